"""The checkpoint manager: saves the training state to every tier, and decides where a run resumes from.

    step, source = checkpointer.load_latest(state)         # at start: memory, peer, FSx, S3, or none
    checkpointer.save(step, trainer.state_dict, last=...)  # every step: the training loop's only call
    checkpointer.close()                                   # waits for the saves in flight

Tiers, nearest first: node memory every ``checkpoint.memory_interval_steps`` (and its replica on a peer
node; trainer.checkpoint.memory), the FSx checkpoint every ``checkpoint.interval_steps``, S3 every
``checkpoint.s3_every`` committed checkpoints (trainer.checkpoint.s3_tier). A resume takes the newest valid
copy, in the order memory → peer → FSx → S3, and says which (``source``); a corrupt or partial copy at any
tier is skipped with a log line.

FSx saves: every rank writes its DCP shards into ``step-N.tmp`` through a backend
(trainer.checkpoint.backends). At most one save is in flight, its commit included; once a write has
completed on every rank, rank 0 commits it (manifest with every file's size and xxh3-128 hash, fsync, an
atomic rename to ``step-N``) on a background thread, and applies keep-last-k retention, counting only
checkpoints that verify. Uploads to S3 run on a thread of their own; the folder being uploaded is kept
until it is sent.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.backends import FailedWrite, PendingWrite, forget_cached_save_plans, make_backend
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.format import (MANIFEST, CheckpointError, committed_checkpoints, fsync_dir, latest_valid_checkpoint,
                                       stale_folders, step_dir_name, verify_checkpoint, write_manifest)
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.s3_tier import S3Tier, S3TierError
from trainer.config import CheckpointConfig
from trainer.events import EventLog

log = logging.getLogger(__name__)


# -- manager -----------------------------------------------------------------------------------------


@dataclass
class _InFlight:
    step: int
    staging: Path
    write: PendingWrite
    started: float
    blocking_seconds: float
    fault_key: str | None = None  # a writer-crash drill armed on this rank for this save


def _no_hook(point: str, step: int) -> str | None:
    return None


# DCP raises CheckpointException (a BaseException) on every rank when any rank's write failed.
WRITE_FAILURES = (Exception, CheckpointException)


class CheckpointManager:
    """Public: save, load_latest, wait, close (each called on every rank: they are collective). `memory` is
    the node-memory tier and `s3` the S3 tier (None when off); `save_point(point, step)` is called at each
    sub-step of a save that a crash drill names (trainer.resilience.faults.SAVE_KILLS; a no-op otherwise);
    a `fence` (trainer.lease.Fence) stops a superseded trainer before it commits."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, *, rank: int, device: torch.device,
                 metadata: dict[str, Any], events: EventLog, memory: MemoryTier | None = None,
                 s3: S3Tier | None = None, save_point: Callable[[str, int], None] = _no_hook, fence=None):
        self._directory, self._cfg, self._rank, self._metadata, self._events = Path(directory), cfg, rank, metadata, events
        self._memory = memory if cfg.enabled else None
        self._s3 = s3 if cfg.enabled else None
        self._save_point, self._fence = save_point, fence
        self.prefetch = None  # a RestorePrefetch of this start (trainer/checkpoint/prefetch.py), if any
        self.phase = lambda tier: nullcontext()  # restore tiers as start-up phases (trainer.resilience.phases)
        self._backend = make_backend(cfg, device) if cfg.enabled else None
        self._last_saved_step: int | None = None
        self._interval_steps: int | None = None  # the planner's choice when checkpoint.interval_steps is auto
        self.saves_started = 0  # FSx saves started by this process
        self.save_costs: dict[int, dict[str, float]] = {}  # step -> stall (less the previous save), background
        self._in_flight: _InFlight | None = None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._commit_future: Future | None = None
        self._verified: dict[Path, tuple[int, bool]] = {}  # folder -> (manifest mtime, verified ok)
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-s3") if rank == 0 else None
        self._upload_futures: list[Future] = []
        self._uploading: set[Path] = set()  # kept by retention until sent
        self._commit_count = 0
        # Everything the loop waited for in this manager since the last FSx save began (memory copies, polls
        # that finished a write or waited for a commit): charged to the next save's `checkpoint_stall`.
        self._loop_wait_since_save = 0.0
        self._memory_seconds_since_save = 0.0
        self._memory_copies_since_save = 0
        if rank == 0 and cfg.enabled:
            self._remove_stale()
            if self._s3 is not None:
                self._s3.steps()  # fail at start, with the URI named, when the tier cannot be reached

    def _remove_stale(self) -> None:
        """At start-up no save of this job is in flight: what a crash left half-written or half-deleted goes."""
        for folder in stale_folders(self._directory):
            log.info("removing %s (left by an interrupted save or deletion)", folder)
            shutil.rmtree(folder, ignore_errors=True)

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    # -- saving ------------------------------------------------------------------------------------

    def save(self, step: int, state_fn: Callable[[], dict[str, Any]], *, last: bool = False) -> bool:
        """Once per step: the node-memory copy when due, finish a completed background write, and an FSx save
        when the interval (or last) says so. True when a save to FSx was started."""
        if not self.enabled:
            return False
        entered = time.perf_counter()
        state = None
        if self._memory is not None and self._memory.due(step):
            state = state_fn()
            self._memory.save(step, state)
            self._memory_seconds_since_save += time.perf_counter() - entered
            self._memory_copies_since_save += 1
        self._poll()
        saving = (last or step % self.interval_steps == 0) and self._last_saved_step != step
        if saving:
            self._save_to_disk(step, state if state is not None else state_fn(), entered)
        else:
            self._loop_wait_since_save += time.perf_counter() - entered
        return saving

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

    def _save_to_disk(self, step: int, state: dict[str, Any], entered: float) -> None:
        # At most one save in flight, its commit included: a crash during this save then costs this save only.
        waited_from = time.perf_counter()
        self.wait()
        previous_save_seconds = time.perf_counter() - waited_from
        staging = self._directory / (step_dir_name(step) + ".tmp")
        if self._rank == 0:
            if staging.exists():  # left by a crash mid-save: never committed, safe to drop
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        barrier_from = time.perf_counter()
        dist.barrier()
        started = time.perf_counter()
        barrier_seconds = started - barrier_from
        fault_key = self._save_point("write", step)  # the checkpoint_writer_crash drill: this write fails
        try:
            write = self._backend.start(state, staging, fail_with=fault_key)
        except WRITE_FAILURES as err:  # sync: the write itself failed
            write = FailedWrite(err)
        blocking = time.perf_counter() - started
        self._save_point("shard_write", step)  # async: the shards are being written right now
        self._in_flight = _InFlight(step, staging, write, started, blocking, fault_key)
        self._last_saved_step = step
        if self._cfg.mode == "sync":
            self._finish_in_flight()
        # The stall a save costs the loop is all of this, not the hand-off alone: waiting for the previous save
        # and its commit, the barrier, the hand-off (sync: the whole write), and the waits since the last save.
        loop_wait = self._loop_wait_since_save + time.perf_counter() - entered
        self._events.write("checkpoint_stall", step=step, mode=self._backend.name, loop_wait_seconds=loop_wait,
                          handoff_seconds=blocking, previous_save_seconds=previous_save_seconds,
                          barrier_seconds=barrier_seconds, memory_seconds=self._memory_seconds_since_save,
                          memory_copies=self._memory_copies_since_save)
        # The FSx tier's own cost: less the node-memory copies and any wait for the previous save to end.
        self.save_costs.setdefault(step, {})["stall"] = loop_wait - previous_save_seconds - self._memory_seconds_since_save
        self._loop_wait_since_save = self._memory_seconds_since_save = 0.0
        self._memory_copies_since_save = 0
        self.saves_started += 1

    def _poll(self) -> None:
        if self._in_flight is not None and self._in_flight.write.done():
            self._finish_in_flight()

    def _finish_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        try:
            flight.write.wait()
        except WRITE_FAILURES as err:
            self._save_failed(flight, err)
            return
        write_seconds = time.perf_counter() - flight.started
        self._events.write("checkpoint_written", step=flight.step, mode=self._backend.name,
                          blocking_seconds=flight.blocking_seconds, write_seconds=write_seconds)
        self.save_costs.setdefault(flight.step, {})["background"] = write_seconds - flight.blocking_seconds
        if self._rank != 0:
            return
        # Rank 0's write completes only after DCP gathered every rank's results and wrote .metadata,
        # so every shard is on disk: the checkpoint can be committed.
        if self._commit_future is not None:
            self._commit_future.result()
        commit = lambda: self._commit(flight, write_seconds)  # noqa: E731
        if self._cfg.mode == "sync":
            commit()
        else:
            self._commit_future = self._commits.submit(commit)

    def _save_failed(self, flight: _InFlight, err: BaseException) -> None:
        """A write that failed on any rank fails on every rank (DCP tells them all): nothing of it is committed,
        its folder goes, training goes on, and the next save (or the final one) commits."""
        cause = (str(err).strip().splitlines() or [type(err).__name__])[-1][:2000]  # DCP's last line: the cause
        log.error("checkpoint step %d failed, not committed (training goes on, the next save commits): %s",
                  flight.step, cause)
        self._events.write("checkpoint_failed", step=flight.step, mode=self._backend.name, error=cause,
                          fault_key=flight.fault_key)
        self._last_saved_step = None if self._last_saved_step == flight.step else self._last_saved_step
        forget_cached_save_plans()  # every rank saw this failure: the next save plans afresh on all of them
        if self._rank == 0:
            shutil.rmtree(flight.staging, ignore_errors=True)

    def _commit(self, flight: _InFlight, write_seconds: float) -> None:
        if self._cfg.mode == "async" and self._cfg.background_nice:
            # Linux nice is per thread: this lowers only the commit thread (hashing), not the training loop.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._cfg.background_nice)
        started = time.perf_counter()
        self._save_point("before_manifest", flight.step)
        manifest = write_manifest(flight.staging, flight.step, self._metadata)  # fsyncs the folder's entries
        self._save_point("before_rename", flight.step)
        final = self._directory / step_dir_name(flight.step)
        replaced = None
        if final.exists():  # e.g. a step-N that failed verification and was replayed: move it aside first
            replaced = final.with_name(f"{final.name}.replaced-{int(time.time())}")
            final.rename(replaced)
        if self._fence is not None:
            self._fence.check()
        flight.staging.rename(final)  # the commit
        self._save_point("before_parent_fsync", flight.step)
        fsync_dir(self._directory)
        self._verified[final] = ((final / MANIFEST).stat().st_mtime_ns, True)  # hashed just now, by us
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        commit_seconds = time.perf_counter() - started
        self.save_costs.setdefault(flight.step, {})["commit"] = commit_seconds
        size = sum(f["bytes"] for f in manifest["files"].values())
        total = write_seconds + commit_seconds
        self._events.write("checkpoint_committed", step=flight.step, mode=self._backend.name, path=str(final),
                          bytes=size, blocking_seconds=flight.blocking_seconds, write_seconds=write_seconds,
                          commit_seconds=commit_seconds, background_seconds=total - flight.blocking_seconds,
                          mb_per_second=size / 1e6 / total if total > 0 else None)
        log.info("checkpoint step %d committed: %s (%.1f MB, loop blocked %.3f s, write %.2f s, commit %.2f s)",
                 flight.step, final, size / 1e6, flight.blocking_seconds, write_seconds, commit_seconds)
        self._commit_count += 1
        if self._s3 is not None and self._commit_count % self._cfg.s3_every == 0:
            self._uploading.add(final)
            self._upload_futures.append(self._uploads.submit(self._upload, final, flight.step))
        self._apply_retention(flight.step)

    def _upload(self, folder: Path, step: int) -> None:
        try:
            sent = self._s3.upload(folder, step)
            self._events.write("checkpoint_uploaded", **sent)
            log.info("checkpoint step %d uploaded to %s (%.1f MB in %.1f s)", step, sent["uri"], sent["bytes"] / 1e6,
                     sent["seconds"])
            self._s3.retain(self._cfg.keep_last)
        except S3TierError as err:  # the FSx copy stands; the next upload tries again
            log.error("S3 tier: %s", err)
            self._events.write("checkpoint_upload_failed", step=step, error=str(err))
        finally:
            self._uploading.discard(folder)

    def _is_valid(self, folder: Path) -> bool:
        """Verified against its manifest, once per process per manifest (committed folders do not change)."""
        try:
            stamp = (folder / MANIFEST).stat().st_mtime_ns
        except FileNotFoundError:
            stamp = -1
        known = self._verified.get(folder)
        if known is None or known[0] != stamp:
            result = verify_checkpoint(folder)
            if not result.ok:
                log.warning("checkpoint %s does not verify: %s", folder, "; ".join(result.problems))
            known = self._verified[folder] = (stamp, result.ok)
        return known[1]

    def _apply_retention(self, step: int) -> None:
        """Keep the newest checkpoint.keep_last *valid* checkpoints; a broken one never counts as kept.

        Deleted: valid ones beyond keep_last, and broken ones older than the newest valid one (nothing would
        ever resume from them). A broken one newer than every valid one stays until its step is saved again
        (then it is replaced). Each deletion renames the folder to step-N.deleting first, so a crash mid-way
        leaves a folder no reader takes for a checkpoint (removed at the next start).
        """
        valid: list[Path] = []
        doomed: list[Path] = []
        for _, folder in reversed(committed_checkpoints(self._directory)):  # newest first
            if folder in self._uploading:
                continue  # still being sent to S3: a later retention pass takes it
            if self._is_valid(folder):
                (valid if len(valid) < self._cfg.keep_last else doomed).append(folder)
            elif valid:
                doomed.append(folder)
        for folder in doomed:
            log.info("retention: deleting %s", folder)
            deleting = folder.with_name(folder.name + ".deleting")
            folder.rename(deleting)
            self._verified.pop(folder, None)
            self._save_point("retention", step)
            shutil.rmtree(deleting, ignore_errors=True)

    def save_final(self, step: int, state_fn: Callable[[], dict[str, Any]]) -> None:
        """The end of training: step saved and committed — saved now unless a save of it is in flight or done,
        and saved again if that save failed."""
        self.save(step, state_fn, last=True)
        self.wait()
        if self.enabled and self._last_saved_step != step:
            log.warning("the final checkpoint (step %d) failed; saving it again", step)
            self.save(step, state_fn, last=True)
            self.wait()
            if self._last_saved_step != step:
                raise RuntimeError(f"the final checkpoint (step {step}) failed twice; see the checkpoint_failed events")

    def wait(self) -> None:
        """Finish the save in flight and its commit (not the S3 uploads: see close)."""
        self._finish_in_flight()
        if self._commit_future is not None:
            self._commit_future.result()
            self._commit_future = None

    def close(self, wait: bool = True, peers_alive: bool = True) -> None:
        """wait=False after a fault: the save in flight is dropped; peers_alive=False: no replica round waited."""
        if not self.enabled:
            return
        if wait:
            self.wait()
        else:
            self._in_flight = None  # never committed: stays a .tmp folder, dropped by the next save of that step
        self._backend.close()
        if self._commits is not None:
            self._commits.shutdown(wait=True)
        if self._uploads is not None:
            self._uploads.shutdown(wait=wait)
            if wait:
                # What was kept for uploads, or left by a retention a crash cut short with nothing committed
                # since (a resume from memory may need no new FSx save before the end).
                self._apply_retention(self._last_saved_step or 0)
        if self._memory is not None:
            self._memory.close(wait=wait and peers_alive)

    # -- loading -----------------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any]) -> tuple[int, str]:
        """Collective: fill `state` in place from the newest valid copy and say where it came from: "memory"
        (every rank's node memory), "peer" (some rank's copy came from its peer's replica), "disk" (the newest
        FSx checkpoint that verifies), "s3" (a copy downloaded because nothing nearer is as new), or "none"
        (step 0, state untouched). Rank 0 records a `resume` event either way."""
        if not self._cfg.resume or not self.enabled:
            return 0, "none"
        rejected: set[Path] = set()  # FSx folders that failed verification while loading: never tried again
        while (resumed := self._load_newest(state, rejected)) is None:
            pass
        return resumed

    def _load_newest(self, state: dict[str, Any], rejected: set[Path]) -> tuple[int, str] | None:
        """One attempt of load_latest; None when the FSx checkpoint chosen did not verify (now in `rejected`)."""
        newest_committed = self._newest_committed_step()
        path = disk_step = None
        if self._memory is not None:
            # Memory wins unless FSx holds something newer that verifies (FSx is hashed only then).
            with self.phase("restore_memory"):
                found = self._memory.restore_newest(state, newer_than=(newest_committed or 0) - 1)
            if found is None and newest_committed is not None:
                path, disk_step = self._find_latest(rejected)
                with self.phase("restore_memory"):
                    found = self._memory.restore_newest(state, newer_than=disk_step - 1 if path is not None else -1)
            if found is not None:
                self._last_saved_step = disk_step if path is not None else newest_committed
                return self._resumed(*found, None)
        if path is None:
            path, disk_step = self._find_latest(rejected)
        source = "disk"
        if self._s3 is not None:
            with self.phase("restore_s3"):
                fetched = self._fetch_from_s3(newer_than=disk_step)
            if fetched is not None:
                (path, disk_step), source = fetched, "s3"
        if path is None:
            return self._resumed(0, "none", None)
        try:
            prehashed = self.prefetch.verified_files(path) if self.prefetch is not None else set()
            with self.phase("restore_fsx"):
                stats = load_checkpoint(state, path, optional=("rng",), prehashed=prehashed)  # verifies as it reads
        except CheckpointError as err:  # raised on every rank alike: DCP gathers every rank's read errors
            log.warning("skipping checkpoint %s (step %s): %s", path, disk_step, err)
            if self._rank == 0:
                self._events.write("checkpoint_rejected", step=disk_step, path=str(path), error=str(err))
            rejected.add(path)
            return None
        log.info("resumed from %s (%.1f MB read, %d files verified here)", path, stats["bytes_read"] / 1e6,
                 stats["files_verified"])
        self._last_saved_step = disk_step
        return self._resumed(disk_step, source, path)

    def _resumed(self, step: int, source: str, path: Path | None) -> tuple[int, str]:
        if self._rank == 0:
            self._events.write("resume", step=step, source=source, path=str(path) if path is not None else None)
        return step, source

    def _fetch_from_s3(self, newer_than: int | None) -> tuple[Path, int] | None:
        """Collective: rank 0 brings back the newest S3 copy newer than what FSx holds (it downloads onto the
        shared FSx folder), and every rank learns its path."""
        choice: list = [None, None]
        if self._rank == 0:
            self._directory.mkdir(parents=True, exist_ok=True)
            found = self._s3.restore_newest(self._directory, newer_than)
            if found is not None:
                choice = [str(found[0]), found[1]]
        dist.broadcast_object_list(choice, src=0)
        return (Path(choice[0]), choice[1]) if choice[0] is not None else None

    def _newest_committed_step(self) -> int | None:
        """Collective: the step of the newest committed folder, unverified (cheap: a directory listing)."""
        found = committed_checkpoints(self._directory) if self._rank == 0 else []
        choice = [found[-1][0] if found else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _find_latest(self, rejected: set[Path]) -> tuple[Path | None, int | None]:
        """Collective: the newest checkpoint not in `rejected` whose files have their manifest's sizes, and its step
        ((None, None): none). Rank 0 looks and tells the others; the load itself checks the content hashes."""
        found = latest_valid_checkpoint(self._directory, hash_files=False, exclude=rejected) if self._rank == 0 else None
        choice = [str(found.path) if found else None, int(found.manifest["step"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None, None
        if not Path(choice[0]).is_dir():
            raise RuntimeError(f"rank {self._rank} does not see the checkpoint rank 0 chose ({choice[0]}): "
                               "is the checkpoint directory on a shared file system?")
        return Path(choice[0]), choice[1]
