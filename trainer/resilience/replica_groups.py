"""Replica groups as failure domains: HSDP with torchft across groups, so a fault stops one group, not the job.

    groups = replica_groups_for(cfg, rank, world_size, events, device)   # Single() when R = 1: today's path
    groups.attach(model, state_fn, load_fn)   # FSDP2's gradient all-reduce hook goes through torchft
    groups.begin_step(step)                   # the quorum of this step; a healing group takes a live peer's state
    ...forward, backward...
    if groups.should_commit(step): optimizer.step()   # else the step is discarded and trained again

Each of the R groups is a job of its own (its own rendezvous, ft_launcher and in-job restart, its node memory
and peer ring); FSDP2 shards the model over the group's ranks, and the gradient shards are averaged across the
groups that take part in the step through the group's torchft Manager (a Lighthouse forms each step's quorum).
Rank r of group g is global rank g * W + r: data, drills and records are keyed by it.

A group that failed restarts through its own launchers, resumes from its own tiers, then heals from a live
group (torchft's checkpoint transport: each rank fetches its peer rank's shards) and joins the next quorum.
The other groups commit without it: a step whose gradient all-reduce saw a group die is discarded
(should_commit is False on every group) and trained again by the groups left, with the same data.

Records (control.jsonl, written by each group's rank 0): ``quorum_changed`` (groups in and out, the step, why),
``replica_group_heal`` (donor group, bytes, seconds), ``step_discarded`` (the step, why).
The run's shared files (metrics.jsonl, the FSx checkpoint, result.json) are written by the group that is
replica rank 0 of the step's quorum, the lowest group index taking part: one writer per step whichever group
died (see docs/replica-groups.md).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any, Callable

import torch
from torch.distributed.fsdp import FSDPModule

from trainer.config import Config
from trainer.env import REPLICA_GROUP_ENV
from trainer.resilience.sdc import fingerprint_table, judge
from trainer.resilience.torchft_compat import QuorumSpy, group_of_replica_id, quiet_torchft, tensor_bytes
from trainer.run.events import EventLog

log = logging.getLogger(__name__)


def group_of_environment() -> int:
    """This process's replica group (0 unless the runner put it in one)."""
    return int(os.environ.get(REPLICA_GROUP_ENV, "0"))


class Single:
    """R = 1: no quorum, every step commits, this group writes the run's files (today's path, unchanged)."""

    groups = 1

    def __init__(self, rank: int, world_size: int):
        self.group, self.rank, self.world_size = 0, rank, world_size
        self.global_rank = rank

    def attach(self, model: torch.nn.Module, state_fn: Callable[[], dict], load_fn: Callable[[dict], None]) -> None:
        pass

    def resumed_at(self, step: int) -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def should_commit(self, step: int) -> bool:
        return True

    def replicas_equal(self, model: torch.nn.Module, step: int) -> bool | None:
        return None

    def average_across_groups(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def compare_fingerprints(self, model: torch.nn.Module, step: int) -> dict[str, Any] | None:
        return None

    def heal_from_the_others(self) -> None:
        pass

    @property
    def participants(self) -> int:
        return 1

    @property
    def participating_groups(self) -> list[int]:
        """The groups taking part in this step (their share of its samples is trained; the others' is skipped)."""
        return [0]

    @property
    def writes_run_files(self) -> bool:
        return True

    def figures(self) -> dict[str, Any]:
        return {}

    def result(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class TorchftGroups(Single):
    """R >= 2: this process's group, and its torchft Manager (quorum, cross-group all-reduce, heal)."""

    def __init__(self, cfg: Config, rank: int, world_size: int, events: EventLog, device: torch.device):
        # torchft only with R >= 2: today's path (R = 1) imports nothing of it
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        super().__init__(rank, world_size)
        quiet_torchft()
        r = cfg.resilience
        self.groups = cfg.training.replica_groups
        self.group = group_of_environment()
        assert 0 <= self.group < self.groups, (self.group, self.groups)
        self.global_rank = self.group * world_size + rank
        self.events = events
        timeout = datetime.timedelta(seconds=r.replica_timeout_seconds)
        pg = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
        self._state_fn: Callable[[], dict] | None = None
        self._load_fn: Callable[[dict], None] | None = None
        self._quorum: Any = None  # the newest quorum the lighthouse issued (torchft's Quorum)
        self._quorum_id = -1
        self._members: set[str] = set()  # the quorum's replica ids (a restarted group comes back with a new one)
        self._heal_started: float | None = None
        self._quorum_timeout, self._join_timeout = r.quorum_timeout_seconds, r.lighthouse_join_timeout_seconds
        self._check_interval = r.replica_check_interval
        self._sdc_every = r.sdc_check_every
        self.last_agreed_step = 0  # the newest step whose fingerprints every group shared (trainer.resilience.sdc)
        self._device = device
        self._replica_timeout = r.replica_timeout_seconds
        self._quorum_seconds = 0.0
        self.heals = 0
        self.on_heal: Callable[[int, int | None, float, int], None] = lambda step, donor, seconds, size: None
        # use_async_quorum=False: a healing group applies the live state before its forward pass and takes part
        # in that very step, instead of training one step for nothing.
        self.manager = Manager(
            pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
            use_async_quorum=False, replica_id=f"group_{self.group:04d}", timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=r.quorum_timeout_seconds),
            connect_timeout=datetime.timedelta(seconds=r.quorum_timeout_seconds),
            rank=rank, world_size=world_size, init_sync=False, quorum_retries=r.lighthouse_retries)
        self.manager._client = QuorumSpy(self.manager._client, self._saw_quorum)

    # -- what torchft calls --------------------------------------------------------------------------------

    def _saw_quorum(self, quorum: Any) -> None:
        self._quorum = quorum
        if quorum.heal:
            self._heal_started = time.perf_counter()

    def _state(self) -> dict:
        assert self._state_fn is not None
        return self._state_fn()

    def _load(self, state: dict) -> None:
        assert self._load_fn is not None
        received = tensor_bytes(state)
        self._load_fn(state)
        seconds = time.perf_counter() - (self._heal_started or time.perf_counter())
        self.heals += 1
        donor = self._donor()
        log.warning("replica group %d healed from group %s: step %d, %.1f MB in %.2f s", self.group, donor,
                    int(state["step"]), received / 1e6, seconds)
        self.events.write("replica_group_heal", group=self.group, donor_group=donor, step=int(state["step"]),
                          bytes=received, seconds=seconds, group_rank=self.rank)
        self.on_heal(int(state["step"]), donor, seconds, received)

    def _donor(self) -> int | None:
        quorum = self._quorum
        if quorum is None or quorum.recover_src_replica_rank is None:
            return None
        ids = sorted(quorum.replica_ids)  # replica ranks are given in the order of the sorted replica ids
        return group_of_replica_id(ids[quorum.recover_src_replica_rank])

    # -- the loop ------------------------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, state_fn: Callable[[], dict], load_fn: Callable[[dict], None]) -> None:
        self._state_fn, self._load_fn = state_fn, load_fn

        def average(gradient: torch.Tensor) -> None:  # FSDP2 calls it with each reduce-scattered gradient shard
            self.manager.allreduce(gradient).wait()

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(average)

    def resumed_at(self, step: int) -> None:
        """The step this group resumed from its own tiers: the quorum heals every group behind the furthest."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self, step: int) -> None:
        started = time.perf_counter()
        try:
            self._begin_step(step)
        finally:
            self._quorum_seconds += time.perf_counter() - started

    def _begin_step(self, step: int) -> None:
        self.manager.start_quorum()
        if self._quorum_id == -1:
            self._wait_for_every_group(step)
        elif self._quorum is not None and self._quorum.quorum_id < self._quorum_id:
            self._wait_for_the_last_quorum(step)
        quorum = self._quorum
        if quorum is None or quorum.quorum_id == self._quorum_id:
            return
        ids = set(quorum.replica_ids)
        members = sorted(group_of_replica_id(i) for i in ids)
        joined = sorted(group_of_replica_id(i) for i in ids - self._members)
        left = sorted(group_of_replica_id(i) for i in self._members - ids)
        first = self._quorum_id == -1
        self._quorum_id, self._members = quorum.quorum_id, ids
        why = ("this group (re)started" if first else
               "a group failed or was lost" if left and not joined else
               "a group joined" if joined and not left else
               "a group restarted and came back" if joined == left else "groups left and joined")
        log.warning("replica group %d: quorum %d at step %d: groups %s take part (in %s, out %s): %s", self.group,
                    quorum.quorum_id, step, members, joined, left, why)
        if self.rank == 0:
            self.events.write("quorum_changed", group=self.group, quorum_id=quorum.quorum_id, step=step,
                              groups=members, joined=joined, left=left, why=why, participants=len(members),
                              groups_total=self.groups)

    def _wait_for_every_group(self, step: int) -> None:
        """A process's first quorum waits for every group, up to a bound: the lighthouse forms a quorum with the
        first group that asks, and the groups of a start come up seconds apart. A run's first step waits up to
        resilience.quorum_timeout_seconds (every group then starts from the same step with the same weights, as
        a clean run of this shape does); a restarted group's first quorum, up to the lighthouse's join timeout
        (a live job's groups are all in it at once; a group lost for good never comes)."""
        # Alone: the other groups are starting too (a run's start, a relaunch) rather than training: wait longer.
        alone = self.manager.num_participants() <= 1
        bound = self._quorum_timeout if step == 0 or alone else self._join_timeout
        if not self._ask_again_until(self.groups, bound):
            log.warning("replica group %d: %d of %d groups in its first quorum after %.0f s: training goes on "
                        "with them", self.group, self.manager.num_participants(), self.groups, bound)

    def _wait_for_the_last_quorum(self, step: int) -> None:
        """The lighthouse restarted (its quorum ids start again from 1) and knows no group yet: it formed a
        quorum with the first that asked. The groups of the last quorum are alive (none left it): wait for them
        up to the join timeout, or this step would train without them for nothing."""
        wanted = len(self._members)
        if self.manager.num_participants() < wanted and not self._ask_again_until(wanted, self._join_timeout):
            log.warning("replica group %d: after the lighthouse's restart, %d of the last quorum's %d groups are "
                        "back at step %d", self.group, self.manager.num_participants(), wanted, step)

    def _ask_again_until(self, groups: int, seconds: float) -> bool:
        """Ask for the quorum again until it holds `groups` groups (True) or `seconds` passed (False)."""
        deadline = time.monotonic() + seconds
        while self.manager.num_participants() < groups and time.monotonic() < deadline:
            time.sleep(0.2)
            self.manager.start_quorum()
        return self.manager.num_participants() >= groups

    def should_commit(self, step: int) -> bool:
        started = time.perf_counter()
        # Every rank's vote comes within the cross-group all-reduce's timeout (a slow rank's collective fails at
        # replica_timeout_seconds): waiting twice that never decides for a rank whose peer is merely slow, which
        # could commit on one rank and not on another.
        committed = self.manager.should_commit(timeout=datetime.timedelta(seconds=2 * self._replica_timeout))
        self._quorum_seconds += time.perf_counter() - started
        if not committed:
            error = self.manager.errored()
            why = (f"{type(error.original_exception).__name__}: {str(error.original_exception).splitlines()[0]}"
                   if error is not None else "another group's rank failed it")
            log.warning("replica group %d: step %d discarded (%s); it is trained again", self.group, step + 1, why)
            if self.rank == 0:
                self.events.write("step_discarded", group=self.group, step=step + 1, why=why[:300])
        return committed

    def replicas_equal(self, model: torch.nn.Module, step: int) -> bool | None:
        """HSDP's invariant, checked every resilience.replica_check_interval steps: every group taking part holds
        the same parameters, bit for bit (each rank's shard fingerprint: trainer.resilience.sdc); None when not
        due or the comparison failed (a group died during it). A mismatch is recorded (``replica_divergence``)
        and logged as an error."""
        if not self._check_interval or step % self._check_interval or self.participants < 2:
            return None
        table = fingerprint_table(self.manager, model, self._device, self.group, self.groups, self.world_size)
        if table is None:
            return None
        finding = judge(table, self.participating_groups)
        if finding is not None:
            log.error("replica group %d: the groups' parameters differ after step %d (ranks and the groups apart: %s)",
                      self.group, step, finding["ranks"])
            if self.rank == 0:
                self.events.write("replica_divergence", group=self.group, step=step,
                                  ranks={str(r): g for r, g in finding["ranks"].items()})
        return finding is None

    def compare_fingerprints(self, model: torch.nn.Module, step: int) -> dict[str, Any] | None:
        """Every resilience.sdc_check_every steps: each rank's shard fingerprint against its peers' in the other
        groups (trainer.resilience.sdc); the finding when they differ, else None."""
        if not self._sdc_every or step % self._sdc_every or self.participants < 2:
            return None
        table = fingerprint_table(self.manager, model, self._device, self.group, self.groups, self.world_size)
        if table is None:  # a group died during it: the next check compares
            return None
        finding = judge(table, self.participating_groups)
        if finding is None:
            self.last_agreed_step = step
            return None
        return {**finding, "step": step, "last_agreed_step": self.last_agreed_step}

    def heal_from_the_others(self) -> None:
        """This group's state is wrong: one step back on torchft's count, so the next quorum makes it recover a live
        group's state (trainer.resilience.sdc)."""
        self.manager.load_state_dict({"step": self.manager.current_step() - 1,
                                      "batches_committed": self.manager.batches_committed()})

    def average_across_groups(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the groups taking part (the report's loss); on a failed all-reduce, this group's own."""
        mine = value.clone()
        self.manager.allreduce(value).wait()
        return mine if self.manager.errored() is not None else value

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @property
    def participating_groups(self) -> list[int]:
        return sorted(group_of_replica_id(i) for i in self._members) if self._members else [self.group]

    @property
    def writes_run_files(self) -> bool:
        return self.manager.participating_rank() == 0

    def figures(self) -> dict[str, Any]:
        """This step's: the group writing it, the groups in it, the seconds it waited for the quorum and the
        commit vote (the planner's Costs.quorum_seconds; a heal's transfer included when there was one)."""
        waited, self._quorum_seconds = self._quorum_seconds, 0.0
        return {"replica_group": self.group, "participants": self.participants, "quorum_seconds": waited}

    def result(self) -> dict[str, Any]:
        return {"replica_groups": self.groups, "replica_group": self.group, "heals": self.heals}

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def replica_groups_for(cfg: Config, rank: int, world_size: int, events: EventLog, device: torch.device) -> Single:
    """The off switch: R = 1 is today's path, with nothing of torchft imported."""
    if cfg.training.replica_groups == 1:
        return Single(rank, world_size)
    return TorchftGroups(cfg, rank, world_size, events, device)
