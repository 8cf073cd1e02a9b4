"""The checkpoint manager: one public surface, write backends behind it.

    checkpointer.maybe_save(step, trainer.state_dict, last=...)   # the training loop's only call
    checkpointer.find_latest() / load(state, path)                  # at start
    checkpointer.close()                                            # waits for the save in flight

Backends write one DCP checkpoint into ``step-N.tmp``:

- ``sync``: ``dcp.save``; the loop waits for the whole write (the baseline).
- ``torch-async`` (CPU, or CUDA without NVRx): ``dcp.async_save`` with the process-based executor on its
  *own* gloo group (on the default group it hangs or aborts in gloo), staging into reused shared-memory
  buffers so only a warm memcpy blocks the loop.
- ``nvrx-async`` (CUDA): NVRx's ``FileSystemWriterAsync`` + persistent ``AsyncCallsQueue``.

At most one save is in flight; the previous one is finished before the next starts. When a write has
completed on every rank, rank 0 commits it (manifest with every file's size and xxh3-128 hash, then an atomic
rename to ``step-N``) on a background thread, and applies keep-last-k retention.
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

from trainer.checkpoint import (MANIFEST, committed_checkpoints, fsync_dir, latest_valid_checkpoint, stale_folders,
                                step_dir_name, verify_checkpoint, write_manifest)
from trainer.config import CheckpointConfig
from trainer.events import EventLog

log = logging.getLogger(__name__)


# -- backends ----------------------------------------------------------------------------------------


class PendingWrite:
    """A write that may still be running; wait() re-raises its failure."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _FutureWrite(PendingWrite):
    def __init__(self, future: Future, on_poll: Callable[[], None] = lambda: None):
        self.future = future
        self.on_poll = on_poll

    def done(self) -> bool:
        self.on_poll()
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


class SyncBackend:
    name = "sync"

    def start(self, state: dict[str, Any], folder: Path) -> PendingWrite:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(folder))
        return PendingWrite()

    def close(self) -> None:
        return None


class TorchAsyncBackend:
    """dcp.async_save in a background process, on a dedicated gloo group, with reused staging buffers."""

    name = "torch-async"

    def __init__(self, device: torch.device, nice: int):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.nice = nice
        self._reniced: set[int] = set()
        import datetime

        # Its own group with a long timeout: background writes may take minutes, and the main group's
        # timeout can be short (in-process restart on gloo).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
        on_cuda = device.type == "cuda"
        # Shared memory: the background process reads the staged tensors in place instead of receiving
        # pickled copies. The stager caches these buffers, so later saves copy into warm memory.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=True,
                                                   use_async_staging=False, use_non_blocking_copy=False))

    def start(self, state: dict[str, Any], folder: Path) -> PendingWrite:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        # Plan caching: the state's layout is the same every save, so the persistent background process
        # skips re-planning (a round of collectives) after the first save.
        response = dcp.async_save(state, checkpoint_id=str(folder), process_group=self.group,
                                  planner=DefaultSavePlanner(enable_plan_caching=True),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        # Newer torch returns AsyncSaveResponse when staging is itself asynchronous; ours is synchronous.
        return _FutureWrite(getattr(response, "upload_completion", response), on_poll=self._renice_writer)

    def _renice_writer(self) -> None:
        """Lower the priority of DCP's writer process (our child, started lazily on the first save)."""
        if not self.nice:
            return
        import psutil

        for child in psutil.Process().children(recursive=True):
            if child.pid not in self._reniced:
                try:
                    child.nice(max(child.nice(), self.nice))
                except psutil.Error:
                    continue
                self._reniced.add(child.pid)

    def close(self) -> None:
        self.stager.close()


class NvrxAsyncBackend:
    """NVRx's async DCP writer with a persistent worker (GPU). Every rank must poll at the same steps."""

    name = "nvrx-async"

    def __init__(self) -> None:
        from trainer import nvrx_compat

        self._compat = nvrx_compat
        self.queue = nvrx_compat.async_calls_queue(persistent=True)

    def start(self, state: dict[str, Any], folder: Path) -> PendingWrite:
        writer = self._compat.filesystem_writer_async(str(folder))
        plan = self._compat.plan_async_save(state, writer)
        finished = {"done": False}
        request = self._compat.async_request(writer, plan, lambda: finished.update(done=True))
        self.queue.schedule_async_request(request)
        backend = self

        class _NvrxWrite(PendingWrite):
            def done(self) -> bool:
                # Collective across ranks: called by every rank at the same step (maybe_save's poll).
                backend.queue.maybe_finalize_async_calls(blocking=False, no_dist=False)
                return finished["done"]

            def wait(self) -> None:
                backend.queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
                assert finished["done"], "NVRx finalized the queue without running the finalize function"

        return _NvrxWrite()

    def close(self) -> None:
        self.queue.close()


def make_backend(cfg: CheckpointConfig, device: torch.device):
    if cfg.mode == "sync":
        return SyncBackend()
    backend = cfg.async_backend
    if backend == "auto":
        from trainer.nvrx_compat import nvrx_available

        backend = "nvrx" if device.type == "cuda" and nvrx_available() else "torch"
    if backend == "nvrx":
        if device.type != "cuda":
            raise ValueError("checkpoint.async_backend: nvrx needs CUDA (TorchAsyncCheckpoint and its writer "
                             "synchronize the GPU); use torch or auto on CPU")
        return NvrxAsyncBackend()
    return TorchAsyncBackend(device, cfg.background_nice)


# -- manager -----------------------------------------------------------------------------------------


@dataclass
class _InFlight:
    step: int
    staging: Path
    write: PendingWrite
    started: float
    blocking_seconds: float


# The sub-steps of a save where a crash is drilled (faults.schedule "kill_at_<point>@STEP"); see save_point.
SAVE_POINTS = ("shard_write", "before_manifest", "before_rename", "before_parent_fsync", "retention")


def _no_hook(point: str, step: int) -> None:
    return None


class CheckpointManager:
    """Saves, commits and loads training state; collective methods are called on every rank.

    `save_point(point, step)` is called at each of SAVE_POINTS while step's save passes it (the fault
    injector's crash drills; a no-op otherwise).
    """

    def __init__(self, directory: Path, cfg: CheckpointConfig, *, rank: int, device: torch.device,
                 metadata: dict[str, Any], events: EventLog, save_point: Callable[[str, int], None] = _no_hook,
                 fence=None):
        self.directory = Path(directory)
        self.cfg = cfg
        self.rank = rank
        self.metadata = metadata
        self.events = events
        self.save_point = save_point
        self.fence = fence  # trainer.lease.Fence: a superseded trainer never commits
        self.backend = make_backend(cfg, device) if cfg.enabled else None
        self.last_saved_step: int | None = None
        self._in_flight: _InFlight | None = None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._commit_future: Future | None = None
        self._verified: dict[Path, tuple[int, bool]] = {}  # folder -> (manifest mtime, verified ok)
        if rank == 0 and cfg.enabled:
            self._remove_stale()

    def _remove_stale(self) -> None:
        """At start-up no save of this job is in flight: what a crash left half-written or half-deleted goes."""
        for folder in stale_folders(self.directory):
            log.info("removing %s (left by an interrupted save or deletion)", folder)
            shutil.rmtree(folder, ignore_errors=True)

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    # -- saving ------------------------------------------------------------------------------------

    def maybe_save(self, step: int, state_fn: Callable[[], dict[str, Any]], *, last: bool = False) -> bool:
        """Once per step: finish a completed background write, and save when the interval (or last) says so.
        True when a save was started."""
        if not self.enabled:
            return False
        self._poll()
        if (last or step % self.cfg.interval_steps == 0) and self.last_saved_step != step:
            self.save(step, state_fn())
            return True
        return False

    def save(self, step: int, state: dict[str, Any]) -> None:
        # At most one save in flight, its commit included: a crash during this save then costs this save only.
        self.wait()
        staging = self.directory / (step_dir_name(step) + ".tmp")
        if self.rank == 0:
            if staging.exists():  # left by a crash mid-save: never committed, safe to drop
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        write = self.backend.start(state, staging)
        blocking = time.perf_counter() - started
        self.save_point("shard_write", step)  # async: the shards are being written right now
        self._in_flight = _InFlight(step, staging, write, started, blocking)
        self.last_saved_step = step
        if self.cfg.mode == "sync":
            self._finish_in_flight()

    def _poll(self) -> None:
        if self._in_flight is not None and self._in_flight.write.done():
            self._finish_in_flight()

    def _finish_in_flight(self) -> None:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.write.wait()
        write_seconds = time.perf_counter() - flight.started
        self.events.write("checkpoint_written", step=flight.step, mode=self.backend.name,
                          blocking_seconds=flight.blocking_seconds, write_seconds=write_seconds)
        if self.rank != 0:
            return
        # Rank 0's write completes only after DCP gathered every rank's results and wrote .metadata,
        # so every shard is on disk: the checkpoint can be committed.
        if self._commit_future is not None:
            self._commit_future.result()
        commit = lambda: self._commit(flight, write_seconds)  # noqa: E731
        if self.cfg.mode == "sync":
            commit()
        else:
            self._commit_future = self._commits.submit(commit)

    def _commit(self, flight: _InFlight, write_seconds: float) -> None:
        if self.cfg.mode == "async" and self.cfg.background_nice:
            # Linux nice is per thread: this lowers only the commit thread (hashing), not the training loop.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.cfg.background_nice)
        started = time.perf_counter()
        self.save_point("before_manifest", flight.step)
        manifest = write_manifest(flight.staging, flight.step, self.metadata)  # fsyncs the folder's entries
        self.save_point("before_rename", flight.step)
        final = self.directory / step_dir_name(flight.step)
        replaced = None
        if final.exists():  # e.g. a step-N that failed verification and was replayed: move it aside first
            replaced = final.with_name(f"{final.name}.replaced-{int(time.time())}")
            final.rename(replaced)
        if self.fence is not None:
            self.fence.check()
        flight.staging.rename(final)  # the commit
        self.save_point("before_parent_fsync", flight.step)
        fsync_dir(self.directory)
        self._verified[final] = ((final / MANIFEST).stat().st_mtime_ns, True)  # hashed just now, by us
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        commit_seconds = time.perf_counter() - started
        size = sum(f["bytes"] for f in manifest["files"].values())
        total = write_seconds + commit_seconds
        self.events.write("checkpoint_committed", step=flight.step, mode=self.backend.name, path=str(final),
                          bytes=size, blocking_seconds=flight.blocking_seconds, write_seconds=write_seconds,
                          commit_seconds=commit_seconds, background_seconds=total - flight.blocking_seconds,
                          mb_per_second=size / 1e6 / total if total > 0 else None)
        log.info("checkpoint step %d committed: %s (%.1f MB, loop blocked %.3f s, write %.2f s, commit %.2f s)",
                 flight.step, final, size / 1e6, flight.blocking_seconds, write_seconds, commit_seconds)
        self._apply_retention(flight.step)

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
        for _, folder in reversed(committed_checkpoints(self.directory)):  # newest first
            if self._is_valid(folder):
                (valid if len(valid) < self.cfg.keep_last else doomed).append(folder)
            elif valid:
                doomed.append(folder)
        for folder in doomed:
            log.info("retention: deleting %s", folder)
            deleting = folder.with_name(folder.name + ".deleting")
            folder.rename(deleting)
            self._verified.pop(folder, None)
            self.save_point("retention", step)
            shutil.rmtree(deleting, ignore_errors=True)

    def wait(self) -> None:
        """Finish the save in flight and its commit."""
        self._finish_in_flight()
        if self._commit_future is not None:
            self._commit_future.result()
            self._commit_future = None

    def close(self, wait: bool = True) -> None:
        if not self.enabled:
            return
        if wait:
            self.wait()
        else:
            self._in_flight = None  # never committed: stays a .tmp folder, dropped by the next save of that step
        self.backend.close()
        if self._commits is not None:
            self._commits.shutdown(wait=True)

    # -- loading -----------------------------------------------------------------------------------

    def newest_committed_step(self) -> int | None:
        """Collective: the step of the newest committed folder, unverified (cheap: a directory listing)."""
        from trainer.checkpoint import committed_checkpoints

        found = committed_checkpoints(self.directory) if self.rank == 0 else []
        choice = [found[-1][0] if found else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def find_latest(self) -> tuple[Path | None, int | None]:
        """Collective: the newest valid checkpoint and its step, (None, None) when there is none.

        Rank 0 verifies (hashing every file once, not once per rank) and tells the others which one it is.
        """
        found = latest_valid_checkpoint(self.directory) if self.rank == 0 else None
        choice = [str(found.path) if found else None, int(found.manifest["step"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None, None
        if not Path(choice[0]).is_dir():
            raise RuntimeError(f"rank {self.rank} does not see the checkpoint rank 0 chose ({choice[0]}): "
                               "is the checkpoint directory on a shared file system?")
        self.last_saved_step = choice[1]
        return Path(choice[0]), choice[1]

    def load(self, state: dict[str, Any], path: Path, optional: tuple[str, ...] = ()) -> None:
        """Load the checkpoint at path into state in place.

        Top-level entries named in `optional` (per-rank RNG, say) are loaded only where the checkpoint
        has them, so a checkpoint from another world size still resumes.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name in optional:
            for key in list(state.get(name, {})):
                if not any(k.startswith(f"{name}.{key}") for k in stored):
                    log.warning("checkpoint %s has no %s.%s; keeping the current value", path, name, key)
                    del state[name][key]
        dcp.load(state, checkpoint_id=str(path))
        log.info("resumed from %s", path)

    def load_latest(self, state: dict[str, Any], optional: tuple[str, ...] = ()) -> int | None:
        """Load the newest valid checkpoint into state in place; its step, or None when there is none."""
        path, step = self.find_latest()
        if path is not None:
            self.load(state, path, optional)
        return step
