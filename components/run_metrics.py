"""What the run folder's records mean as MLflow metrics and table rows: pure functions, no I/O.

The live forwarder (components.forwarder) applies them to the lines it tails while training runs, and the
train step's report (components.train.report) to the whole history at the end, so a committed checkpoint or
a recovery reads the same in both:

- ``event_record(event, recoveries)`` — a fault, a failed save, a recovery (its seconds and lost steps at
  its first step, and the running count ``recoveries``), a straggler report, an interval choice;
- ``commit_record(commit, loop_wait, handoff)`` — a committed checkpoint with the worst rank's stall;
- ``CommitStalls`` — commits held until every rank's stall line is in;
- ``system_rows(node, samples)`` — a node's system metrics as ``system/<node>/<metric>``;
- ``opens_a_streak(event)`` — whether a straggler event is a table row (and a console line);
- ``table(records)`` — rows as the columns MLflow's table view shows.
"""

from __future__ import annotations

from typing import Any

RECOVERY_TABLE = "recovery_events.json"
STRAGGLER_TABLE = "straggler_events.json"
# Recovery fields logged as metrics at the recovery's first step.
RECOVERY_METRICS = ("recovery_seconds", "lost_steps", "reload_seconds", "reinit_seconds",
                    "detect_and_teardown_seconds", "first_step_seconds", "fsx_bytes_read", "restore_seconds",
                    "restore_overlapped_seconds", "restore_gb_per_second")


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
    return None


def commit_record(commit: dict[str, Any], loop_wait: float | None, handoff: float | None) -> dict[str, Any]:
    """A committed checkpoint's record (worst rank): the loop's whole wait for the save (previous save,
    barrier, hand-off), the hand-off alone — each the commit's own blocking time when no stall is known —,
    background time, size, speed."""
    return {"step": commit["step"], "time": commit["time"],
            "checkpoint_loop_wait_seconds": commit["blocking_seconds"] if loop_wait is None else loop_wait,
            "checkpoint_blocking_seconds": commit["blocking_seconds"] if handoff is None else handoff,
            "checkpoint_background_seconds": commit["background_seconds"],
            "checkpoint_bytes": commit["bytes"], "checkpoint_mb_per_second": commit["mb_per_second"] or 0.0}


class CommitStalls:
    """Committed checkpoints waiting for every rank's ``checkpoint_stall`` line (the worst rank wins)."""

    def __init__(self, pending: list[dict[str, Any]] | None = None):
        self.pending = list(pending or [])  # commits read whose stalls are not all in
        self._loop_waits: dict[int, dict[int, float]] = {}  # step -> rank -> loop wait
        self._handoffs: dict[int, dict[int, float]] = {}

    def note(self, event: dict[str, Any], *, replaying: bool = False) -> None:
        """A stall or commit event; replaying: a restarted reader's history (its commits are in `pending`)."""
        if event.get("event") == "checkpoint_stall":
            self._loop_waits.setdefault(event["step"], {})[event["rank"]] = event.get("loop_wait_seconds", 0.0)
            self._handoffs.setdefault(event["step"], {})[event["rank"]] = event.get("handoff_seconds", 0.0)
        elif event.get("event") == "checkpoint_committed" and not replaying:
            self.pending.append(event)

    def ready(self, ranks: int, final: bool) -> list[dict[str, Any]]:
        """The records of the commits whose `ranks` stall lines are in (final: all of them), in order."""
        records, waiting = [], []
        for commit in self.pending:
            loop_waits = self._loop_waits.get(commit["step"], {})
            if len(loop_waits) < ranks and not final:
                waiting.append(commit)  # another rank's stall line is on its way
                continue
            handoffs = self._handoffs.get(commit["step"], {})
            records.append(commit_record(commit, max(loop_waits.values(), default=None),
                                         max(handoffs.values(), default=None)))
        self.pending = waiting
        return records


def system_rows(node: str, samples: list[dict[str, Any]]) -> list[list]:
    """A node's system samples as metric rows [key, value, time in ms, sample number]."""
    return [[f"system/{node}/{key[len('system/'):]}", float(value), int(s["time"] * 1000), int(s["sample"])]
            for s in samples for key, value in s.items() if key.startswith("system/")]


def opens_a_streak(event: dict[str, Any]) -> bool:
    """A straggler event the table lists: the first report of a streak, or one that acts (replace_node) — a
    node slow for weeks is one row, not one per report (the per-report count goes to ``stragglers``)."""
    return event.get("event") == "straggler" and (event["consecutive_reports"] == 1 or event["action"] != "report")


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
