"""A DCP storage reader that reads a checkpoint the way the storage wants and verifies it in the same pass.

DCP's own ``FileSystemReader.read_data`` (torch 2.13, torch/distributed/checkpoint/filesystem.py) reads item
by item, each through a ``torch.load`` of a file slice, then copies into the target: on the bench that is 12 %
of a plain read of the same files, and the manifest's verification read every file once more before it.
``FastReader`` keeps DCP's metadata, planner and resharding (it only replaces ``read_metadata`` and
``read_data``) and, per file:

- sorts the items by offset and walks them in windows of whole items (merged ranges; for a file this rank
  verifies, the whole file), asking the kernel to read a bounded number of windows ahead (MADV_WILLNEED);
- hashes those same bytes in file order on one thread (xxh3, the manifest's algorithm, releases the GIL)
  while the main thread copies: the verification is the read;
- decodes each tensor item in place (the torch.save zip is stored uncompressed: its ``data/0`` record is the
  tensor's bytes) and copies it once into the planner's target tensor.

The reusable buffer is the page cache itself: the file is memory-mapped, so the only copy is the one into
the target. Reading into buffers of our own first was measured (bench/checkpoint.py's machine, 315 MB, warm):
allocating and filling them cost more than the whole mapped load — 0.27 s against 0.07 s, a raw read 0.05 s.

Each data file is verified by exactly one rank (``verifier_of``: its writer's rank where that rank exists),
so one read pass covers verification and load. A hash mismatch raises ``CheckpointError`` naming the file,
which DCP's load turns into a failure on every rank (it gathers read errors): the caller moves on to an older
checkpoint. Items it cannot decode (a transform such as compression, a pickle it does not know, big-endian
data) go through DCP's own path, from the same buffer.

The tensor decoder is trainer.checkpoint.tensor_decode.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import pickle
import re
from concurrent.futures import Future as ThreadFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainer.checkpoint import reads
from trainer.checkpoint.format import MANIFEST, CheckpointError, hasher
from trainer.checkpoint.tensor_decode import Undecodable, decode_tensor

log = logging.getLogger(__name__)

WINDOW_BYTES = 32 << 20
PREFETCH_WINDOWS = 4  # readahead asked of the kernel, in windows beyond the one being copied
MERGE_GAP_BYTES = 1 << 20  # read through a gap this small rather than issue another request

_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass
class Window:
    """One read: bytes [start, end) of a file and the items entirely inside it."""

    start: int
    end: int
    items: list[tuple[int, int, Any]] = field(default_factory=list)  # (offset, length, item)


def plan_windows(items: list[tuple[int, int, Any]], file_size: int, whole_file: bool,
                 window_bytes: int = WINDOW_BYTES, merge_gap: int = MERGE_GAP_BYTES) -> list[Window]:
    """Cut a file into reads of whole items, in offset order, each at most `window_bytes` (or one item).
    With `whole_file` the windows tile every byte of the file (it is hashed); otherwise they cover the items,
    merged across gaps of at most `merge_gap`."""
    windows: list[Window] = []

    def hash_only(start: int, stop: int) -> None:
        windows.extend(Window(s, min(s + window_bytes, stop)) for s in range(start, stop, window_bytes))

    for offset, length, item in sorted(items, key=lambda entry: entry[0]):
        end = offset + length
        last = windows[-1] if windows else None
        if last is not None and end - last.start <= window_bytes and (whole_file or offset - last.end <= merge_gap):
            last.end = end
            last.items.append((offset, length, item))
            continue
        start = offset
        if whole_file:
            start = last.end if last is not None else 0
            if end - start > window_bytes and offset > start:  # the gap alone, so no read exceeds the bound
                hash_only(start, offset)
                start = offset
        windows.append(Window(start, end, [(offset, length, item)]))
    if whole_file:
        hash_only(windows[-1].end if windows else 0, file_size)
    return windows


def verifier_of(relative_path: str, index: int, world_size: int) -> int:
    """The rank that hashes this file: the rank that wrote it (``__<rank>_0.distcp``) where that rank
    exists in this world, else an even spread by its position in the manifest."""
    match = _WRITER.match(relative_path)
    writer = int(match.group(1)) if match else index
    return writer % world_size


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class _Mapping:
    """A file mapped copy-on-write (writable views, so torch.frombuffer does not warn; nothing is ever written,
    so no page is copied): reading it is the page cache's copy, with no buffer of our own in between."""

    def __init__(self, path: Path):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            # Not MAP_POPULATE: on a private writable mapping it breaks copy-on-write for every page (measured:
            # twice as slow); the readahead below fills the mapping as it is walked.
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE) if self.size else None
        finally:
            os.close(fd)
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._advised = 0

    def prefetch(self, end: int) -> None:
        """Ask the kernel to start reading up to `end` (asynchronous readahead: the bounded I/O in flight)."""
        start = self._advised - self._advised % mmap.PAGESIZE
        if self._map is not None and end > self._advised:
            self._map.madvise(mmap.MADV_WILLNEED, start, min(end, self.size) - start)
            self._advised = end

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view still held (an exception's traceback): the collector unmaps it
                log.debug("%s: mapping still referenced; left to the garbage collector", self.path)


class FastReader(FileSystemReader):
    """Drop-in for ``FileSystemReader`` (``dcp.load(state, storage_reader=FastReader(path))``).

    With a manifest in the folder .metadata is checked before it is unpickled (always), and with `verify` (the
    default) each data file by its verifier rank while it is read. `window_bytes` × `prefetch_windows` bounds the
    readahead in flight; nothing is buffered beyond the page cache. After a load, `stats` holds bytes read, files
    verified and items that went through DCP's path."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True, window_bytes: int = WINDOW_BYTES,
                 prefetch_windows: int = PREFETCH_WINDOWS, prehashed: set[str] = frozenset()):
        super().__init__(path)
        self._prehashed = set(prehashed)  # verified by this process already (prefetch.RestorePrefetch)
        self._folder = Path(path)
        self._window_bytes, self._prefetch_windows = window_bytes, prefetch_windows
        manifest_path = self._folder / MANIFEST
        # The manifest is read even without `verify`: .metadata is a pickle, unpickled only once its hash matched.
        self._manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
        self._verify = verify
        self.stats = {"bytes_read": 0, "files_verified": 0, "items": 0, "items_fallback": 0}

    def _expected_hash(self, relative_path: str) -> str | None:
        if self._manifest is None:
            return None
        entry = self._manifest["files"].get(relative_path)
        if entry is None:
            raise CheckpointError(f"{self._folder / relative_path}: read by the load but not listed in "
                                  f"{self._folder / MANIFEST}")
        return entry["hash"]

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._manifest is None or kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        path = self._folder / ".metadata"
        data = path.read_bytes()
        reads.count(len(data))
        self._check_hash(".metadata", [memoryview(data)])
        metadata = pickle.loads(data)  # DCP's own format; trusted only once its hash matched the manifest
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_hash(self, relative_path: str, views: list[memoryview]) -> None:
        expected = self._expected_hash(relative_path)
        digest = hasher(self._manifest["hash_algorithm"])
        for view in views:
            digest.update(view)
        if digest.hexdigest() != expected:
            raise CheckpointError(f"{self._folder / relative_path}: content hash ({self._manifest['hash_algorithm']}) "
                                  "differs from the manifest (corrupted); an older checkpoint is needed")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[tuple[int, int, ReadItem]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info.length, item))
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        mine = set()
        if self._manifest is not None and self._verify:
            data_files = [name for name in self._manifest["files"] if name not in (".metadata", MANIFEST)]
            mine = {name for index, name in enumerate(data_files)
                    if verifier_of(name, index, world) == rank and name not in self._prehashed}
            for name in mine:
                per_file.setdefault(name, [])
        # One hashing thread: xxh3 releases the GIL, so hashing a window overlaps copying the one before, and
        # a single worker keeps the updates in file order.
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hashing:
            for relative_path in sorted(per_file):
                self._read_file(relative_path, per_file[relative_path], relative_path in mine, planner, hashing)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_file(self, relative_path: str, items, verify: bool, planner: LoadPlanner,
                   hashing: ThreadPoolExecutor) -> None:
        path = self._folder / relative_path
        mapping = _Mapping(path)
        hashed: list[ThreadFuture] = []
        deferred: list[tuple[ReadItem, bytes]] = []  # pickled items: unpickled only once the file verified
        digest = hasher(self._manifest["hash_algorithm"]) if verify else None
        failed: Exception | None = None  # an item that did not decode: corruption, if the hash says so
        try:
            needed = max((offset + length for offset, length, _ in items), default=0)
            if needed > mapping.size:
                raise CheckpointError(f"{path}: ends at byte {mapping.size}, the checkpoint's metadata says "
                                      f"{needed} (truncated)")
            windows = plan_windows(items, mapping.size, whole_file=verify, window_bytes=self._window_bytes)
            for index, window in enumerate(windows):
                ahead = windows[min(index + self._prefetch_windows, len(windows) - 1)]
                mapping.prefetch(ahead.end)
                chunk = mapping.view[window.start:window.end]
                if digest is not None:
                    hashed.append(hashing.submit(digest.update, chunk))
                for offset, length, item in window.items if failed is None else ():
                    blob = mapping.view[offset:offset + length]
                    try:
                        if item.type == LoadItemType.BYTE_IO:
                            deferred.append((item, bytes(blob)))
                        else:
                            self._load_tensor(item, blob, planner)
                    except Exception as err:  # finish hashing first: a corrupt file is named as such
                        if digest is None:
                            raise
                        failed = err
                    finally:
                        blob.release()
                if relative_path not in self._prehashed:  # else the prefetch read (and counted) it already
                    reads.count(window.end - window.start)
                    self.stats["bytes_read"] += window.end - window.start
        finally:
            for future in hashed:  # the hashing thread holds views of the mapping until it is done
                future.result()
            mapping.close()
        if digest is not None:
            if digest.hexdigest() != self._expected_hash(relative_path):
                raise CheckpointError(f"{path}: content hash ({self._manifest['hash_algorithm']}) differs from the "
                                      "manifest (corrupted); an older checkpoint is needed") from failed
            if failed is not None:
                raise failed
            self.stats["files_verified"] += 1
        for item, data in deferred:
            self._load_bytes(item, data, planner)

    def _load_bytes(self, item: ReadItem, data: bytes, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (), io.BytesIO(data))
        planner.load_bytes(item, io.BytesIO(stream.read(-1)))
        self.stats["items"] += 1

    def _load_tensor(self, item: ReadItem, blob: memoryview, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        self.stats["items"] += 1
        try:
            if info.transform_descriptors:
                raise Undecodable(f"transforms {info.transform_descriptors}")
            tensor = decode_tensor(blob)
        except Undecodable as why:
            log.debug("%s: %s read through DCP's path (%s)", self._folder, item.storage_index.fqn, why)
            self.stats["items_fallback"] += 1
            tensor = self._torch_load(item, blob)
        tensor = _narrow(tensor, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointError(f"{self._folder}: {item.storage_index.fqn} is {tuple(tensor.size())} in the checkpoint, "
                                  f"{tuple(target.size())} in the model being loaded")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    def _torch_load(self, item: ReadItem, blob: memoryview) -> torch.Tensor:
        """DCP's own decoding of one item (filesystem.py's read_data), from the bytes already read."""
        info = self.storage_data[item.storage_index]
        stream = self.transforms.transform_load_stream(item, info.transform_descriptors or (), io.BytesIO(blob))
        seekable = stream if stream.seekable() else io.BytesIO(stream.read(-1))
        return torch.load(seekable, map_location="cpu", weights_only=True)
