"""The one tail reader of the run folder's JSON-lines files: whole lines appended since a byte offset.

    records, offset = read_new_lines(path, offset)   # from where the last call stopped
    records = read_lines_before(path, offset)          # what came before it (a restarted reader's history)

A line still being written (no newline yet) waits for the next call; a line torn by a process killed
mid-write, and written after, is skipped. Offsets count bytes of whole lines, so they survive a restart of the
reader (the forwarder saves them with the rows they produced).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_new_lines(path: Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records of the whole lines after `offset`, and the offset after the last of them."""
    try:
        with Path(path).open("rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return _parse(data[:end]), offset + end


def read_lines_before(path: Path, offset: int) -> list[dict[str, Any]]:
    """The records of the lines before `offset` (a whole-line offset that read_new_lines returned)."""
    if offset <= 0:
        return []
    try:
        with Path(path).open("rb") as handle:
            return _parse(handle.read(offset))
    except FileNotFoundError:
        return []


def _parse(data: bytes) -> list[dict[str, Any]]:
    records = []
    for line in data.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # torn by a process killed mid-write, then appended after: skipped
            continue
    return records
