"""The model section: a base model's weights to continue from (a folder, or an S3 prefix the stage step puts on
FSx), or a preset architecture trained from scratch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.rules import check_s3_uri, is_s3_uri, require

# The families a base model's config.json may name (its model_type); trainer.model.families builds them.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Manifests and spooled records of releases before the families name no model_type: they were Llama.
DEFAULT_MODEL_TYPE = "llama"

# Llama 3's rotary scaling ("llama3"): the published configs' rope_scaling, with the factor each model names.
def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# transformers LlamaConfig arguments. A preset named after a published model is that model's config.json
# (tests/unit/test_presets.py compares them with tests/data/<model>/config.json), its vocabulary included; the
# others take the tokenizer's vocabulary.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # ~0.1 M params: test runs of hundreds of steps about recoveries, not training (the chaos soak): a step on 2 CPU
    # ranks is ~0.08 s, tiny's ~0.18 s, and a checkpoint 1/20 of tiny's.
    "micro": dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  tie_word_embeddings=False),
    # A few M params: the CPU demo and the tests.
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=False),
    # ~100 M params with the byte vocabulary: CPU benchmarks.
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=2048, rope_theta=500000.0,
                  tie_word_embeddings=False),
    # meta-llama/Llama-3.2-1B's config.json.
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
                      rope_scaling=_llama3_rope(32.0), rms_norm_eps=1e-5, vocab_size=128256,
                      tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B's config.json.
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                        rope_scaling=_llama3_rope(8.0), rms_norm_eps=1e-5, vocab_size=128256,
                        tie_word_embeddings=False),
}
# The published model each preset is, where it is one (its Hugging Face name).
PUBLISHED_PRESETS = {"llama3-1b": "meta-llama/Llama-3.2-1B", "llama3.1-8b": "meta-llama/Llama-3.1-8B"}


def preset_arguments(model: "ModelConfig", tokenizer_vocab: int) -> dict[str, Any]:
    """The LlamaConfig arguments of model.preset with its vocabulary: model.vocab_size when set, else the
    published model's, else the tokenizer's."""
    preset = dict(MODEL_PRESETS[model.preset])
    return {**preset, "vocab_size": model.vocab_size or preset.get("vocab_size") or tokenizer_vocab}


@dataclass
class ModelConfig:
    """The Llama-architecture model."""

    preset: Literal["micro", "tiny", "small", "llama3-1b", "llama3.1-8b"] = "tiny"
    """Architecture preset (layer count and widths) for training from scratch; see MODEL_PRESETS. Ignored when
    init_from is set: the base model's config.json gives its dimensions."""

    init_from: str = ""
    """A base model in Hugging Face format (config.json + *.safetensors; model_type llama, mistral, qwen2 or qwen3:
    trainer.model.families) to continue from: a local folder, or its S3 prefix (s3://bucket/prefix), which the
    stage step stages under <fsx_root>/models/<last segment>-<hash of the URI>/hf and checks once. Its own
    tokenizer (tokenizer.json beside the weights) is used unless data.tokenizer names another. Empty starts from
    random weights. A checkpoint of the run to resume from takes precedence."""

    vocab_size: int = 0
    """Vocabulary size of a model trained from scratch; 0 means the preset's where it is a published model's
    (llama3-1b, llama3.1-8b: 128,256), else the tokenizer's (the built-in byte tokenizer has 258). Ignored with
    init_from (the base model's config.json has it)."""

    def __post_init__(self) -> None:
        require(self.preset in MODEL_PRESETS, "model.preset", f"must be one of {sorted(MODEL_PRESETS)}")
        require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0")
        if is_s3_uri(self.init_from):
            check_s3_uri(self.init_from, "model.init_from")


