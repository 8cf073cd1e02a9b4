"""Numeric faults on 2 CPU ranks: how soon each drill is caught, what it costs, and what the checks cost a step,
measured side by side in one run.

    .venv/bin/python bench/numeric_faults.py              # ~10 min
    .venv/bin/python bench/numeric_faults.py --rounds 1   # harness check

The demo's tiny model, 2 ranks (R = 2 replica groups of one node for bitflip), the same data and steps:
- per drill (nan, spike, sdc at R = 1; bitflip at R = 2), the steps from the fault to its detection (the
  numeric_anomaly or sdc_found event's step minus the drill's), the steps lost (rolled back) and the samples
  skipped, and the final held-out loss against a clean run's of the same shape;
- the cost: runs with the checks on and off, alternating, --rounds times: R = 1 with resilience.numeric_checks
  on against off; R = 2 with the fingerprints every --sdc-every steps against none. Step time is the median of a
  run's step-to-step wall time; the ratio is the median over rounds of on / off. The fingerprints' cost at the
  default cadence (every 100 steps) is the measured extra time scaled by --sdc-every / 100 (goal <= 1.01x).
Writes bench/results/numeric_faults.json.
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
from trainer.run.run_dir import RunDir, read_json  # noqa: E402

SPIKES = ["--resilience.spike_window=8", "--resilience.spike_after_steps=8"]
GROUPS = ["--training.num_nodes=2", "--training.replica_groups=2", "--resilience.straggler_interval=0",
          "--resilience.replica_check_interval=0", "--local.node_replacement_delay_seconds=1"]


def _run(scratch: Path, tokens: Path, name: str, steps: int, *overrides: str) -> dict:
    cfg = load_config("local", [f"--run.work_dir={scratch / name}", f"--run.run_id={name}",
                                f"--checkpoint.memory_dir={scratch / name / 'node-memory'}",
                                f"--training.num_steps={steps}", "--checkpoint.interval_steps=10",
                                "--resilience.rollback_steps=5", "--resilience.skip_steps=5", *overrides])
    result = run_local_training(cfg, tokens)
    times = [r["time"] for r in read_metrics(RunDir(cfg.run_dir).metrics)]
    evaluation = read_json(Path(result["evaluation"])) if result.get("evaluation") else None
    return {"cfg": cfg, "step_seconds": statistics.median(b - a for a, b in zip(times, times[1:])),
            "heldout_loss": evaluation["candidate"]["heldout_loss"] if evaluation else None}


def _drill(run: dict, clean: dict, fault_step: int, found_event: str) -> dict:
    found = read_events(run["cfg"].run_dir, found_event)
    rollbacks = read_events(run["cfg"].run_dir, "rollback")
    skipped = read_events(run["cfg"].run_dir, "data_skipped")
    return {"detected_after_steps": found[0]["step"] - fault_step if found else None,
            "steps_lost": sum(r["lost_steps"] for r in rollbacks) + sum(
                max(0, f["step"] - f["last_agreed_step"]) for f in found if f.get("action") == "rollback"
                and f["group"] == 0),
            "samples_skipped": sum(s["samples"] for s in skipped),
            "heldout_loss": run["heldout_loss"], "clean_heldout_loss": clean["heldout_loss"],
            "heldout_loss_over_clean": run["heldout_loss"] / clean["heldout_loss"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fault-step", type=int, default=30)
    parser.add_argument("--sdc-every", type=int, default=10, help="the fingerprints' cadence in the cost runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "numeric_faults.json")
    args = parser.parse_args()
    logs.configure()
    at, steps = args.fault_step, args.steps
    with tempfile.TemporaryDirectory(prefix="bench-numeric-") as tmp:
        scratch = Path(tmp)
        tokens = demo_token_dir(scratch / "data", documents=400)
        clean1 = _run(scratch, tokens, "clean1", steps, "--resilience.spike_zscore=0")
        clean2 = _run(scratch, tokens, "clean2", steps, *GROUPS, "--resilience.sdc_check_every=0")
        drills = {
            "nan": _drill(_run(scratch, tokens, "nan", steps, "--resilience.spike_zscore=0",
                               f"--faults.schedule=nan@{at}:rank=1"), clean1, at, "numeric_anomaly"),
            "spike": _drill(_run(scratch, tokens, "spike", steps, *SPIKES, f"--faults.schedule=spike@{at}"),
                            clean1, at, "numeric_anomaly"),
            "sdc": _drill(_run(scratch, tokens, "sdc", steps, *SPIKES, "--resilience.spike_zscore=20",
                               f"--faults.schedule=sdc@{at}:rank=1"), clean1, at, "numeric_anomaly"),
            "bitflip": _drill(_run(scratch, tokens, "bitflip", steps, *GROUPS, "--resilience.sdc_check_every=10",
                                   f"--faults.schedule=bitflip@{at}:group=1:rank=1"), clean2, at, "sdc_found"),
        }
        checks, fingerprints = [], []
        for round_ in range(args.rounds):
            off = _run(scratch, tokens, f"off1-{round_}", steps, "--resilience.numeric_checks=false")
            on = _run(scratch, tokens, f"on1-{round_}", steps)
            checks.append(on["step_seconds"] / off["step_seconds"])
            off = _run(scratch, tokens, f"off2-{round_}", steps, *GROUPS, "--resilience.sdc_check_every=0")
            on = _run(scratch, tokens, f"on2-{round_}", steps, *GROUPS, f"--resilience.sdc_check_every={args.sdc_every}")
            fingerprints.append(on["step_seconds"] / off["step_seconds"])
    measured = statistics.median(fingerprints)
    figures = {
        "drills": drills,
        "step_time_checks_on_over_off": statistics.median(checks),
        "step_time_checks_on_over_off_rounds": checks,
        f"step_time_fingerprints_every_{args.sdc_every}_over_none": measured,
        "step_time_fingerprints_every_100_over_none": 1 + (measured - 1) * args.sdc_every / 100,
        "fingerprint_rounds": fingerprints,
        "steps": steps, "fault_step": at, "rounds": args.rounds,
    }
    write_results(args.out, figures, "bench/numeric_faults.py")
    for name, drill in drills.items():
        print(f"{name}: detected {drill['detected_after_steps']} step(s) after the fault, {drill['steps_lost']} steps "
              f"lost, {drill['samples_skipped']} samples skipped, held-out loss {drill['heldout_loss_over_clean']:.3f}x "
              "a clean run's")
    print(f"step time, checks on / off: {figures['step_time_checks_on_over_off']:.3f}; fingerprints every 100 steps / "
          f"none: {figures['step_time_fingerprints_every_100_over_none']:.4f} (measured every {args.sdc_every}: "
          f"{measured:.3f})")
    return 0 if all(d["detected_after_steps"] is not None for d in drills.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
