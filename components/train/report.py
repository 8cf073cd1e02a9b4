"""What a training run produced, read back from the run folder the same way on either launcher (one
machine or a TrainJob): per-step metrics, per-checkpoint records, goodput and recovery totals."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.events import read_events
from trainer.run_dir import RunDir, read_json, read_jsonl


def training_report(run_dir: Path, started_at: float | None) -> dict[str, Any]:
    """Goodput and recovery totals from the run folder alone, so both launchers (this machine, a TrainJob)
    report the same thing: productive step seconds over the job's wall time, from started_at (the launch;
    else the first process start) to the result (else now)."""
    run_dir = RunDir(run_dir)
    if started_at is None:
        launches = read_events(run_dir.path, "launch")
        started_at = min((e["process_started_at"] for e in launches), default=None)
    finished_at = (read_json(run_dir.result) or {}).get("finished_at") or time.time()
    wall = finished_at - started_at if started_at is not None else None
    productive = sum(r["step_seconds"] for r in read_metrics(run_dir.metrics))
    recoveries = read_events(run_dir.path, "recovery")
    totals = {"recoveries": len(recoveries), "lost_steps": sum(r["lost_steps"] or 0 for r in recoveries),
              "recovery_seconds_total": sum(r["recovery_seconds"] or 0.0 for r in recoveries)}
    for mechanism in sorted({r["mechanism"] for r in recoveries}):
        totals[f"recoveries_{mechanism}"] = sum(r["mechanism"] == mechanism for r in recoveries)
    return {"job_wall_seconds": wall, "productive_seconds": productive,
            "goodput": productive / wall if wall else None, "recovery_totals": totals}


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Per-step records from metrics.jsonl; the last record of a step wins (steps replayed after a restart)."""
    by_step = {int(record["step"]): record for record in read_jsonl(path)}
    return [by_step[s] for s in sorted(by_step)]


def checkpoint_metric_records(run_dir: Path) -> list[dict[str, float]]:
    """Per-checkpoint records for MLflow: the loop's stall (worst rank), background time, size, speed."""
    stall: dict[int, float] = {}
    for event in read_events(run_dir, "checkpoint_written"):
        stall[event["step"]] = max(stall.get(event["step"], 0.0), event["blocking_seconds"])
    records = []
    for event in read_events(run_dir, "checkpoint_committed"):
        records.append({"step": event["step"], "time": event["time"],
                        "checkpoint_blocking_seconds": stall.get(event["step"], event["blocking_seconds"]),
                        "checkpoint_background_seconds": event["background_seconds"],
                        "checkpoint_bytes": event["bytes"], "checkpoint_mb_per_second": event["mb_per_second"] or 0.0})
    return records
