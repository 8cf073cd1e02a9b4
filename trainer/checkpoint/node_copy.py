"""The node-memory copy off the step's critical path (checkpoint.memory_copy=async).

    copier = BackgroundCopy(store, device, nice, after_commit=replicator.replicate)
    copier.start(step, state)       # the loop: hands the copy over (or skips it while the last is being written)
    copier.before_state_changes()   # the loop, before the optimizer step (or a load) writes what is being read
    copier.wait()                   # until the copy is committed: restore, rollback, close

On CUDA the device-to-host copy runs on a side stream into a pinned host buffer reused across saves, and the next
optimizer step's kernels wait for it on the GPU (an event: the host never blocks). A thread of the process then
copies the pinned buffer into the node-memory slot and hashes it in the same pass, off the GPU's path entirely.
On the CPU the thread reads the live tensors, so the next optimizer step waits until it has read them; the
forward and backward of the next step run beside it.

A copy in flight when the process dies leaves a slot without meta.json, which nobody reads: the node holds the
step before (one step more replayed than with a synchronous copy; docs/throughput.md).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from trainer.checkpoint.node_store import RankStore, StoredCopy
from trainer.checkpoint.state_bytes import _view

log = logging.getLogger(__name__)


class BackgroundCopy:
    def __init__(self, store: RankStore, device: torch.device, nice: int,
                 after_commit: Callable[[StoredCopy], None] = lambda copy: None):
        """after_commit(copy): what follows a commit, on the copy's thread (the peer round of this copy: it waits
        for the round before, which sends the newest slot, never the one a copy writes)."""
        self.store, self.device = store, device
        self.after_commit = after_commit
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="node-memory-copy",
                                            initializer=lambda: _renice_this_thread(nice))
        self._pending: Future | None = None
        self._reads_done = threading.Event()
        self._reads_done.set()
        self._staging: torch.Tensor | None = None  # pinned, reused while the state's size stays the same
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copied: torch.cuda.Event | None = None
        self.loop_seconds = 0.0  # what the loop spent on copies: handing them over and waiting for their reads
        self.skipped = 0  # steps whose copy was skipped: the last one was still being written

    def start(self, step: int, state: dict[str, Any], wait_if_busy: bool = False) -> bool:
        """Hand this step's copy over; False (nothing done) when the last copy is still being written and
        wait_if_busy is not set: the copies then run as often as the host can write them, and the loop never
        waits for one (the training's last step waits: its copy is the one a restart wants)."""
        if self.busy and not wait_if_busy:
            self.skip(step)
            return False
        started = time.perf_counter()
        self.wait()  # the last copy is committed: its slot, and on CUDA the staging buffer, are free again
        meta, layout, values = self.store.describe(step, state)
        if self._stream is not None:
            values = self._stage(layout, values, meta["nbytes"])
        self._reads_done.clear()
        self._pending = self._executor.submit(self._write, meta, layout, values)
        self.loop_seconds += time.perf_counter() - started
        return True

    @property
    def busy(self) -> bool:
        """A copy is still being written: the next one would be skipped."""
        return self._pending is not None and not self._pending.done()

    def skip(self, step: int) -> None:
        """This step's copy is not made: the last one is still being written."""
        self.skipped += 1
        if self.skipped == 1:
            log.warning("node memory: the copy of the last step is still being written at step %d: copies are "
                        "skipped until it is done (the node holds an older step; checkpoint.memory_copy)", step)

    def before_state_changes(self) -> None:
        """Called before anything writes the parameters or the optimizer's state."""
        if self._pending is None:
            return
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)  # ordered on the GPU, not the host
            return
        started = time.perf_counter()
        self._reads_done.wait()
        self.loop_seconds += time.perf_counter() - started

    def wait(self) -> StoredCopy | None:
        """Until the copy in flight is committed (re-raises its failure); the copy, or None when none was."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def close(self, wait: bool = True) -> None:
        if wait:
            try:
                self.wait()
            except Exception as err:  # noqa: BLE001 - at close a failed copy is only worth a line
                log.warning("node memory: the last copy failed: %s", err)
        self._executor.shutdown(wait=wait)

    def _stage(self, layout: list[dict[str, Any]], values: list[Any], nbytes: int) -> list[Any]:
        """Start the device-to-host copies on the side stream; the values the thread copies from (the staging
        buffer's views, and the non-tensor leaves as they are)."""
        if self._staging is None or self._staging.numel() != nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step that produced them
        staged = []
        with torch.cuda.stream(self._stream):
            for entry, value in zip(layout, values):
                if "offset" not in entry:
                    staged.append(value)
                    continue
                source = value.detach().reshape(-1).view(torch.uint8)
                target = self._staging[entry["offset"]:entry["offset"] + entry["nbytes"]]
                target.copy_(source, non_blocking=source.is_cuda)
                if source.is_cuda:
                    value.record_stream(self._stream)
                staged.append(_view(self._staging, entry))
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
        return staged

    def _write(self, meta: dict[str, Any], layout: list[dict[str, Any]], values: list[Any]) -> StoredCopy:
        try:
            if self._copied is not None:
                self._copied.synchronize()
                self._reads_done.set()
            copy = self.store.write(meta, layout, values)
        finally:
            self._reads_done.set()
        self.after_commit(copy)
        return copy


def _renice_this_thread(nice: int) -> None:
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as err:
            log.debug("could not renice the node-memory copy thread: %s", err)
