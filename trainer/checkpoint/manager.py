"""The checkpoint manager: saves the training state to every tier, and decides where a run resumes from.

    step, source = checkpointer.load_latest(state)         # at start: memory, peer, FSx, S3, or none
    checkpointer.save(step, trainer.state_dict, last=...)  # every step: the training loop's only call
    checkpointer.close()                                   # waits for the saves in flight

Tiers, nearest first: node memory every ``checkpoint.memory_interval_steps`` (and its replica on a peer
node; trainer.checkpoint.memory), the FSx checkpoint every ``checkpoint.interval_steps``, S3 every
``checkpoint.s3_every`` committed checkpoints (trainer.checkpoint.s3_tier). A small façade: the FSx save
from hand-off to commit and upload is trainer.checkpoint.commit, which copies stay trainer.checkpoint.retention,
the choice of the copy to resume from trainer.checkpoint.resume, and what each save cost the loop (the
planner's input) trainer.checkpoint.costs.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.env import REPLICA_GROUP_ENV
from trainer.checkpoint.backends import make_backend
from trainer.checkpoint.commit import FsxSaves
from trainer.checkpoint.costs import SaveCosts
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.resume import ResumeChoice
from trainer.checkpoint.retention import Retention
from trainer.checkpoint.s3_tier import S3Tier
from trainer.config import CheckpointConfig
from trainer.run.events import EventLog

log = logging.getLogger(__name__)


def _no_hook(point: str, step: int) -> str | None:
    return None


class NonFiniteState(RuntimeError):
    """The state to save holds NaN or infinity: it is not committed."""


class CheckpointManager:
    """Public: save, load_latest, wait, close (each called on every rank: they are collective). `memory` is
    the node-memory tier and `s3` the S3 tier (None when off); `save_point(point, step)` is called at each
    sub-step of a save that a crash drill names (trainer.config.drills.SAVE_KILLS; a no-op otherwise);
    a `fence` (trainer.run.lease.Fence) stops a superseded trainer before it commits; `prefetch` is this
    start's RestorePrefetch (trainer.checkpoint.prefetch) and `phase(tier)` puts the restore tiers under the
    start-up watchdog (trainer.resilience.phases)."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, *, rank: int, device: torch.device,
                 metadata: dict[str, Any], events: EventLog, memory: MemoryTier | None = None,
                 s3: S3Tier | None = None, save_point: Callable[[str, int], str | None] = _no_hook, fence=None,
                 prefetch=None, phase: Callable[[str], Any] | None = None,
                 writes_shared: Callable[[], bool] = lambda: True):
        self._cfg, self._events, self._rank = cfg, events, rank
        # With replica groups, one group writes the job's FSx checkpoint (the same on every rank of a group:
        # trainer.resilience.replica_groups); the others keep their node-memory copies only.
        self._writes_shared = writes_shared
        self._memory = memory if cfg.enabled else None
        s3 = s3 if cfg.enabled else None
        self._interval_steps: int | None = None  # the planner's choice when checkpoint.interval_steps is auto
        self.costs = SaveCosts()
        self._resume = ResumeChoice(directory, rank=rank, events=events, memory=self._memory, s3=s3,
                                    prefetch=prefetch, phase=phase)
        self._saves: FsxSaves | None = None
        if cfg.enabled:
            retention = Retention(directory, cfg.keep_last, save_point)
            self._saves = FsxSaves(directory, cfg, rank=rank, backend=make_backend(cfg, device), metadata=metadata,
                                   events=events, costs=self.costs, retention=retention, s3=s3,
                                   save_point=save_point, fence=fence, device=device)
            # Half-written saves go at start-up, when no save of this job is in flight: with replica groups
            # another group may be writing one as this group starts (seen: a healed group's start removed the
            # live group's step-N.tmp mid-save); theirs stay until a start of the whole job.
            if rank == 0 and not os.environ.get(REPLICA_GROUP_ENV):
                retention.remove_stale()
                if s3 is not None:
                    s3.steps()  # fail at start, with the URI named, when the tier cannot be reached

    @property
    def enabled(self) -> bool:
        return self._saves is not None

    @property
    def saves_started(self) -> int:
        return self.costs.saves_started

    @property
    def save_costs(self) -> dict[int, dict[str, float]]:
        """step -> stall (less the previous save), background, commit seconds: the planner's measurements."""
        return self.costs.by_step

    # -- saving ------------------------------------------------------------------------------------

    def before_state_changes(self) -> None:
        """The optimizer step or a load is about to write the state: a node-memory copy in flight has read it."""
        if self._memory is not None:
            self._memory.before_state_changes()

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], *, last: bool = False) -> bool:
        """Once per step: the node-memory copy when due, finish a completed background write, and an FSx save
        when the interval (or last) says so. True when a save to FSx was started."""
        if not self.enabled:
            return False
        entered = time.perf_counter()
        state = None
        if self._memory is not None and self._memory.due(step, last=last):
            state = state_fn()
            if self._memory.save(step, state, wait_if_busy=last):
                self.costs.memory_copy(time.perf_counter() - entered)
        self._saves.poll()
        saving = ((last or step % self.interval_steps == 0) and self._saves.last_saved_step != step
                  and self._writes_shared())
        if not saving:
            self.costs.loop_waited(time.perf_counter() - entered)
            return False
        waits = self._saves.start(step, state if state is not None else state_fn())
        if waits.get("refused"):  # non-finite state: nothing written (checkpoint_refused names the ranks)
            return False
        # The stall a save costs the loop is all of this, not the hand-off alone: waiting for the previous save
        # and its commit, the barrier, the hand-off (sync: the whole write), and the waits since the last save.
        stall = self.costs.fsx_save_started(step, time.perf_counter() - entered, waits["previous_save_seconds"])
        # Reduced over every rank while training goes on, and recorded once (trainer.checkpoint.commit).
        self._saves.reduce_stall(step, {"handoff_seconds": waits["handoff_seconds"],
                                        "barrier_seconds": waits["barrier_seconds"], **stall})
        return True

    @property
    def interval_steps(self) -> int:
        """FSx save cadence in steps: checkpoint.interval_steps, or the planner's choice when that is auto."""
        if self._interval_steps is not None:
            return self._interval_steps
        return self._cfg.auto_probe_steps if self._cfg.interval_steps == "auto" else self._cfg.interval_steps

    @interval_steps.setter
    def interval_steps(self, steps: int) -> None:
        assert steps >= 1, steps
        self._interval_steps = steps

    @property
    def memory_interval_steps(self) -> int | None:
        """The node-memory copy's cadence in steps (None: no node-memory tier)."""
        return self._memory.interval_steps if self._memory is not None else None

    @memory_interval_steps.setter
    def memory_interval_steps(self, steps: int) -> None:
        assert steps >= 1 and self._memory is not None, steps
        self._memory.interval_steps = steps

    def save_final(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> None:
        """The end of training: step saved and committed — saved now unless a save of it is in flight or done,
        and saved again if that save failed. Collective: the last save's costs are recorded too."""
        self.save(step, state_fn, last=True)
        self.wait()
        if self.enabled and not self._writes_shared():
            return
        if self.enabled and self._saves.refused_step == step:
            raise NonFiniteState(f"the final checkpoint (step {step}) was refused: the state holds NaN or infinity "
                                 "(the checkpoint_refused event names the ranks, train.log the tensors), and nothing "
                                 "non-finite is ever committed: the newest finite checkpoint stands. The weights "
                                 "diverged; resilience.numeric_checks (on by default) stops a non-finite step "
                                 "before it is applied")
        if self.enabled and self._saves.last_saved_step != step:
            log.warning("the final checkpoint (step %d) failed; saving it again", step)
            self.save(step, state_fn, last=True)
            self.wait()
            if self._saves.last_saved_step != step:
                raise RuntimeError(f"the final checkpoint (step {step}) failed twice; see the checkpoint_failed events")
        if self.enabled:
            self._saves.record_last_costs()

    def pin(self, step: int | None) -> None:
        """Retention keeps FSx's checkpoint of `step` beside keep_last until pinned again (None: nothing kept)."""
        if self._saves is not None:
            self._saves.pin(step)

    def newest_committed_at_or_before(self, step: int) -> int | None:
        """The newest committed FSx checkpoint's step not after `step` (a listing: not verified)."""
        return self._saves.newest_committed_at_or_before(step) if self._saves is not None else None

    def drop_after(self, step: int) -> None:
        """Collective, no save in flight (wait): every copy of a step after `step` leaves every tier — an
        abandoned branch (trainer.job.numeric_recovery), which no later resume may take up."""
        if not self.enabled:
            return
        if self._memory is not None:
            self._memory.drop_after(step)
        if self._rank == 0 and self._writes_shared():
            dropped = self._saves.drop_after(step)
            if dropped:
                log.warning("checkpoints of steps %s dropped: they came after step %d, where training went back to",
                            dropped, step)
        dist.barrier()

    def wait(self) -> None:
        """Finish the save in flight and its commit (not the S3 uploads: see close)."""
        if self._saves is not None:
            self._saves.wait()

    def close(self, wait: bool = True, peers_alive: bool = True) -> None:
        """wait=False after a fault: the save in flight is dropped; peers_alive=False: no replica round waited."""
        if not self.enabled:
            return
        self._saves.close(wait)
        if self._memory is not None:
            self._memory.close(wait=wait and peers_alive)

    # -- loading -----------------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any], at_most: int | None = None) -> tuple[int, str]:
        """Collective: fill `state` in place from the newest valid copy (not after step `at_most`: a rollback)
        and say where it came from (memory, peer, disk, s3, or none: step 0, state untouched;
        trainer.checkpoint.resume)."""
        if not self.enabled or (not self._cfg.resume and at_most is None):
            return 0, "none"
        step, source, saved_step = self._resume.load_latest(state, at_most)
        if source != "none":
            self._saves.last_saved_step = saved_step
        return step, source
