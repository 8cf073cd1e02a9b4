"""The model section: a base model's weights to continue from (a folder, or an S3 prefix the stage step puts on
FSx), or a preset architecture trained from scratch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.rules import check_s3_uri, is_s3_uri, require

MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # A few M params: the CPU demo and the tests.
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=False),
    # ~100 M params with the byte vocabulary: CPU benchmarks.
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=2048, rope_theta=500000.0,
                  tie_word_embeddings=False),
    # Llama-3.2-1B's shape.
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                      tie_word_embeddings=True),
    # Llama-3.1-8B's shape.
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                        tie_word_embeddings=False),
}


@dataclass
class ModelConfig:
    """The Llama-architecture model."""

    preset: Literal["tiny", "small", "llama3-1b", "llama3.1-8b"] = "tiny"
    """Architecture preset (layer count and widths) for training from scratch; see MODEL_PRESETS. Ignored when
    init_from is set: the base model's config.json gives its dimensions."""

    init_from: str = ""
    """A Llama-family base model in Hugging Face format (config.json + *.safetensors) to continue from: a local
    folder, or its S3 prefix (s3://bucket/prefix), which the stage step stages under
    <fsx_root>/models/<last segment of the prefix>/hf and checks once. Empty starts from random weights. A
    checkpoint of the run to resume from takes precedence."""

    vocab_size: int = 0
    """Vocabulary size of a model trained from scratch; 0 means the tokenizer's (the built-in byte tokenizer has
    258). Ignored with init_from (the base model's config.json has it)."""

    def __post_init__(self) -> None:
        require(self.preset in MODEL_PRESETS, "model.preset", f"must be one of {sorted(MODEL_PRESETS)}")
        require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0")
        if is_s3_uri(self.init_from):
            check_s3_uri(self.init_from, "model.init_from")


