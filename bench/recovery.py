"""Recovery time by mechanism and fault type, side by side in one run (2 CPU ranks, 101 M params).

    .venv/bin/python bench/recovery.py                 # ~10 min
    .venv/bin/python bench/recovery.py --preset tiny   # harness check

For each mechanism the same model, data and fault schedule (an exception, a hang, a SIGKILL, on
alternating ranks) run once:
- in_process: NVRx in-process restart (layer 1), ft_launcher behind it for process deaths;
- ft_launcher: in-job restart of the workers (layer 2);
- full_relaunch: the launcher gives up at once (max_restarts=0) and the whole job is started again
  (new launcher, rendezvous, interpreters, imports, model build, reload) — the baseline.
Recovery seconds = fault → the next completed step, split into detect + tear down, re-init, reload and
first step, from the trainer's recovery events. Writes bench/results/recovery.json.
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
from trainer import logs  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.events import read_events  # noqa: E402

log = logging.getLogger("bench.recovery")

MECHANISMS = {
    # An in-memory copy every step: an in-process restart reloads the fault's own step without reading disk.
    "in_process": ["--resilience.in_process=true", "--resilience.memory_snapshot_interval_steps=1",
                   "--resilience.launcher=ft_launcher", "--resilience.max_restarts=3", "--resilience.job_restarts=0"],
    "ft_launcher": ["--resilience.launcher=ft_launcher", "--resilience.max_restarts=3", "--resilience.job_restarts=0"],
    "full_relaunch": ["--resilience.launcher=ft_launcher", "--resilience.max_restarts=0",
                      "--resilience.job_restarts=3"],
}
SPLIT = ("detect_and_teardown_seconds", "reinit_seconds", "reload_seconds", "first_step_seconds")


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0,
                        help="ft_launcher hang detection (s); above the slowest step incl. the first async save")
    parser.add_argument("--collective-timeout", type=float, default=3.0, help="gloo timeout under in-process (s)")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "recovery.json")
    args = parser.parse_args()

    schedule = "exception@3:rank=1, hang@6:rank=0, sigkill@9:rank=1"
    scratch = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    try:
        data = demo_token_dir(scratch)

        results: dict[str, dict] = {}
        splits: dict[str, dict] = {}
        for mechanism, flags in MECHANISMS.items():
            cfg = load_config("local", [
                f"--run.work_dir={scratch}", f"--run.run_id={mechanism.replace('_', '-')}",
                f"--model.preset={args.preset}", "--training.num_steps=12", "--training.batch_size=1",
                "--training.seq_len=128", "--training.warmup_steps=1", "--training.log_every=1",
                "--checkpoint.interval_steps=2", "--checkpoint.keep_last=1", f"--faults.schedule={schedule}",
                f"--resilience.heartbeat_timeout={args.heartbeat_timeout}",
                f"--resilience.collective_timeout={args.collective_timeout}",
                f"--resilience.soft_timeout={max(20.0, args.collective_timeout + 5)}", *flags])
            run_local_training(cfg, data)
            recoveries = {r["fault_type"]: r for r in read_events(cfg.run_dir, "recovery")}
            results[mechanism] = {f: (recoveries[f]["recovery_seconds"] if f in recoveries else None)
                                  for f in ("exception", "hang", "sigkill")}
            splits[mechanism] = {f: {"mechanism": r["mechanism"], "lost_steps": r["lost_steps"],
                                     "reload_source": r["reload_source"],
                                     **{k: r[k] for k in SPLIT}} for f, r in recoveries.items()}
            log.info("%s: %s", mechanism, results[mechanism])

        figures = {**results, "splits": splits, "params_preset": args.preset,
                   "heartbeat_timeout": args.heartbeat_timeout, "collective_timeout": args.collective_timeout,}
        write_results(args.output, figures, "bench/recovery.py")

        def cell(value):
            return "n/a" if value is None else f"{value:.1f} s"

        print("\n| fault | in-process | ft_launcher | full relaunch |\n|---|---|---|---|")
        for fault in ("exception", "hang", "sigkill"):
            print(f"| {fault} | {cell(results['in_process'][fault])} | {cell(results['ft_launcher'][fault])} | "
                  f"{cell(results['full_relaunch'][fault])} |")
        print("\n| mechanism / fault | handled by | reload from | lost steps | detect + tear down | re-init | reload | "
              "first step |\n|---|---|---|---|---|---|---|---|")
        for mechanism, by_fault in splits.items():
            for fault, s in by_fault.items():
                print(f"| {mechanism} / {fault} | {s['mechanism']} | {s['reload_source']} | {s['lost_steps']} | "
                      f"{cell(s['detect_and_teardown_seconds'])} | "
                      f"{cell(s['reinit_seconds'])} | {cell(s['reload_seconds'])} | {cell(s['first_step_seconds'])} |")
        print(args.output)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
