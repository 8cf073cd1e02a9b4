"""One writer per run folder: a lease held by the launcher, and a generation number that fences old trainers.

    with RunLease(run_dir) as lease:          # RunFolderBusy if another launcher holds it
        generation = lease.new_generation()   # every launch (and relaunch) gets a new one
        ... start the trainers with RESILIENT_TRAIN_LEASE_GENERATION=generation ...

    fence = Fence(run_dir, generation)        # in each trainer
    fence.check()                             # before every append or commit: LeaseLost once superseded

The lease is an ``flock`` on ``<run_dir>/lease.lock`` (FSx for Lustre honours it with the ``flock`` mount
option, which the PersistentVolume sets), held for the life of the launcher; ``lease.json`` beside it
names the holder and the current generation. A lock alone is not enough: it is released when its holder
dies, while that holder's trainers may still run (or be stuck in I/O). So every launch bumps the generation,
and a trainer whose generation is no longer the current one stops before it writes anything more.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from trainer.run.run_dir import RunDir, read_json, write_json

log = logging.getLogger(__name__)



class RunFolderBusy(RuntimeError):
    """Another launcher holds the run folder's lease; the message names the holder."""


class LeaseLost(RuntimeError):
    """A newer launch took over the run folder: this trainer must stop without writing."""


def read_lease(run_dir: Path) -> dict[str, Any]:
    return read_json(RunDir(run_dir).lease) or {"generation": 0}


def _holder_text(lease: dict[str, Any]) -> str:
    holder = lease.get("holder") or {}
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder["since"])) if "since" in holder else "?"
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} since {since}, generation {lease.get('generation')}"


class RunLease:
    """The run folder's lease, held from __enter__ (or acquire) to release."""

    def __init__(self, run_dir: Path, wait_seconds: float = 10.0):
        self.run_dir = Path(run_dir)
        self.wait_seconds = wait_seconds  # a holder killed a moment ago releases its lock as it finishes dying
        self._handle = None
        self.generation = 0

    def acquire(self) -> "RunLease":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        handle = RunDir(self.run_dir).lease_lock.open("a")
        deadline = time.monotonic() + self.wait_seconds
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
            handle.close()
            raise RunFolderBusy(f"run folder {self.run_dir} is in use by another training launcher "
                                f"({_holder_text(read_lease(self.run_dir))}): wait for it to finish or stop it, or "
                                "give this run another run.run_id — two launches never write one run folder") from None
        self._handle = handle
        self.generation = int(read_lease(self.run_dir).get("generation", 0))
        return self

    def new_generation(self) -> int:
        """Bump the generation: every trainer started under an older one is fenced from now on."""
        assert self._handle is not None, "new_generation() without holding the lease"
        self.generation += 1
        record = {"generation": self.generation,
                  "holder": {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}}
        write_json(RunDir(self.run_dir).lease, record, fsync=True)
        log.info("run folder %s: lease generation %d", self.run_dir, self.generation)
        return self.generation

    def release(self) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None

    def __enter__(self) -> "RunLease":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class Fence:
    """A trainer's side of the lease: check() raises LeaseLost once a newer generation holds the folder."""

    def __init__(self, run_dir: Path, generation: int):
        self.run_dir = Path(run_dir)
        self.generation = generation

    def check(self) -> None:
        current = read_lease(self.run_dir)
        if int(current.get("generation", 0)) != self.generation:
            raise LeaseLost(f"run folder {self.run_dir} now belongs to another launch ({_holder_text(current)}); "
                            f"this trainer (generation {self.generation}) stops without writing anything more")
