"""Run under torchrun by bench/checkpoint.py: per-rank memcpy, DCP load and raw read timings.

Builds the same Trainer as the benchmark runs (so the state is the real sharded model + AdamW state),
takes one step so the optimizer state exists, then measures on every rank:
- a warm memcpy of this rank's whole state into preallocated buffers (the floor for a blocking stall);
- staging the state for an async save (a later save's, warm): DCP's ``DefaultStager``, which deep-copies every
  DTensor wrapper each save, against the trainer's ``ReusingStager`` (trainer/checkpoint/stager.py), alternating;
  and what the loop does before a save's hand-off: the finite check (a read of the state) then the staging copy;
- a raw sequential read of this rank's shard file of the same checkpoint;
- loads of the checkpoint into that state: DCP's own reader (``dcp.load``), the project's (``load_checkpoint``:
  FastReader, verifying each file as it reads) and the project's without verification;
each with the page cache warm, then again cold (every file of the checkpoint evicted with
posix_fadvise(DONTNEED) first: works without root, on the files only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainer.checkpoint.commit import nonfinite_flags
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.stager import ReusingStager
from trainer.config import load_config
from trainer.job.trainer import Trainer


def _leaves(state) -> list[torch.Tensor]:
    out = []
    if isinstance(state, dict):
        for value in state.values():
            out.extend(_leaves(value))
    elif isinstance(state, torch.Tensor):
        out.append(state)
    return out


def _local_tensors(state) -> list[torch.Tensor]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in _leaves(state)]


def _read_file(path: Path, chunk: int = 16 << 20) -> int:
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    with path.open("rb", buffering=0) as handle:
        while read := handle.readinto(view):
            total += read
    return total


def _read_whole(path: Path, buffer: torch.Tensor) -> int:
    """The file into one buffer of its size, already touched: a read that also writes every byte to memory,
    as a load must (the chunked raw read reuses one 16 MB buffer, which stays in the CPU's cache)."""
    view = memoryview(buffer.numpy()).cast("B")
    with path.open("rb", buffering=0) as handle:
        return handle.readinto(view)


def _evict(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(run, cold: bool, folder: Path) -> float:
    """Seconds for run() on every rank at once (the slowest rank's figure is taken by the caller)."""
    if cold:
        _evict(folder)
    dist.barrier()
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    dist.barrier()
    return seconds


def _staging_seconds(state, rounds: int = 5) -> dict[str, float]:
    """Median seconds to stage `state` for a later async save, each stager warm (its first staging, which
    allocates the buffers, not counted); the stagers alternate so the host's noise hits both."""
    options = StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                             use_non_blocking_copy=False)  # the trainer's thread executor on CPU (backends.py)
    reusing = ReusingStager(options)
    stagers = {"default": DefaultStager(options), "reusing": reusing}
    runs = {"default": stagers["default"].stage, "reusing": reusing.stage,
            "check_then_reusing": lambda s: (nonfinite_flags(s, torch.device("cpu")), reusing.stage(s))}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for stager in stagers.values():
        stager.stage(state)
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run(state)
            seconds[name].append(time.perf_counter() - started)
    for stager in stagers.values():
        stager.close()
    return {f"stage_{name}_seconds": statistics.median(runs) for name, runs in seconds.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("config_path", "data_dir", "checkpoint", "out"):
        parser.add_argument(name)
    args = parser.parse_args()
    config_path, data_dir, checkpoint, out = args.config_path, args.data_dir, args.checkpoint, args.out
    cfg = load_config(config_path)
    trainer = Trainer(cfg, Path(data_dir))
    trainer.train_step()  # AdamW creates its state on the first step
    state = trainer.state_dict()
    tensors = _local_tensors(state)
    buffers = [torch.empty_like(t) for t in tensors]
    copies = []
    for _ in range(4):  # the first copy faults the buffers in; the rest are warm
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)
        copies.append(time.perf_counter() - started)
    memcpy_seconds = statistics.median(copies[1:])
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)

    rank = dist.get_rank()
    folder = Path(checkpoint)
    shard = folder / f"__{rank}_0.distcp"
    whole = torch.ones(shard.stat().st_size, dtype=torch.uint8)
    loads = {"raw_read": lambda: _read_file(shard), "raw_read_whole": lambda: _read_whole(shard, whole),
             "dcp_load": lambda: dcp.load(state, checkpoint_id=checkpoint),
             "load": lambda: load_checkpoint(state, folder),
             "load_unverified": lambda: load_checkpoint(state, folder, verify=False)}
    mine = {"rank": rank, "memcpy_seconds": memcpy_seconds, "state_bytes": state_bytes,
            "raw_read_bytes": shard.stat().st_size,
            "dtensors": sum(1 for t in _leaves(state) if hasattr(t, "to_local")),
            **_staging_seconds(state)}
    for cold in (False, True):
        for name, run in loads.items():
            runs = [_timed(run, cold, folder) for _ in range(3)]
            mine[f"{name}_{'cold' if cold else 'warm'}_seconds"] = min(runs)
    mine["raw_read_seconds"], mine["load_seconds"] = mine["raw_read_warm_seconds"], mine["dcp_load_warm_seconds"]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone, indent=2))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
