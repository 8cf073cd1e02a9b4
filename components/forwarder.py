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
- ``trainer_status.json`` — rank 0's progress report (trainer.observe.progress), as a line in this step's log.

What each record means as a metric is components.run_metrics (the train step's report uses the same);
this module is the thread, the read positions and the state across passes.

Exactly once, through the spool (components.tracking): the forwarder's read positions (byte offsets of
whole lines), and the commits it read that still wait for another rank's stall line, are saved with the rows
they produced, so a retried step or a restarted forwarder goes on where the journal stopped, and an MLflow
outage only delays delivery.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from components.run_metrics import (RECOVERY_TABLE, STRAGGLER_TABLE, CommitStalls, event_record, opens_a_streak,
                                    system_rows, table)
from components.tracking import Tracker, metric_rows
from trainer.observe.progress import progress_line
from trainer.run.run_dir import RunDir, read_json
from trainer.run.tail import read_lines_before, read_new_lines

log = logging.getLogger(__name__)


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
        self._commits = CommitStalls(saved.get("pending_commits", []))  # read, waiting for every rank's stall
        self._recoveries: list[dict[str, Any]] = []
        self._stragglers: list[dict[str, Any]] = []
        self._progress_seen: int | None = None
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
            event_files = sorted(self.run_dir.events.glob("rank-*.jsonl"))
            for path in event_files:
                found, cursor[self._key(path)] = self._new_lines(path)
                events += found
            rows += self._event_rows(sorted(events, key=lambda e: e["time"]), ranks=len(event_files), final=final)
            for path in sorted(self.run_dir.system.glob("*.jsonl")):
                samples, cursor[self._key(path)] = self._new_lines(path)
                rows += system_rows(path.stem, samples)
            new_recoveries = [e for e in events if e.get("event") == "recovery"]
            if rows or cursor != self.cursor:
                # Commits read but waiting for a stall line go with the positions: a restarted forwarder has them.
                self.tracker.forward(self.run, rows, {"offsets": cursor, "pending_commits": self._commits.pending})
                self.cursor = cursor
            if new_recoveries:
                self._recoveries += new_recoveries
                self.log_recovery_table()
            self._log_progress()
            new_stragglers = [e for e in events if opens_a_streak(e)]
            if new_stragglers:
                self._stragglers += new_stragglers
                self._log_table(self._stragglers, STRAGGLER_TABLE)
            return len(rows)

    def _log_progress(self) -> None:
        """The trainer's progress report (trainer.observe.progress), in this step's log when it changed."""
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
            self.tracker.log_table(self.run, data=table(records), artifact_file=artifact_file)

    def _key(self, path: Path) -> str:
        return str(Path(path).relative_to(self.run_dir.path))

    def _new_lines(self, path: Path) -> tuple[list[dict[str, Any]], int]:
        """Whole lines appended since the cursor (a line still being written waits for the next pass)."""
        return read_new_lines(path, self.cursor.get(self._key(path), 0))

    def _replay_history(self) -> None:
        """A restarted forwarder (a retried step) rebuilds what earlier passes knew — stalls seen, the
        recoveries and straggler streaks of the tables — from the lines before its cursor, without sending them
        (the commits still waiting for stalls came back with the cursor)."""
        self._replayed_history = True
        seen = [event for path in sorted(self.run_dir.events.glob("rank-*.jsonl"))
                for event in read_lines_before(path, self.cursor.get(self._key(path), 0))]
        for event in sorted(seen, key=lambda e: e["time"]):
            self._commits.note(event, replaying=True)
            if event.get("event") == "recovery":
                self._recoveries.append(event)
            elif opens_a_streak(event):
                self._stragglers.append(event)

    def _event_rows(self, events: list[dict[str, Any]], ranks: int, final: bool) -> list[list]:
        records: list[dict[str, Any]] = []
        recoveries = len(self._recoveries)
        for event in events:
            self._commits.note(event)
            recoveries += event.get("event") == "recovery"
            record = event_record(event, recoveries)
            if record is not None:
                records.append(record)
        records += self._commits.ready(ranks, final)
        return metric_rows(records)
