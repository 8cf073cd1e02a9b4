"""The order of the training samples: a function of (seed, global index) alone — epochs without replacement,
corpora mixed by weight, a rank's batch a slice of its step's indices whatever the world size."""

import json

import numpy as np
import pytest

from trainer.data.batches import TokenBatches, rank_samples, skipped_ranges
from trainer.data.samples import Mixture, epoch_key, permute
from trainer.data.shards import tokenize_files


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097, 100_003])
def test_permute_is_a_bijection_of_the_range(n):
    out = permute(np.arange(n), n, key=12345)
    assert sorted(out.tolist()) == list(range(n))


def test_permute_depends_on_the_key_and_nothing_else():
    n = 10_000
    a = permute(np.arange(n), n, epoch_key(1, 0, 0))
    assert np.array_equal(a, permute(np.arange(n), n, epoch_key(1, 0, 0)))
    assert np.array_equal(a[123:456], permute(np.arange(123, 456), n, epoch_key(1, 0, 0)))  # index by index
    for other in (epoch_key(2, 0, 0), epoch_key(1, 1, 0), epoch_key(1, 0, 1)):
        assert not np.array_equal(a, permute(np.arange(n), n, other))
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05  # shuffled, not a rotation


@pytest.mark.parametrize("weights", [[1.0], [3.0, 1.0], [0.7, 0.2, 0.1], [1.0, 1e-4]])
def test_the_mixture_holds_every_prefix_to_its_weights(weights):
    mixture = Mixture(weights)
    shares = np.asarray(weights) / sum(weights)
    for consumed in (1, 10, 999, 4096, 12_345, 3 * mixture.block + 17):
        drawn = mixture.drawn(consumed)
        assert sum(drawn) == consumed
        assert all(abs(d - s * consumed) <= 1 + consumed / mixture.block for d, s in zip(drawn, shares))
    corpora, ranks = mixture.locate(np.arange(5 * mixture.block))
    for corpus in range(len(weights)):  # each corpus's samples are numbered 0, 1, 2, ... in stream order
        assert ranks[corpora == corpus].tolist() == list(range(int((corpora == corpus).sum())))


def _token_dir(tmp_path, name, documents):
    raw = tmp_path / f"{name}-raw"
    raw.mkdir()
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    tokenize_files([raw / "a.jsonl"], tmp_path / name, 0.1)
    return tmp_path / name


@pytest.fixture
def mixed(tmp_path):
    _token_dir(tmp_path, "web", [f"web page {i} " * 3 for i in range(400)])
    _token_dir(tmp_path, "code", [f"def f{i}(): return {i}" for i in range(200)])
    mixture = tmp_path / "mix"
    mixture.mkdir()
    (mixture / "tokens.json").write_text(json.dumps({"mixture": [{"name": "web", "dir": "../web", "weight": 3},
                                                                 {"name": "code", "dir": "../code", "weight": 1}]}))
    return TokenBatches.open(mixture, "train", seq_len=16, batch_size=4, seed=7)


def test_an_epoch_covers_every_window_of_a_corpus_once_then_starts_a_new_order(mixed):
    samples = np.arange(3 * sum(c.windows for c in mixed.corpora) * 4)
    corpora, windows = mixed.windows_of(samples)
    for index, corpus in enumerate(mixed.corpora):
        mine = windows[corpora == index]
        n = corpus.windows
        first, second = mine[:n], mine[n:2 * n]
        assert sorted(first.tolist()) == list(range(n)) and sorted(second.tolist()) == list(range(n))
        assert not np.array_equal(first, second)
    drawn = mixed.drawn(len(samples))
    assert drawn["web"] == 3 * drawn["code"]
    assert mixed.epochs(len(samples))["code"] == pytest.approx(drawn["code"] / mixed.corpora[1].windows)


def test_a_step_is_the_same_samples_at_any_world_size(mixed):
    """4 ranks x batch 4 or 2 ranks x batch 4 x 2 micro-steps or 1 rank x batch 8 x 2: the same 16 global indices,
    hence the same windows."""
    def step(first, ranks, batch, micro_steps):
        return sorted(i for m in range(micro_steps) for r in range(ranks) for i in rank_samples(first, m, r, ranks, batch))

    assert step(32, 4, 4, 1) == step(32, 2, 4, 2) == step(32, 1, 8, 2) == list(range(32, 48))
    a = np.concatenate([mixed.batch(32, 0, r, 4)[0] for r in range(4)])
    b = np.concatenate([mixed.batch(32, m, r, 2)[0] for m in range(2) for r in range(2)])
    assert np.array_equal(a, b)


def test_windows_are_seq_len_plus_one_tokens_every_seq_len(mixed):
    corpus = mixed.corpora[0]
    inputs, labels = mixed.samples(np.arange(8))
    assert inputs.shape == labels.shape == (8, 16)
    assert np.array_equal(inputs[:, 1:], labels[:, :-1])
    assert np.array_equal(corpus.window(1)[0], corpus.window(0)[-1])  # windows overlap by the one target token
    assert corpus.windows == (len(corpus.tokens) - 1) // 16


def test_the_skipped_ranges_are_exactly_the_missing_groups_rank_samples():
    """2 groups x 2 ranks x batch 4, 2 micro-steps: group 1's ranks are global ranks 2 and 3."""
    ranges = skipped_ranges(64, [1], groups=2, group_slice=2 * 4, micro_steps=2)
    group_1 = sorted(i for m in range(2) for r in (2, 3) for i in rank_samples(64, m, r, 4, 4))
    assert ranges == [[72, 80], [88, 96]]
    assert [i for start, end in ranges for i in range(start, end)] == group_1
    assert skipped_ranges(64, [], groups=2, group_slice=8, micro_steps=2) == []
