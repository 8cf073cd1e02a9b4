"""Deterministic per-rank batches from the token shards (trainer.data.shards writes them).

A batch is a function of (seed, step, micro-step, rank) only, so resuming at step k needs no saved
iterator state and replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from trainer.data.shards import META_FILE, DataError, load_meta, shard_files


class _Concatenated:
    """Several token shards read as one array (slices only): the same windows as their concatenation in a file."""

    def __init__(self, parts: list[np.ndarray]):
        self._parts = parts
        self._starts = np.cumsum([0] + [len(p) for p in parts])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(len(self))
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            offset = start - int(self._starts[first])
            take = min(stop - start, len(self._parts[first]) - offset)
            pieces.append(self._parts[first][offset:offset + take])
            start += take
            first += 1
        return np.concatenate(pieces) if len(pieces) != 1 else pieces[0]



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
        paths = [Path(data_dir) / name for name in shard_files(meta["splits"][split])]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise DataError(f"{Path(data_dir) / META_FILE} lists {', '.join(missing)}, which does not exist: "
                            "stage the dataset again")
        parts = [np.memmap(p, dtype=np.dtype(meta["dtype"]), mode="r") for p in paths if p.stat().st_size]
        tokens = parts[0] if len(parts) == 1 else _Concatenated(parts)  # (none: fewer tokens than a window)
        path = paths[0] if len(paths) == 1 else f"{paths[0].parent}/{'+'.join(p.name for p in paths)}"
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
