"""One torch.save of one tensor decoded in place: the tensor as a view of the bytes, with no copy.

The decoder relies on torch.save's zip format (``archive/data.pkl`` calling ``torch._utils._rebuild_tensor_v2``
with a persistent ``storage`` id, ``archive/byteorder``, ``archive/data/<key>``), stable since torch 1.6; it
does not call private torch functions. tests/unit/test_fast_reader.py checks it on the pinned torch,
``TESTED_TORCH`` below, and anything it does not recognise raises ``Undecodable`` (the caller then takes DCP's
own path) instead of guessing. The reader that uses it is trainer.checkpoint.fast_reader.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import zipfile

import torch

TESTED_TORCH = "2.13"

# The legacy storage class names torch.save pickles (torch/storage.py), without touching the deprecated classes.
_STORAGE_DTYPES = {"BFloat16Storage": torch.bfloat16, "BoolStorage": torch.bool, "ByteStorage": torch.uint8,
                   "CharStorage": torch.int8, "ComplexDoubleStorage": torch.complex128,
                   "ComplexFloatStorage": torch.complex64, "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
                   "HalfStorage": torch.float16, "IntStorage": torch.int32, "LongStorage": torch.int64,
                   "ShortStorage": torch.int16}


class Undecodable(Exception):
    """This item is not a plain torch.save of one tensor: DCP's own path reads it."""


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview, so zipfile parses a record without copying it."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        data = bytes(self._view[self._pos:end])
        self._pos = end
        return data


class _TensorUnpickler(pickle.Unpickler):
    """Only what torch.save writes for one dense CPU tensor; anything else is Undecodable."""

    def __init__(self, data: bytes, records: dict[str, memoryview]):
        super().__init__(io.BytesIO(data))
        self._records = records

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise Undecodable(f"{module}.{name}")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise Undecodable(f"persistent id {pid!r}")
        _, dtype, key, _location, numel = pid
        record = self._records.get(f"data/{key}")
        if record is None or len(record) < numel * dtype.itemsize:
            raise Undecodable(f"storage record {key} missing or short")
        return torch.frombuffer(record, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    @staticmethod
    def _rebuild(storage, storage_offset, size, stride, requires_grad, backward_hooks, metadata=None):
        if backward_hooks or metadata:
            raise Undecodable("tensor with hooks or metadata")
        size = tuple(size)
        contiguous, expected = True, 1
        for length, step in zip(reversed(size), reversed(tuple(stride))):
            contiguous &= length == 1 or step == expected
            expected *= length
        if contiguous:  # what DCP saves (it clones views): a plain view, cheaper than as_strided
            return storage[storage_offset:storage_offset + expected].view(size)
        return storage.as_strided(size, stride, storage_offset)


def _records(blob: memoryview) -> dict[str, memoryview]:
    """The zip's records by name (without the archive's folder), as views of `blob`, read from its central
    directory directly: torch.save's archives are small, stored, and without zip64 below 4 GiB; anything
    else (zip64 fields, a comment) is left to zipfile, which costs ~0.2 ms per record."""
    end = len(blob) - 22
    if end < 0 or bytes(blob[end:end + 4]) != b"PK\x05\x06":
        return _records_via_zipfile(blob)
    count, _, directory = struct.unpack_from("<HII", blob, end + 10)
    records, position = {}, directory
    for _ in range(count):
        if bytes(blob[position:position + 4]) != b"PK\x01\x02":
            raise Undecodable("bad central directory")
        method, = struct.unpack_from("<H", blob, position + 10)
        size, _, name_length, extra_length, comment_length = struct.unpack_from("<IIHHH", blob, position + 20)
        header, = struct.unpack_from("<I", blob, position + 42)
        if 0xFFFFFFFF in (size, header):
            return _records_via_zipfile(blob)
        if method != zipfile.ZIP_STORED:
            raise Undecodable("compressed record")
        name = bytes(blob[position + 46:position + 46 + name_length]).decode()
        local_name, local_extra = struct.unpack_from("<HH", blob, header + 26)
        start = header + 30 + local_name + local_extra
        records[name.split("/", 1)[-1]] = blob[start:start + size]
        position += 46 + name_length + extra_length + comment_length
    return records


def _records_via_zipfile(blob: memoryview) -> dict[str, memoryview]:
    try:
        infos = zipfile.ZipFile(_MemoryFile(blob)).infolist()
    except (zipfile.BadZipFile, ValueError) as err:
        raise Undecodable(f"not a torch.save zip ({err})") from err
    records = {}
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise Undecodable(f"compressed record {info.filename}")
        header = blob[info.header_offset:info.header_offset + 30]
        start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
        records[info.filename.split("/", 1)[-1]] = blob[start:start + info.file_size]
    return records


def decode_tensor(blob: memoryview) -> torch.Tensor:
    """The tensor one torch.save wrote into `blob`, as a view of `blob` (no copy). Raises Undecodable."""
    try:
        records = _records(blob)
    except (struct.error, UnicodeDecodeError) as err:
        raise Undecodable(f"not a torch.save zip ({err})") from err
    pickled, byteorder = records.get("data.pkl"), records.get("byteorder")
    if pickled is None or (byteorder is not None and bytes(byteorder) != b"little"):
        raise Undecodable("no data.pkl, or not little-endian")
    try:
        tensor = _TensorUnpickler(bytes(pickled), records).load()
    except (pickle.UnpicklingError, TypeError, RuntimeError, EOFError) as err:
        raise Undecodable(str(err)) from err
    if not isinstance(tensor, torch.Tensor):
        raise Undecodable(f"a {type(tensor).__name__}, not a tensor")
    return tensor
