"""The order of the training samples: the k-th global sample as a function of (seed, k) alone.

    mixture = Mixture([3.0, 1.0])                  # corpora mixed 3:1 (in the order of their names)
    corpus, index = mixture.locate(k)              # sample k is the index-th sample drawn from that corpus
    key = corpus_key(name, content_hash)           # what the corpus is, not where data.datasets lists it
    window = permute(index % n, n, epoch_key(seed, key, index // n))    # n windows: epoch after epoch

- **Mixing** is a fixed pattern of BLOCK positions, each naming a corpus, repeated: the greedy largest-deficit
  interleave (as Megatron-LM's blended datasets build theirs), so every prefix of the stream holds each corpus in
  its share to within one sample per block. A sample's corpus and its rank among that corpus's samples are two
  table look-ups, whatever k is.
- **Epochs**: a corpus of n windows hands them out as a permutation of [0, n), a new one each epoch, none
  repeated inside one. The permutation is a keyed Feistel network over the next even power of two, walked back
  into range (cycle walking): O(1) per index and no table, so a corpus of 10⁹ windows costs no memory.

Nothing here depends on the world size, the rank or the replica groups: those only choose which global indices
a rank trains at a step (trainer.data.batches). Nor on where a corpus stands in data.datasets: its permutations
are keyed by its name and content hash, and a mixture's pattern lists the corpora by name. A run whose data
changes goes on in a new data phase (trainer.data.phases), never by re-ordering what it already drew.
"""

from __future__ import annotations

import hashlib

import numpy as np

BLOCK = 4096  # positions of the mixing pattern (more when a corpus's share would give it fewer than 16)
_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def corpus_key(name: str, content_hash: str) -> int:
    """A corpus's identity as a 64-bit permutation key: its name and its tokens' content hash (tokens.json)."""
    return int.from_bytes(hashlib.sha256(f"{name}\0{content_hash}".encode()).digest()[:8], "little")


def epoch_key(seed: int, corpus: int, epoch: int) -> int:
    """The permutation key of one corpus's epoch; corpus: its corpus_key (or, in a run of a release before it, its
    position in the mixture)."""
    with np.errstate(over="ignore"):
        key = _mix(np.array([seed], dtype=np.uint64) * _GOLDEN + np.uint64(corpus))
        return int(_mix(key ^ np.uint64(epoch) * _GOLDEN)[0])


def permute(indices: np.ndarray, n: int, key: int) -> np.ndarray:
    """A bijection of [0, n) chosen by `key`, applied to `indices` (each in [0, n))."""
    indices = np.asarray(indices, dtype=np.uint64)
    if n <= 1:
        return indices.astype(np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits & 1
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    with np.errstate(over="ignore"):
        keys = _mix(np.uint64(key) + np.arange(1, _ROUNDS + 1, dtype=np.uint64) * _GOLDEN)

        def network(x: np.ndarray) -> np.ndarray:
            left, right = x >> half, x & mask
            for round_key in keys:
                left, right = right, left ^ (_mix(right ^ round_key) & mask)
            return (left << half) | right

        out = network(indices)
        outside = out >= np.uint64(n)
        while outside.any():  # cycle walking: a permutation of the larger range, followed back into [0, n)
            out[outside] = network(out[outside])
            outside = out >= np.uint64(n)
    return out.astype(np.int64)


class Mixture:
    """Corpora interleaved by weight: which corpus the k-th sample comes from, and its rank there."""

    def __init__(self, weights: list[float]):
        assert weights and all(w > 0 for w in weights), weights
        shares = np.asarray(weights, dtype=np.float64) / sum(weights)
        self.block = BLOCK
        while self.block * shares.min() < 16:
            self.block *= 2
        pattern = np.empty(self.block, dtype=np.int32)
        drawn = np.zeros(len(shares), dtype=np.int64)
        for position in range(self.block):
            corpus = int(np.argmax(shares * (position + 1) - drawn))  # the largest deficit; ties: the first
            pattern[position] = corpus
            drawn[corpus] += 1
        self.pattern = pattern
        self.per_block = drawn
        # before[d, p]: samples of corpus d at positions < p of a block
        self.before = np.zeros((len(shares), self.block + 1), dtype=np.int64)
        for corpus in range(len(shares)):
            self.before[corpus, 1:] = np.cumsum(pattern == corpus)
        self.rank_in_corpus = self.before[pattern, np.arange(self.block)]

    def locate(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, rank among that corpus's samples) of each global sample index."""
        samples = np.asarray(samples, dtype=np.int64)
        blocks, positions = np.divmod(samples, self.block)
        corpora = self.pattern[positions]
        return corpora, blocks * self.per_block[corpora] + self.rank_in_corpus[positions]

    def drawn(self, consumed: int) -> list[int]:
        """Samples taken from each corpus by the first `consumed` of the stream."""
        blocks, rest = divmod(int(consumed), self.block)
        return [int(blocks * self.per_block[d] + self.before[d, rest]) for d in range(len(self.per_block))]
