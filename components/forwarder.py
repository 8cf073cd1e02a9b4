"""The live forwarder: what the run folder accumulates during training reaches the MLflow train run while it
trains, on either launcher (this machine or a TrainJob: the train step reads the run folder either way).

    with RunFolderForwarder(tracker, run, run_dir, interval_seconds=10, step_metric_every=1):
        train()                     # every interval: what was appended -> one spooled MLflow record
    # on exit (success or failure): everything left

Each pass reads what four files gained since the last one (trainer.run.tail), so it costs what is new however
long the run:
- ``metrics.jsonl`` — a point per step at ``mlflow.step_metric_every``; a step replayed after a fault adds no
  second point (the first stands, as in the run folder's own figures: trainer.planning.measured);
- ``events/control.jsonl`` — faults (``fault``: 1 at its step), failed saves, recoveries (their seconds and lost
  steps at the recovery's first step, the running count ``recoveries``, and a row of the recovery table), the
  planner's interval choices, straggler streaks (a row of the straggler table);
- ``events/periodic.jsonl`` — each committed checkpoint (background time, size, speed) and what each save cost
  the loop (the worst rank's, one record per save), straggler reports (``stragglers`` and
  ``straggler_lowest_score``);
- ``system/samples.jsonl`` — every node's system metrics, aggregated across nodes (components.run_metrics);
- ``trainer_status.json`` — rank 0's progress report (trainer.observe.progress), as a line in this step's log.

Tables grow by appending: a pass's new rows are a part of their own (``recovery_events/part-<first row>.json``),
never a rewrite of the rows before. What each record means as a metric is components.run_metrics; this module
is the thread, the read positions and the small state across passes.

Exactly once, through the spool (components.tracking): the read positions (byte offsets of whole lines) and the
counters (the newest step seen, recoveries, table rows, system points) are saved with the rows and table parts
they produced, so a retried step or a restarted forwarder goes on where the journal stopped — it reads nothing
before its positions — and an MLflow outage only delays delivery.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from components.run_metrics import (RECOVERY_TABLE, STRAGGLER_TABLE, event_record, opens_a_streak, recovery_row,
                                    step_rows, system_rows, table)
from components.tracking import Tracker, metric_rows
from trainer.observe.progress import progress_line
from trainer.run.run_dir import RunDir, read_json
from trainer.run.tail import read_new_lines

log = logging.getLogger(__name__)


class RunFolderForwarder:
    def __init__(self, tracker: Tracker, run: str, run_dir: Path, interval_seconds: float = 10.0,
                 step_metric_every: int = 1):
        self.tracker = tracker
        self.run = run
        self.run_dir = RunDir(run_dir)
        self.interval_seconds = interval_seconds
        self.step_metric_every = step_metric_every
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one pass at a time (the thread's, the last one's)
        self._files = {self._key(path): path for path in (self.run_dir.metrics, self.run_dir.control_log,
                                                          self.run_dir.periodic_log, self.run_dir.system_samples)}
        saved = tracker.forwarded_cursor()
        # An earlier release's positions name per-rank files: only the ones this release reads are kept.
        self.cursor: dict[str, int] = {k: v for k, v in saved.get("offsets", {}).items() if k in self._files}
        self.counters: dict[str, Any] = saved.get("counters") or self._counters_of_an_earlier_release()
        self._progress_seen: int | None = None

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
        """Journal what appeared since the last pass (final: the same, at the end). Returns the number of metric
        points sent."""
        with self._lock:
            cursor, counters = dict(self.cursor), {**self.counters, "tables": dict(self.counters["tables"])}
            new: dict[str, list[dict[str, Any]]] = {}
            for key, path in self._files.items():
                new[key], cursor[key] = read_new_lines(path, cursor.get(key, 0))
            steps, counters["max_step"] = step_rows(new[self._key(self.run_dir.metrics)], counters["max_step"],
                                                    self.step_metric_every)
            records = []
            for event in new[self._key(self.run_dir.control_log)] + new[self._key(self.run_dir.periodic_log)]:
                counters["recoveries"] += event.get("event") == "recovery"
                record = event_record(event, counters["recoveries"])
                if record is not None:
                    records.append(record)
            rows = metric_rows(steps) + metric_rows(records)
            samples = new[self._key(self.run_dir.system_samples)]
            if samples:
                rows += system_rows(samples, counters["system_points"])
                counters["system_points"] += 1
            control = new[self._key(self.run_dir.control_log)]
            recovery_rows = [row for row in map(recovery_row, control) if row is not None]
            parts = [part for part in (self._table_part(counters, RECOVERY_TABLE, recovery_rows),
                                       self._table_part(counters, STRAGGLER_TABLE, [e for e in control
                                                                                    if opens_a_streak(e)]))
                     if part is not None]
            if rows or parts or cursor != self.cursor:
                self.tracker.forward(self.run, rows, {"offsets": cursor, "counters": counters}, tables=parts)
                self.cursor, self.counters = cursor, counters
            self._log_progress()
            return len(rows)

    @staticmethod
    def _table_part(counters: dict[str, Any], artifact_file: str, records: list[dict[str, Any]]
                    ) -> tuple[str, dict[str, list], int] | None:
        """New rows of a table as its next part (artifact file, columns, index of its first row)."""
        if not records:
            return None
        first = counters["tables"].get(artifact_file, 0)
        counters["tables"][artifact_file] = first + len(records)
        return artifact_file, table(records), first

    def _counters_of_an_earlier_release(self) -> dict[str, Any]:
        """A spool an earlier release's forwarder left (no counters): the newest step it sent is the last one
        before its position in metrics.jsonl, read once (the upgrade's cost, not every restart's)."""
        offset = self.cursor.get(self._key(self.run_dir.metrics), 0)
        sent = read_new_lines(self.run_dir.metrics, 0, until=offset)[0] if offset else []
        return {"max_step": max((int(r["step"]) for r in sent), default=0), "recoveries": 0, "system_points": 0,
                "tables": {}}

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

    def _key(self, path: Path) -> str:
        return str(Path(path).relative_to(self.run_dir.path))
