"""The checkpoint manager: saves, commits and loads training state, and decides where a run resumes from.

    step, source = checkpointer.load_latest(state)         # at start: the in-memory copy, a checkpoint, or none
    checkpointer.save(step, trainer.state_dict, last=...)  # every step: the training loop's only call
    checkpointer.close()                                   # waits for the save in flight

Every rank writes its DCP shards into ``step-N.tmp`` through a backend (trainer.checkpoint.backends). At
most one save is in flight, its commit included; once a write has completed on every rank, rank 0 commits
it (manifest with every file's size and xxh3-128 hash, fsync, an atomic rename to ``step-N``) on a
background thread, and applies keep-last-k retention, counting only checkpoints that verify. Under
in-process restart the manager also keeps the in-memory copy (trainer.checkpoint.memory) every
``resilience.memory_snapshot_interval_steps`` and prefers it at resume when it is at least as new as the
newest valid checkpoint and every rank holds the same step.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from trainer.checkpoint.backends import PendingWrite, make_backend
from trainer.checkpoint.format import (MANIFEST, committed_checkpoints, fsync_dir, latest_valid_checkpoint, stale_folders,
                                       step_dir_name, verify_checkpoint, write_manifest)
from trainer.checkpoint.memory import MemorySnapshot
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


def _no_hook(point: str, step: int) -> None:
    return None


class CheckpointManager:
    """Public: save, load_latest, wait, close (each called on every rank: they are collective). `memory` is
    the in-memory copy of an in-process restart (None otherwise); `save_point(point, step)` is called at each
    sub-step of a save that a crash drill names (trainer.resilience.faults.SAVE_KILLS) while step's save passes it (the fault injector's crash drills; a no-op otherwise); a
    `fence` (trainer.lease.Fence) stops a superseded trainer before it commits."""

    def __init__(self, directory: Path, cfg: CheckpointConfig, *, rank: int, device: torch.device,
                 metadata: dict[str, Any], events: EventLog, memory: MemorySnapshot | None = None,
                 save_point: Callable[[str, int], None] = _no_hook, fence=None):
        self._directory = Path(directory)
        self._cfg = cfg
        self._rank = rank
        self._metadata = metadata
        self._events = events
        self._memory = memory
        self._save_point = save_point
        self._fence = fence
        self._backend = make_backend(cfg, device) if cfg.enabled else None
        self._last_saved_step: int | None = None
        self._in_flight: _InFlight | None = None
        self._commits = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit") if rank == 0 else None
        self._commit_future: Future | None = None
        self._verified: dict[Path, tuple[int, bool]] = {}  # folder -> (manifest mtime, verified ok)
        if rank == 0 and cfg.enabled:
            self._remove_stale()

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
        """Once per step: keep the in-memory copy when due, finish a completed background write, and save when
        the interval (or last) says so. True when a save to disk was started."""
        if self._memory is not None and self._memory.due(step):
            self._memory.capture(step, state_fn())
        if not self.enabled:
            return False
        self._poll()
        if (last or step % self._cfg.interval_steps == 0) and self._last_saved_step != step:
            self._save_to_disk(step, state_fn())
            return True
        return False

    def _save_to_disk(self, step: int, state: dict[str, Any]) -> None:
        # At most one save in flight, its commit included: a crash during this save then costs this save only.
        self.wait()
        staging = self._directory / (step_dir_name(step) + ".tmp")
        if self._rank == 0:
            if staging.exists():  # left by a crash mid-save: never committed, safe to drop
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        dist.barrier()
        started = time.perf_counter()
        write = self._backend.start(state, staging)
        blocking = time.perf_counter() - started
        self._save_point("shard_write", step)  # async: the shards are being written right now
        self._in_flight = _InFlight(step, staging, write, started, blocking)
        self._last_saved_step = step
        if self._cfg.mode == "sync":
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
        self._events.write("checkpoint_written", step=flight.step, mode=self._backend.name,
                          blocking_seconds=flight.blocking_seconds, write_seconds=write_seconds)
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
        size = sum(f["bytes"] for f in manifest["files"].values())
        total = write_seconds + commit_seconds
        self._events.write("checkpoint_committed", step=flight.step, mode=self._backend.name, path=str(final),
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
        for _, folder in reversed(committed_checkpoints(self._directory)):  # newest first
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
        self._backend.close()
        if self._commits is not None:
            self._commits.shutdown(wait=True)

    # -- loading -----------------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any]) -> tuple[int, str]:
        """Collective: fill `state` in place from the newest state there is and say which: the in-memory copy
        when it is at least as new as the newest valid checkpoint and every rank holds the same step
        ("memory"), else that checkpoint ("disk"), else nothing ("none", step 0). Rank 0 records a `resume`
        event either way."""
        if not self._cfg.resume:
            return 0, "none"
        memory_step = self._memory.agreed_step() if self._memory is not None else None
        newest_committed = self._newest_committed_step()
        path = disk_step = None
        # Hashing the checkpoint files is skipped when no committed checkpoint is newer than the in-memory copy.
        if memory_step is None or memory_step < (newest_committed or 0):
            path, disk_step = self._find_latest()
        if memory_step is not None and memory_step >= (disk_step or 0):
            self._memory.restore_into(state)
            self._last_saved_step = disk_step if path is not None else newest_committed
            step, source = memory_step, "memory"
        elif path is not None:
            self._load(state, path, optional=("rng",))
            self._last_saved_step = disk_step
            step, source = disk_step, "disk"
        else:
            step, source = 0, "none"
        if self._rank == 0:
            self._events.write("resume", step=step, source=source, path=str(path) if source == "disk" else None)
        return step, source

    def _newest_committed_step(self) -> int | None:
        """Collective: the step of the newest committed folder, unverified (cheap: a directory listing)."""
        found = committed_checkpoints(self._directory) if self._rank == 0 else []
        choice = [found[-1][0] if found else None]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _find_latest(self) -> tuple[Path | None, int | None]:
        """Collective: the newest valid checkpoint and its step, (None, None) when there is none.

        Rank 0 verifies (hashing every file once, not once per rank) and tells the others which one it is.
        """
        found = latest_valid_checkpoint(self._directory) if self._rank == 0 else None
        choice = [str(found.path) if found else None, int(found.manifest["step"]) if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None, None
        if not Path(choice[0]).is_dir():
            raise RuntimeError(f"rank {self._rank} does not see the checkpoint rank 0 chose ({choice[0]}): "
                               "is the checkpoint directory on a shared file system?")
        return Path(choice[0]), choice[1]

    def _load(self, state: dict[str, Any], path: Path, optional: tuple[str, ...] = ()) -> None:
        """Load the checkpoint at path into state in place.

        Top-level entries named in `optional` (per-rank RNG, say) are loaded only where the checkpoint
        has them, so a checkpoint from another world size still resumes.
        """
        stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name in optional:
            for key in list(state.get(name, {})):
                if not any(k.startswith(f"{name}.{key}") for k in stored):
                    log.warning("checkpoint %s has no %s.%s; keeping the current value", path, name, key)
                    del state[name][key]
        dcp.load(state, checkpoint_id=str(path))
        log.info("resumed from %s", path)
