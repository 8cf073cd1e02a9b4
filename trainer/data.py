"""Token data: tokenization into shards on disk, and deterministic per-rank batches.

Shards are flat arrays of token ids (``train.bin`` / ``val.bin``, uint16, or uint32 for vocabularies
above 65,536) described by ``tokens.json``.
A batch is a function of (seed, step, micro-step, rank) only, so resuming at step k needs no saved
iterator state and replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
from tqdm import tqdm

from trainer.run_dir import write_json
from trainer.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
META_FILE = "tokens.json"


class DataError(RuntimeError):
    """Token data missing, malformed or too small for the requested batches."""


def is_held_out(document: str, val_fraction: float) -> bool:
    """Deterministic split by content: the same document always lands on the same side."""
    digest = hashlib.sha256(document.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def read_documents(files: list[Path]) -> Iterable[str]:
    """Documents from .txt (blank-line separated), .jsonl (a "text" field per line) and .parquet (a "text"
    column) files."""
    for path in sorted(files):
        if path.suffix == ".parquet":
            # pyarrow only here: only the stage step reads .parquet, and the trainer image does not have it
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            if "text" not in parquet.schema_arrow.names:
                raise DataError(f"{path}: expected a 'text' column, found {parquet.schema_arrow.names}")
            for batch in parquet.iter_batches(columns=["text"]):
                yield from (text for text in batch.column(0).to_pylist() if text)
        elif path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as handle:
                for line_number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError) as err:
                        raise DataError(f"{path}:{line_number}: expected a JSON object with a 'text' field") from err
                    yield text
        elif path.suffix == ".txt":
            for block in path.read_text(encoding="utf-8").split("\n\n"):
                if block.strip():
                    yield block.strip()


def tokenize_files(files: list[Path], out_dir: Path, val_fraction: float, tokenizer: str = "byte") -> dict:
    """Tokenize raw text files into train/val shards in out_dir; reuses them when the inputs are unchanged.

    The cache key is a hash of the input files' contents, the split and the tokenizer, so editing one
    document re-tokenizes and touching nothing does not.
    """
    if not files:
        raise DataError(f"no .txt, .jsonl or .parquet files to tokenize for {out_dir}")
    loaded = load_tokenizer(tokenizer)
    hasher = hashlib.sha256(f"v{SHARD_FORMAT_VERSION}:{val_fraction}".encode())
    hasher.update(loaded.tokenizer.to_str().encode())
    for path in sorted(files):
        hasher.update(path.name.encode())
        hasher.update(hashlib.sha256(path.read_bytes()).digest())
    content_hash = hasher.hexdigest()

    meta_path = out_dir / META_FILE
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("content_hash") == content_hash and all((out_dir / s["file"]).is_file()
                                                            for s in meta["splits"].values()):
            log.info("token shards in %s are up to date (content hash %s)", out_dir, content_hash[:12])
            return meta

    texts: dict[str, list[str]] = {"train": [], "val": []}
    for document in read_documents(files):
        texts["val" if is_held_out(document, val_fraction) else "train"].append(document)
    for split, docs in texts.items():
        if not docs:
            raise DataError(f"the {split} split is empty: add documents or change data.val_fraction")

    dtype = np.uint16 if loaded.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"format_version": SHARD_FORMAT_VERSION, "tokenizer": loaded.name, "vocab_size": loaded.vocab_size,
            "dtype": np.dtype(dtype).name, "content_hash": content_hash, "val_fraction": val_fraction, "splits": {}}
    for split, docs in texts.items():
        target = out_dir / f"{split}.bin"
        tmp = target.with_suffix(".bin.tmp")
        count = 0
        # encode_batch runs on all cores (the tokenizers library's Rust thread pool); the bar shows on a terminal.
        with tmp.open("wb") as handle, tqdm(total=len(docs), desc=f"tokenize {split}", unit="doc",
                                            disable=not sys.stderr.isatty()) as bar:
            for start in range(0, len(docs), 4096):  # bounded memory for large corpora
                batch = docs[start : start + 4096]
                for ids in loaded.encode_documents(batch):
                    np.asarray(ids, dtype=dtype).tofile(handle)
                    count += len(ids)
                bar.update(len(batch))
        tmp.replace(target)
        meta["splits"][split] = {"file": target.name, "tokens": count, "documents": len(docs)}
    write_json(meta_path, meta)  # written last: its presence means the shards are complete
    log.info("tokenized %d train / %d val documents into %s", len(texts["train"]), len(texts["val"]), out_dir)
    return meta


def load_meta(data_dir: Path) -> dict:
    meta_path = Path(data_dir) / META_FILE
    if not meta_path.is_file():
        raise DataError(f"{meta_path} not found: stage the dataset first (the stage step writes it)")
    return json.loads(meta_path.read_text())


@dataclass
class TokenBatches:
    """Random fixed-length windows from one split, chosen by (seed, step, micro_step, rank)."""

    tokens: np.ndarray
    seq_len: int
    batch_size: int
    seed: int

    @classmethod
    def open(cls, data_dir: Path, split: str, seq_len: int, batch_size: int, seed: int) -> "TokenBatches":
        meta = load_meta(data_dir)
        if split not in meta["splits"]:
            raise DataError(f"{data_dir}: no {split!r} split in {META_FILE}")
        path = Path(data_dir) / meta["splits"][split]["file"]
        tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        if len(tokens) < seq_len + 2:
            raise DataError(f"{path} holds {len(tokens)} tokens, fewer than training.seq_len + 2 = {seq_len + 2}")
        return cls(tokens=tokens, seq_len=seq_len, batch_size=batch_size, seed=seed)

    def batch(self, step: int, micro_step: int, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of shape [batch_size, seq_len] as int64."""
        rng = np.random.default_rng([self.seed, step, micro_step, rank])
        starts = rng.integers(0, len(self.tokens) - self.seq_len - 1, size=self.batch_size)
        windows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        return windows[:, :-1], windows[:, 1:]

    def sequential(self, max_batches: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        """Non-overlapping windows from the start, for evaluation (same batches every time)."""
        span = self.seq_len + 1
        count = min(max_batches * self.batch_size, len(self.tokens) // span)
        for first in range(0, count, self.batch_size):
            rows = range(first, min(first + self.batch_size, count))
            windows = np.stack([np.asarray(self.tokens[r * span : (r + 1) * span], dtype=np.int64) for r in rows])
            yield windows[:, :-1], windows[:, 1:]
