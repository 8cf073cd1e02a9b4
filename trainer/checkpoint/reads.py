"""Bytes this process read from checkpoint folders on FSx, so a recovery can say what it cost the shared file
system (the recovery record's ``fsx_bytes_read``): a resume from node memory or a peer reads none, one from
FSx reads the verification's hashing of every file (rank 0) and each rank's share of the DCP load."""

from __future__ import annotations

import threading

from torch.distributed.checkpoint import FileSystemReader

_lock = threading.Lock()
_bytes_read = 0


def count(nbytes: int) -> None:
    global _bytes_read
    with _lock:
        _bytes_read += nbytes


def bytes_read() -> int:
    """Bytes read from checkpoint files by this process so far (a counter: take differences)."""
    return _bytes_read


class CountingReader(FileSystemReader):
    """DCP's file-system reader, counting the bytes of every item it reads."""

    def read_data(self, plan, planner):
        count(sum(self.storage_data[item.storage_index].length for item in plan.items))
        return super().read_data(plan, planner)
