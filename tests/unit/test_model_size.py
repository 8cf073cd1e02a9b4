"""A model's size from its config.json, and everything sized from it: the node memory, the first heartbeat, the
start-up phases' read timeouts, the planner's costs; and the base model's config checked as a family we build."""

import json
from pathlib import Path

import pytest
import torch

from trainer.config import MODEL_PRESETS, load_config
from trainer.launch.command import initial_heartbeat_timeout, node_memory_gib
from trainer.model.base import BaseModelError, expected_tensors, read_base_config
from trainer.planning.model_size import ModelShape, ModelSizeError, model_shape
from trainer.resilience.phases import startup_timeouts

LLAMA_8B = Path(__file__).resolve().parents[1] / "data" / "llama-3.1-8b"


def _meta_count(config: dict) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return sum(p.numel() for p in model.parameters())  # tied weights counted once, as parameters() does


@pytest.mark.parametrize("config", [
    json.loads((LLAMA_8B / "config.json").read_text()),
    {**MODEL_PRESETS["llama3-1b"], "vocab_size": 128256},  # tied embeddings
    {**MODEL_PRESETS["tiny"], "vocab_size": 258},
    {**MODEL_PRESETS["tiny"], "vocab_size": 500, "attention_bias": True, "mlp_bias": True, "head_dim": 48},
], ids=["llama-3.1-8b", "llama3-1b-tied", "tiny", "biases-and-head-dim"])
def test_the_parameter_count_is_what_transformers_builds(config):
    assert ModelShape.from_config(config).parameters == _meta_count(config)


def test_llama_3_1_8b_is_sized_from_its_config_json():
    shape = ModelShape.from_config(json.loads((LLAMA_8B / "config.json").read_text()))
    assert shape.parameters == 8_030_261_248  # as published
    assert shape.weights_bytes == 2 * shape.parameters  # bf16 files
    assert set(expected_tensors(read_base_config(LLAMA_8B))) >= {"lm_head.weight", "model.embed_tokens.weight"}


def _wide_model(tmp_path) -> Path:
    """A base model matching no preset: 3.2 B parameters the tiny preset would call 2 M."""
    folder = tmp_path / "wide"
    folder.mkdir()
    config = {**json.loads((LLAMA_8B / "config.json").read_text()), "num_hidden_layers": 10}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_what_a_launch_sizes_from_the_model_follows_the_base_models_config_not_the_preset(tmp_path):
    base = load_config("pipelines/configs/eks-prod.yaml", ["--model.preset=tiny", f"--model.init_from={_wide_model(tmp_path)}"])
    tiny = load_config("pipelines/configs/eks-prod.yaml", ["--model.preset=tiny", "--model.init_from="])
    shape = model_shape(base)
    assert 3.2e9 < shape.parameters < 3.3e9 and model_shape(tiny).parameters < 1e7
    per_node = 4 * shape.state_bytes / base.training.num_nodes  # two slots of its own share and two of its peer's
    assert node_memory_gib(base) * 2**30 >= per_node and node_memory_gib(tiny) == 1
    seconds, why = initial_heartbeat_timeout(base)
    assert seconds >= shape.state_bytes / (base.kubernetes.fsx_throughput_mbps * 1e6)
    assert f"resume {shape.state_bytes / 1e9:.1f} GB" in why
    assert initial_heartbeat_timeout(tiny)[0] < seconds


def test_the_restore_timeouts_grow_with_the_model_and_a_users_setting_wins(tmp_path):
    config = {**json.loads((LLAMA_8B / "config.json").read_text()), "num_hidden_layers": 320}  # ~70 B
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = load_config("pipelines/configs/eks-prod.yaml", [f"--model.init_from={tmp_path}"])
    timeouts = startup_timeouts(cfg, None)
    state = model_shape(cfg).state_bytes
    assert timeouts["restore_fsx"] == pytest.approx(1.5 * state / 240e6, abs=1) and timeouts["restore_fsx"] > 3600
    assert timeouts["restore_base"] == 1800  # 1.1 x 141 GB of bf16 at 240 MB/s, x 1.5: under the default
    user = load_config("pipelines/configs/eks-prod.yaml", [f"--model.init_from={tmp_path}",
                                                           "--resilience.startup_timeouts=restore_fsx=99"])
    assert startup_timeouts(user, None)["restore_fsx"] == 99


def test_a_base_model_not_staged_yet_is_named_not_guessed_from_the_preset():
    cfg = load_config("pipelines/configs/eks-cpt.yaml")
    with pytest.raises(ModelSizeError, match=r"model.init_from: /fsx/models/Llama-3.1-8B-[0-9a-f]{8}/hf/config.json not found.*"
                                             "run the stage step first"):
        model_shape(cfg)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, r"model_type 'gpt2' is not a family this trainer builds: model.init_from takes 'llama', "
                             r"'mistral', 'qwen2', 'qwen3' models"),
    ({"architectures": ["LlamaForSequenceClassification"]}, r"architectures \['LlamaForSequenceClassification'\]"),
    ({"rope_scaling": {"rope_type": "su", "factor": 2.0}}, r"rope_scaling type 'su' is not one"),
    ({"vocab_size": 0}, r"vocab_size must be a positive integer"),
])
def test_a_config_of_no_family_we_build_is_refused_naming_the_field(tmp_path, change, message):
    config = {**json.loads((LLAMA_8B / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BaseModelError, match=message):
        read_base_config(tmp_path)


def test_llama3_rope_scaling_gqa_and_a_128k_vocabulary_load():
    config = read_base_config(LLAMA_8B)
    assert config.vocab_size == 128256 and config.num_key_value_heads == 8
    assert config.rope_parameters["rope_type"] == "llama3"
