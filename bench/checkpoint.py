"""Checkpoint benchmark: the same model and state with no checkpointing, sync and async saves, in one run.

    .venv/bin/python bench/checkpoint.py                 # ≥ 100 M params (preset small), 2 CPU ranks
    .venv/bin/python bench/checkpoint.py --preset tiny   # a quick check of the harness

Everything is measured side by side in one invocation (the machine is shared and noisy) and reported
as ratios. Each configuration runs the real trainer under torchrun (FSDP2, gloo, DCP) on the same data
and seed; throughput is taken over the same window of steps for every configuration, after the first
two checkpoints (the first async save also starts DCP's background process, reported separately).
Writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from components.train.report import read_metrics  # noqa: E402
from trainer import logs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.events import read_events  # noqa: E402
from trainer.run_dir import RunDir  # noqa: E402

log = logging.getLogger("bench.checkpoint")


def _config(work: Path, run_id: str, args, *extra: str):
    return load_config("local", [
        f"--run.work_dir={work}", f"--run.run_id={run_id}", f"--model.preset={args.preset}",
        f"--training.num_steps={args.steps}", f"--training.batch_size={args.batch_size}",
        f"--training.seq_len={args.seq_len}", "--training.warmup_steps=1", "--training.log_every=1",
        f"--checkpoint.interval_steps={args.interval}", "--checkpoint.keep_last=1", *extra])


def _throughput(cfg, first_step: int) -> tuple[float, int]:
    """Steps per second between the records of first_step and the last step (saves in between count)."""
    records = {r["step"]: r for r in read_metrics(RunDir(cfg.run_dir).metrics)}
    last = max(records)
    return (last - first_step) / (records[last]["time"] - records[first_step]["time"]), last - first_step


def _stalls(cfg) -> tuple[list[float], float]:
    """Per-save blocking seconds (max over ranks), excluding the first save, and the first save's."""
    # note: the first save's *blocking* part is small; its background part includes the process start.
    by_step: dict[int, float] = {}
    for event in read_events(cfg.run_dir, "checkpoint_written"):
        by_step[event["step"]] = max(by_step.get(event["step"], 0.0), event["blocking_seconds"])
    ordered = [by_step[s] for s in sorted(by_step)]
    return ordered[1:], ordered[0]


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset (small ≥ 100 M params)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=2, help="checkpoint every N steps")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "checkpoint.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        data = demo_token_dir(scratch)

        runs = {
            "none": _config(scratch, "none", args, "--checkpoint.enabled=false"),
            "sync": _config(scratch, "sync", args, "--checkpoint.mode=sync"),
            "async": _config(scratch, "async", args, "--checkpoint.mode=async"),
        }
        # The same window for every configuration, after the second save: the second async save waits for
        # the first, which also starts DCP's background process (a one-time cost, reported on its own).
        window_start = 2 * args.interval + 1
        throughput, results = {}, {}
        for name, cfg in runs.items():
            started = time.perf_counter()
            results[name] = run_local_training(cfg, data)
            throughput[name], window = _throughput(cfg, window_start)
            log.info("%s: %.3f steps/s over %d steps (run %.0f s)", name, throughput[name], window,
                     time.perf_counter() - started)

        sync_stalls, sync_first = _stalls(runs["sync"])
        async_stalls, async_first = _stalls(runs["async"])
        committed = read_events(runs["async"].run_dir, "checkpoint_committed")
        checkpoint = Path(committed[-1]["path"])

        probe_out = scratch / "probe.json"
        probe_cfg = runs["async"].run_dir / "probe.yaml"
        probe_cfg.write_text(_config(scratch, "probe", args, "--checkpoint.enabled=false").to_yaml())
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={runs['async'].training.nproc_per_node}", str(ROOT / "bench" / "checkpoint_probe.py"),
                        str(probe_cfg), str(data), str(checkpoint), str(probe_out)], check=True, cwd=ROOT)
        probe = json.loads(probe_out.read_text())
        memcpy = max(p["memcpy_seconds"] for p in probe)
        load = max(p["load_seconds"] for p in probe)
        raw_read = max(p["raw_read_seconds"] for p in probe)

        stall_async, stall_sync = statistics.median(async_stalls), statistics.median(sync_stalls)
        figures = {
            "params": results["none"]["num_parameters"],
            "state_bytes": sum(p["state_bytes"] for p in probe),
            "checkpoint_bytes": committed[-1]["bytes"],
            "interval_steps": args.interval,
            "window_steps": window,
            "stall_async_seconds": stall_async,
            "stall_sync_seconds": stall_sync,
            "first_save_async_blocking_seconds": async_first,
            "first_save_async_background_seconds": committed[0]["background_seconds"],
            "first_save_sync_seconds": sync_first,
            "memcpy_seconds": memcpy,
            "stall_over_memcpy": stall_async / memcpy,
            "stall_over_sync": stall_async / stall_sync,
            "throughput_steps_per_second": throughput,
            "throughput_ratio_async": throughput["async"] / throughput["none"],
            "throughput_ratio_sync": throughput["sync"] / throughput["none"],
            "async_background_seconds": statistics.median(e["background_seconds"] for e in committed[1:] or committed),
            "load_seconds": load,
            "raw_read_seconds": raw_read,
            "load_over_raw_read": raw_read / load,
        }
        write_results(args.output, figures, "bench/checkpoint.py")
        rows = [
            ("params", f"{figures['params'] / 1e6:.1f} M", ""),
            ("state (params + AdamW), all ranks", f"{figures['state_bytes'] / 1e9:.2f} GB", ""),
            ("blocking stall per save, async", f"{stall_async:.3f} s", ""),
            ("blocking stall per save, sync", f"{stall_sync:.3f} s", ""),
            ("warm memcpy of the state", f"{memcpy:.3f} s", ""),
            ("first async save in the background (starts DCP's process)",
             f"{figures['first_save_async_background_seconds']:.1f} s", "one-time"),
            ("async stall / memcpy", f"{figures['stall_over_memcpy']:.2f}x", "goal <= 1.5x"),
            ("async stall / sync stall", f"{figures['stall_over_sync']:.3f}", "goal <= 0.10"),
            (f"throughput, save every {args.interval} steps, async", f"{figures['throughput_ratio_async']:.1%}",
             "goal >= 97 %"),
            (f"throughput, save every {args.interval} steps, sync", f"{figures['throughput_ratio_sync']:.1%}",
             "sync <= 70 % sets N"),
            ("raw read / DCP load", f"{figures['load_over_raw_read']:.1%}", "goal >= 70 %"),
        ]
        print("\n| measure | value | goal |\n|---|---|---|")
        for row in rows:
            print(f"| {row[0]} | {row[1]} | {row[2]} |")
        print(args.output)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
