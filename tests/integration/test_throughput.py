"""The throughput features (trainer.model.parallelize, trainer.model.optimizer, trainer.job.step) on the CPU with
the tiny model: each trains what the plain path trains, and does what it is for (counted or measured here)."""

import ctypes
import gc
import json
import os
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from components.train.local import run_local_training
from trainer.config import MODEL_PRESETS, TrainingConfig
from trainer.model.build import build_model
from trainer.model.parallelize import apply_activation_checkpointing, device_mesh, parallelize
from trainer.resilience.numerics import NumericDrills
from trainer.run.events import read_events
from trainer.run.run_dir import read_jsonl
from tests.metrics import losses_by_step

pytestmark = pytest.mark.integration

TINY = LlamaConfig(vocab_size=258, **MODEL_PRESETS["tiny"])


# -- gradient accumulation: one reduce-scatter per optimizer step -------------------------------------------------

def _accumulate(rank: int, port: int, mode: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    from trainer.job.step import forward_backward

    training = TrainingConfig(grad_accum_steps=3, batch_size=2, seq_len=32, reduce_gradients=mode)
    model = parallelize(build_model(TINY, seed=0), training, torch.device("cpu"),
                        device_mesh(training, 2, torch.device("cpu")))
    calls = []
    original = dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    dist.reduce_scatter_single = counted
    rng = np.random.default_rng(rank)
    micro = [(rng.integers(0, 258, (2, 32)), rng.integers(0, 258, (2, 32))) for _ in range(3)]
    loss, norm = forward_backward(model, micro, device=torch.device("cpu"), training_cfg=training,
                                  drills=NumericDrills([], rank, None, set()), step=1, first_sample=0,
                                  global_batch=12)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters()])
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"loss": float(loss), "norm": float(norm), "reduce_scatters": len(calls),
                       "units": 1 + TINY.num_hidden_layers, "grads": grads.tolist()}, handle)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    results = {}
    for mode in ("per_step", "per_micro_batch"):
        out = tmp_path_factory.mktemp(mode) / "result.json"
        mp.spawn(_accumulate, args=(_free_port(), mode, str(out)), nprocs=2, join=True)
        results[mode] = json.loads(out.read_text())
    return results


def test_gradient_accumulation_reduce_scatters_once_per_step_and_gives_the_same_gradients(accumulated):
    once, every = accumulated["per_step"], accumulated["per_micro_batch"]
    # FSDP2 reduce-scatters each unit's gradients (a decoder layer, or the root) in one call per backward.
    assert every["reduce_scatters"] == 3 * every["units"]
    assert once["reduce_scatters"] == once["units"]
    assert once["loss"] == every["loss"]  # the forward is the same
    # The same sum, in another order (accumulated before the reduction instead of after): fp32 rounding apart.
    assert once["norm"] == pytest.approx(every["norm"], rel=1e-5)
    np.testing.assert_allclose(once["grads"], every["grads"], rtol=1e-4, atol=1e-7)


# -- selective activation checkpointing keeps less ----------------------------------------------------------------

class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def _heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not had back (torch's CPU allocator allocates through it): the
    small blocks in use, and the large ones, which it maps and unmaps one by one."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _kept_after_forward(mode: str, selective_ac="op") -> int:
    """Bytes the forward leaves allocated for the backward."""
    model = build_model(TINY, seed=0)
    apply_activation_checkpointing(model, TrainingConfig(activation_checkpointing=mode, selective_ac=selective_ac))
    model.train()
    tokens = torch.randint(0, 258, (4, 128), generator=torch.Generator().manual_seed(0))
    gc.collect()
    before = _heap_in_use()
    loss = model(input_ids=tokens, targets=tokens)
    gc.collect()
    kept = _heap_in_use() - before
    loss.backward()  # the checkpointed graph still trains
    assert all(p.grad is not None for p in model.parameters())
    return kept


def test_selective_checkpointing_keeps_less_than_none_and_more_than_full():
    kept = {mode: _kept_after_forward(mode) for mode in ("none", "selective", "full")}
    kept["every 2nd layer"] = _kept_after_forward("selective", 2)
    assert kept["full"] < kept["every 2nd layer"] < kept["none"], kept
    assert kept["full"] < kept["selective"] < kept["none"], kept


# -- compile, the 2-D mesh, fused AdamW: real runs of the trainer -------------------------------------------------

def test_compiled_blocks_train_the_same_losses_within_tolerance(trained_run, tmp_path, token_dir, training_config):
    """One compile (the tiny model's 3 blocks share their graph). Inductor's fused kernels reorder fp32 sums:
    the losses agree to 1e-4 of their value, not bit for bit. A SIGKILL at step 3 restarts the ranks: they load
    the compiled graphs from the run folder's compile cache instead of compiling them again."""
    cfg, _ = trained_run
    reference = losses_by_step(cfg.run_dir / "metrics.jsonl")
    compiled = training_config(tmp_path, "compiled", "--training.num_steps=4", "--checkpoint.interval_steps=4",
                               "--training.compile=true", "--faults.schedule=sigkill@3:rank=1")
    run_local_training(compiled, token_dir)
    losses = losses_by_step(compiled.run_dir / "metrics.jsonl")
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert loss == pytest.approx(reference[step], rel=1e-4), (step, loss, reference[step])
    assert "compile True" in (compiled.run_dir / "train.log").read_text()

    cold, restarted = read_events(compiled.run_dir, "compile_cache")
    assert Path(cold["folder"]).parent == compiled.run_dir / "compile-cache" == Path(restarted["folder"]).parent
    assert cold["fx_graph_misses"] > 0 and cold["fx_graph_hits"] == 0 and cold["aot_autograd_misses"] > 0
    assert restarted["fx_graph_misses"] == 0 and restarted["aot_autograd_misses"] == 0
    assert restarted["fx_graph_hits"] > 0 and restarted["aot_autograd_hits"] > 0


HSDP = ["--training.nproc_per_node=4", "--training.data_parallel_replicate_degree=2",
        "--resilience.replica_check_interval=2", "--training.num_steps=6", "--checkpoint.interval_steps=3",
        "--optimizer.implementation=fused"]


def test_native_hsdp_on_a_2x2_mesh_trains_resumes_bit_identically_and_keeps_replicas_equal(tmp_path, token_dir,
                                                                                        training_config):
    cfg = training_config(tmp_path / "first", "hsdp", *HSDP)
    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 6 and result["world_size"] == 4
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert {r["step"]: r.get("replicas_equal") for r in records if "replicas_equal" in r} == {2: True, 4: True,
                                                                                             6: True}
    assert records[-1]["loss"] < records[0]["loss"]
    assert "mesh {'dp_replicate': 2, 'dp_shard': 2}" in (cfg.run_dir / "train.log").read_text()
    reference = losses_by_step(cfg.run_dir / "metrics.jsonl")

    resumed = training_config(tmp_path / "second", "hsdp-resumed", *HSDP)
    shutil.copytree(cfg.checkpoint_dir / "step-000003", resumed.checkpoint_dir / "step-000003")
    again = run_local_training(resumed, token_dir)
    assert again["steps_this_launch"] == 3
    replayed = losses_by_step(resumed.run_dir / "metrics.jsonl")
    assert replayed == {s: reference[s] for s in (4, 5, 6)}


def test_mfu_and_tflops_are_in_every_step_record(trained_run):
    cfg, _ = trained_run
    records = read_jsonl(cfg.run_dir / "metrics.jsonl")
    assert all(r["tflops_per_gpu"] > 0 for r in records)
    assert not any("mfu" in r for r in records)  # no peak is known for a CPU, and none was set


def test_a_checkpoint_with_every_parameter_decayed_resumes_into_the_no_decay_groups(tmp_path, token_dir,
                                                                                   training_config):
    """A run started before optimizer.no_decay (one AdamW group) continues after the upgrade from its checkpoint:
    the groups and hyperparameters are the config's at each start (trainer.model.optimizer.optimizer_groups_of),
    not a key the checkpoint lacks (which torch's set_state_dict raised as KeyError: 'weight_decay')."""
    before = training_config(tmp_path, "upgraded", "--training.num_steps=4", "--checkpoint.interval_steps=4",
                             "--optimizer.no_decay=[]")
    run_local_training(before, token_dir)
    after = training_config(tmp_path, "upgraded", "--training.num_steps=6", "--checkpoint.interval_steps=2")
    result = run_local_training(after, token_dir)
    assert result["steps"] == 6 and result["steps_this_launch"] == 2
    resumes = read_events(after.run_dir, "resume")
    assert (resumes[-1]["step"], resumes[-1]["source"]) == (4, "disk")
    assert "AdamW (foreach): 22 parameter tensors decayed, 8 not" in (after.run_dir / "train.log").read_text()
