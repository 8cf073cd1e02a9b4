"""A preset named after a published model is that model: its transformers config, built from the preset, equals
the one transformers builds from the model's published config.json (tests/data/<model>/config.json), every field
that shapes the network or its numerics compared — its rope scaling, norm epsilon, vocabulary and tying included."""

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from trainer.config import ConfigError, load_config
from trainer.config.model import MODEL_PRESETS, PUBLISHED_PRESETS, ModelConfig, preset_arguments

DATA = Path(__file__).resolve().parents[1] / "data"
PUBLISHED = {"llama3-1b": DATA / "llama-3.2-1b", "llama3.1-8b": DATA / "llama-3.1-8b"}
# What a config.json says of the checkpoint or of the tokenizer, not of the network: ids come from the tokenizer
# (checked against the base model's config by trainer.model.base.check_tokenizer_fits), the rest is bookkeeping.
NOT_THE_NETWORK = {"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
                   "transformers_version", "use_cache", "_name_or_path"}


def _network(config: LlamaConfig) -> dict:
    return {key: value for key, value in config.to_dict().items() if key not in NOT_THE_NETWORK}


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PRESETS))
def test_a_published_preset_is_the_published_models_config(preset):
    assert PUBLISHED[preset].name.lower() == PUBLISHED_PRESETS[preset].split("/")[1].lower()
    published = LlamaConfig.from_dict(json.loads((PUBLISHED[preset] / "config.json").read_text()))
    ours = LlamaConfig(**preset_arguments(ModelConfig(preset=preset), tokenizer_vocab=384))  # (not the tokenizer's)
    assert _network(ours) == _network(published)
    assert ours.vocab_size == 128_256 and ours.rms_norm_eps == 1e-5 and ours.rope_parameters["rope_type"] == "llama3"


def test_every_preset_without_a_published_model_takes_the_tokenizers_vocabulary():
    for preset in sorted(set(MODEL_PRESETS) - set(PUBLISHED_PRESETS)):
        model = load_config(None, [f"--model.preset={preset}"]).model
        assert preset_arguments(model, tokenizer_vocab=384)["vocab_size"] == 384
        sized = load_config(None, [f"--model.preset={preset}", "--model.vocab_size=1000"]).model
        assert preset_arguments(sized, tokenizer_vocab=384)["vocab_size"] == 1000


@pytest.mark.parametrize("preset", sorted(PUBLISHED_PRESETS))
def test_a_published_preset_with_the_byte_tokenizer_is_refused_unless_its_vocabulary_is_set_on_purpose(preset):
    with pytest.raises(ConfigError, match=rf"data.tokenizer: the byte tokenizer \(258 ids\) with model.preset={preset}, "
                                          r"which is meta-llama/.* with its 128,256-token vocabulary"):
        load_config(None, [f"--model.preset={preset}"])
    load_config(None, [f"--model.preset={preset}", "--model.vocab_size=128256"])  # a throughput check, said so
    load_config(None, [f"--model.preset={preset}", "--data.tokenizer=/models/llama3/tokenizer"])
