"""Run under torchrun by bench/checkpoint.py: the *plain* asynchronous checkpointing a team would write from
the PyTorch docs ("Asynchronous Saving with Distributed Checkpoint (DCP)"), beside ours.

    torchrun --nproc-per-node=2 bench/plain_dcp.py CONFIG.yaml DATA_DIR OUT_DIR

The same Trainer (model, FSDP2 sharding, AdamW, data, seed) as the benchmark's other configurations, with
our checkpointing off; every `checkpoint.interval_steps` steps the loop waits for the previous save's future
and calls `dcp.async_save` on a gloo group of its own (the default thread executor: the state is staged to
CPU in the loop, then written by a thread). No manifest, no commit, no nice; the previous folder is removed
once the next save is written (keep-last-1, so the disk does not fill). Rank 0 writes OUT_DIR/metrics.jsonl
(one record per step, like the trainer's) and every rank OUT_DIR/saves-<rank>.json (the loop's wait per
save, and how long each write ran after the loop went on).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from trainer.config import load_config
from trainer.job.trainer import Trainer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("config_path", "data_dir", "out"):
        parser.add_argument(name)
    args = parser.parse_args()
    config_path, data_dir, out = args.config_path, args.data_dir, args.out
    cfg = load_config(config_path)
    out = Path(out)
    trainer = Trainer(cfg, Path(data_dir))
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    interval = int(cfg.checkpoint.interval_steps)
    future, previous, folder, saves = None, None, None, []
    with (out / "metrics.jsonl").open("w") if rank == 0 else open("/dev/null", "w") as metrics:
        while trainer.should_continue_training():
            record = trainer.train_step()
            metrics.write(json.dumps({**record, "time": time.time()}) + "\n")
            if trainer.step % interval and trainer.should_continue_training():
                continue
            started = time.perf_counter()
            if future is not None:
                future.result()
                if rank == 0 and previous is not None:
                    shutil.rmtree(previous, ignore_errors=True)
                previous = folder
            waited = time.perf_counter() - started
            folder = out / f"step-{trainer.step}"
            handoff_started = time.perf_counter()
            future = dcp.async_save(trainer.state_dict(), checkpoint_id=str(folder), process_group=group)
            handed_off = time.perf_counter()
            save = {"step": trainer.step, "previous_save_seconds": waited, "handoff_seconds": handed_off - handoff_started,
                    "loop_wait_seconds": handed_off - started}
            future.add_done_callback(lambda _, save=save, since=handed_off: save.update(
                background_seconds=time.perf_counter() - since))
            saves.append(save)
        tail = time.perf_counter()
        future.result()
        final_wait = time.perf_counter() - tail
    (out / f"saves-{rank}.json").write_text(json.dumps({"saves": saves, "final_checkpoint_wait_seconds": final_wait}))
    dist.barrier()
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
