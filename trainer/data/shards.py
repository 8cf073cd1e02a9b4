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
import io
import json
import logging
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import orjson
from tqdm import tqdm

from trainer.data.tokenizer import LoadedTokenizer, load_tokenizer
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
META_FILE = "tokens.json"


class DataError(RuntimeError):
    """Token data missing, malformed or too small for the requested batches."""


def is_held_out(document: str, val_fraction: float) -> bool:
    """Deterministic split by content: the same document always lands on the same side."""
    return _held_out(document.encode("utf-8"), val_fraction)


def _held_out(encoded: bytes, val_fraction: float) -> bool:
    return int.from_bytes(hashlib.sha256(encoded).digest()[:8], "big") / 2**64 < val_fraction


def _json_text(line: str):
    """The "text" of one JSONL line: orjson, and Python's json for what orjson refuses but json reads (NaN,
    lone surrogates, integers beyond 64 bits), so the accepted input is what it always was."""
    try:
        return orjson.loads(line)["text"]
    except orjson.JSONDecodeError:
        return json.loads(line)["text"]


CHUNK_CHARS = 4 << 20  # text per tokenization task: bounds memory (a few tasks in flight), amortises a task's cost


def _text_chunks(files: list[Path]) -> Iterator[tuple[str, Path, int, Any]]:
    """The corpus as (kind, path, start, payload) tasks of whole documents, in document order, each about
    CHUNK_CHARS: .jsonl byte ranges of whole lines (start, end), .txt text cut at a blank line, .parquet
    "text" values. Nothing holds more."""
    for path in sorted(files):
        if path.suffix == ".parquet":
            # pyarrow only here: only the stage step reads .parquet, and the trainer image does not have it
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            if "text" not in parquet.schema_arrow.names:
                raise DataError(f"{path}: expected a 'text' column, found {parquet.schema_arrow.names}")
            for batch in parquet.iter_batches(columns=["text"], batch_size=4096):
                yield "texts", path, 0, [text for text in batch.column(0).to_pylist() if text]
        elif path.suffix == ".jsonl":
            # Byte ranges of whole lines: the task reads its own range, so no text passes through this process.
            with path.open("rb") as handle:
                size, start = path.stat().st_size, 0
                while start < size:
                    handle.seek(start + CHUNK_CHARS)
                    handle.readline()
                    end = min(handle.tell(), size)
                    yield "jsonl", path, start, end
                    start = end
        elif path.suffix == ".txt":
            with path.open(encoding="utf-8") as handle:
                carried = ""
                while text := handle.read(CHUNK_CHARS):
                    text = carried + text
                    cut = text.rfind("\n\n")
                    # Documents are the stripped, non-empty pieces between blank lines: cutting at any "\n\n"
                    # gives the same pieces as splitting the whole file.
                    if cut < 0:
                        carried = text
                        continue
                    yield "txt", path, 0, text[:cut]
                    carried = text[cut + 2:]
                if carried:
                    yield "txt", path, 0, carried


def _documents(kind: str, path: Path, first_line: int, payload: Any) -> Iterable[str]:
    if kind == "texts":
        yield from payload
    elif kind == "jsonl":  # first_line: the range's first byte; payload: its end
        with path.open("rb") as handle:
            handle.seek(first_line)
            data = handle.read(payload - first_line)
        # Universal newlines, as the file's line reader always had.
        lines = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8", newline=None)
        for index, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                text = _json_text(line)
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise DataError(f"{path}:{_line_number(path, first_line) + index}: expected a JSON object with a "
                                "'text' field") from err
            yield text
    else:
        for block in payload.split("\n\n"):
            if block.strip():
                yield block.strip()


def _line_number(path: Path, offset: int) -> int:
    """The number of the line starting at byte `offset` (for an error message: counts the lines before it)."""
    with path.open("rb") as handle:
        return 1 + sum(block.count(b"\n") for block in iter(lambda: handle.read(min(8 << 20, offset - handle.tell())), b""))


def read_documents(files: list[Path]) -> Iterable[str]:
    """Documents from .txt (blank-line separated), .jsonl (a "text" field per line) and .parquet (a "text"
    column) files, streamed."""
    for chunk in _text_chunks(files):
        yield from _documents(*chunk)


_worker_tokenizers: dict[str, LoadedTokenizer] = {}


def _tokenize_chunk(chunk: tuple[str, Path, int, Any], tokenizer: str, val_fraction: float, dtype: str
                    ) -> dict[str, tuple[bytes, int, int]]:
    """One task: its documents split by content and tokenized; per split (token bytes, tokens, documents)."""
    if tokenizer not in _worker_tokenizers:
        _worker_tokenizers[tokenizer] = load_tokenizer(tokenizer)
    loaded = _worker_tokenizers[tokenizer]
    texts = list(_documents(*chunk))
    encoded = [text.encode("utf-8") for text in texts]  # once, for the split and the byte tokenizer
    held = [_held_out(data, val_fraction) for data in encoded]
    out = {}
    for split, side in (("train", False), ("val", True)):
        mine = [i for i, h in enumerate(held) if h == side]
        ids = (loaded.encode_to_array([texts[i] for i in mine], np.dtype(dtype), [encoded[i] for i in mine])
               if mine else np.empty(0, dtype=dtype))
        out[split] = (ids.tobytes(), len(ids), len(mine))
    return out


def _tokenize_chunk_to_files(chunk: tuple[str, Path, int, Any], tokenizer: str, val_fraction: float, dtype: str,
                             part: Path) -> dict[str, tuple[Path, int, int]]:
    """A worker's task: _tokenize_chunk, its token bytes left in files beside the output (not sent back
    through a pipe: that copy cost more than the tokenizing)."""
    out = {}
    for split, (data, tokens, documents) in _tokenize_chunk(chunk, tokenizer, val_fraction, dtype).items():
        path = part.with_suffix(f".{split}")
        path.write_bytes(data)
        out[split] = (path, tokens, documents)
    return out


def _tokenized(chunks: Iterator, tokenizer: str, val_fraction: float, dtype: str, workers: int,
               parts: Path) -> Iterator[dict[str, tuple[bytes | Path, int, int]]]:
    """Each chunk's result, in order: per split its token bytes (or a file of them, from a worker), tokens and
    documents. With workers > 1 a process pool runs at most 2 × workers tasks at a time (memory stays bounded
    whatever the corpus size)."""
    if workers <= 1:
        for chunk in chunks:
            yield _tokenize_chunk(chunk, tokenizer, val_fraction, dtype)
        return
    # forkserver: the caller may hold threads (torch, the tokenizers pool) that a plain fork would copy mid-use.
    context = multiprocessing.get_context("forkserver")
    parts.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_worker) as pool:
        pending: collections.deque = collections.deque()
        for index, chunk in enumerate(chunks):
            pending.append(pool.submit(_tokenize_chunk_to_files, chunk, tokenizer, val_fraction, dtype,
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
    out = []
    for path in sorted(files):
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while block := handle.read(8 << 20):
                digest.update(block)
        out.append([path.name, digest.hexdigest()])
    return out


def combined_content_hash(digests: list[list[str]], val_fraction: float, tokenizer_json: str) -> str:
    """The shards' cache key from file_digests: the inputs' contents, the split and the tokenizer. Shards of
    contiguous file groups combine their digests, in order, into the key one task would compute."""
    hasher = hashlib.sha256(f"v{SHARD_FORMAT_VERSION}:{val_fraction}".encode())
    hasher.update(tokenizer_json.encode())
    for name, digest in digests:
        hasher.update(name.encode())
        hasher.update(bytes.fromhex(digest))
    return hasher.hexdigest()


def tokenize_files(files: list[Path], out_dir: Path, val_fraction: float, tokenizer: str = "byte",
                   workers: int | None = None, *, require_both_splits: bool = True) -> dict:
    """Tokenize raw text files into train/val shards in out_dir; reuses them when the inputs are unchanged.

    The cache key is a hash of the input files' contents, the split and the tokenizer, so editing one
    document re-tokenizes and touching nothing does not. Streaming: memory is bounded by a few chunks per
    worker, not by the corpus. `workers` processes (default: one per core, fewer for a small corpus)
    tokenize chunks in parallel; the output does not depend on their number. tokens.json also lists each
    input's digest ("file_digests"), from which shards of a corpus combine their cache key. A shard of a
    larger corpus may have an empty split (require_both_splits=False): the corpus as a whole is checked.
    """
    if not files:
        raise DataError(f"no .txt, .jsonl or .parquet files to tokenize for {out_dir}")
    loaded = load_tokenizer(tokenizer)
    digests = file_digests(files)
    content_hash = combined_content_hash(digests, val_fraction, loaded.tokenizer.to_str())

    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("content_hash") == content_hash and all((out_dir / name).is_file()
                                                            for s in meta["splits"].values() for name in shard_files(s)):
            log.info("token shards in %s are up to date (content hash %s)", out_dir, content_hash[:12])
            return {**meta, "file_digests": digests}  # (older tokens.json files lack them)

    dtype = np.uint16 if loaded.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    if workers is None:
        corpus_chars = sum(path.stat().st_size for path in files)
        workers = max(1, min(os.cpu_count() or 1, corpus_chars // (2 * CHUNK_CHARS)))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": SHARD_FORMAT_VERSION, "tokenizer": loaded.name, "vocab_size": loaded.vocab_size,
            "dtype": np.dtype(dtype).name, "content_hash": content_hash, "val_fraction": val_fraction, "splits": {},
            "file_digests": digests}
    counts = {split: {"tokens": 0, "documents": 0} for split in ("train", "val")}
    temporary = {split: out_dir / f"{split}.bin.tmp" for split in counts}
    parts = out_dir / ".parts"  # the workers' outputs, each appended in order, then deleted
    try:
        with contextlib.ExitStack() as stack:
            handles = {split: stack.enter_context(path.open("wb")) for split, path in temporary.items()}
            bar = stack.enter_context(tqdm(desc="tokenize", unit="B", unit_scale=True, disable=not sys.stderr.isatty()))
            for result in _tokenized(_text_chunks(files), tokenizer, val_fraction, np.dtype(dtype).name, workers,
                                     parts):
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
