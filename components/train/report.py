"""What a training run produced, read back from the run folder the same way on either launcher (one
machine or a TrainJob): per-step metrics, per-checkpoint records, goodput and recovery totals."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from components.run_metrics import commit_record
from trainer.planning.measured import badput_breakdown, kept_metrics, save_stalls
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_json

read_metrics = kept_metrics  # per-step records, a replayed step's last record winning


def training_report(run_dir: Path, started_at: float | None) -> dict[str, Any]:
    """Goodput, badput and recovery totals from the run folder alone, so both launchers (this machine, a
    TrainJob) report the same thing: productive step seconds over the job's whole wall time, from the run's start
    (trainer.run.events.run_started_at: started_at, the launch's, else the first process start) to the result
    (else now), and where the rest went."""
    run_dir = RunDir(run_dir)
    finished_at = (read_json(run_dir.result) or {}).get("finished_at") or time.time()
    split = badput_breakdown(run_dir.path, started_at, finished_at)
    recoveries = read_events(run_dir.path, "recovery")
    totals = {"recoveries": len(recoveries), "lost_steps": sum(r["lost_steps"] or 0 for r in recoveries),
              "recovery_seconds_total": sum(r["recovery_seconds"] or 0.0 for r in recoveries)}
    for mechanism in sorted({r["mechanism"] for r in recoveries}):
        totals[f"recoveries_{mechanism}"] = sum(r["mechanism"] == mechanism for r in recoveries)
    return {"job_wall_seconds": split["wall_seconds"], "productive_seconds": split["productive_seconds"],
            "goodput": split["goodput"], "badput_seconds": split["badput_seconds"], "recovery_totals": totals}


def checkpoint_metric_records(run_dir: Path) -> list[dict[str, float]]:
    """Per-checkpoint records for MLflow (worst rank), as the live forwarder sends them (components.run_metrics)."""
    stalls = save_stalls(run_dir)
    return [commit_record(event, stalls.get(event["step"], {}).get("loop_wait_seconds"),
                          stalls.get(event["step"], {}).get("handoff_seconds"))
            for event in read_events(run_dir, "checkpoint_committed")]
