"""Content hashes of files, read in chunks so that no file is ever held in memory whole: a checkpoint's shards
(trainer.checkpoint.format), a base model's safetensors files (trainer.model.base), a corpus's input files
(trainer.data.shards). Corruption detection, not tamper-proofing: the hashes sit beside what they hash.

    digest = hash_file(path)                              # xxh3-128: ~10x sha256's speed here
    digest = hash_file(path, "sha256", on_chunk=count)    # each chunk's size to a byte counter
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable

import xxhash

ALGORITHMS = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
CHUNK_BYTES = 8 << 20


def hasher(algorithm: str):
    """A fresh hash object of `algorithm` (a KeyError for one not in ALGORITHMS: the caller names the file)."""
    return ALGORITHMS[algorithm]()


def hash_file(path: Path, algorithm: str = "xxh3_128", on_chunk: Callable[[int], None] | None = None) -> str:
    """The hex digest of a file's contents, read CHUNK_BYTES at a time; on_chunk(bytes) after each read."""
    digest = hasher(algorithm)
    with Path(path).open("rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            if on_chunk is not None:
                on_chunk(len(chunk))
    return digest.hexdigest()
