"""Run under torchrun by bench/checkpoint.py: per-rank memcpy, DCP load and raw read timings.

Builds the same Trainer as the benchmark runs (so the state is the real sharded model + AdamW state),
takes one step so the optimizer state exists, then measures on every rank:
- a warm memcpy of this rank's whole state into preallocated buffers (the floor for a blocking stall);
- dcp.load of the given checkpoint into that state;
- a raw sequential read of this rank's shard file of the same checkpoint.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.config import load_config
from trainer.trainer import Trainer


def _local_tensors(state) -> list[torch.Tensor]:
    out = []
    if isinstance(state, dict):
        for value in state.values():
            out.extend(_local_tensors(value))
    elif isinstance(state, torch.Tensor):
        out.append(state.to_local() if hasattr(state, "to_local") else state)
    return out


def _read_file(path: Path, chunk: int = 16 << 20) -> int:
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    with path.open("rb", buffering=0) as handle:
        while read := handle.readinto(view):
            total += read
    return total


def main() -> int:
    config_path, data_dir, checkpoint, out = sys.argv[1:5]
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
    shard = Path(checkpoint) / f"__{rank}_0.distcp"
    dist.barrier()
    started = time.perf_counter()
    raw_bytes = _read_file(shard)
    raw_seconds = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    dcp.load(state, checkpoint_id=checkpoint)
    load_seconds = time.perf_counter() - started
    dist.barrier()

    mine = {"rank": rank, "memcpy_seconds": memcpy_seconds, "state_bytes": state_bytes, "raw_read_seconds": raw_seconds,
            "raw_read_bytes": raw_bytes, "load_seconds": load_seconds}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone, indent=2))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
