"""FSx saves, from the hand-off to the commit: the in-flight write, the commit protocol, the S3 upload.

Every rank writes its DCP shards into ``step-N.tmp`` through a backend (trainer.checkpoint.backends). At most
one save is in flight, its commit included; once a write has completed on every rank, rank 0 commits it
(manifest with every file's size and xxh3-128 hash, fsync, an atomic rename to ``step-N``) on a background
thread, then applies retention (trainer.checkpoint.retention). Every ``checkpoint.s3_every`` commits, the
folder is uploaded on a thread of its own and kept until it is sent.

What a save cost every rank becomes one record, not one per rank: right after the hand-off every rank issues an
asynchronous all-reduce (MAX) of its figures for that save and goes on training — the loop never waits for it,
so the stall it measures gains nothing. Once it has completed (the next step's poll, a few milliseconds later),
rank 0 writes the save's ``checkpoint_stall`` record (the worst rank's loop wait, hand-off, barrier, node-memory
copies) from its commit thread.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from trainer.checkpoint.backends import FailedWrite, PendingWrite, forget_cached_save_plans
from trainer.checkpoint.costs import SaveCosts
from trainer.checkpoint.format import committed_checkpoints, fsync_dir, step_dir_name, write_manifest
from trainer.checkpoint.state_bytes import flatten
from trainer.checkpoint.retention import Retention
from trainer.checkpoint.s3_tier import S3Tier, S3TierError
from trainer.config import CheckpointConfig
from trainer.run.events import EventLog

log = logging.getLogger(__name__)

# DCP raises CheckpointException (a BaseException) on every rank when any rank's write failed.
WRITE_FAILURES = (Exception, CheckpointException)
# A save's figures as every rank reduces them (MAX) after its hand-off: the worst rank's.
STALL_FIGURES = ("loop_wait_seconds", "handoff_seconds", "barrier_seconds", "previous_save_seconds",
                 "memory_seconds", "memory_copies")


def nonfinite_flags(state: dict[str, Any], device: torch.device) -> tuple[list[str], torch.Tensor]:
    """(the paths of the state's floating-point tensors, a bool per path on `device`: it holds a NaN or an
    infinity). The state mixes devices (on a GPU: the shards on it, AdamW's step counts and the RNG state on the
    host), so each flag is moved to `device` before they are stacked. A tensor's least and greatest values are
    both finite exactly when all of them are (NaN propagates through min and max): one read of the state and
    no temporaries, where isfinite(...).any() allocates two masks of the state's size (on this VM, faulting
    those pages in was most of a save's barrier: 0.7 s of the small preset's 0.9 s loop wait)."""
    paths, flags = [], []
    for path, value in flatten(state):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
            paths.append(".".join(map(str, path)))
            low, high = torch.aminmax(value.detach())
            flags.append(torch.logical_not(torch.isfinite(low) & torch.isfinite(high)).to(device))
    return paths, torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool, device=device)


@dataclass
class _InFlight:
    step: int
    staging: Path
    write: PendingWrite
    started: float
    blocking_seconds: float
    fault_key: str | None = None  # a writer-crash drill armed on this rank for this save
    finite_check: dict[str, Any] | None = None  # what the manifest records of the ranks' check of their shards


class FsxSaves:
    """Collective (start, poll, wait, close run on every rank). `save_point(point, step)` is called at each
    sub-step a crash drill names; a `fence` (trainer.run.lease.Fence) stops a superseded trainer before it
    commits."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, *, rank: int, backend: Any,
                 metadata: dict[str, Any], events: EventLog, costs: SaveCosts, retention: Retention,
                 s3: S3Tier | None, save_point: Callable[[str, int], str | None], fence=None,
                 device: torch.device | None = None):
        self._directory, self._cfg, self._rank, self._backend = Path(directory), cfg, rank, backend
        self._device = device if device is not None else torch.device("cpu")  # where the reduction's tensor lives
        self._reduction: tuple[Any, torch.Tensor] | None = None  # (async work, figures) of the newest save
        self._metadata, self._events, self._costs, self._retention = metadata, events, costs, retention
        self._s3, self._save_point, self._fence = s3, save_point, fence
        self.last_saved_step: int | None = None  # the newest save started (and not failed), or resumed from
        self.refused_step: int | None = None  # the newest save refused: its state held NaN or infinity
        self._in_flight: _InFlight | None = None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._commit_future: Future | None = None
        self._uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-s3") if rank == 0 else None
        self._upload_futures: list[Future] = []
        self._uploading: set[Path] = set()  # kept by retention until sent
        # kept by retention, beside keep_last: the newest checkpoint before an open numeric episode (replaced
        # whole, never mutated: the commit thread reads it)
        self.pinned: frozenset[Path] = frozenset()
        self._commit_count = 0

    @property
    def backend_name(self) -> str:
        return self._backend.name

    def start(self, step: int, state: dict[str, Any]) -> dict[str, float]:
        """Hand the state to the backend once the previous save (and its commit) is done; what the loop waited
        for: previous_save_seconds, barrier_seconds, handoff_seconds (sync: the whole write)."""
        waited_from = time.perf_counter()
        self.wait()  # at most one save in flight, its commit included: a crash then costs this save only
        previous_save_seconds = time.perf_counter() - waited_from
        staging = self._directory / (step_dir_name(step) + ".tmp")
        if self._rank == 0:
            if staging.exists():  # left by a crash mid-save: never committed, safe to drop
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        self._record_stall(wait=True)  # the last save's reduction completed long ago: its record, if not yet
        barrier_from = time.perf_counter()
        finite_check = self._finite_check(step, state)  # a collective: it is the save's barrier
        started = time.perf_counter()
        barrier_seconds = started - barrier_from
        if finite_check is None:
            self.refused_step = step
            if self._rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            return {"previous_save_seconds": previous_save_seconds, "barrier_seconds": barrier_seconds,
                    "handoff_seconds": 0.0, "refused": True}
        fault_key = self._save_point("write", step)  # the checkpoint_writer_crash drill: this write fails
        try:
            write = self._backend.start(state, staging, fail_with=fault_key)
        except WRITE_FAILURES as err:  # sync: the write itself failed
            write = FailedWrite(err)
        blocking = time.perf_counter() - started
        self._save_point("shard_write", step)  # async: the shards are being written right now
        self._in_flight = _InFlight(step, staging, write, started, blocking, fault_key, finite_check)
        self.last_saved_step = step
        if self._cfg.mode == "sync":
            self._finish_in_flight()
        return {"previous_save_seconds": previous_save_seconds, "barrier_seconds": barrier_seconds,
                "handoff_seconds": blocking}

    def _finite_check(self, step: int, state: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank checks its own shards in memory, before anything is written: what the manifest records,
        or None when a rank holds a NaN or an infinity (the save is refused: a checkpoint with one is never
        committed, so no resume and no rollback can take it up). One all-gather of a count per rank."""
        paths, bad = nonfinite_flags(state, self._device)
        counts = [torch.zeros(1, dtype=torch.int64, device=self._device) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, bad.sum().reshape(1).to(torch.int64))
        counts = [int(c) for c in counts]
        if not any(counts):
            return {"ranks": len(counts), "tensors": len(paths), "finite": True}
        mine = [p for p, b in zip(paths, bad.tolist()) if b]
        if mine:
            log.error("checkpoint step %d refused: this rank's %s hold(s) NaN or infinity%s", step,
                      ", ".join(mine[:5]), f" (and {len(mine) - 5} more)" if len(mine) > 5 else "")
        if self._rank == 0:
            self._events.write("checkpoint_refused", step=step, why="non-finite values",
                               ranks={rank: count for rank, count in enumerate(counts) if count})
        return None

    def reduce_stall(self, step: int, stall: dict[str, Any]) -> None:
        """Collective, asynchronous: this rank's figures of the save just handed off (the loop's wait for it),
        reduced over every rank (MAX) while training goes on; recorded once complete (poll)."""
        figures = torch.tensor([float(step), *(float(stall.get(k) or 0.0) for k in STALL_FIGURES)],
                               dtype=torch.float64, device=self._device)
        work = dist.all_reduce(figures, op=dist.ReduceOp.MAX, async_op=True) if dist.is_initialized() else None
        self._reduction = (work, figures)

    def _record_stall(self, wait: bool) -> None:
        """Rank 0 records the reduced figures of the last save once its all-reduce completed (wait: now)."""
        if self._reduction is None:
            return
        work, figures = self._reduction
        if work is not None:
            if not wait and not work.is_completed():
                return
            work.wait()
        self._reduction = None
        if self._rank != 0:
            return
        step, *worst = figures.tolist()
        record = {"step": int(step), "mode": self._backend.name,
                  "ranks": dist.get_world_size() if dist.is_initialized() else 1, **dict(zip(STALL_FIGURES, worst))}
        record["memory_copies"] = int(record["memory_copies"])
        self._commits.submit(self._events.write, "checkpoint_stall", **record)

    def poll(self) -> None:
        """Finish a background write that completed (rank 0 then commits it); record a save's reduced costs."""
        self._record_stall(wait=False)
        if self._in_flight is not None and self._in_flight.write.done():
            self._finish_in_flight()

    def wait(self) -> None:
        """Finish the save in flight and its commit (not the S3 uploads: see close)."""
        self._finish_in_flight()
        if self._commit_future is not None:
            self._commit_future.result()
            self._commit_future = None

    def record_last_costs(self) -> None:
        """Once training ended on every rank: the last save's reduced figures recorded (waited for)."""
        self._record_stall(wait=True)

    def close(self, wait: bool) -> None:
        """wait=False after a fault: the save in flight is dropped (it stays a .tmp folder, dropped by the next
        save of that step) and the uploads are not waited for."""
        if wait:
            self.wait()
        else:
            self._in_flight = None
        self._backend.close()
        if self._commits is not None:
            self._commits.shutdown(wait=True)
        if self._uploads is not None:
            self._uploads.shutdown(wait=wait)
            if wait:
                # What was kept for uploads, or left by a retention a crash cut short with nothing committed
                # since (a resume from memory may need no new FSx save before the end).
                self._retention.apply(self.last_saved_step or 0, self._uploading | self.pinned)

    def pin(self, step: int | None) -> None:
        self.pinned = frozenset() if step is None else frozenset({self._directory / step_dir_name(step)})

    def newest_committed_at_or_before(self, step: int) -> int | None:
        return max((found for found, _ in committed_checkpoints(self._directory) if found <= step), default=None)

    def drop_after(self, step: int) -> list[int]:
        """Rank 0, no save in flight: the committed checkpoints after `step` leave FSx and S3 (an abandoned
        branch: trainer.job.numeric_recovery); the uploads already handed over finish first, so none lands
        after. Returns the steps dropped."""
        if self._fence is not None:
            self._fence.check()  # a superseded trainer deletes nothing
        for future in self._upload_futures:
            future.result()  # each catches its own S3 errors
        dropped = [found for found, folder in committed_checkpoints(self._directory) if found > step]
        for found in dropped:
            shutil.rmtree(self._directory / step_dir_name(found))
        if dropped:
            fsync_dir(self._directory)
        if self._s3 is not None:
            self._s3.delete_after(step)
        self.last_saved_step = min(self.last_saved_step or 0, step) or None
        return dropped

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
        self._costs.written(flight.step, write_seconds - flight.blocking_seconds)
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
        if self._rank == 0 or flight.fault_key is not None:  # rank 0 for the run, and the drill's own rank
            self._events.write("checkpoint_failed", step=flight.step, mode=self._backend.name, error=cause,
                               fault_key=flight.fault_key)
        self.last_saved_step = None if self.last_saved_step == flight.step else self.last_saved_step
        forget_cached_save_plans()  # every rank saw this failure: the next save plans afresh on all of them
        if self._rank == 0:
            shutil.rmtree(flight.staging, ignore_errors=True)

    def _commit(self, flight: _InFlight, write_seconds: float) -> None:
        if self._cfg.mode == "async" and self._cfg.background_nice:
            # Linux nice is per thread: this lowers only the commit thread (hashing), not the training loop.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._cfg.background_nice)
        started = time.perf_counter()
        self._save_point("before_manifest", flight.step)
        manifest = write_manifest(flight.staging, flight.step,  # fsyncs the folder's entries
                                  {**self._metadata, "finite_check": flight.finite_check})
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
        self._retention.verified_now(final)  # hashed just now, by us
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        commit_seconds = time.perf_counter() - started
        self._costs.committed(flight.step, commit_seconds)
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
        self._retention.apply(flight.step, self._uploading | self.pinned)

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
