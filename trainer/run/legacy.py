"""A run folder written by the release before the shared event streams (``events/rank-N.jsonl``, one file per
rank) resumes under this one with its history: its records are converted once into the streams
(trainer.run.events), in time order and before anything new is written, and ``events/format.json`` says so.

- every record keeps its kind, time and fields, and goes to its stream;
- a save's per-rank ``checkpoint_stall`` and ``checkpoint_written`` lines become one ``checkpoint_stall``
  record with the worst rank's figures, as this release writes it (trainer.checkpoint.commit);
- a failed save is kept once (rank 0's), a straggler event once per streak (or when it acts);
- a recovery gets the offset in failures.jsonl where the next restart's explanation starts.

The per-rank files stay where they are, untouched (forensics; the release that wrote them can still read them).
The first writer of this release migrates (``ensure_current_format``, under an flock, once per process); a
reader of a folder not migrated yet converts in memory (``legacy_records``) and writes nothing.
"""

from __future__ import annotations

import fcntl
import json
import time
from pathlib import Path
from typing import Any, Iterator

from trainer.run.run_dir import FAILURE_EVENTS, PERIODIC_EVENTS, RunDir, read_jsonl, write_atomic, write_json

FORMAT_VERSION = 2
_STALL_FIELDS = ("loop_wait_seconds", "handoff_seconds", "barrier_seconds", "previous_save_seconds",
                 "memory_seconds", "memory_copies")
_checked: set[str] = set()  # run folders this process found in the current format


def ensure_current_format(run_dir: Path) -> None:
    """Before this process's first write into a run folder: migrate an earlier release's events (once, whoever
    comes first), and mark the folder as written in this format."""
    run = RunDir(run_dir)
    key = str(run.path.resolve())
    if key in _checked:
        return
    if not run.events_format.is_file():
        run.events.mkdir(parents=True, exist_ok=True)
        with run.migrate_lock.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not run.events_format.is_file():
                _migrate(run)
    _checked.add(key)


def _migrate(run: RunDir) -> None:
    legacy = run.legacy_events()
    converted = list(legacy_records(run)) if legacy else []
    streams = {"control": run.control_log, "failures": run.failures_log, "periodic": run.periodic_log}
    for name, path in streams.items():
        # Nothing of this release was written yet (every writer waits for this), so each stream is rewritten whole.
        lines = "".join("\n" + json.dumps(record) + "\n" for stream, record in converted if stream == name)
        if lines or path.exists():
            write_atomic(path, lines, fsync=True)
    write_json(run.events_format, {"version": FORMAT_VERSION, "migrated_at": time.time(),
                                   "migrated_records": len(converted),
                                   "migrated_from": [p.name for p in legacy]}, fsync=True)


def legacy_records(run: RunDir) -> Iterator[tuple[str, dict[str, Any]]]:
    """(stream, record) of an earlier release's per-rank files, converted, in time order."""
    records = sorted((r for path in run.legacy_events() for r in read_jsonl(path)), key=lambda r: r["time"])
    stalls: dict[int, dict[str, Any]] = {}
    failures_offset = 0
    failed_saves: set[int] = set()
    converted: list[tuple[str, dict[str, Any]]] = []
    for record in records:
        kind = record.get("event")
        if kind in ("checkpoint_stall", "checkpoint_written"):
            _reduce_stall(stalls, record)
            continue
        if kind == "checkpoint_failed":
            if record["step"] in failed_saves:
                continue
            failed_saves.add(record["step"])
        if kind == "straggler" and record.get("consecutive_reports", 1) != 1 and record.get("action") == "report":
            continue
        stream = "failures" if kind in FAILURE_EVENTS else "periodic" if kind in PERIODIC_EVENTS else "control"
        converted.append((stream, record))
    # A recovery's explanation read every failure before it: the next one starts after them.
    for stream, record in converted:
        if stream == "failures":
            failures_offset += len(("\n" + json.dumps(record) + "\n").encode())
        elif record.get("event") == "recovery":
            record["failures_offset"] = failures_offset
    converted += [("periodic", stall) for stall in stalls.values()]
    yield from sorted(converted, key=lambda item: item[1]["time"])


def _reduce_stall(stalls: dict[int, dict[str, Any]], record: dict[str, Any]) -> None:
    """A save's per-rank lines -> one record with the worst rank's figures (the time of its latest line)."""
    known = stalls.setdefault(record["step"], {"event": "checkpoint_stall", "rank": 0, "step": record["step"],
                                               "time": record["time"], "attempt": record.get("attempt"),
                                               "mode": record.get("mode"), "ranks": 0})
    known["time"] = max(known["time"], record["time"])
    if record["event"] == "checkpoint_written":
        known["write_seconds"] = max(known.get("write_seconds", 0.0), record.get("write_seconds", 0.0))
        return
    known["ranks"] += 1
    for field in _STALL_FIELDS:
        if field in record:
            known[field] = max(known.get(field, 0), record[field])
