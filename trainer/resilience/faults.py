"""Fault injection: real faults at chosen steps, times or on a seeded schedule, for drills, tests and benchmarks.

    faults.schedule = "sigkill@120:rank=1, hang@200, exception@t=30, kill_before_rename@40"

Loop faults fire after a step (``maybe_inject``); save drills SIGKILL the process at one sub-step of a save
(``at_save_point``, called by the checkpoint manager), to prove that a crash anywhere in a save costs no more
than that save.

Each fault fires once per run: before acting, the faulting rank records a ``fault`` event in its events file
(durable across the restart), and a fault already recorded there never fires again — so the replay of the
lost steps after recovery runs clean. The training loop calls ``maybe_inject(step)`` once per step.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainer.events import read_events

log = logging.getLogger(__name__)

LOOP_FAULTS = ("exception", "hang", "hang_in_collective", "sigkill", "exit", "slow_rank", "checkpoint_writer_crash",
               "node_loss", "corrupt_memory")
# Save drill -> the sub-step of CheckpointManager.save it kills at (the manager calls save_point(point, step)).
SAVE_KILLS = {"kill_during_shard_write": "shard_write", "kill_before_manifest": "before_manifest",
              "kill_before_rename": "before_rename", "kill_before_parent_fsync": "before_parent_fsync",
              "kill_during_retention": "retention"}
FAULT_TYPES = LOOP_FAULTS + tuple(SAVE_KILLS)

_ITEM = re.compile(r"^(?P<type>[a-z_]+)@(?:(?P<step>\d+)|t=(?P<seconds>\d+(?:\.\d+)?)s?)(?::rank=(?P<rank>\d+))?$")


class InjectedFault(RuntimeError):
    """Raised by an injected `exception` fault."""


@dataclass(frozen=True)
class Fault:
    type: str
    step: int | None  # fires after this optimizer step completes
    seconds: float | None  # or once this many seconds of training have passed in the run
    rank: int

    @property
    def key(self) -> str:
        when = f"{self.step}" if self.step is not None else f"t={self.seconds}"
        return f"{self.type}@{when}:rank={self.rank}"


def parse_schedule(text: str) -> list[Fault]:
    """The schedule's faults; ValueError naming the bad item."""
    faults = []
    for raw in (item.strip() for item in text.split(",")):
        if not raw:
            continue
        match = _ITEM.match(raw)
        if not match:
            raise ValueError(f"{raw!r} must look like TYPE@STEP, TYPE@t=SECONDS, optionally followed by :rank=R "
                             "(e.g. sigkill@120:rank=1)")
        if match["type"] not in FAULT_TYPES:
            raise ValueError(f"{match['type']!r} in {raw!r} is not one of {list(FAULT_TYPES)}")
        if match["type"] in SAVE_KILLS and match["seconds"]:
            raise ValueError(f"{raw!r}: a save drill fires at a step's save, so it takes TYPE@STEP")
        faults.append(Fault(match["type"], int(match["step"]) if match["step"] else None,
                            float(match["seconds"]) if match["seconds"] else None, int(match["rank"] or 0)))
    return faults


def random_schedule(num_steps: int, mtbf_steps: float, types: list[str], world_size: int, seed: int) -> list[Fault]:
    """Exponential inter-arrival steps (mean mtbf_steps), types and ranks drawn from a seeded RNG."""
    rng = random.Random(seed)
    faults, step = [], 0.0
    while True:
        step += rng.expovariate(1.0 / mtbf_steps)
        if step >= num_steps:
            return faults
        faults.append(Fault(rng.choice(types), max(1, int(step)), None, rng.randrange(world_size)))


class FaultInjector:
    """Fires this rank's scheduled faults; a no-op when the schedule is empty."""

    def __init__(self, faults: list[Fault], rank: int, events, fired_keys: set[str], run_started_at: float,
                 slow_seconds: float, node_memory=None):
        """node_memory: this rank's node-memory store (trainer.checkpoint.node_store.RankStore), for the
        node_loss and corrupt_memory drills; None when the memory tier is off."""
        mine = [f for f in faults if f.rank == rank and f.key not in fired_keys]
        self.pending = [f for f in mine if f.type not in SAVE_KILLS]
        self.save_kills = [f for f in mine if f.type in SAVE_KILLS]
        self.rank = rank
        self.events = events
        self.run_started_at = run_started_at
        self.slow_seconds = slow_seconds
        self.node_memory = node_memory
        if mine:
            log.warning("fault injection armed on rank %d: %s", rank, ", ".join(f.key for f in mine))

    def maybe_inject(self, step: int) -> None:
        if not self.pending:
            return
        elapsed = time.time() - self.run_started_at
        due = [f for f in self.pending if (f.step is not None and step >= f.step)
               or (f.seconds is not None and elapsed >= f.seconds)]
        for fault in due:
            self.pending.remove(fault)
            self._fire(fault, step)

    def at_save_point(self, point: str, step: int) -> None:
        """SIGKILL this process if a save drill is due at this sub-step of step's save (called from the
        checkpoint manager, possibly on its commit thread: the kill takes the whole process)."""
        for fault in self.save_kills:
            if SAVE_KILLS[fault.type] == point and step >= fault.step:
                self.save_kills.remove(fault)
                self.events.write("fault", fault_type=fault.type, key=fault.key, step=step, pid=os.getpid(),
                                  save_point=point)
                log.warning("injecting fault %s: SIGKILL at %s of the step-%d save on rank %d", fault.key, point,
                            step, self.rank)
                os.kill(os.getpid(), signal.SIGKILL)

    def _fire(self, fault: Fault, step: int) -> None:
        self.events.write("fault", fault_type=fault.type, key=fault.key, step=step, pid=os.getpid())
        log.warning("injecting fault %s at step %d on rank %d", fault.key, step, self.rank)
        if fault.type == "exception":
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")
        if fault.type == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.type in ("node_loss", "corrupt_memory"):
            if self.node_memory is None:
                log.warning("%s on rank %d: the memory tier is off, so this is a plain SIGKILL", fault.type, self.rank)
            elif fault.type == "node_loss":  # the node is gone: its memory (own copies and replicas) with it
                self.node_memory.wipe()
            else:  # the newest own copy no longer matches its checksum: a restart must skip it
                self.node_memory.own.corrupt_newest()
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.type == "exit":
            os._exit(137)  # what the kernel's OOM killer leaves as the exit status
        if fault.type == "hang":
            while True:  # stops making progress and heartbeats, outside any collective
                time.sleep(0.1)  # short sleeps: an in-process restart can interrupt the thread between them
        if fault.type == "hang_in_collective":
            # torch only here: the config imports this module for the fault grammar and must not pull it in
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.zeros(1))  # no other rank joins: blocks inside the collective
            while True:  # reached only if the collective times out without raising
                time.sleep(0.1)
        if fault.type == "slow_rank":
            time.sleep(self.slow_seconds)
        if fault.type == "checkpoint_writer_crash":
            writers = psutil.Process().children(recursive=True)
            for child in writers:
                child.kill()
            log.warning("killed %d checkpoint writer process(es) of rank %d", len(writers), self.rank)


def fired_fault_keys(run_dir: Path) -> set[str]:
    return {e["key"] for e in read_events(run_dir, "fault")}
