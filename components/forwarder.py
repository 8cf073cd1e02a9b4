"""The live forwarder: what the run folder accumulates during training reaches the MLflow train run while it
trains, on either launcher (this machine or a TrainJob: the train step reads the run folder either way).

    with RunFolderForwarder(tracker, run, run_dir, interval_seconds=10):
        train()                     # every interval: new lines -> one spooled MLflow record
    # on exit (success or failure): everything left, and the recovery table

Forwarded, each from its file in the run folder and each point with its own time:
- ``metrics.jsonl`` — every line, a replayed step included (MLflow then holds both points of that step, as
  metrics.jsonl does): loss, lr, grad_norm, step and data seconds, tokens/s;
- ``events/rank-N.jsonl`` — committed checkpoints (with the worst rank's loop wait, once every rank's stall
  is in), failed saves, faults (``fault``: 1 at its step), recoveries (their seconds and lost steps at the
  recovery's first step, the running count ``recoveries``, and the recovery table), straggler reports (the
  count ``stragglers`` and ``straggler_lowest_score`` per report, and the straggler table: a row per streak
  and per replacement), the planner's
  interval choices;
- ``system/<node>.jsonl`` — each training node's system metrics as ``system/<node>/<metric>``;
- ``trainer_status.json`` — rank 0's progress report (trainer.progress), as a line in this step's log.

Exactly once, through the spool (components.tracking): the forwarder's read positions (byte offsets of
whole lines), and the commits it read that still wait for another rank's stall line, are saved with the rows
they produced, so a retried step or a restarted forwarder goes on where the journal stopped, and an MLflow
outage only delays delivery.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from components.tracking import Tracker, metric_rows
from trainer.progress import progress_line
from trainer.run_dir import RunDir, read_json

log = logging.getLogger(__name__)

RECOVERY_TABLE = "recovery_events.json"
STRAGGLER_TABLE = "straggler_events.json"
# Recovery fields logged as metrics at the recovery's first step.
RECOVERY_METRICS = ("recovery_seconds", "lost_steps", "reload_seconds", "reinit_seconds",
                    "detect_and_teardown_seconds", "first_step_seconds", "fsx_bytes_read", "restore_seconds",
                    "restore_overlapped_seconds", "restore_gb_per_second")


class RunFolderForwarder:
    def __init__(self, tracker: Tracker, run: str, run_dir: Path, interval_seconds: float = 10.0):
        self.tracker = tracker
        self.run = run
        self.run_dir = RunDir(run_dir)
        self.interval_seconds = interval_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one pass at a time (the thread's, the last one's)
        saved = tracker.forwarded_cursor()
        self.cursor: dict[str, int] = saved.get("offsets", {})  # file (relative to the run folder) -> bytes read
        self._stalls: dict[int, dict[int, float]] = {}  # step -> rank -> loop wait, handoff (worst rank wins)
        self._handoffs: dict[int, dict[int, float]] = {}
        self._pending_commits: list[dict[str, Any]] = saved.get("pending_commits", [])  # read, waiting for stalls
        self._recoveries: list[dict[str, Any]] = []
        self._stragglers: list[dict[str, Any]] = []
        self._progress_seen: int | None = None
        self._recovery_count = 0
        self._replayed_history = False

    # -- lifecycle ---------------------------------------------------------------------------------------

    def __enter__(self) -> "RunFolderForwarder":
        self._thread = threading.Thread(target=self._run, name="mlflow-forwarder", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.forward(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            try:
                self.forward()
            except Exception:  # noqa: BLE001 - a forwarding problem must never stop training; logged, retried
                log.exception("forwarding the run folder to MLflow failed; retrying in %.0f s", self.interval_seconds)

    # -- one pass ------------------------------------------------------------------------------------------

    def forward(self, final: bool = False) -> int:
        """Journal what appeared since the last pass; final: also commits whose stalls are incomplete. Returns
        the number of metric points sent."""
        with self._lock:
            if not self._replayed_history:
                self._replay_history()
            cursor = dict(self.cursor)
            rows: list[list] = []
            metrics, cursor[self._key(self.run_dir.metrics)] = self._new_lines(self.run_dir.metrics)
            rows += metric_rows(metrics)
            events = []
            for path in sorted(self.run_dir.events.glob("rank-*.jsonl")):
                found, cursor[self._key(path)] = self._new_lines(path)
                events += found
            rows += self._event_rows(sorted(events, key=lambda e: e["time"]), final)
            for path in sorted(self.run_dir.system.glob("*.jsonl")):
                samples, cursor[self._key(path)] = self._new_lines(path)
                node = path.stem
                rows += [[f"system/{node}/{key[len('system/'):]}", float(value), int(s["time"] * 1000),
                          int(s["sample"])] for s in samples for key, value in s.items() if key.startswith("system/")]
            new_recoveries = [e for e in events if e.get("event") == "recovery"]
            if rows or cursor != self.cursor:
                # Commits read but waiting for a stall line go with the positions: a restarted forwarder has them.
                self.tracker.forward(self.run, rows, {"offsets": cursor, "pending_commits": self._pending_commits})
                self.cursor = cursor
            if new_recoveries:
                self._recoveries += new_recoveries
                self.log_recovery_table()
            self._log_progress()
            new_stragglers = [e for e in events if _opens_a_streak(e)]
            if new_stragglers:
                self._stragglers += new_stragglers
                self._log_table(self._stragglers, STRAGGLER_TABLE)
            return len(rows)

    def _log_progress(self) -> None:
        """The trainer's progress report (trainer.progress), in this step's log when it changed."""
        path = self.run_dir.trainer_status
        try:
            changed = path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if changed != self._progress_seen:
            self._progress_seen = changed
            status = read_json(path)
            if status:
                log.info("%s", progress_line(status))

    def log_recovery_table(self) -> None:
        self._log_table(self._recoveries, RECOVERY_TABLE)

    def _log_table(self, records: list[dict[str, Any]], artifact_file: str) -> None:
        if records:
            columns = sorted({key for r in records for key in r})
            self.tracker.log_table(self.run, data={c: [_cell(r.get(c)) for r in records] for c in columns},
                                   artifact_file=artifact_file)

    def _key(self, path: Path) -> str:
        return str(Path(path).relative_to(self.run_dir.path))

    def _new_lines(self, path: Path) -> tuple[list[dict[str, Any]], int]:
        """Whole lines appended since the cursor (a line still being written waits for the next pass)."""
        start = self.cursor.get(self._key(path), 0)
        if not path.is_file():
            return [], start
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read()
        end = data.rfind(b"\n") + 1
        records = []
        for line in data[:end].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # torn by a process killed mid-write, then appended after: skipped
                continue
        return records, start + end

    def _replay_history(self) -> None:
        """A restarted forwarder (a retried step) rebuilds what earlier passes knew — stalls seen, commits still
        waiting for them, the recoveries of the table — from the lines before its cursor, without sending them."""
        self._replayed_history = True
        seen = []
        for path in sorted(self.run_dir.events.glob("rank-*.jsonl")):
            end = self.cursor.get(self._key(path), 0)
            if end:
                with path.open("rb") as handle:
                    data = handle.read(end)
                for line in data.splitlines():
                    try:
                        seen.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
        for event in sorted(seen, key=lambda e: e["time"]):
            if event.get("event") == "checkpoint_stall":
                self._note_stall(event)
            elif event.get("event") == "recovery":
                self._recoveries.append(event)
            elif _opens_a_streak(event):
                self._stragglers.append(event)
        self._recovery_count = len(self._recoveries)

    def _note_stall(self, event: dict[str, Any]) -> None:
        self._stalls.setdefault(event["step"], {})[event["rank"]] = event.get("loop_wait_seconds", 0.0)
        self._handoffs.setdefault(event["step"], {})[event["rank"]] = event.get("handoff_seconds", 0.0)

    def _event_rows(self, events: list[dict[str, Any]], final: bool) -> list[list]:
        records: list[dict[str, Any]] = []
        for event in events:
            kind = event.get("event")
            if kind == "checkpoint_stall":
                self._note_stall(event)
            elif kind == "checkpoint_committed":
                self._pending_commits.append(event)
            elif kind == "checkpoint_failed" and event["rank"] == 0:
                records.append({"step": event["step"], "time": event["time"], "checkpoint_failed": 1})
            elif kind == "fault":
                records.append({"step": event["step"], "time": event["time"], "fault": 1})
            elif kind == "recovery":
                self._recovery_count += 1
                record = {"step": event["first_step"], "time": event["time"], "recoveries": self._recovery_count}
                record.update({k: event[k] for k in RECOVERY_METRICS if event.get(k) is not None})
                records.append(record)
            elif kind == "straggler_report":  # per report: how many, and the slowest rank's lowest score
                records.append({"step": event["step"], "time": event["time"], "stragglers": len(event["stragglers"]),
                                **({"straggler_lowest_score": event["lowest"]["score"]} if event["lowest"] else {})})
            elif kind == "checkpoint_interval_chosen" and event["rank"] == 0:
                records.append({"step": event.get("step", 0), "time": event["time"],
                                "checkpoint_interval_steps_chosen": event["interval_steps"]})
        ranks = len(list(self.run_dir.events.glob("rank-*.jsonl")))
        waiting = []
        for commit in self._pending_commits:
            stalls = self._stalls.get(commit["step"], {})
            if len(stalls) < ranks and not final:
                waiting.append(commit)  # another rank's stall line is on its way
                continue
            records.append({"step": commit["step"], "time": commit["time"],
                            "checkpoint_loop_wait_seconds": max(stalls.values(), default=commit["blocking_seconds"]),
                            "checkpoint_blocking_seconds": max(self._handoffs.get(commit["step"], {}).values(),
                                                               default=commit["blocking_seconds"]),
                            "checkpoint_background_seconds": commit["background_seconds"],
                            "checkpoint_bytes": commit["bytes"],
                            "checkpoint_mb_per_second": commit["mb_per_second"] or 0.0})
        self._pending_commits = waiting
        return metric_rows(records)


def _opens_a_streak(event: dict[str, Any]) -> bool:
    """A straggler event the table lists: the first report of a streak, or one that acts (replace_node) — a
    node slow for weeks is one row, not one per report (the per-report count goes to ``stragglers``)."""
    return event.get("event") == "straggler" and (event["consecutive_reports"] == 1 or event["action"] != "report")


def _cell(value: Any) -> Any:
    """A table cell MLflow's table view shows: lists (a recovery's fault keys) and mappings (a straggler's
    section scores) as text."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in value.items())
    return ", ".join(map(str, value)) if isinstance(value, list) else value
