"""The run's events: three shared append-only streams, each read by who needs it and from where it stopped.

    events = EventLog(run_dir, rank, fence=fence)
    events.write("checkpoint_committed", step=40, ...)   # appended to the stream of its kind

- ``events/control.jsonl`` — the rare records every layer decides by: the train step's launches, each start of
  the ranks (``attempt``, ``launch``, ``resume``), drill faults, recoveries, give-ups, the interval choice, a
  straggler's streak, failed saves. Any rank appends. A start reads it folded (trainer.run.history).
- ``events/failures.jsonl`` — how each rank failed (``rank_failed``, ``hang``), written as it goes: at 8,192
  ranks one fault leaves thousands of these, read once, by the recovery record that explains that fault.
- ``events/periodic.jsonl`` — one record per save (``checkpoint_stall``, reduced over every rank;
  ``checkpoint_committed``), upload and straggler report: rank 0 alone writes it.

A record is one ``write`` of ``"\\n" + JSON + "\\n"`` on a file opened with O_APPEND (Lustre and local file
systems keep such an append whole and in one place). The leading newline ends a line torn by a writer killed
mid-write, so the next writer's record is never glued to it: a SIGKILL loses at most the line being written.
With a fence (trainer.run.lease.Fence), a superseded trainer appends nothing.

``read_events`` reads the whole history: for tests, offline tools and the end of a run, never for a start or a
poll (those fold, tail or get it handed over).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.env import (GENERATION_ENV, IN_PROCESS_ITERATION_ENV, JOB_ATTEMPT_ENV, NODE_GENERATION_ENV, REPLICA_GROUP_ENV,
                         RESTART_COUNT_ENV)
from trainer.run.lease import fence_of_this_process
from trainer.run.legacy import ensure_current_format, legacy_records
from trainer.run.run_dir import RunDir, read_jsonl


def current_attempt() -> str:
    """Which start of the ranks this process belongs to — the same on every rank of it: the launch's lease
    generation, the job relaunch, the launcher's restart, the in-process iteration. Every event carries it, so
    the records of one failed attempt can be told from the next one's (trainer.resilience.failures)."""
    return "/".join(os.environ.get(name, "0") for name in (GENERATION_ENV, JOB_ATTEMPT_ENV, RESTART_COUNT_ENV,
                                                             IN_PROCESS_ITERATION_ENV))


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One record appended whole: a single O_APPEND write (see the module's docstring)."""
    data = ("\n" + json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:  # a short write (a full disk, a signal) leaves a torn line, which readers skip
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


class EventLog:
    """One process's writer of the run's events; with a fence (trainer.run.lease.Fence), a superseded trainer
    appends nothing. rank None: a record of the train step's, not of a rank."""

    def __init__(self, run_dir: Path, rank: int | None, fence=None, group_rank: int | None = None):
        """rank: the job's (global) rank the records name; group_rank: its rank in its replica group, when the
        job has several (the rank 0 of the group that writes the run's files then writes periodic records)."""
        self.run_dir = RunDir(run_dir)
        self.rank = rank
        self.group_rank = rank if group_rank is None else group_rank
        # With replica groups every record says whose it is: each group's restart budget counts its own attempts.
        self.group = int(os.environ[REPLICA_GROUP_ENV]) if os.environ.get(REPLICA_GROUP_ENV) else None
        # No fence handed over (a rank's failure record, a launcher's): the one its launch put in its environment.
        self.fence = fence if fence is not None else fence_of_this_process(run_dir)
        # Which launcher of its node wrote it: a node replaced while cut off is told from its successor.
        self.node_generation = int(os.environ[NODE_GENERATION_ENV]) if os.environ.get(NODE_GENERATION_ENV) else None
        self.run_dir.events.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> dict[str, Any]:
        if self.fence is not None:
            self.fence.check()
        path = self.run_dir.stream_of(event)
        assert path != self.run_dir.periodic_log or self.group_rank in (0, None), \
            f"{event}: rank 0 writes periodic records"
        ensure_current_format(self.run_dir.path)  # an earlier release's events are migrated before anything new
        record = {"event": event, "rank": self.rank, "time": time.time(), "attempt": current_attempt(),
                  **({"group": self.group} if self.group is not None else {}),
                **({"node_generation": self.node_generation} if self.node_generation is not None else {}), **fields}
        append_record(path, record)
        return record


def read_events(run_dir: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The whole history, every stream, ordered by time (an earlier release's run folder not migrated yet: its
    files, converted as the migration converts them). Tests, offline tools and the end of a run only."""
    run = RunDir(run_dir)
    if not run.events_format.is_file() and run.legacy_events():
        records = [record for _, record in legacy_records(run)]
    else:
        records = [record for path in (run.control_log, run.failures_log, run.periodic_log)
                   for record in read_jsonl(path)]
    return sorted((r for r in records if event is None or r.get("event") == event), key=lambda r: r["time"])
