"""One writer per run folder: a lease held by the launcher, and a generation number that fences old trainers.

    with RunLease(run_dir) as lease:          # RunFolderBusy if another launcher holds it
        generation = lease.new_generation()   # every launch (and relaunch) gets a new one
        ... start the trainers with RESILIENT_TRAIN_LEASE_GENERATION=generation ...

    fence = Fence(run_dir, generation)        # in each trainer
    fence.check()                             # before every append or commit: LeaseLost once superseded

Nodes are fenced one by one as well: a node's launcher claims its node index as it starts
(``claim_node``: ``fence/node-N.json`` gets a generation one above its predecessor's) and hands that generation
to its workers. A node cut off from the job's network but still reaching the file system (FSx is served over
another network than EFA) is replaced by a new launcher of the same index; from that claim on, every write of
the old node's processes raises LeaseLost, and its launcher stops them (trainer.launch.launcher.NodeWatch).

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


def read_node_generation(run_dir: Path, index: int) -> int:
    record = read_json(RunDir(run_dir).node_fence(index)) or {}
    return int(record.get("generation", 0))


def claim_node(run_dir: Path, index: int) -> int:
    """A launcher starting as node `index`: its fencing generation, one above every earlier launcher of that index,
    whose processes write nothing more from now on. One launcher per index starts at a time (the local runner
    starts a replacement after its predecessor's end; a Job's pod replacement, podReplacementPolicy: Failed)."""
    run = RunDir(run_dir)
    run.node_fence(index).parent.mkdir(parents=True, exist_ok=True)
    generation = read_node_generation(run_dir, index) + 1
    write_json(run.node_fence(index), {"generation": generation, "host": socket.gethostname(), "pid": os.getpid(),
                                       "since": time.time()}, fsync=True)
    return generation


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


def fence_of_this_process(run_dir: Path) -> "Fence | None":
    """The fence a process of a launch writes under, from what its launcher put in the environment (the launch's
    lease generation, its node's claim); None for a process outside any launch (tests, tools, `python -m trainer`)."""
    from trainer.env import GENERATION_ENV, NODE_GENERATION_ENV, NODE_INDEX_ENV, NODE_RANK_ENV  # noqa: PLC0415

    generation, node_generation = os.environ.get(GENERATION_ENV), os.environ.get(NODE_GENERATION_ENV)
    if not generation and not node_generation:
        return None
    node = None
    if node_generation:
        node = int(os.environ.get(NODE_INDEX_ENV) or os.environ.get(NODE_RANK_ENV) or 0), int(node_generation)
    return Fence(run_dir, int(generation) if generation else None, node=node)


def check_fence_of_this_process(run_dir: Path) -> None:
    """LeaseLost if this process's launch or node was superseded: called before a write that has no Fence handed
    to it (a launcher's samples, a rank's failure record, its progress)."""
    fence = fence_of_this_process(run_dir)
    if fence is not None:
        fence.check()


class Fence:
    """A trainer's side of the lease: check() raises LeaseLost once a newer generation holds the folder, or once a
    newer launcher claimed this trainer's node (`node`: (node index, the node generation its launcher claimed))."""

    def __init__(self, run_dir: Path, generation: int | None, node: tuple[int, int] | None = None):
        self.run_dir = Path(run_dir)
        self.generation = generation
        self.node = node

    def check(self) -> None:
        current = read_lease(self.run_dir)
        if self.generation is not None and int(current.get("generation", 0)) != self.generation:
            raise LeaseLost(f"run folder {self.run_dir} now belongs to another launch ({_holder_text(current)}); "
                            f"this trainer (generation {self.generation}) stops without writing anything more")
        if self.node is not None:
            index, generation = self.node
            newest = read_node_generation(self.run_dir, index)
            if newest != generation:
                raise LeaseLost(f"node {index} was replaced (node generation {newest}, this trainer's {generation}): "
                                "a newer launcher of this node index writes the run folder now; this trainer stops "
                                "without writing anything more")
