"""Run under torchrun by tests/integration/test_checkpoint_tiers.py: train and save to every tier, or only
resume, then record what the ranks hold.

    python -m torch.distributed.run --standalone --nproc-per-node=2 tests/tier_harness.py PHASE CONFIG DATA

PHASE: train, resume, or rollback-N (resume, then go back to the newest copy of step N or earlier and drop
every later one from every tier, as a numeric rollback does: trainer.job.numeric_recovery).

Writes <run_dir>/harness-<phase>.json (rank 0): the step, the last loss and a digest of every rank's local
state (weights, optimizer moments), so a test can tell that a resume restored exactly what was saved.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from trainer.checkpoint.state_bytes import flatten
from trainer.config import load_config
from trainer.job.trainer import Trainer


def state_digest(trainer: Trainer) -> str:
    digest = xxhash.xxh3_128()
    state = trainer.state_dict()
    for path, value in flatten({"model": state["model"], "optim": state["optim"]}):
        if hasattr(value, "numpy"):
            digest.update(repr(path).encode())
            digest.update(value.contiguous().view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def main() -> None:
    phase, config_path, data_dir = sys.argv[1:4]
    cfg = load_config(config_path)
    trainer = Trainer(cfg, Path(data_dir))
    try:
        if phase == "train":
            trainer.train()
        else:
            trainer.resume()
        if phase.startswith("rollback-"):
            state = trainer.state_dict()
            step, _ = trainer.checkpointer.load_latest(state, at_most=int(phase.split("-")[1]))
            trainer.load_state_dict(state)
            trainer.checkpointer.drop_after(step)
        digests: list = [None] * trainer.world_size
        dist.all_gather_object(digests, state_digest(trainer))
        if trainer.rank == 0:
            (cfg.run_dir / f"harness-{phase}.json").write_text(json.dumps(
                {"step": trainer.step, "last_loss": trainer.last_loss, "digests": digests}))
    finally:
        trainer.close()


if __name__ == "__main__":
    main()
