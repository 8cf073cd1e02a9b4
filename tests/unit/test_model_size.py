"""A model's size from its config.json, and everything sized from it: the node memory, the first heartbeat, the
start-up phases' read timeouts, the planner's costs; and the base model's config checked as a family we build."""

import json
import os
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
    measured = "--kubernetes.fsx_throughput_mbps=240"  # what a busy file system gave, below its provisioned 586 MB/s
    cfg = load_config("pipelines/configs/eks-prod.yaml", [f"--model.init_from={tmp_path}", measured])
    timeouts = startup_timeouts(cfg, None)
    state = model_shape(cfg).state_bytes
    assert timeouts["restore_fsx"] == pytest.approx(1.5 * state / 240e6, abs=1) and timeouts["restore_fsx"] > 3600
    assert timeouts["restore_base"] == 1800  # 1.1 x 141 GB of bf16 at 240 MB/s, x 1.5: under the default
    user = load_config("pipelines/configs/eks-prod.yaml", [f"--model.init_from={tmp_path}", measured,
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


_SAVED_BYTES = """
import gc, json, os, sys
import torch
from transformers import LlamaConfig
from trainer.config import load_config
from trainer.model import parallelize
from trainer.model.build import build_model

def resident():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

raw, held = json.loads(sys.argv[1]), {}
ids = torch.randint(0, raw["vocab_size"], (2, 1024))
for mode in sys.argv[2:]:
    model = build_model(LlamaConfig(**raw), 0)
    parallelize.apply_activation_checkpointing(model, load_config("local", [
        f"--training.activation_checkpointing={mode}"]).training)
    for _ in range(2):  # the second step: the allocator warm
        gc.collect()
        before = resident()
        loss = model(input_ids=ids, targets=ids)
        loss = getattr(loss, "loss", loss)
        held[mode] = resident() - before
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
print(json.dumps(held))
"""


def test_the_activation_estimate_is_what_a_step_keeps_for_its_backward():
    """What a real forward keeps until its backward (the process's resident growth: every saved tensor is over
    the mmap threshold, so freeing one returns it) against the estimate, per checkpointing mode, within 15 %."""
    import subprocess
    import sys

    from trainer.planning.model_size import gpu_memory_bytes

    raw = {"vocab_size": 256, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 2}
    modes = ["none", "full", "selective"]
    done = subprocess.run([sys.executable, "-c", _SAVED_BYTES, json.dumps(raw), *modes], capture_output=True,
                          text=True, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    held = json.loads(done.stdout.splitlines()[-1])
    for mode in modes:
        estimate = gpu_memory_bytes(ModelShape.from_config(raw), shard_ranks=1, batch_size=2, seq_len=1024,
                                    activation_checkpointing=mode, param_bytes=4)["activations"]
        assert abs(estimate - held[mode]) <= 0.15 * held[mode], (mode, held[mode] / 2**20, estimate / 2**20)
    assert held["none"] > 2 * held["selective"] > 4 * held["full"]  # each mode keeps what it says


def test_accumulated_gradients_are_the_whole_models_in_the_reduce_dtype(tmp_path):
    """FSDP2 between micro-batches (set_requires_gradient_sync(False)) with bf16 parameters and fp32 reductions:
    the unsharded gradients it keeps are the estimate's accumulated_gradients, byte for byte."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import LlamaConfig

    from trainer.model.build import build_model
    from trainer.planning.model_size import gpu_memory_bytes

    raw = {**MODEL_PRESETS["tiny"], "vocab_size": 300}
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_model(LlamaConfig(**raw), 0)
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=mixed)
        fully_shard(model, mp_policy=mixed)
        model.set_requires_gradient_sync(False)
        ids = torch.randint(0, 300, (2, 16))
        model(input_ids=ids, targets=ids).backward()
        kept = [p for group in (m._get_fsdp_state()._fsdp_param_group for m in model.modules()
                                if hasattr(m, "_get_fsdp_state")) if group is not None for p in group.fsdp_params]
        accumulated = sum(p.unsharded_accumulated_grad.nbytes for p in kept
                          if p.unsharded_accumulated_grad is not None)
        assert {p.unsharded_accumulated_grad.dtype for p in kept} == {torch.float32}
    finally:
        dist.destroy_process_group()
    estimate = gpu_memory_bytes(ModelShape.from_config(raw), shard_ranks=1, batch_size=2, seq_len=16,
                                grad_accum_steps=4, reduce_gradients="per_step")
    assert estimate["accumulated_gradients"] == accumulated == 4 * ModelShape.from_config(raw).parameters
    assert gpu_memory_bytes(ModelShape.from_config(raw), shard_ranks=1, batch_size=2, seq_len=16, grad_accum_steps=4,
                            reduce_gradients="per_micro_batch")["accumulated_gradients"] == 0
