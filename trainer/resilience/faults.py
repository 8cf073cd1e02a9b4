"""Fault injection: real faults at chosen steps, times or on a seeded schedule, for drills, tests and benchmarks.

    faults.schedule = "sigkill@120:rank=1, hang@200, exception@t=30, kill_before_rename@40, exception@150:repeat"

Loop faults fire after a step (``maybe_inject``); save drills SIGKILL the process at one sub-step of a save
(``at_save_point``, called by the checkpoint manager), to prove that a crash anywhere in a save costs no more
than that save; ``checkpoint_writer_crash`` makes the writer of a save fail half-way through its files (the
save is reported failed, never committed, and the next one commits).

Each fault fires once per run: before acting, the faulting rank records a ``fault`` event in the control records
(durable across the restart), and a fault already recorded there never fires again — so the replay of the
lost steps after recovery runs clean. A ``:repeat`` fault is a crash loop instead: it fires on every attempt
that is about to train its step (a bad batch, a broken node), which the restart budget must end
(trainer.resilience.budget). The training loop calls ``maybe_inject(step)`` once per step.

Every fault leaves a record after it fires: a ``recovery`` naming it (``fault_keys``), or, when no restart
was needed, a ``fault_absorbed`` event (slow_rank) or a ``checkpoint_failed`` event (checkpoint_writer_crash).
A schedule item that could never fire is refused when the schedule is parsed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

from trainer.config.drills import NETWORK_FAULTS, NUMERIC_FAULTS, SAVE_FAULTS, STARTUP_HANGS, Fault, parse_schedule
from trainer.env import NODE_LAUNCHER_PID_ENV
from trainer.resilience.node_exit import in_a_node_of_many, kill_this_group, kill_this_node
from trainer.run.history import control_state
from trainer.run.run_dir import RunDir
from trainer.run.tail import read_last_record

log = logging.getLogger(__name__)

class InjectedFault(RuntimeError):
    """Raised by an injected `exception` fault."""


class InjectedBug(RuntimeError):
    """Raised by a `bug` drill: the same exception at the same line on every attempt (a deterministic error)."""


class FaultInjector:
    """Fires this rank's scheduled faults; a no-op when the schedule is empty."""

    def __init__(self, faults: list[Fault], rank: int, events, fired_keys: set[str], run_started_at: float,
                 slow_seconds: float, node_memory=None, straggler_factor: float = 1.5, straggling: bool = False):
        """node_memory: this rank's node-memory store (trainer.checkpoint.node_store.RankStore), for the
        node_loss and corrupt_memory drills; None when the memory tier is off. straggling: a straggler fault
        fired on this rank under this node's launcher (`straggling_here`): the rank is still slow."""
        mine = [f for f in faults if f.rank == rank and (f.repeat or f.key not in fired_keys)
                and f.type not in STARTUP_HANGS  # those hang in start-up (trainer.resilience.phases)
                and f.type not in NETWORK_FAULTS  # the local runner enacts those (localcluster/network.py)
                and f.type not in NUMERIC_FAULTS]  # they act inside the step (trainer.resilience.numerics)
        self.pending = [f for f in mine if f.type not in SAVE_FAULTS and not f.repeat]
        self.repeating = [f for f in mine if f.repeat]
        self.save_kills = [f for f in mine if f.type in SAVE_FAULTS]
        self.fired_keys = fired_keys
        self.rank = rank
        self.events = events
        self.run_started_at = run_started_at
        self.slow_seconds = slow_seconds
        self.node_memory = node_memory
        self.straggler_factor = straggler_factor
        # How many times slower than itself this rank runs (the loop stretches each section by it).
        self.slowdown = straggler_factor if straggling else 1.0
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

    def before_step(self, step: int) -> None:
        """A `:repeat` fault due at `step` fires now, before that step trains — on every attempt that gets here
        (called after the previous step, and after a resume)."""
        for fault in self.repeating:
            if fault.step == step:
                count = sum(1 for key in self.fired_keys if key.startswith(fault.key + "#"))
                key = f"{fault.key}#{count + 1}"
                self.fired_keys.add(key)
                self._fire(fault, step - 1, key=key)

    def at_save_point(self, point: str, step: int) -> str | None:
        """Called by the checkpoint manager at each sub-step of step's save (possibly on its commit thread).
        A kill drill due here SIGKILLs the process (the whole process: every thread); a writer-crash drill due
        at "write" is returned as the fault key the write must fail with (the backend fails it half-way)."""
        for fault in self.save_kills:
            if SAVE_FAULTS[fault.type] == point and step >= fault.step:
                self.save_kills.remove(fault)
                self.events.write("fault", fault_type=fault.type, key=fault.key, step=step, pid=os.getpid(),
                                  save_point=point)
                if fault.type == "checkpoint_writer_crash":
                    log.warning("injecting fault %s: the writer of the step-%d save on rank %d fails mid-write",
                                fault.key, step, self.rank)
                    return fault.key
                log.warning("injecting fault %s: SIGKILL at %s of the step-%d save on rank %d", fault.key, point,
                            step, self.rank)
                os.kill(os.getpid(), signal.SIGKILL)
        return None

    def _fire(self, fault: Fault, step: int, key: str | None = None) -> None:
        key = key or fault.key
        self.events.write("fault", fault_type=fault.type, key=key, step=step, pid=os.getpid(),
                          launcher_pid=os.environ.get(NODE_LAUNCHER_PID_ENV))
        log.warning("injecting fault %s after step %d on rank %d", key, step, self.rank)
        if fault.type == "exception":
            raise InjectedFault(f"injected exception at step {step} on rank {self.rank}")
        if fault.type == "bug":
            raise InjectedBug(f"injected bug before step {step + 1} on rank {self.rank}")
        if fault.type == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.type == "group_loss":
            kill_this_group(f"drill {key} after step {step} on rank {self.rank}", permanent=fault.permanent)
        if fault.type == "node_loss" and in_a_node_of_many():
            kill_this_node(f"drill {key} after step {step} on rank {self.rank}")
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
        if fault.type == "straggler":
            self.slowdown = self.straggler_factor
            self.events.write("fault_absorbed", fault_key=key, step=step,
                              why=f"rank {self.rank} runs {self.straggler_factor:g}x slower from step {step} on, "
                                  "until its node is replaced: straggler detection should name it")
        if fault.type == "slow_rank":
            time.sleep(self.slow_seconds)
            self.events.write("fault_absorbed", fault_key=key, step=step,
                              why=f"rank {self.rank} stalled {self.slow_seconds:g} s and training went on: "
                                  "no restart needed")


def straggling_here(straggling: list[list], rank: int) -> bool:
    """Whether a straggler fault fired on this rank under this node's launcher ([rank, launcher pid] of each,
    trainer.run.history): the slow machine is still there after an in-job restart, and gone once its node was
    replaced (a new launcher)."""
    here = os.environ.get(NODE_LAUNCHER_PID_ENV)
    return any(r == rank and launcher_pid == here for r, launcher_pid in straggling)


def last_trained_step(run_dir: Path) -> int:
    """The last step metrics.jsonl records (0: none), read from its end: the file grows with the run."""
    last = read_last_record(RunDir(run_dir).metrics)
    return int(last["step"]) if last else 0


def startup_hang_drill(schedule: str, rank: int, run_dir: Path, events) -> Callable[[str], bool]:
    """hang_in(phase) for the start-up watchdog (trainer.resilience.phases): True — after recording the fault —
    when a hang_in_<phase> drill of this rank is due in that phase: not fired yet, and its step trained."""
    drills = [f for f in parse_schedule(schedule) if f.type in STARTUP_HANGS and f.rank == rank]
    if not drills:
        return lambda phase: False
    fired, reached = set(control_state(run_dir).fired_fault_keys), last_trained_step(run_dir)

    def hang_in(phase: str) -> bool:
        for fault in drills:
            if phase in STARTUP_HANGS[fault.type] and fault.key not in fired and reached >= fault.step:
                fired.add(fault.key)
                events.write("fault", fault_type=fault.type, key=fault.key, step=reached, pid=os.getpid(),
                             phase=phase, launcher_pid=os.environ.get(NODE_LAUNCHER_PID_ENV))
                return True
        return False

    return hang_in
