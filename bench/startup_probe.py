"""Run under torchrun by bench/startup.py: one start's load of a base model on every rank, measured from the kernel's
counters, ranks reading in turn from a cold page cache (as if each were a node of its own).

    torchrun --nproc-per-node=N bench/startup_probe.py {new,today} MODEL_FOLDER OUT.json

- ``new``: the trainer's path (trainer.model.base): the model built on the meta device, sharded with FSDP2,
  materialised, then each rank's rows read through DCP's Hugging Face reader.
- ``today``: the path before it (commit 836d549, trainer/model/build.py load_or_build_model): every rank
  ``LlamaForCausalLM.from_pretrained(folder, dtype=float32)``, then the shards kept.

Each rank evicts the model's files from the page cache (posix_fadvise DONTNEED) before its turn and reads while the
others wait, so its ``read_bytes`` (/proc/self/io: what the storage served it) is a node's cold read. Each rank
reports the bytes, its peak RSS (VmHWM) over what it held before the load, its shard's bytes (fp32) and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.model.base import BaseWeightsReader, index_base_weights, load_base_weights, read_base_config
from trainer.config import TrainingConfig
from trainer.model.build import build_model_on_meta, materialize_on
from trainer.model.parallelize import device_mesh, parallelize


def _shard(model, world: int):
    """The trainer's FSDP2 sharding in fp32 (the probe measures reads and memory, not speed)."""
    training = TrainingConfig(nproc_per_node=world, mixed_precision_param="float32")
    return parallelize(model, training, torch.device("cpu"), device_mesh(training, world, torch.device("cpu")))


def _io() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])


def _status(key: str) -> int:
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key))
    return int(line.split()[1]) * 1024


def _evict(folder: Path) -> None:
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a file just written) are not dropped: written back first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _Turns:
    """Ranks take turns, in rank order, through the job's store (no collective: usable inside a DCP read)."""

    def __init__(self, name: str):
        self.store = dist.distributed_c10d._get_default_store()
        self.name = name

    def wait(self, rank: int) -> None:
        if rank:
            self.store.wait([f"{self.name}/done/{rank - 1}"])

    def done(self, rank: int) -> None:
        self.store.set(f"{self.name}/done/{rank}", "1")


class _TurnReader(BaseWeightsReader):
    """The trainer's reader, its reads taken in turn from a cold cache, each rank's storage reads counted."""

    def __init__(self, folder: Path, index, turns: _Turns, rank: int):
        super().__init__(folder, index)
        self.turns, self.rank, self.storage_bytes = turns, rank, 0

    def read_data(self, plan, planner):
        self.turns.wait(self.rank)
        _evict(Path(self.path))
        before = _io()
        try:
            return super().read_data(plan, planner)
        finally:
            self.storage_bytes = _io() - before
            self.turns.done(self.rank)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", choices=["new", "today"])
    parser.add_argument("model", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    config = read_base_config(args.model)
    turns = _Turns(args.path)
    dist.barrier()
    held_before, started = _status("VmRSS"), time.perf_counter()
    if args.path == "new":
        index = index_base_weights(args.model, config, hash_files=False) if rank == 0 else None
        box = [index]
        dist.broadcast_object_list(box, src=0)
        model = _shard(build_model_on_meta(config), world)
        materialize_on(model, torch.device("cpu"))
        reader = _TurnReader(args.model, box[0], turns, rank)
        load_base_weights(model, args.model, box[0], reader=reader)
        storage = reader.storage_bytes
    else:
        from transformers import LlamaForCausalLM

        turns.wait(rank)
        _evict(args.model)
        before = _io()
        model = LlamaForCausalLM.from_pretrained(str(args.model), local_files_only=True, use_safetensors=True,
                                                 attn_implementation="sdpa", dtype=torch.float32)
        storage = _io() - before
        turns.done(rank)
        model = _shard(model, world)
    seconds = time.perf_counter() - started
    shard = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters())
    mine = {"rank": rank, "storage_bytes_read": storage, "peak_rss_bytes": _status("VmHWM") - held_before,
            "shard_bytes": shard, "load_seconds": seconds}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        args.out.write_text(json.dumps(everyone, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
