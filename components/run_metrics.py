"""What the run folder's records mean as MLflow metrics and table rows: pure functions, no I/O.

The live forwarder (components.forwarder) applies them to the lines it tails while training runs, and the
train step's report (components.train.report) to the history at the end, so a committed checkpoint or a
recovery reads the same in both:

- ``step_rows(records, after, every)`` — per-step metrics at the configured cadence (and every val_loss), each step
  once;
- ``event_record(event, recoveries)`` — a fault, a failed save, a recovery (its seconds and lost steps at
  its first step, and the running count ``recoveries``), a straggler report, an interval choice, a committed
  checkpoint, a save's stall (the worst rank's, reduced by the ranks: trainer.checkpoint.commit);
- ``system_rows(samples, point)`` — every node's system metrics as a few keys that do not grow with the cluster;
- ``opens_a_streak(event)`` — whether a straggler event is a table row (and a console line);
- ``recovery_row(event)`` — a recovery, or a numeric fault's anomaly, rerun, SDC finding, rollback or skip, as a
  row of the recovery table with its mechanism (None: not one);
- ``table(records)`` — rows as the columns MLflow's table view shows.
"""

from __future__ import annotations

import statistics
from typing import Any

RECOVERY_TABLE = "recovery_events.json"
STRAGGLER_TABLE = "straggler_events.json"
# The numeric faults' records (trainer.resilience.numerics, trainer.job.numeric_recovery): rows of the recovery
# table, each with the mechanism that acted.
NUMERIC_MECHANISMS = {"numeric_anomaly": "numeric_check", "numeric_rerun": "rerun", "sdc_suspected": "rerun",
                      "rollback": "rollback", "data_skipped": "skip"}
# Recovery fields logged as metrics at the recovery's first step.
RECOVERY_METRICS = ("recovery_seconds", "lost_steps", "reload_seconds", "reinit_seconds",
                    "detect_and_teardown_seconds", "first_step_seconds", "fsx_bytes_read", "restore_seconds",
                    "restore_overlapped_seconds", "restore_gb_per_second")


def step_rows(records: list[dict[str, Any]], after: int, every: int) -> tuple[list[dict[str, Any]], int]:
    """The per-step records MLflow gets, and the newest step seen: each step once — a step replayed after a
    fault (at or below `after`, the newest step already seen) adds no second point, the first one stands —
    and every `every`-th step only (mlflow.step_metric_every), except a step with a periodic validation
    (val_loss: eval.every_steps), which always goes."""
    sent = []
    for record in records:
        step = int(record["step"])
        if step > after:
            after = step
            if step % every == 0 or "val_loss" in record:
                sent.append(record)
    return sent, after


def event_record(event: dict[str, Any], recoveries: int) -> dict[str, Any] | None:
    """The metric record of one event (None: it has none); `recoveries`: the run's count including this one
    when the event is a recovery."""
    kind = event.get("event")
    if kind == "checkpoint_failed" and event["rank"] == 0:
        return {"step": event["step"], "time": event["time"], "checkpoint_failed": 1}
    if kind == "fault":
        return {"step": event["step"], "time": event["time"], "fault": 1}
    if kind == "recovery":
        record = {"step": event["first_step"], "time": event["time"], "recoveries": recoveries}
        record.update({k: event[k] for k in RECOVERY_METRICS if event.get(k) is not None})
        return record
    if kind == "straggler_report":  # per report: how many, and the slowest rank's lowest score
        return {"step": event["step"], "time": event["time"], "stragglers": len(event["stragglers"]),
                **({"straggler_lowest_score": event["lowest"]["score"]} if event["lowest"] else {})}
    if kind == "checkpoint_interval_chosen" and event["rank"] == 0:
        return {"step": event.get("step", 0), "time": event["time"],
                "checkpoint_interval_steps_chosen": event["interval_steps"]}
    if kind in ("numeric_anomaly", "sdc_suspected"):
        return {"step": event["step"], "time": event["time"], kind: 1}
    if kind == "rollback":  # a mark on the loss's plot at the anomaly, with what it cost
        return {"step": event["anomaly_step"], "time": event["time"], "rollback": 1,
                "rollback_lost_steps": event["lost_steps"], "samples_skipped_by_rollback": event["samples"]}
    if kind == "checkpoint_committed":
        return commit_record(event)
    if kind == "checkpoint_stall":
        return stall_record(event)
    return None


def commit_record(commit: dict[str, Any]) -> dict[str, Any]:
    """A committed checkpoint: its background time (write and commit), size, speed."""
    return {"step": commit["step"], "time": commit["time"],
            "checkpoint_background_seconds": commit["background_seconds"],
            "checkpoint_bytes": commit["bytes"], "checkpoint_mb_per_second": commit["mb_per_second"] or 0.0}


def stall_record(stall: dict[str, Any]) -> dict[str, Any]:
    """What a save cost the loop, the worst rank's: its whole wait (previous save, barrier, hand-off, node-memory
    copies) and the hand-off alone."""
    return {"step": stall["step"], "time": stall["time"],
            "checkpoint_loop_wait_seconds": stall["loop_wait_seconds"],
            "checkpoint_blocking_seconds": stall.get("handoff_seconds", 0.0)}


def system_rows(samples: list[dict[str, Any]], point: int) -> list[list]:
    """Every node's newest sample of these, as metric rows [key, value, time in ms, point]: per metric the
    minimum, median and maximum across nodes and which node is at either end (its index), so a cluster of
    1,024 nodes has the keys one node has."""
    newest: dict[str, dict[str, Any]] = {}
    for sample in samples:
        node = str(sample.get("node", "node-0"))
        if node not in newest or sample["time"] >= newest[node]["time"]:
            newest[node] = sample
    if not newest:
        return []
    at = int(max(s["time"] for s in newest.values()) * 1000)
    rows = []
    for key in sorted({k for s in newest.values() for k in s if k.startswith("system/")}):
        values = sorted((float(s[key]), node) for node, s in newest.items() if key in s)
        (low, low_node), (high, high_node) = values[0], values[-1]
        for name, value in (("min", low), ("median", statistics.median(v for v, _ in values)), ("max", high),
                            ("min_node", _node_index(low_node)), ("max_node", _node_index(high_node))):
            rows.append([f"{key}/{name}", float(value), at, point])
    return rows


def _node_index(node: str) -> float:
    """node-7 -> 7 (a metric is a number); -1 for a name without one."""
    digits = node.rsplit("-", 1)[-1]
    return float(digits) if digits.isdigit() else -1.0


def opens_a_streak(event: dict[str, Any]) -> bool:
    """A straggler event the table lists: the first report of a streak, or one that acts (replace_node) — a
    node slow for weeks is one row, not one per report (the per-report count goes to ``stragglers``)."""
    return event.get("event") == "straggler" and (_first_of_streak(event) or event["action"] != "report")


def _first_of_streak(event: dict[str, Any]) -> bool:
    """Run folders before resilience.straggler_confirm_reports named a straggler in its first report."""
    return event.get("first_of_streak", event["consecutive_reports"] == 1)


def recovery_row(event: dict[str, Any]) -> dict[str, Any] | None:
    kind = event.get("event")
    if kind == "recovery":
        return event
    if kind in NUMERIC_MECHANISMS:
        return {**event, "mechanism": NUMERIC_MECHANISMS[kind]}
    return None


def table(records: list[dict[str, Any]]) -> dict[str, list]:
    """Records as MLflow table columns (every key any record has)."""
    columns = sorted({key for r in records for key in r})
    return {c: [_cell(r.get(c)) for r in records] for c in columns}


def _cell(value: Any) -> Any:
    """A table cell MLflow's table view shows: lists (a recovery's fault keys) and mappings (a straggler's
    section scores) as text."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    return ", ".join(map(str, value)) if isinstance(value, list) else value


def replica_group_line(event: dict[str, Any]) -> tuple[tuple, str] | None:
    """The console's line of a replica-group record and the key that shows it once (each group's rank 0 records
    a quorum change; every rank of a healed group its heal); None for any other record."""
    kind = event.get("event")
    if kind == "quorum_changed" and event["left"] or kind == "quorum_changed" and event["joined"] != event["groups"]:
        return (("quorum", event["quorum_id"], tuple(event["groups"])),
                f"  ! replica groups at step {event['step']}: {event['groups']} train (out {event['left']}, in "
                f"{event['joined']}): {event['why']}")
    if kind == "replica_group_heal":
        return (("heal", event["group"], event["step"]),
                f"  ! replica group {event['group']} healed from group {event['donor_group']} at step {event['step']}"
                f" ({event['bytes'] / 1e6:.0f} MB per rank in {event['seconds']:.1f} s)")
    if kind == "step_discarded":
        return ("discarded", event["step"]), f"  ! step {event['step']} discarded by the replica groups: {event['why']}"
    return None
