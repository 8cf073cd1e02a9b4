"""What a finished run measured, read from its run folder: the costs the planner takes, and where the job's
wall time went (badput by category, after Google's ml-goodput-measurement taxonomy).

    costs = measured_costs(run_dir)          # {"step_seconds": ..., "checkpoint_stall_seconds": ..., ...}
    split = badput_breakdown(run_dir, started_at=..., finished_at=...)

Categories, in seconds of the job's wall time (they and the productive time add up to it; `other` is the
rest: logging, metrics, the processes' exit):
- productive: the kept steps' compute (a step replayed after a fault counts once), less their data wait;
- data_loading: the kept steps' wait for their batches;
- checkpoint_save: everything the loop waited for in saves (previous save, barrier, hand-off, node-memory
  copies) and the final save's wait;
- checkpoint_load: reloading the state after a fault;
- wasted_progress: steps computed and then lost to a fault (their replays are productive);
- infrastructure_recovery: detection, tear-down and re-initialisation after a fault;
- startup: from the job's start to its first step.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from trainer.run.events import read_events, run_started_at
from trainer.run.run_dir import RunDir, read_json, read_jsonl

BADPUT_CATEGORIES = ("checkpoint_save", "checkpoint_load", "wasted_progress", "infrastructure_recovery", "startup",
                     "data_loading", "other")
MECHANISM_COST = {"in_process": "in_process_restart_seconds", "ft_launcher": "restart_seconds",
                  "job_restart": "job_restart_seconds"}


def kept_metrics(path: Path) -> list[dict[str, float]]:
    """Per-step records from metrics.jsonl; the last record of a step wins (steps replayed after a restart)."""
    by_step = {int(record["step"]): record for record in read_jsonl(path)}
    return [by_step[s] for s in sorted(by_step)]


def save_stalls(run_dir: Path) -> dict[int, dict[str, float]]:
    """Per FSx save (by step): the loop's whole wait and the hand-off alone, worst rank."""
    stalls: dict[int, dict[str, float]] = {}
    for event in read_events(run_dir, "checkpoint_stall"):
        known = stalls.setdefault(event["step"], {"loop_wait_seconds": 0.0, "handoff_seconds": 0.0,
                                                   "memory_seconds": 0.0, "memory_copies": 0})
        for key in known:
            known[key] = max(known[key], event.get(key, 0))
    return stalls


def measured_costs(run_dir: Path) -> dict[str, float]:
    """The planner's inputs (trainer.planning.goodput.Costs field names) that this run measured; a cost the run
    did not exercise (no fault of that kind, no save) is left out."""
    run_dir = Path(run_dir)
    metrics = kept_metrics(RunDir(run_dir).metrics)
    costs: dict[str, float] = {}
    if metrics:
        costs["step_seconds"] = statistics.median(r["step_seconds"] for r in metrics)
    stalls = save_stalls(run_dir)
    later = [stalls[s] for s in sorted(stalls)][1:]  # the first save also starts the writer: a one-time cost
    written = read_events(run_dir, "checkpoint_committed")
    mode = written[-1]["mode"] if written else None
    if later:
        key = "sync_stall_seconds" if mode == "sync" else "checkpoint_stall_seconds"
        costs[key] = statistics.median(s["loop_wait_seconds"] - s["memory_seconds"] for s in later)
        memory = [s["memory_seconds"] / s["memory_copies"] for s in later if s["memory_copies"] > 0]
        if memory:
            costs["memory_stall_seconds"] = statistics.median(memory)
    if mode and mode != "sync" and len(written) > 1:
        costs["checkpoint_background_seconds"] = statistics.median(e["background_seconds"] for e in written[1:])
    recoveries = read_events(run_dir, "recovery")
    for source, key in (("disk", "fsx_reload_seconds"), ("memory", "memory_reload_seconds"),
                        ("peer", "memory_reload_seconds")):
        found = [r["reload_seconds"] for r in recoveries if r.get("reload_source") == source]
        if found and key not in costs:
            costs[key] = statistics.median(found)
    for mechanism, key in MECHANISM_COST.items():
        found = [(r.get("detect_and_teardown_seconds") or 0.0) + r["reinit_seconds"] for r in recoveries
                 if r.get("mechanism") == mechanism and r.get("reinit_seconds") is not None]
        if found:
            costs[key] = statistics.median(found)
    # A start-up's own cost: the first process's start to the first step (not the run's start: a later launch
    # of the same run folder starts after that step).
    first_process = min((e["process_started_at"] for e in read_events(run_dir, "launch")), default=None)
    startup = _startup_seconds(read_jsonl(RunDir(run_dir).metrics), first_process)
    if startup is not None:
        costs["startup_seconds"] = startup
    return costs


def _startup_seconds(records: list[dict], started_at: float | None) -> float | None:
    starts = [r["time"] - r["step_seconds"] for r in records if "time" in r]
    if started_at is None or not starts:
        return None
    return max(0.0, min(starts) - started_at)


def badput_breakdown(run_dir: Path, started_at: float | None = None, finished_at: float | None = None) -> dict[str, Any]:
    """Where the job's wall time went: productive seconds, each badput category's seconds, and the goodput
    (productive / wall). started_at: the launch's start (trainer.run.events.run_started_at); finished_at: the
    end (default: the result's finished_at)."""
    run_dir = Path(run_dir)
    records = read_jsonl(RunDir(run_dir).metrics)
    kept = kept_metrics(RunDir(run_dir).metrics)
    started_at = run_started_at(run_dir, started_at)
    result = read_json(RunDir(run_dir).result) or {}
    finished_at = finished_at or result.get("finished_at")
    if started_at is None or finished_at is None or not kept:
        return {"wall_seconds": None, "productive_seconds": None, "goodput": None, "badput_seconds": {}}
    wall = finished_at - started_at
    data = sum(r.get("data_seconds", 0.0) for r in kept)
    productive = sum(r["step_seconds"] for r in kept) - data
    recoveries = read_events(run_dir, "recovery")
    seconds = {
        "checkpoint_save": sum(s["loop_wait_seconds"] for s in save_stalls(run_dir).values())
        + (result.get("final_checkpoint_wait_seconds") or 0.0),
        "checkpoint_load": sum(r.get("reload_seconds") or 0.0 for r in recoveries),
        "wasted_progress": sum(r["step_seconds"] for r in records) - sum(r["step_seconds"] for r in kept),
        "infrastructure_recovery": sum((r.get("detect_and_teardown_seconds") or 0.0) + (r.get("reinit_seconds") or 0.0)
                                       for r in recoveries),
        "startup": _startup_seconds(records, started_at) or 0.0,
        "data_loading": data,
    }
    seconds["other"] = wall - productive - sum(seconds.values())
    return {"wall_seconds": wall, "productive_seconds": productive, "goodput": productive / wall if wall > 0 else None,
            "badput_seconds": seconds}
