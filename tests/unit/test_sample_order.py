"""The order of the training samples: a function of (seed, global index) alone — epochs without replacement,
corpora mixed by weight, a rank's batch a slice of its step's indices whatever the world size."""

import json

import numpy as np
import pytest

from trainer.data.batches import TokenBatches, rank_samples, skipped_ranges
from trainer.data.phases import MixtureChanged
from trainer.data.samples import Mixture, epoch_key, permute
from trainer.data.shards import DataError, tokenize_files


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


# -- what a corpus is, not where it stands; a changed mixture on a continuation (trainer.data.phases) ----------------

def _mixture(tmp_path, name, parts, seed=7):
    """A mixture folder beside the corpora `parts` names ([(corpus, weight)], in data.datasets' order)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "tokens.json").write_text(json.dumps({"mixture": [{"name": corpus, "dir": f"../{corpus}", "weight": weight}
                                                                for corpus, weight in parts]}))
    return TokenBatches.open(folder, "train", seq_len=16, batch_size=4, seed=seed)


def _named_windows(batches, samples):
    corpora, windows = batches.windows_of(samples)
    return [(batches.corpora[c].name, int(w)) for c, w in zip(corpora, windows)]


@pytest.fixture
def corpora(tmp_path):
    _token_dir(tmp_path, "web", [f"web page {i} " * 3 for i in range(400)])
    _token_dir(tmp_path, "code", [f"def f{i}(): return {i}" for i in range(200)])
    _token_dir(tmp_path, "books", [f"chapter {i}. " * 5 for i in range(150)])
    return tmp_path


def test_a_corpus_keeps_its_sample_order_wherever_data_datasets_lists_it(corpora):
    listed = _mixture(corpora, "a", [("web", 3), ("code", 1)])
    reordered = _mixture(corpora, "b", [("code", 1), ("web", 3)])
    samples = np.arange(2000)
    assert _named_windows(listed, samples) == _named_windows(reordered, samples)
    assert listed.drawn(2000) == reordered.drawn(2000)


def test_a_changed_mixture_is_refused_on_a_continuation_naming_each_change(corpora):
    first = _mixture(corpora, "a", [("web", 3), ("code", 1)])
    [phase0] = [first.continue_phases([], position=0, step=0, on_change="refuse")]
    assert [c.name for c in phase0.corpora] == ["code", "web"] and phase0.start == 0
    changed = _mixture(corpora, "b", [("web", 3), ("code", 2), ("books", 1)])
    with pytest.raises(MixtureChanged, match=r"data.datasets: the corpora differ from those this run drew its first 400 "
                                             r"samples from \(data phase 0\): books added \(weight 1\); code weight 1 -> 2\."
                                             r".*--data.on_mixture_change=new_phase"):
        changed.continue_phases([phase0], position=400, step=50, on_change="refuse")
    same = _mixture(corpora, "c", [("code", 1), ("web", 3)])  # listed in another order: the same mixture
    assert same.continue_phases([phase0], position=400, step=50, on_change="refuse") is None


def test_a_new_data_phase_keeps_every_sample_drawn_and_each_kept_corpus_goes_on_where_it_left_off(corpora):
    """web 3 : code 1 for 400 samples, then web 1 : code 1 : books 1 (books added, web and code re-weighted)."""
    before = _mixture(corpora, "a", [("web", 3), ("code", 1)])
    phase0 = before.continue_phases([], position=0, step=0, on_change="refuse")
    after = _mixture(corpora, "b", [("web", 1), ("code", 1), ("books", 1)])
    phase1 = after.continue_phases([phase0], position=400, step=50, on_change="new_phase")
    assert (phase1.phase, phase1.start, phase1.step) == (1, 400, 50)
    assert {c.name: c.offset for c in phase1.corpora} == {"books": 0, "code": 100, "web": 300}
    assert phase1.drawn_before == before.drawn_by_identity(400)

    # a restart after it (the same mixture, listed in any order) takes up both phases, and nothing new
    restarted = _mixture(corpora, "c", [("books", 1), ("code", 1), ("web", 1)])
    assert restarted.continue_phases([phase0, phase1], position=420, step=52,
                                     on_change="refuse") is None
    # the 400 samples drawn before the boundary are what phase 0 drew (a rollback across it trains them again)
    assert _named_windows(restarted, np.arange(400)) == _named_windows(before, np.arange(400))
    after_boundary = _named_windows(restarted, np.arange(400, 1000))
    assert {name for name, _ in after_boundary} == {"web", "code", "books"}
    for name, drawn_before in (("web", 300), ("code", 100)):
        earlier = [w for n, w in _named_windows(before, np.arange(400)) if n == name]
        later = [w for n, w in after_boundary if n == name]
        assert len(earlier) == drawn_before and len(later) == 200
        windows = restarted.corpora[[c.name for c in restarted.corpora].index(name)].windows
        if drawn_before + 200 <= windows:  # within one epoch: no window drawn twice across the boundary
            assert len(set(earlier) | set(later)) == drawn_before + 200
    assert restarted.drawn(1000) == {"books": 200, "code": 300, "web": 500}


def test_a_rollback_into_a_phase_whose_corpus_was_removed_names_it(corpora):
    before = _mixture(corpora, "a", [("web", 3), ("code", 1)])
    phase0 = before.continue_phases([], position=0, step=0, on_change="refuse")
    after = _mixture(corpora, "b", [("web", 1), ("books", 1)])
    phase1 = after.continue_phases([phase0], position=400, step=50, on_change="new_phase")
    assert {c.name: c.offset for c in phase1.corpora} == {"books": 0, "web": 300}
    assert after.drawn(600) == {"books": 100, "web": 400}
    with pytest.raises(DataError, match=r"samples of data phase 0 \(from sample 0\) come from code:[0-9a-f]+, which "
                                        r"the data folder no longer holds: stage it again"):
        after.windows_of(np.arange(390, 410))


def test_a_run_begun_before_data_phases_resumes_in_the_order_it_trained_in(corpora):
    """Its corpora keyed by position in data.datasets (the release before): a resume of its checkpoint (no
    data.order in it: Trainer.load_state_dict gives "position") with no data_phase record takes up that order, so
    the samples it drew are not re-ordered under it."""
    batches = _mixture(corpora, "a", [("web", 3), ("code", 1)])
    phase0 = batches.continue_phases([], position=200, step=25, first_order="position", on_change="refuse")
    assert phase0.order == "position" and [c.name for c in phase0.corpora] == ["web", "code"]
    corpora_, windows = batches.windows_of(np.arange(3000))
    for index, corpus in enumerate(batches.corpora):  # the release before: epoch_key(seed, position, epoch)
        drawn = np.arange(int((corpora_ == index).sum()))
        epochs, positions = np.divmod(drawn, corpus.windows)
        expected = [int(permute(np.array([p]), corpus.windows, epoch_key(7, index, int(e)))[0])
                    for e, p in zip(epochs, positions)]
        assert windows[corpora_ == index].tolist() == expected
