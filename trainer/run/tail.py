"""The one tail reader of the run folder's JSON-lines files: whole lines appended since a byte offset.

    records, offset = read_new_lines(path, offset)   # from where the last call stopped
    record = read_last_record(path, before=t)         # the last record older than t, read from the end
    records = read_last_records(path, wanted, count)  # the last few records of a kind, read from the end

A line still being written (no newline yet) waits for the next call; a line torn by a process killed
mid-write, and written after, is skipped, and so are the blank lines that separate shared streams' records
(trainer.run.events). Offsets count bytes of whole lines, so they survive a restart of the reader (the
forwarder saves them with the rows they produced).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def read_new_lines(path: Path, offset: int = 0, until: int | None = None) -> tuple[list[dict[str, Any]], int]:
    """The records of the whole lines after `offset` (and before `until`), and the offset after the last of them."""
    try:
        with Path(path).open("rb") as handle:
            handle.seek(offset)
            data = handle.read() if until is None else handle.read(max(0, until - offset))
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return _parse(data[:end]), offset + end


def read_last_record(path: Path, before: float | None = None, block: int = 1 << 16) -> dict[str, Any] | None:
    """The file's last record (with `before`: the last whose "time" is earlier), read backwards block by block:
    what a restart asks of a month of metrics.jsonl costs the blocks after that record, not the file."""
    found = read_last_records(path, lambda r: before is None or r.get("time", float("inf")) < before, 1, block)
    return found[0] if found else None


def read_last_records(path: Path, wanted: Callable[[dict[str, Any]], bool], count: int,
                      block: int = 1 << 16, since: float | None = None) -> list[dict[str, Any]]:
    """The last `count` records `wanted` accepts, oldest first, read backwards block by block from the file's end;
    with `since`, the reading stops at the block holding the first record older than it (the streams are
    appended in time order, give or take the writers' clocks: the block's other records are still judged)."""
    found: list[dict[str, Any]] = []
    try:
        handle = Path(path).open("rb")
    except FileNotFoundError:
        return found
    with handle:
        end = handle.seek(0, 2)
        tail = b""
        while end > 0 and len(found) < count:
            start = max(0, end - block)
            handle.seek(start)
            tail = handle.read(end - start) + tail
            end = start
            lines = tail.split(b"\n")
            if end > 0:  # the first piece may be the end of a line that began in an earlier block
                tail, lines = lines[0], lines[1:]
            else:
                tail = b""
            for record in reversed(_parse(b"\n".join(lines))):
                if wanted(record):
                    found.append(record)
                    if len(found) == count:
                        break
                if since is not None and record.get("time", float("inf")) < since:
                    end = 0  # everything before this block is older still
    return found[::-1]


def _parse(data: bytes) -> list[dict[str, Any]]:
    records = []
    for line in data.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # torn by a process killed mid-write, then appended after: skipped
            continue
    return records
