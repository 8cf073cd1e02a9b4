"""Token shards on disk: documents read, tokenized in parallel and written as shards with their tokens.json.

Shards are flat arrays of token ids (``train.bin`` / ``val.bin``, uint16, or uint32 for vocabularies
above 65,536) described by ``tokens.json``; a split may also be several shards (``"files"``), read as their
concatenation.
The batches drawn from them are trainer.data.batches.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from trainer.data.documents import CHUNK_CHARS, DOCUMENT_FORMATS, Chunk, DataError, text_chunks
from trainer.data.documents import documents as documents_of
from trainer.data.tokenizer import LoadedTokenizer, load_tokenizer
from trainer.run.digest import hash_file
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
META_FILE = "tokens.json"


def is_held_out(document: str, val_fraction: float) -> bool:
    """Deterministic split by content: the same document always lands on the same side."""
    return _held_out(document.encode("utf-8"), val_fraction)


def _held_out(encoded: bytes, val_fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "big") / 2**64 < val_fraction


_worker_tokenizers: dict[str, LoadedTokenizer] = {}


def _tokenize_chunk(chunk: Chunk, tokenizer: str, val_fraction: float, dtype: str, text_field: str
                    ) -> dict[str, tuple[bytes, int, int]]:
    """One task: its documents split by content and tokenized; per split (token bytes, tokens, documents)."""
    if tokenizer not in _worker_tokenizers:
        _worker_tokenizers[tokenizer] = load_tokenizer(tokenizer)
    loaded = _worker_tokenizers[tokenizer]
    texts = list(documents_of(chunk, text_field))
    encoded = [text.encode("utf-8") for text in texts]  # once, for the split and the byte tokenizer
    held = [_held_out(data, val_fraction) for data in encoded]
    out = {}
    for split, side in (("train", False), ("val", True)):
        mine = [i for i, h in enumerate(held) if h == side]
        ids = (loaded.encode_to_array([texts[i] for i in mine], np.dtype(dtype), [encoded[i] for i in mine])
               if mine else np.empty(0, dtype=dtype))
        out[split] = (ids.tobytes(), len(ids), len(mine))
    return out


def _tokenize_chunk_to_files(chunk: Chunk, tokenizer: str, val_fraction: float, dtype: str, text_field: str,
                             part: Path) -> dict[str, tuple[Path, int, int]]:
    """A worker's task: _tokenize_chunk, its token bytes left in files beside the output (not sent back
    through a pipe: that copy cost more than the tokenizing)."""
    out = {}
    for split, (data, tokens, documents) in _tokenize_chunk(chunk, tokenizer, val_fraction, dtype, text_field).items():
        path = part.with_suffix(f".{split}")
        path.write_bytes(data)
        out[split] = (path, tokens, documents)
    return out


def _tokenized(chunks: Iterator[Chunk], tokenizer: str, val_fraction: float, dtype: str, text_field: str,
               workers: int, parts: Path) -> Iterator[dict[str, tuple[bytes | Path, int, int]]]:
    """Each chunk's result, in order: per split its token bytes (or a file of them, from a worker), tokens and
    documents. With workers > 1 a process pool runs at most 2 × workers tasks at a time (memory stays bounded
    whatever the corpus size)."""
    if workers <= 1:
        for chunk in chunks:
            yield _tokenize_chunk(chunk, tokenizer, val_fraction, dtype, text_field)
        return
    # forkserver: the caller may hold threads (torch, the tokenizers pool) that a plain fork would copy mid-use.
    context = multiprocessing.get_context("forkserver")
    parts.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_worker) as pool:
        pending: collections.deque = collections.deque()
        for index, chunk in enumerate(chunks):
            pending.append(pool.submit(_tokenize_chunk_to_files, chunk, tokenizer, val_fraction, dtype, text_field,
                                       parts / f"{index:08d}"))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _quiet_worker() -> None:
    # One process per core already: the tokenizers library's own thread pool would oversubscribe them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def file_digests(files: list[Path]) -> list[list[str]]:
    """(name, sha256 of the contents) of each file in sorted order (streamed: no file is held in memory)."""
    return [[path.name, hash_file(path, "sha256")] for path in sorted(files)]


def combined_content_hash(digests: list[list[str]], val_fraction: float, tokenizer_json: str,
                          text_field: str = "text") -> str:
    """The shards' cache key from file_digests: the inputs' contents, the split, the tokenizer and the field the
    text is read from. Shards of contiguous file groups combine their digests, in order, into the key one task
    would compute."""
    hasher = hashlib.sha256(f"v{SHARD_FORMAT_VERSION}:{val_fraction}:{text_field}".encode())
    hasher.update(tokenizer_json.encode())
    for name, digest in digests:
        hasher.update(name.encode())
        hasher.update(bytes.fromhex(digest))
    return hasher.hexdigest()


def tokenize_files(files: list[Path], out_dir: Path, val_fraction: float, tokenizer: str = "byte",
                   workers: int | None = None, *, require_both_splits: bool = True, text_field: str = "text") -> dict:
    """Tokenize raw text files into train/val shards in out_dir; reuses them when the inputs are unchanged.

    The cache key is a hash of the input files' contents, the split and the tokenizer, so editing one
    document re-tokenizes and touching nothing does not. Streaming: memory is bounded by a few chunks per
    worker, not by the corpus. `workers` processes (default: one per core, fewer for a small corpus)
    tokenize chunks in parallel; the output does not depend on their number. tokens.json also lists each
    input's digest ("file_digests"), from which shards of a corpus combine their cache key. A shard of a
    larger corpus may have an empty split (require_both_splits=False): the corpus as a whole is checked.
    """
    if not files:
        raise DataError(f"no document files ({', '.join(DOCUMENT_FORMATS)}) to tokenize for {out_dir}")
    loaded = load_tokenizer(tokenizer)
    digests = file_digests(files)
    content_hash = combined_content_hash(digests, val_fraction, loaded.tokenizer.to_str(), text_field)

    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("content_hash") == content_hash and all((out_dir / name).is_file()
                                                            for s in meta["splits"].values() for name in shard_files(s)):
            log.info("token shards in %s are up to date (content hash %s)", out_dir, content_hash[:12])
            return {"tokenizer_hash": loaded.content_hash(), **meta, "file_digests": digests}  # (older files lack them)

    dtype = np.uint16 if loaded.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    if workers is None:
        corpus_chars = sum(path.stat().st_size for path in files)
        workers = max(1, min(os.cpu_count() or 1, corpus_chars // (2 * CHUNK_CHARS)))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": SHARD_FORMAT_VERSION, "tokenizer": loaded.name, "vocab_size": loaded.vocab_size,
            "tokenizer_hash": loaded.content_hash(), "dtype": np.dtype(dtype).name, "content_hash": content_hash,
            "val_fraction": val_fraction, "text_field": text_field, "splits": {}, "file_digests": digests}
    counts = {split: {"tokens": 0, "documents": 0} for split in ("train", "val")}
    temporary = {split: out_dir / f"{split}.bin.tmp" for split in counts}
    parts = out_dir / ".parts"  # the workers' outputs, each appended in order, then deleted
    try:
        with contextlib.ExitStack() as stack:
            handles = {split: stack.enter_context(path.open("wb")) for split, path in temporary.items()}
            bar = stack.enter_context(tqdm(desc="tokenize", unit="B", unit_scale=True, disable=not sys.stderr.isatty()))
            for result in _tokenized(text_chunks(files, text_field), tokenizer, val_fraction, np.dtype(dtype).name,
                                     text_field, workers, parts):
                for split, (data, tokens, documents) in result.items():
                    if isinstance(data, Path):  # a worker's part file
                        with data.open("rb") as part:
                            shutil.copyfileobj(part, handles[split], 8 << 20)
                        data.unlink()
                    else:
                        handles[split].write(data)
                    counts[split]["tokens"] += tokens
                    counts[split]["documents"] += documents
                    bar.update(tokens * np.dtype(dtype).itemsize)
        for split, count in counts.items():
            if require_both_splits and not count["documents"]:
                raise DataError(f"the {split} split is empty: add documents or change data.val_fraction")
    except BaseException:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    for split, path in temporary.items():
        target = out_dir / f"{split}.bin"
        path.replace(target)
        meta["splits"][split] = {"file": target.name, **counts[split]}
    write_json(meta_path, meta)  # written last: its presence means the shards are complete
    log.info("tokenized %d train / %d val documents into %s (%d worker(s))", counts["train"]["documents"],
             counts["val"]["documents"], out_dir, workers)
    return meta


def shard_files(split: dict) -> list[str]:
    """A split's token files in order (tokens.json: "file", or "files" for a split written as several shards,
    whose concatenation is the split)."""
    return list(split["files"]) if "files" in split else [split["file"]]


def load_meta(data_dir: Path) -> dict:
    meta_path = Path(data_dir) / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{meta_path} not found: stage the dataset first (the stage step writes it)")
    return json.loads(meta_path.read_text())
