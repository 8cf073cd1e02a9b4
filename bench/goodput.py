"""Goodput under one seeded fault schedule, applied identically to every configuration, in one run.

    .venv/bin/python bench/goodput.py           # ~8 min on 2 CPU ranks
    .venv/bin/python bench/goodput.py --steps 40 --mtbf 15   # quicker

Configurations (same model, data, seed and fault schedule):
- baseline: synchronous checkpoints, every fault relaunches the whole job;
- ft_launcher: synchronous checkpoints, in-job restarts;
- in_process+ft_launcher: in-process restart for exceptions, ft_launcher for process deaths;
- resilient (in_process+ft_launcher+async): the same with asynchronous checkpoints.

Definitions:
- goodput = productive step time / wall time, where productive step time sums the step times of the
  steps that were kept (a step replayed after a fault counts once, its last time) and the wall time runs
  from the first step's start to the end of training (the one-time start-up before the first step, equal
  for all configurations, is reported separately as startup_seconds);
- job_goodput = the same over the job's whole wall time, start-up included;
- lost_steps: steps computed and then lost to faults (recomputed after reloading);
- checkpoint_overhead: the loop's checkpoint stalls (worst rank) over the wall time.
Writes bench/results/goodput.json.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from components.train.report import checkpoint_metric_records, read_metrics  # noqa: E402
from trainer import logs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.events import read_events  # noqa: E402
from trainer.resilience.faults import random_schedule  # noqa: E402
from trainer.run_dir import RunDir, read_jsonl  # noqa: E402

log = logging.getLogger("bench.goodput")

CONFIGS = {
    "baseline": ["--checkpoint.mode=sync", "--resilience.launcher=ft_launcher", "--resilience.max_restarts=0",
                 "--resilience.job_restarts=10"],
    "ft_launcher": ["--checkpoint.mode=sync", "--resilience.launcher=ft_launcher", "--resilience.max_restarts=10",
                    "--resilience.job_restarts=0"],
    "in_process+ft_launcher": ["--checkpoint.mode=sync", "--resilience.in_process=true",
                               "--resilience.in_process_max_restarts=10", "--resilience.max_restarts=10",
                               "--resilience.job_restarts=0"],
    "in_process+ft_launcher+async": ["--checkpoint.mode=async", "--resilience.in_process=true",
                                     "--resilience.in_process_max_restarts=10", "--resilience.max_restarts=10",
                                     "--resilience.job_restarts=0"],
}


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--mtbf", type=float, default=25.0, help="mean steps between faults")
    parser.add_argument("--interval", type=int, default=5, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "goodput.json")
    args = parser.parse_args()

    # One schedule, written out explicitly, so every configuration sees exactly the same faults.
    faults = random_schedule(args.steps, args.mtbf, ["exception", "sigkill"], world_size=2, seed=args.seed)
    schedule = ", ".join(f.key for f in faults)
    log.info("fault schedule: %s", schedule)

    scratch = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        data = demo_token_dir(scratch)

        figures: dict[str, dict] = {}
        for name, flags in CONFIGS.items():
            cfg = load_config("local", [
                f"--run.work_dir={scratch}", f"--run.run_id={name.replace('+', '-').replace('_', '-')}",
                f"--model.preset={args.preset}", f"--training.num_steps={args.steps}", "--training.batch_size=8",
                "--training.seq_len=128", "--training.warmup_steps=5", "--training.log_every=10",
                f"--checkpoint.interval_steps={args.interval}", "--checkpoint.keep_last=2",
                f"--faults.schedule={schedule}", "--resilience.collective_timeout=3", *flags])
            result = run_local_training(cfg, data)
            metrics_path = RunDir(cfg.run_dir).metrics
            kept, all_records = read_metrics(metrics_path), read_jsonl(metrics_path)  # replayed steps counted once
            first_start = min(r["time"] - r["step_seconds"] for r in all_records)
            wall = max(r["time"] for r in all_records) - first_start
            productive = sum(r["step_seconds"] for r in kept)
            stall = sum(r["checkpoint_blocking_seconds"] for r in checkpoint_metric_records(cfg.run_dir))
            figures[name] = {
                "goodput": productive / wall,
                "job_goodput": result["goodput"],
                "lost_steps": len(all_records) - len(kept),
                "faults": len(read_events(cfg.run_dir, "fault")),
                "recoveries_by_mechanism": {key.removeprefix("recoveries_"): count
                                            for key, count in result["recovery_totals"].items()
                                            if key.startswith("recoveries_")},
                "checkpoint_overhead": stall / wall,
                "wall_seconds": wall,
                "startup_seconds": first_start - read_events(cfg.run_dir, "launch")[0]["process_started_at"],
                "job_wall_seconds": result["job_wall_seconds"],
                "final_loss": result["final_loss"],
            }
            log.info("%s: %s", name, figures[name])

        final_losses = {f["final_loss"] for f in figures.values()}
        output = {**figures, "schedule": schedule, "steps": args.steps, "preset": args.preset,
                  "same_final_loss": len(final_losses) == 1,}
        write_results(args.output, output, "bench/goodput.py")
        print(f"\nfault schedule: {schedule}\n")
        print("| configuration | goodput | job goodput | lost steps | faults | recoveries | checkpoint overhead "
              "| wall |\n|---|---|---|---|---|---|---|---|")
        for name, f in figures.items():
            print(f"| {name} | {f['goodput']:.1%} | {f['job_goodput']:.1%} | {f['lost_steps']} | {f['faults']} | "
                  f"{f['recoveries_by_mechanism']} | {f['checkpoint_overhead']:.1%} | {f['wall_seconds']:.0f} s |")
        print(f"\nsame final loss in every configuration: {output['same_final_loss']}")
        print(args.output)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
