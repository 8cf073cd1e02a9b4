"""Peer replicas of the node-memory tier: each rank's copy also lives in the memory of another node.

Ranks form a ring over nodes: rank r sends each new copy of its state to ``r + ranks_per_node`` (the same
local rank on the next node) and keeps the copy of ``r - ranks_per_node``. The transfer runs on a thread
and a gloo group of its own, so the training loop only waits when a round is still running when the next
copy is due. The receiver writes into its replica slots the same way a rank writes its own (meta.json last,
with the sender's checksum), so a transfer cut short is never read.

At recovery a rank whose node lost its memory gets its state back from the peer holding the replica, over
the process group (``send_replica``/``receive_replica``) — never by reading the peer's files.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.node_store import Slot, SlotPair, StoredCopy

log = logging.getLogger(__name__)


def _send_copy(meta: dict[str, Any], data: torch.Tensor, dst: int, group=None) -> list:
    encoded = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    header = torch.tensor([encoded.numel(), data.numel()], dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(encoded, dst, group=group)
    if data.numel():
        dist.send(data, dst, group=group)


def _receive_copy_into(pair: SlotPair, src: int, group=None) -> Slot | None:
    """Receive one copy from src into the pair's next slot; returns the slot (committed), or None when src
    had nothing to send (an empty header)."""
    header = torch.zeros(2, dtype=torch.int64)
    dist.recv(header, src, group=group)
    meta_len, data_len = int(header[0]), int(header[1])
    if meta_len == 0:
        return None
    encoded = torch.zeros(meta_len, dtype=torch.uint8)
    dist.recv(encoded, src, group=group)
    meta = json.loads(bytes(encoded.numpy()).decode())
    slot = pair.next_slot()
    slot.begin_write()
    buffer = slot.buffer(data_len)
    if data_len:
        dist.recv(buffer, src, group=group)
    slot.commit(meta)
    return slot


def _thread_ids() -> set[int]:
    try:
        return {int(name) for name in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: no per-thread priorities
        return set()


def _renice(thread_id: int, nice: int) -> None:
    if nice:
        try:
            os.setpriority(os.PRIO_PROCESS, thread_id, nice)
        except OSError as err:  # a thread that has already exited, or a platform without it
            log.debug("could not renice thread %d: %s", thread_id, err)


class PeerReplicator:
    """The ring transfer of one rank: send own copies to `send_to`, keep `receive_from`'s in `replica`."""

    def __init__(self, replica: SlotPair, send_to: int, receive_from: int, sends_first: bool,
                 timeout_seconds: float = 1800.0, nice: int = 0):
        """sends_first alternates along the ring (even nodes send first, odd nodes receive first), so blocking
        gloo pairs never wait on each other. nice: the transfer's CPU priority (checkpoint.background_nice),
        so that where cores are short the training loop's threads come first."""
        self.replica, self.send_to, self.receive_from = replica, send_to, receive_from
        self.sends_first = sends_first
        self.nice = nice
        # Its own group: the transfer runs beside the training loop's collectives on the default group.
        threads_before = _thread_ids()
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
        # gloo runs the sends and receives on the group's own worker threads, started just now.
        for thread_id in _thread_ids() - threads_before:
            _renice(thread_id, nice)
        self._rounds: queue.Queue = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="peer-replica", daemon=True)
        self._thread.start()

    def replicate(self, copy: StoredCopy) -> None:
        """Start a round for this copy (every rank calls it for the same steps); the previous round first
        finishes, so the slot being sent is never the one being overwritten."""
        self.wait()
        self._idle.clear()
        self._rounds.put(copy)

    def wait(self) -> None:
        """Until the round in flight is done; re-raises its failure."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"peer replica transfer failed: {error}") from error

    def close(self, wait: bool = True) -> None:
        if wait:
            try:
                self.wait()
            except RuntimeError as err:
                log.warning("%s", err)
        self._rounds.put(None)

    def _run(self) -> None:
        _renice(threading.get_native_id(), self.nice)
        while True:
            copy = self._rounds.get()
            if copy is None:
                return
            try:
                if self.sends_first:
                    _send_copy(copy.meta, copy.data, self.send_to, self.group)
                    _receive_copy_into(self.replica, self.receive_from, self.group)
                else:
                    _receive_copy_into(self.replica, self.receive_from, self.group)
                    _send_copy(copy.meta, copy.data, self.send_to, self.group)
            except BaseException as err:  # noqa: BLE001 - handed to the training loop by wait()
                self._error = err
            finally:
                self._idle.set()


def send_replica(copy: StoredCopy | None, dst: int) -> None:
    """Recovery, on the holder: the replica of dst (or an empty header when it has none)."""
    if copy is None:
        dist.send(torch.zeros(2, dtype=torch.int64), dst)
    else:
        _send_copy(copy.meta, copy.data, dst)


def receive_replica(own: SlotPair, src: int) -> StoredCopy | None:
    """Recovery, on the rank whose memory is gone: its copy from the peer, written into its own slots (so
    this node holds it again) and verified against the checksum the sender wrote."""
    slot = _receive_copy_into(own, src)
    return slot.load() if slot is not None else None
