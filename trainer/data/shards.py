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
import orjson
from tqdm import tqdm

from trainer.data.conversations import (TARGET, BadRecord, ConversationFormat, chat_template, end_of_turn_ids, pack,
                                        render, row_arrays, tokenize_rendered)
from trainer.data.documents import CHUNK_CHARS, DOCUMENT_FORMATS, Chunk, DataError, text_chunks
from trainer.data.documents import documents as documents_of
from trainer.data.documents import records as records_of
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


def _worker_tokenizer(tokenizer: str) -> LoadedTokenizer:
    if tokenizer not in _worker_tokenizers:
        _worker_tokenizers[tokenizer] = load_tokenizer(tokenizer)
    return _worker_tokenizers[tokenizer]


def _tokenize_chunk(chunk: Chunk, tokenizer: str, val_fraction: float, dtype: str, text_field: str,
                    conversations: ConversationFormat | None = None) -> dict[str, dict]:
    """One task: its documents split by content and tokenized; per split {"streams": {"bin": token bytes, and for
    a fine-tuning corpus "flags": their flags}, "counts": {tokens, documents, ...}}."""
    if conversations is not None:
        return _tokenize_conversations(chunk, _worker_tokenizer(tokenizer), tokenizer, val_fraction, dtype,
                                       conversations)
    loaded = _worker_tokenizer(tokenizer)
    texts = list(documents_of(chunk, text_field))
    encoded = [text.encode("utf-8") for text in texts]  # once, for the split and the byte tokenizer
    held = [_held_out(data, val_fraction) for data in encoded]
    out = {}
    for split, side in (("train", False), ("val", True)):
        mine = [i for i, h in enumerate(held) if h == side]
        ids = (loaded.encode_to_array([texts[i] for i in mine], np.dtype(dtype), [encoded[i] for i in mine])
               if mine else np.empty(0, dtype=dtype))
        out[split] = {"streams": {"bin": ids.tobytes()}, "counts": {"tokens": len(ids), "documents": len(mine)}}
    return out


def _templated(fmt: ConversationFormat, loaded: LoadedTokenizer) -> bool:
    """Whether records are rendered by the tokenizer folder's chat template: always for chat (refused without
    one), for prompt/completion when there is one (lists of messages need it; text pairs do not use it)."""
    return loaded.folder is not None and (fmt.kind == "chat" or loaded.chat_template is not None)


def _tokenize_conversations(chunk: Chunk, loaded: LoadedTokenizer, tokenizer: str, val_fraction: float, dtype: str,
                            fmt: ConversationFormat) -> dict[str, dict]:
    """A fine-tuning task: each record rendered (the chat template), tokenized with its targets, split by content,
    then packed into rows of seq_len + 1 (trainer.data.conversations)."""
    template = chat_template(tokenizer) if _templated(fmt, loaded) else None
    capacity = fmt.seq_len + 1
    pad = loaded.pad_id if loaded.pad_id is not None else (loaded.eos_id if loaded.eos_id is not None else 0)
    pieces: dict[str, list] = {"train": [], "val": []}
    counts = {split: {"documents": 0, "truncated": 0, "dropped": 0, "bad_records": 0, "targets": 0,
                      "conversation_tokens": 0} for split in pieces}
    for where, record in records_of(chunk):
        try:
            rendered = render(record, template, fmt)
            ids, target = tokenize_rendered(loaded, rendered)
            if not target[1:].any():
                raise BadRecord("no target token is left once rendered and tokenized")
        except BadRecord as err:
            if fmt.bad_records != "skip":
                raise DataError(f"{where}: {err} (data.bad_records=skip counts such records and trains the rest)"
                                ) from err
            counts["train"]["bad_records"] += 1
            continue
        split = "val" if _held_out(orjson.dumps(record, option=orjson.OPT_SORT_KEYS), val_fraction) else "train"
        if len(ids) > capacity:
            if fmt.too_long == "drop":
                counts[split]["dropped"] += 1
                continue
            ids, target = ids[:capacity], target[:capacity]
            counts[split]["truncated"] += 1
            if not target[1:].any():
                counts[split]["dropped"] += 1
                continue
        pieces[split].append((ids, target))
    out = {}
    for split, mine in pieces.items():
        rows = pack([len(ids) for ids, _ in mine], capacity)
        tokens, flags = row_arrays(mine, rows, capacity, pad)
        counted = counts[split]
        counted.update(documents=len(mine), rows=len(rows), tokens=len(tokens),
                       conversation_tokens=sum(len(ids) for ids, _ in mine),
                       targets=int(((flags & TARGET) != 0).sum()))
        out[split] = {"streams": {"bin": tokens.astype(dtype).tobytes(), "flags": flags.tobytes()}, "counts": counted}
    return out


def _tokenize_chunk_to_files(chunk: Chunk, tokenizer: str, val_fraction: float, dtype: str, text_field: str,
                             conversations: ConversationFormat | None, part: Path) -> dict[str, dict]:
    """A worker's task: _tokenize_chunk, its bytes left in files beside the output (not sent back through a pipe:
    that copy cost more than the tokenizing)."""
    out = _tokenize_chunk(chunk, tokenizer, val_fraction, dtype, text_field, conversations)
    for split, result in out.items():
        for stream, data in result["streams"].items():
            path = part.with_suffix(f".{split}.{stream}")
            path.write_bytes(data)
            result["streams"][stream] = path
    return out


def _tokenized(chunks: Iterator[Chunk], tokenizer: str, val_fraction: float, dtype: str, text_field: str,
               conversations: ConversationFormat | None, workers: int, parts: Path) -> Iterator[dict[str, dict]]:
    """Each chunk's result, in order (_tokenize_chunk's; a worker's bytes in files). With workers > 1 a process pool
    runs at most 2 x workers tasks at a time (memory stays bounded whatever the corpus size)."""
    if workers <= 1:
        for chunk in chunks:
            yield _tokenize_chunk(chunk, tokenizer, val_fraction, dtype, text_field, conversations)
        return
    # forkserver: the caller may hold threads (torch, the tokenizers pool) that a plain fork would copy mid-use.
    context = multiprocessing.get_context("forkserver")
    parts.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_quiet_worker) as pool:
        pending: collections.deque = collections.deque()
        for index, chunk in enumerate(chunks):
            pending.append(pool.submit(_tokenize_chunk_to_files, chunk, tokenizer, val_fraction, dtype, text_field,
                                       conversations, parts / f"{index:08d}"))
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


def reading_key(text_field: str, conversations: ConversationFormat | None, loaded: LoadedTokenizer) -> str:
    """How the documents are read, for the cache key: the text field, or a fine-tuning format with its settings and
    the tokenizer folder's own files (its chat template renders the records)."""
    if conversations is None:
        return text_field
    return f"conversations:{conversations.key()}:{loaded.content_hash()}"


def tokenize_files(files: list[Path], out_dir: Path, val_fraction: float, tokenizer: str = "byte",
                   workers: int | None = None, *, require_both_splits: bool = True, text_field: str = "text",
                   conversations: ConversationFormat | None = None) -> dict:
    """Tokenize raw text files into train/val shards in out_dir; reuses them when the inputs are unchanged.

    The cache key is a hash of the input files' contents, the split and the tokenizer, so editing one
    document re-tokenizes and touching nothing does not. Streaming: memory is bounded by a few chunks per
    worker, not by the corpus. `workers` processes (default: one per core, fewer for a small corpus)
    tokenize chunks in parallel; the output does not depend on their number. tokens.json also lists each
    input's digest ("file_digests"), from which shards of a corpus combine their cache key. A shard of a
    larger corpus may have an empty split (require_both_splits=False): the corpus as a whole is checked.

    `conversations`: a fine-tuning corpus (trainer.data.conversations): each split's rows of seq_len + 1 tokens in
    ``<split>.bin`` and their flags (target, run start) in ``<split>.flags``; tokens.json's "conversations" holds
    the format and each split counts its rows, targets, and the records dropped, truncated or skipped.
    """
    if not files:
        raise DataError(f"no document files ({', '.join(DOCUMENT_FORMATS)}) to tokenize for {out_dir}")
    loaded = load_tokenizer(tokenizer)
    digests = file_digests(files)
    content_hash = combined_content_hash(digests, val_fraction, loaded.tokenizer.to_str(),
                                         reading_key(text_field, conversations, loaded))

    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("content_hash") == content_hash and all(
                (out_dir / name).is_file() for s in meta["splits"].values() for name in shard_files(s) + flag_files(s)):
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
    if conversations is not None:
        meta["conversations"] = {"format": conversations.kind, "seq_len": conversations.seq_len,
                                 "loss_on": conversations.loss_on, "too_long": conversations.too_long,
                                 "end_of_turn_ids": (end_of_turn_ids(chat_template(tokenizer), loaded)
                                                     if _templated(conversations, loaded) else [])}
    streams = ("bin",) if conversations is None else ("bin", "flags")
    counts: dict[str, collections.Counter] = {split: collections.Counter(tokens=0, documents=0)
                                              for split in ("train", "val")}
    temporary = {(split, stream): out_dir / f"{split}.{stream}.tmp" for split in counts for stream in streams}
    parts = out_dir / ".parts"  # the workers' outputs, each appended in order, then deleted
    columns = None if conversations is None else conversations.fields
    try:
        with contextlib.ExitStack() as stack:
            handles = {key: stack.enter_context(path.open("wb")) for key, path in temporary.items()}
            bar = stack.enter_context(tqdm(desc="tokenize", unit="B", unit_scale=True, disable=not sys.stderr.isatty()))
            for result in _tokenized(text_chunks(files, text_field, columns), tokenizer, val_fraction,
                                     np.dtype(dtype).name, text_field, conversations, workers, parts):
                for split, produced in result.items():
                    for stream, data in produced["streams"].items():
                        if isinstance(data, Path):  # a worker's part file
                            with data.open("rb") as part:
                                shutil.copyfileobj(part, handles[split, stream], 8 << 20)
                            data.unlink()
                        else:
                            handles[split, stream].write(data)
                    counts[split].update(produced["counts"])
                    bar.update(produced["counts"]["tokens"] * np.dtype(dtype).itemsize)
        for split, count in counts.items():
            if require_both_splits and not count["documents"]:
                raise DataError(f"the {split} split is empty: add documents or change data.val_fraction")
    except BaseException:
        for path in temporary.values():
            path.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(parts, ignore_errors=True)
    for (split, stream), path in temporary.items():
        target = out_dir / f"{split}.{stream}"
        path.replace(target)
        meta["splits"].setdefault(split, {})["file" if stream == "bin" else "flags_file"] = target.name
    for split, count in counts.items():
        meta["splits"][split].update(count)
    write_json(meta_path, meta)  # written last: its presence means the shards are complete
    log.info("tokenized %d train / %d val documents into %s (%d worker(s))", counts["train"]["documents"],
             counts["val"]["documents"], out_dir, workers)
    if conversations is not None:
        skipped = {key: sum(count[key] for count in counts.values()) for key in ("dropped", "truncated", "bad_records")}
        if any(skipped.values()):
            log.warning("%s: %d conversation(s) longer than training.seq_len + 1 = %d dropped, %d truncated "
                        "(data.too_long), %d bad record(s) skipped (data.bad_records)", out_dir, skipped["dropped"],
                        conversations.seq_len + 1, skipped["truncated"], skipped["bad_records"])
    return meta


def flag_files(split: dict) -> list[str]:
    """A fine-tuning split's flags files, in the order of its token files (none for text)."""
    return list(split["flags_files"]) if "flags_files" in split else ([split["flags_file"]] if "flags_file" in split
                                                                       else [])


def shard_files(split: dict) -> list[str]:
    """A split's token files in order (tokens.json: "file", or "files" for a split written as several shards,
    whose concatenation is the split)."""
    return list(split["files"]) if "files" in split else [split["file"]]


def load_meta(data_dir: Path) -> dict:
    meta_path = Path(data_dir) / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{meta_path} not found: stage the dataset first (the stage step writes it)")
    return json.loads(meta_path.read_text())
