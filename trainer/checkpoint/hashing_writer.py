"""DCP's file-system writer, hashing every file in the pass that writes it, so a commit never reads a shard again.

Each rank's writer feeds the bytes it writes through xxh3-128 (the manifest's algorithm) on their way to the file,
and returns the digests of its files to DCP's coordinator inside its write results (one extra result under a
key no tensor has); the coordinator's ``finish`` takes them out before DCP builds ``.metadata`` from the rest,
and writes them, with ``.metadata``'s own, to ``written-digests.json`` in the folder. Rank 0's commit
(trainer.checkpoint.format.write_manifest) assembles the manifest from that file and a ``stat`` per file:
O(files), not O(bytes). The result crosses processes as data (DCP gathers results with pickle), so it works
the same when the write runs in DCP's background process.

The hash is of the bytes handed to the file, in order: DCP's writer only appends (an item's offset is the
stream's position before it), and the stream refuses seek.

NVRx's FileSystemWriterAsync (the GPU default) writes in processes it forks in its checkpoint worker, which return
only DCP's results. Its hashing subclass (hashing_async_writer) runs NVRx's save function with NVRx's module-level
`open` shadowed in that worker: each shard it opens is hashed as it is written and leaves its digest in a sidecar
file beside it, which the rank reads (and removes) when NVRx hands it the results; from there on, as above.
"""

from __future__ import annotations

import builtins
import functools
import io
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainer.checkpoint.format import HASH_ALGORITHM, WRITTEN_DIGESTS
from trainer.run import digest

_DIGESTS_KEY = "__resilient_train.written_digests__"  # no state-dict key starts with "__"
_SIDECAR = ".written-digest.json"  # a shard's digest, from NVRx's writer process to its rank


class _HashingStream(io.RawIOBase):
    """Write-only, append-only: every byte written is hashed before it goes to the file."""

    def __init__(self, raw: Any):
        super().__init__()
        self._raw = raw
        self._hash = digest.hasher(HASH_ALGORITHM)
        self.bytes = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        written = self._raw.write(view)
        # A raw file may take part of a buffer; only what it took is in the file (the caller writes the rest).
        written = view.nbytes if written is None else written
        self._hash.update(view[:written])
        self.bytes += written
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        self._raw.flush()  # the file itself is closed by the FileSystem's context manager
        super().close()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class _HashingFileSystem(FileSystem):
    """DCP's local file system; what it opens for writing is hashed as it is written."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}  # file name -> {"bytes", "hash"} of this save

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
            stream.flush()
            # One entry per file; DCP's writer threads each write files of their own.
            self.written[Path(path).name] = {"bytes": stream.bytes, "hash": stream.hexdigest()}


class HashingFileSystemWriter(FileSystemWriter):
    """FileSystemWriter whose files' digests reach the folder's written-digests.json (see the module doc)."""

    def __init__(self, path: str | os.PathLike, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.fs = _HashingFileSystem()

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.fs.written = {}

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()  # DCP's writer returns a completed future
        own = {name: entry for name, entry in self.fs.written.items() if not name.startswith(".metadata")}
        carried = WriteResult(index=MetadataIndex(f"{_DIGESTS_KEY}{plan.storage_data.prefix}"), size_in_bytes=0,
                              storage_data=own)
        future: Future = Future()
        future.set_result([*results, carried])
        return future

    def finish(self, metadata, results: list[list[WriteResult]]) -> None:
        kept, written = _split_digests(results)
        super().finish(metadata, kept)
        metadata_file = next((name for name in self.fs.written if name.startswith(".metadata")), None)
        if metadata_file is not None:  # written as .metadata.tmp, then renamed
            written[".metadata"] = self.fs.written[metadata_file]
        _write_digests(Path(self.path), written)


def _split_digests(results: list[list[WriteResult]]) -> tuple[list[list[WriteResult]], dict[str, dict[str, Any]]]:
    """Every rank's DCP results, and the digests the ranks carried beside them."""
    written: dict[str, dict[str, Any]] = {}
    for rank_results in results:
        for carried in rank_results:
            if carried.index.fqn.startswith(_DIGESTS_KEY):
                written.update(carried.storage_data)
    return [data_results(rank_results) for rank_results in results], written


def _write_digests(folder: Path, written: dict[str, dict[str, Any]]) -> None:
    with (folder / WRITTEN_DIGESTS).open("w") as handle:
        json.dump({"hash_algorithm": HASH_ALGORITHM, "files": written}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def data_results(results: list[WriteResult]) -> list[WriteResult]:
    """A rank's write results without the one carrying its digests: what DCP's own writer returns."""
    return [r for r in results if not r.index.fqn.startswith(_DIGESTS_KEY)]


# -- NVRx's FileSystemWriterAsync ---------------------------------------------------------------------------------


class _SidecarHashingFile(_HashingStream):
    """A shard NVRx's writer process opens: hashed as written; on a clean close its digest goes to a sidecar."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(builtins.open(path, "wb"))
        self.path = str(path)

    def __exit__(self, kind, error, trace) -> None:
        super().close()  # flushes the file
        self._raw.close()
        if kind is None:
            Path(self.path + _SIDECAR).write_text(json.dumps({"bytes": self.bytes, "hash": self.hexdigest()}))


def _hashing_open(file, mode: str = "r", *args, **kwargs):
    """builtins.open, except that a DCP shard opened for writing is a _SidecarHashingFile."""
    if mode == "wb" and str(file).endswith(".distcp") and not args and not kwargs:
        return _SidecarHashingFile(file)
    return builtins.open(file, mode, *args, **kwargs)


def _save_hashing(module_name: str, save_fn: Callable, *args: Any) -> Any:
    """NVRx's save function, in its checkpoint worker, with that module's `open` shadowed there (and so in the
    processes it forks to write each bucket): NVRx calls open() on each shard by its plain name."""
    import importlib  # the NVRx module, already imported in this worker (it unpickled save_fn from it)

    importlib.import_module(module_name).open = _hashing_open
    return save_fn(*args)


@functools.cache
def hashing_async_writer(base: type) -> type:
    """NVRx's FileSystemWriterAsync (`base`, from trainer.resilience.nvrx_compat) whose shards are hashed as
    written (see the module doc)."""

    class HashingFileSystemWriterAsync(base):
        def get_save_function_and_args(self):
            returned = super().get_save_function_and_args()
            save_fn, *rest = returned
            if save_fn is None:
                return returned
            return (functools.partial(_save_hashing, base.__module__, save_fn), *rest)

        def retrieve_write_results(self) -> list[WriteResult]:
            results = super().retrieve_write_results()
            written = {}
            for file_name, *_ in self.write_buckets or []:
                sidecar = Path(str(file_name) + _SIDECAR)
                try:
                    written[Path(file_name).name] = json.loads(sidecar.read_text())
                except FileNotFoundError:  # not hashed (a version whose writer opens files otherwise): the commit does
                    continue
                sidecar.unlink()
            rank = _rank()
            return [*results, WriteResult(index=MetadataIndex(f"{_DIGESTS_KEY}{rank}"), size_in_bytes=0,
                                          storage_data=written)]

        def finish(self, metadata, results: list[list[WriteResult]]) -> None:
            kept, written = _split_digests(results)
            super().finish(metadata, kept)
            _write_digests(Path(self.checkpoint_dir), written)  # .metadata itself: hashed at the commit (small)

    return HashingFileSystemWriterAsync


def _rank() -> int:
    import torch.distributed as dist  # torch is loaded already: this module is DCP's

    return dist.get_rank() if dist.is_initialized() else 0
