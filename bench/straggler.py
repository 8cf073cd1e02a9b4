"""Straggler detection on 2 CPU ranks: how soon a straggler is named, how often a clean run names one, and what
the detection costs a step — measured side by side in one run.

    .venv/bin/python bench/straggler.py             # ~8 min
    .venv/bin/python bench/straggler.py --rounds 1  # harness check (~3 min)

Per round, three runs of the same model, data and steps (the demo's tiny preset, 2 ranks, checkpoints as in
the local config), in this order:
- clean, detection off (resilience.straggler_interval=0): the reference step time;
- clean, detection every --interval steps: its reports, any straggler it names (a false positive), the lowest
  relative step score seen, and its step time against the run without detection;
- a straggler drill (straggler@STEP:rank=1, faults.straggler_factor), STEP moving through the interval from
  round to round (a fault just after a report, mid-interval, just before one): the latency from the fault's
  step to the first report naming rank 1, in steps and in intervals.
Step time: the median of each run's step-to-step wall time (saves included); the overhead is the median over
rounds of on / off. Writes bench/results/straggler.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from components.train.report import read_metrics  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.observe import logs  # noqa: E402
from trainer.run.events import read_events  # noqa: E402
from trainer.run.run_dir import RunDir  # noqa: E402


def _run(scratch: Path, tokens: Path, name: str, steps: int, *overrides: str):
    cfg = load_config("local", [f"--run.work_dir={scratch / name}", f"--run.run_id={name}",
                                f"--checkpoint.memory_dir={scratch / name / 'node-memory'}",
                                f"--training.num_steps={steps}",
                                # windows of about a second: by reports alone, so the latency is in intervals
                                "--resilience.straggler_confirm_seconds=0", *overrides])
    run_local_training(cfg, tokens)
    times = [r["time"] for r in read_metrics(RunDir(cfg.run_dir).metrics)]
    step_seconds = statistics.median(b - a for a, b in zip(times, times[1:]))
    return cfg, step_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--interval", type=int, default=10)
    parser.add_argument("--factor", type=float, default=1.5)
    args = parser.parse_args()
    logs.configure()
    scratch = Path(tempfile.mkdtemp(prefix="bench-straggler-"))
    tokens = demo_token_dir(scratch)
    clean, drills, overheads = [], [], []
    for index in range(args.rounds):
        _, off = _run(scratch, tokens, f"off-{index}", args.steps, "--resilience.straggler_interval=0")
        cfg, on = _run(scratch, tokens, f"on-{index}", args.steps, f"--resilience.straggler_interval={args.interval}")
        overheads.append(on / off)
        reports = read_events(cfg.run_dir, "straggler_report")
        clean.append({"reports": len(reports), "named": len(read_events(cfg.run_dir, "straggler")),
                      "lowest_step_score": min((r["lowest"]["score"] for r in reports if r["lowest"]), default=None)})
        # The fault's place in the interval: just after a report, mid-interval, just before one.
        fault_step = 2 * args.interval + 1 + (index * (args.interval - 2)) // max(1, args.rounds - 1)
        cfg, _ = _run(scratch, tokens, f"drill-{index}", args.steps, f"--resilience.straggler_interval={args.interval}",
                      f"--faults.straggler_factor={args.factor}", f"--faults.schedule=straggler@{fault_step}:rank=1")
        named = [s for s in read_events(cfg.run_dir, "straggler") if s["straggler_rank"] == 1]
        latency = named[0]["step"] - fault_step if named else None
        drills.append({"fault_step": fault_step, "first_named_at": named[0]["step"] if named else None,
                       "latency_steps": latency, "latency_intervals": latency / args.interval if named else None,
                       "score": named[0]["score"] if named else None,
                       "wrong_rank_named": len(read_events(cfg.run_dir, "straggler")) - len(named)})
        print(f"round {index}: clean {clean[-1]}, drill {drills[-1]}, step time on/off {overheads[-1]:.3f}",
              flush=True)
    latencies = [d["latency_intervals"] for d in drills if d["latency_intervals"] is not None]
    figures = {"rounds": args.rounds, "steps": args.steps, "interval_steps": args.interval, "factor": args.factor,
               "clean_runs": clean, "drills": drills,
               "clean_reports": sum(c["reports"] for c in clean),
               "false_positives": sum(c["named"] for c in clean),
               "lowest_clean_step_score": min((c["lowest_step_score"] for c in clean
                                               if c["lowest_step_score"] is not None), default=None),
               "detected": len(latencies), "max_latency_intervals": max(latencies, default=None),
               "step_time_ratio_on_over_off": statistics.median(overheads)}
    write_results(ROOT / "bench" / "results" / "straggler.json", figures, "bench/straggler.py")
    print(f"false positives {figures['false_positives']} in {figures['clean_reports']} clean reports (lowest step "
          f"score {figures['lowest_clean_step_score']}); detected {len(latencies)}/{args.rounds}, latency at most "
          f"{figures['max_latency_intervals']} intervals; step time with detection / without "
          f"{figures['step_time_ratio_on_over_off']:.3f}")
    return 0 if len(latencies) == args.rounds and figures["false_positives"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
