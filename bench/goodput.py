"""Goodput under one seeded fault schedule, applied identically to every configuration, in one run; and the
simulator's prediction of each from the costs the runs measured (its calibration on this machine).

    .venv/bin/python bench/goodput.py                          # ~15 min on 2 CPU ranks
    .venv/bin/python bench/goodput.py --steps 60 --mtbf 20     # quicker

Configurations (same model, data, seed and fault schedule), named as the planner names them
(trainer.planning.goodput.CONFIGURATIONS):
- sync+relaunch: synchronous FSx saves, no node memory; every fault relaunches the whole job;
- async+ft_launcher: asynchronous FSx saves, no node memory; in-job restarts (state from FSx);
- async+ft_launcher+memory+peer: the same with the node-memory tier and its peer replica (state from memory);
- in_process+ft_launcher+memory+peer: and exceptions recovered in-process.

Definitions (trainer.planning.measured):
- goodput (the headline) = productive seconds / the job's whole wall time, from the launch to the end of the
  last save (start-up and tail included); productive = the kept steps' compute (a step replayed after a fault
  counts once) less their wait for data;
- window_goodput: the same over the window from the first step's start to the last step's end;
- badput by category (fractions of the job's wall time): checkpoint save, checkpoint load, wasted progress,
  infrastructure recovery, start-up, data loading, other;
- recoveries: one line per restart, with the fault that caused it (or why none did).
Prediction: each configuration's measured costs (step time, the loop's wait per save, background time,
restart and reload per mechanism, start-up) and the same faults at the same steps go to the simulator
(trainer.planning.simulate, trace mode); calibration_gap_points = the largest |simulated − measured| goodput.
Writes bench/results/goodput.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.config.drills import random_schedule  # noqa: E402
from trainer.observe import logs  # noqa: E402
from trainer.planning.goodput import CONFIGURATION_NAMES, CONFIGURATIONS, Costs  # noqa: E402
from trainer.planning.measured import badput_breakdown, kept_metrics, measured_costs  # noqa: E402
from trainer.planning.simulate import simulate  # noqa: E402
from trainer.run.events import read_events  # noqa: E402
from trainer.run.run_dir import RunDir, read_jsonl  # noqa: E402

log = logging.getLogger("bench.goodput")

NO_MEMORY = ["--checkpoint.memory_interval_steps=0"]


def configurations(budget: int) -> dict[str, list[str]]:
    """The configurations' flags; `budget`: restarts allowed at each layer (more than the schedule's faults)."""
    in_job = ["--resilience.launcher=ft_launcher", f"--resilience.max_restarts={budget}", "--resilience.job_restarts=0"]
    return {
        "sync+relaunch": ["--checkpoint.mode=sync", *NO_MEMORY, "--resilience.launcher=ft_launcher",
                          "--resilience.max_restarts=0", f"--resilience.job_restarts={budget}"],
        "async+ft_launcher": ["--checkpoint.mode=async", *NO_MEMORY, *in_job],
        "async+ft_launcher+memory+peer": ["--checkpoint.mode=async", *in_job],
        "in_process+ft_launcher+memory+peer": ["--checkpoint.mode=async", *in_job, "--resilience.in_process=true",
                                               f"--resilience.in_process_max_restarts={budget}"],
    }


FAULT_CLASS = {"exception": "exception", "sigkill": "process"}


def explain_recoveries(run_dir: Path) -> list[str]:
    """One line per restart: the fault it recovered from, how, from where, what it lost."""
    lines = []
    for r in read_events(run_dir, "recovery"):
        cause = r["fault_key"] or "no injected fault (a restart the launcher made on its own: see train.log)"
        lines.append(f"{cause} -> {r['mechanism']} #{r['restart_iteration']}, reloaded step {r['reloaded_step']} "
                     f"from {r['reload_source']}, lost {r['lost_steps']} steps, {r['recovery_seconds'] or 0:.1f} s")
    return lines


def measured_inputs(run_dir: Path, steps: int, startup: float) -> dict[str, float]:
    """What this run measured, as the simulator's costs. `startup`: from the job's start (the launcher, not the
    first worker) to the first step."""
    measured = {**measured_costs(run_dir), "startup_seconds": startup}
    costs = {k: v for k, v in measured.items() if k in Costs.__dataclass_fields__}
    costs["step_seconds"] = badput_breakdown(run_dir)["productive_seconds"] / steps  # the mean kept step
    costs.setdefault("checkpoint_stall_seconds", costs.get("sync_stall_seconds", 0.0))
    return costs


def predict(name: str, costs: dict[str, float], trace: list[tuple[int, str]], steps: int, interval: int,
            measured_goodput: float) -> dict:
    """The simulator fed with the measured costs and the same faults at the same steps."""
    config = next(c for c in CONFIGURATIONS if c.name == name)
    step = costs["step_seconds"]
    intervals = {"fsx": interval * step, "fsx_sync": interval * step, "memory": step}
    result = simulate(Costs(nodes=2, node_mtbf_hours=1.0, **costs), config, intervals, steps * step,
                      trace=[tuple(t) for t in trace], final_save=True)
    return {"goodput": result["goodput"], "wall_seconds": result["wall_seconds"], "costs": costs,
            "routes": {k: list(v) for k, v in config.routes.items()}, "badput": result["badput"],
            "gap_points": 100 * abs(result["goodput"] - measured_goodput)}


def repredict(path: Path) -> dict:
    """The predictions of a results file again, from the costs and faults it recorded (after a change to the
    simulator; the measurements stay as they were)."""
    output = json.loads(path.read_text())
    for name in CONFIGURATION_NAMES:
        if name in output:
            figures = output[name]
            figures["predicted"] = predict(name, figures["predicted"]["costs"], output["trace"], output["steps"],
                                           output["interval_steps"], figures["goodput"])
    output["calibration_gap_points"] = max(output[n]["predicted"]["gap_points"] for n in CONFIGURATION_NAMES if n in output)
    path.write_text(json.dumps(output, indent=2))
    return output


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--mtbf", type=float, default=40.0, help="mean steps between faults")
    parser.add_argument("--interval", type=int, default=10, help="FSx checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "goodput.json")
    parser.add_argument("--repredict", action="store_true",
                        help="only recompute the predictions in --output from the costs and faults it recorded")
    args = parser.parse_args()
    if args.repredict:
        output = repredict(args.output)
        print(f"calibration gap: {output['calibration_gap_points']:.1f} points")
        return 0

    # One schedule, written out explicitly, so every configuration sees exactly the same faults.
    faults = random_schedule(args.steps, args.mtbf, ["exception", "sigkill"], world_size=2, seed=args.seed)
    schedule = ", ".join(f.key for f in faults)
    trace = [(f.step, FAULT_CLASS[f.type]) for f in faults]
    log.info("fault schedule: %s", schedule)

    scratch = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        data = demo_token_dir(scratch)
        figures: dict[str, dict] = {}
        for name, flags in configurations(budget=len(faults) + 2).items():
            cfg = load_config("local", [
                f"--run.work_dir={scratch}", f"--run.run_id={name.replace('+', '-').replace('_', '-')}",
                f"--model.preset={args.preset}", f"--training.num_steps={args.steps}", "--training.batch_size=8",
                "--training.seq_len=128", "--training.warmup_steps=5", "--training.log_every=20",
                f"--checkpoint.interval_steps={args.interval}", "--checkpoint.keep_last=2",
                f"--checkpoint.memory_dir={scratch}/node-memory", f"--faults.schedule={schedule}",
                "--resilience.collective_timeout=3", *flags])
            result = run_local_training(cfg, data)
            run_dir = cfg.run_dir
            records, kept = read_jsonl(RunDir(run_dir).metrics), kept_metrics(RunDir(run_dir).metrics)
            first_start = min(r["time"] - r["step_seconds"] for r in records)
            window = max(r["time"] for r in records) - first_start
            wall = result["job_wall_seconds"]
            figures[name] = {
                "goodput": result["goodput"],
                "window_goodput": result["productive_seconds"] / window,
                "badput": {k: v / wall for k, v in result["badput_seconds"].items()},
                "lost_steps": len(records) - len(kept),
                "faults": len(read_events(run_dir, "fault")),
                "recoveries": explain_recoveries(run_dir),
                "recoveries_by_mechanism": {key.removeprefix("recoveries_"): count
                                            for key, count in result["recovery_totals"].items()
                                            if key.startswith("recoveries_")},
                "job_wall_seconds": wall,
                "window_seconds": window,
                "median_step_seconds": statistics.median(r["step_seconds"] for r in kept),
                "final_loss": result["final_loss"],
                "predicted": predict(name, measured_inputs(run_dir, args.steps, result["badput_seconds"]["startup"]),
                                     trace, args.steps, args.interval, result["goodput"]),
            }
            log.info("%s: goodput %.1f%% (predicted %.1f%%)", name, 100 * figures[name]["goodput"],
                     100 * figures[name]["predicted"]["goodput"])

        final_losses = {f["final_loss"] for f in figures.values()}
        output = {**figures, "schedule": schedule, "trace": trace, "steps": args.steps, "preset": args.preset,
                  "interval_steps": args.interval, "same_final_loss": len(final_losses) == 1,
                  "calibration_gap_points": max(f["predicted"]["gap_points"] for f in figures.values())}
        write_results(args.output, output, "bench/goodput.py")
        print(f"\nfault schedule: {schedule}\n")
        print("| configuration | goodput (whole job) | predicted | window goodput | lost steps | faults | "
              "recoveries |\n|---|---|---|---|---|---|---|")
        for name, f in figures.items():
            print(f"| {name} | {f['goodput']:.1%} | {f['predicted']['goodput']:.1%} | {f['window_goodput']:.1%} | "
                  f"{f['lost_steps']} | {f['faults']} | {f['recoveries_by_mechanism']} |")
        for name, f in figures.items():
            print(f"\n{name}: " + ", ".join(f"{k} {v:.1%}" for k, v in f["badput"].items()))
            print("\n".join("  " + line for line in f["recoveries"]))
        print(f"\ncalibration gap: {output['calibration_gap_points']:.1f} points; same final loss: "
              f"{output['same_final_loss']}")
        print(args.output)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
