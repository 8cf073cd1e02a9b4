"""Checkpoint write backends: one DCP checkpoint into a folder, synchronously or in the background.

- ``sync``: ``dcp.save``; the loop waits for the whole write (the baseline).
- ``torch-async`` (CPU, or CUDA without NVRx): ``dcp.async_save`` on its *own* gloo group (on the default
  group it hangs or aborts in gloo), staging into reused buffers so only a warm memcpy blocks the loop; the
  write runs on a thread of this process (``checkpoint.async_executor=thread``, the default: measured faster
  here) or in DCP's background process (``process``: staging through shared memory).
- ``nvrx-async`` (CUDA): NVRx's ``FileSystemWriterAsync`` + persistent ``AsyncCallsQueue``.
"""

from __future__ import annotations

import datetime
import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from trainer.checkpoint.hashing_writer import HashingFileSystemWriter, data_results, hashing_async_writer
from trainer.checkpoint.stager import ReusingStager
from trainer.config import CheckpointConfig
from trainer.resilience import nvrx_compat

log = logging.getLogger(__name__)

class InjectedWriteFailure(OSError):
    """The checkpoint_writer_crash drill: a writer that failed half-way through its files."""


class _WriterThatFailsMidWrite(HashingFileSystemWriter):
    """The checkpoint_writer_crash drill's writer: writes this rank's shards as usual, then cuts the last one
    in half and fails — what a writer dying mid-write (a full disk, an I/O error, a killed writer) leaves.
    DCP reports the failure to every rank, so the whole save fails and is never committed."""

    def __init__(self, folder: Path, fault_key: str):
        super().__init__(str(folder))
        self.folder = Path(folder)
        self.fault_key = fault_key

    def write_data(self, plan, planner):
        results = data_results(super().write_data(plan, planner).wait())
        files = sorted({r.storage_data.relative_path for r in results})
        torn = self.folder / files[-1]
        with torn.open("r+b") as handle:
            handle.truncate(torn.stat().st_size // 2)
        raise InjectedWriteFailure(f"injected {self.fault_key}: the checkpoint writer failed with {torn.name} "
                                   "half-written")


# The background write's own collectives time out after this (a peer gone mid-write): no write waits longer.
BACKGROUND_WRITE_TIMEOUT = datetime.timedelta(minutes=30)


def writer_for(folder: Path, fail_with: str | None):
    """DCP's file-system writer hashing what it writes, or the drill's failing one when a writer-crash fault is
    due."""
    return _WriterThatFailsMidWrite(folder, fail_with) if fail_with else HashingFileSystemWriter(str(folder))


class PendingWrite:
    """A write that may still be running; wait() re-raises its failure."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class FailedWrite(PendingWrite):
    """A write that failed before it got going (sync mode): wait() re-raises, like a background one."""

    def __init__(self, err: BaseException):
        self.err = err

    def wait(self) -> None:
        raise self.err


class _FutureWrite(PendingWrite):
    def __init__(self, future: Future, on_poll: Callable[[], None] = lambda: None):
        self.future = future
        self.on_poll = on_poll

    def done(self) -> bool:
        self.on_poll()
        return self.future.done()

    def wait(self) -> None:
        self.future.result()


def forget_cached_save_plans() -> None:
    """Empty DCP's save-plan cache (enable_plan_caching), which lives in SavePlanner class attributes for the
    whole process (torch 2.13, torch/distributed/checkpoint/planner.py; private, pinned by constraints.txt).
    A save cut short on one rank (a fault, an in-process restart) leaves the ranks' caches out of step: the
    coordinator then sends "unchanged" to a rank that has no cached final plan (KeyError 'DefaultSavePlanner').
    Every rank calls this at the same points (a new backend, a failed save), so the next save plans afresh."""
    for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans", "_cached_global_plan",
                 "_cached_metadata"):
        getattr(SavePlanner, name, {}).clear()


class SyncBackend:
    name = "sync"

    def start(self, state: dict[str, Any], folder: Path, fail_with: str | None = None) -> PendingWrite:
        dcp.save(state, checkpoint_id=str(folder), storage_writer=writer_for(folder, fail_with))
        return PendingWrite()

    def close(self) -> None:
        return None


class TorchAsyncBackend:
    """dcp.async_save on a writer thread (or DCP's background process), on a dedicated gloo group, with reused
    staging buffers."""

    name = "torch-async"

    def __init__(self, device: torch.device, nice: int, executor: str = "process"):
        self.nice = nice
        self.executor = AsyncCheckpointerType.PROCESS if executor == "process" else AsyncCheckpointerType.THREAD
        self._reniced: set[int] = set()
        self._last_write: Future | None = None
        # Its own group with a long timeout: background writes may take minutes, and the main group's
        # timeout can be short (in-process restart on gloo).
        self.group = dist.new_group(backend="gloo", timeout=BACKGROUND_WRITE_TIMEOUT)
        on_cuda = device.type == "cuda"
        # Shared memory: the background process reads the staged tensors in place instead of receiving
        # pickled copies. The stager keeps the staged state, so later saves only copy data into warm memory.
        self.stager = ReusingStager(StagingOptions(use_pinned_memory=on_cuda, use_shared_memory=executor == "process",
                                                   use_async_staging=False, use_non_blocking_copy=False))
        forget_cached_save_plans()  # a new Trainer in this process (an in-process restart): a new cache

    def start(self, state: dict[str, Any], folder: Path, fail_with: str | None = None) -> PendingWrite:
        # The stager overwrites the buffers the last write read from: that write must be over.
        assert self._last_write is None or self._last_write.done(), "a save started while the last one writes"
        # Plan caching: the state's layout is the same every save, so the persistent background process
        # skips re-planning (a round of collectives) after the first save.
        response = dcp.async_save(state, checkpoint_id=str(folder), process_group=self.group,
                                  storage_writer=writer_for(folder, fail_with),
                                  planner=DefaultSavePlanner(enable_plan_caching=True),
                                  async_checkpointer_type=self.executor, async_stager=self.stager)
        # Newer torch returns AsyncSaveResponse when staging is itself asynchronous; ours is synchronous.
        self._last_write = getattr(response, "upload_completion", response)
        return _FutureWrite(self._last_write, on_poll=self._renice_writer)

    def _renice_writer(self) -> None:
        """Lower the priority of DCP's writer process (our child, started lazily on the first save)."""
        if not self.nice:
            return
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
        self._compat = nvrx_compat
        self.queue = nvrx_compat.async_calls_queue(persistent=True)

    def start(self, state: dict[str, Any], folder: Path, fail_with: str | None = None) -> PendingWrite:
        if fail_with:  # NVRx writes in its persistent worker process: the drill kills it mid-save instead
            self._kill_worker_after_schedule = fail_with
        writer = hashing_async_writer(self._compat.filesystem_writer_async_class())(str(folder), thread_count=2)
        plan = self._compat.plan_async_save(state, writer)
        finished = {"done": False}
        request = self._compat.async_request(writer, plan, lambda: finished.update(done=True))
        self.queue.schedule_async_request(request)
        if getattr(self, "_kill_worker_after_schedule", None):
            killed = psutil.Process().children(recursive=True)
            for child in killed:
                child.kill()
            log.warning("%s: killed NVRx's checkpoint worker (%d process(es)) mid-save",
                        self._kill_worker_after_schedule, len(killed))
            self._kill_worker_after_schedule = None
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
        backend = "nvrx" if device.type == "cuda" and nvrx_compat.nvrx_available() else "torch"
    if backend == "nvrx":
        if device.type != "cuda":
            raise ValueError("checkpoint.async_backend: nvrx needs CUDA (TorchAsyncCheckpoint and its writer "
                             "synchronize the GPU); use torch or auto on CPU")
        return NvrxAsyncBackend()
    return TorchAsyncBackend(device, cfg.background_nice, cfg.async_executor)
