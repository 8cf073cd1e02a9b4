"""What a training run produced, read back from the run folder once, the same way on either launcher (one machine
or a TrainJob): goodput and badput over the run's launches, recovery totals, the planner's costs, per-save
records, plots.

    report = TrainingReport.read(run_dir, launched_at)   # one pass over each file (trainer.planning.measured)
    result.update(report.figures())                       # what the step result, summary.json and MLflow get

The figures stay bounded however long the run: totals, the last few recoveries (trainer.run.history), a line
per straggling rank; every recovery is in MLflow's recovery table and in events/control.jsonl.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from components.run_metrics import commit_record, stall_record
from components.train.plots import training_plots
from trainer.planning.measured import MeasuredRun, kept_metrics
from trainer.run.history import RECENT_RECOVERIES
from trainer.run.run_dir import RunDir, read_json

read_metrics = kept_metrics  # per-step records, each step's first (a replayed step counts once)
PLOTTED_STEPS = 20_000  # a month of steps is drawn from every k-th one


class TrainingReport:
    def __init__(self, measured: MeasuredRun):
        self.measured = measured

    @classmethod
    def read(cls, run_dir: Path, launched_at: float | None, finished_at: float | None = None) -> "TrainingReport":
        """launched_at: this launch's start (the train step's); finished_at: default result.json's, else now."""
        finished_at = finished_at or (read_json(RunDir(run_dir).result) or {}).get("finished_at") or time.time()
        return cls(MeasuredRun.read(run_dir, launched_at, finished_at))

    def figures(self) -> dict[str, Any]:
        """Goodput, badput and recovery totals over the run's wall time (its launches: a continuation's too),
        the planner's costs, what each save cost (the mean of the worst rank's loop wait)."""
        split, state, recoveries = self.measured.badput(), self.measured.state, self.measured.recoveries
        totals = {"recoveries": len(recoveries), "lost_steps": sum(r.get("lost_steps") or 0 for r in recoveries),
                  "recovery_seconds_total": sum(r.get("recovery_seconds") or 0.0 for r in recoveries)}
        for mechanism in sorted({r["mechanism"] for r in recoveries}):
            totals[f"recoveries_{mechanism}"] = sum(r["mechanism"] == mechanism for r in recoveries)
        rollbacks = [r for r in self.measured.numeric if r["event"] == "rollback"]
        if rollbacks:  # numeric anomalies that came back on a rerun (trainer.job.numeric_recovery)
            totals.update({"rollbacks": len(rollbacks),
                           "rollback_lost_steps": sum(r.get("lost_steps") or 0 for r in rollbacks),
                           "samples_skipped_by_rollback": sum(r.get("samples") or 0 for r in rollbacks)})
        stalls = [s["loop_wait_seconds"] for s in self.measured.stalls]
        steps = self.measured.ledger.steps
        return {"job_wall_seconds": split["wall_seconds"], "productive_seconds": split["productive_seconds"],
                "goodput": split["goodput"], "badput_seconds": split["badput_seconds"], "recovery_totals": totals,
                "recent_recoveries": recoveries[-RECENT_RECOVERIES:], "stragglers": list(state.stragglers.values()),
                "costs": self.measured.costs(), "faults_injected": len(state.fired_fault_keys),
                "checkpoint_saves": len(stalls), "checkpoint_stall_mean_seconds": sum(stalls) / len(stalls) if stalls
                else 0.0, "steps_recorded": int(steps[-1]) if len(steps) else 0,
                "checkpoint_interval_chosen": state.interval_chosen,
                # what the newest start trained with: its LR schedule and data phase (a continuation's decisions)
                "lr_schedule": state.lr_schedule, "data_phase": state.data_phases[-1] if state.data_phases else None,
                # each kept step once; samples_skipped: what replica groups missing from a step did not train
                "samples_trained": int(self.measured.ledger.kept("samples").sum()),
                "samples_skipped": int(self.measured.ledger.kept("samples_skipped").sum())}

    def checkpoint_records(self) -> list[dict[str, float]]:
        """Per save, as the live forwarder sends them (components.run_metrics): its commit and its stall."""
        stalls = {s["step"]: stall_record(s) for s in self.measured.stalls}
        return [{**commit_record(c), **stalls.get(c["step"], {})} for c in self.measured.commits]

    def plots(self, out_dir: Path) -> list[Path]:
        ledger = self.measured.ledger
        steps = ledger.steps
        if not len(steps):
            return []
        every = max(1, len(steps) // PLOTTED_STEPS)
        metrics = [{"step": int(s), **{name: float(ledger.values[name][s]) for name in ("loss", "tokens_per_second",
                                                                                      "time")}}
                   for s in steps[::every]]
        saves = [r for r in self.checkpoint_records() if "checkpoint_blocking_seconds" in r]
        return training_plots(metrics, saves, self.measured.faults, self.measured.recoveries, out_dir)


def training_report(run_dir: Path, launched_at: float | None) -> dict[str, Any]:
    """The report's figures (TrainingReport.figures) of a run folder."""
    return TrainingReport.read(run_dir, launched_at).figures()
