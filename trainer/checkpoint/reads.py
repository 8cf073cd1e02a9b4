"""Bytes this process read from checkpoint folders on FSx, so a recovery can say what it cost the shared file
system (the recovery record's ``fsx_bytes_read``): a resume from node memory or a peer reads none, one from
FSx reads each data file once (fast_reader: its verifier rank hashes it while loading; prefetch.py counts what
it read before the load on its own) plus each rank's .metadata."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_bytes_read = 0


def count(nbytes: int) -> None:
    global _bytes_read
    with _lock:
        _bytes_read += nbytes


def bytes_read() -> int:
    """Bytes read from checkpoint files by this process so far (a counter: take differences)."""
    return _bytes_read
