"""Structured events (checkpoints, faults, recoveries) as JSON lines, one file per rank.

Every rank appends to ``<run_dir>/events/rank-<N>.jsonl``; readers merge the files (``read_events``), so
no rank waits on another to record what happened to it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.env import BUDGET_SINCE_ENV, GENERATION_ENV, IN_PROCESS_ITERATION_ENV, JOB_ATTEMPT_ENV, RESTART_COUNT_ENV
from trainer.run.run_dir import RunDir, read_jsonl


def current_attempt() -> str:
    """Which start of the ranks this process belongs to — the same on every rank of it: the launch's lease
    generation, the job relaunch, the launcher's restart, the in-process iteration. Every event carries it, so
    the records of one failed attempt can be told from the next one's (trainer.resilience.failures)."""
    return "/".join(os.environ.get(name, "0") for name in (GENERATION_ENV, JOB_ATTEMPT_ENV, RESTART_COUNT_ENV,
                                                             IN_PROCESS_ITERATION_ENV))


class EventLog:
    """One rank's events file; with a fence (trainer.run.lease.Fence), a superseded trainer appends nothing."""

    def __init__(self, run_dir: Path, rank: int, fence=None):
        self.path = RunDir(run_dir).events_of(rank)
        self.rank = rank
        self.fence = fence
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.fence is not None:
            self.fence.check()
        record = {"event": event, "rank": self.rank, "time": time.time(), "attempt": current_attempt(), **fields}
        # Open per record: a SIGKILL can lose at most the line being written, never earlier ones.
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


def read_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """All ranks' events, ordered by time; a torn last line (process killed mid-write) is skipped."""
    records = [record for path in sorted(RunDir(run_dir).events.glob("rank-*.jsonl")) for record in read_jsonl(path)
               if event is None or record.get("event") == event]
    return sorted(records, key=lambda r: r["time"])


def run_started_at(run_dir: Path, launched_at: float | None = None) -> float | None:
    """When this launch of the run started: the one origin of every figure over the run's wall time (the
    report's goodput and badput, the TrainJob status's goodput, a drill at t=SECONDS).

    The launch's start as its launcher recorded it (`launched_at`; in a trainer process, the train step's start
    that every process of the launch inherits in BUDGET_SINCE_ENV); else the earliest process start of the
    launches recorded in the run folder; else None (nothing has started yet)."""
    if launched_at is None and os.environ.get(BUDGET_SINCE_ENV):
        launched_at = float(os.environ[BUDGET_SINCE_ENV])
    if launched_at is not None:
        return launched_at
    return min((e["process_started_at"] for e in read_events(run_dir, "launch")), default=None)
