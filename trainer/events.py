"""Structured events (checkpoints, faults, recoveries) as JSON lines, one file per rank.

Every rank appends to ``<run_dir>/events/rank-<N>.jsonl``; readers merge the files (``read_events``), so
no rank waits on another to record what happened to it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

EVENTS_DIR = "events"


class EventLog:
    """One rank's events file; with a fence (trainer.lease.Fence), a superseded trainer appends nothing."""

    def __init__(self, run_dir: Path, rank: int, fence=None):
        self.path = Path(run_dir) / EVENTS_DIR / f"rank-{rank}.jsonl"
        self.rank = rank
        self.fence = fence
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.fence is not None:
            self.fence.check()
        record = {"event": event, "rank": self.rank, "time": time.time(), **fields}
        # Open per record: a SIGKILL can lose at most the line being written, never earlier ones.
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return record


def read_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """All ranks' events, ordered by time; a torn last line (process killed mid-write) is skipped."""
    records = []
    for path in sorted((Path(run_dir) / EVENTS_DIR).glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event is None or record.get("event") == event:
                records.append(record)
    return sorted(records, key=lambda r: r["time"])
