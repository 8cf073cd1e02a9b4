"""A split of the token data as windows, and the batches ranks train on (trainer.data.shards writes the shards).

    batches = TokenBatches.open(data_dir, "train", seq_len=..., batch_size=..., seed=...)
    inputs, labels = batches.batch(first_sample, micro_step, rank, ranks)

Each corpus's split is one token stream (documents framed BOS ... EOS, one after another), cut into windows of
seq_len + 1 tokens every seq_len tokens, so every token but the first is a target once per epoch and no window
crosses from one split into the other (the splits are separate streams). The k-th global sample is a window chosen
by (seed, k) alone (trainer.data.samples: the corpora interleaved by weight, each corpus's windows a new
permutation every epoch, keyed by its name and content hash), in the data phase k belongs to (trainer.data.phases:
a run whose mixture changed goes on in a new one). A step trains the global samples [first_sample, first_sample +
global batch): micro-step m, rank r of R takes its batch_size samples from the m-th R x batch_size of them. The trainer keeps first_sample
in its checkpoints, so a resume at another world size, or with fewer replica groups, goes on with the next sample.

A data folder holds one corpus's tokens.json, or a mixture's (``"mixture"``: each corpus's folder and weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from trainer.data.conversations import labels_and_positions, positions_from_starts
from trainer.data.phases import DataPhase, MixtureChanged, describe_change, first_phase, next_phase
from trainer.data.samples import Mixture, corpus_key, epoch_key, permute
from trainer.data.shards import META_FILE, DataError, flag_files, load_meta, shard_files

IGNORE = -100  # trainer.model.loss.IGNORE (not imported: the data side imports no torch)


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
class Corpus:
    """One corpus's split as windows: window i is tokens [i * seq_len, i * seq_len + seq_len + 1); a fine-tuning
    corpus's (flags: each token's TARGET and START, trainer.data.conversations) as its packed rows of seq_len + 1."""

    name: str
    tokens: np.ndarray
    seq_len: int
    weight: float
    content_hash: str = ""  # its tokens.json's: with the name, what the corpus is
    flags: np.ndarray | None = None

    @property
    def identity(self) -> str:
        return f"{self.name}:{self.content_hash}"

    @property
    def stride(self) -> int:
        return self.seq_len if self.flags is None else self.seq_len + 1

    @property
    def windows(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len if self.flags is None else len(self.tokens) // self.stride

    def window(self, index: int) -> np.ndarray:
        start = int(index) * self.stride
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def window_flags(self, index: int) -> np.ndarray:
        start = int(index) * self.stride
        return np.asarray(self.flags[start:start + self.seq_len + 1])


def _open_corpus(data_dir: Path, split: str, seq_len: int, name: str, weight: float) -> Corpus:
    meta = load_meta(data_dir)
    if split not in meta["splits"]:
        raise DataError(f"{data_dir}: no {split!r} split in {META_FILE}")
    paths = [Path(data_dir) / file for file in shard_files(meta["splits"][split])]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"{Path(data_dir) / META_FILE} lists {', '.join(missing)}, which does not exist: "
                        "stage the dataset again")
    parts = [np.memmap(p, dtype=np.dtype(meta["dtype"]), mode="r") for p in paths if p.stat().st_size]
    tokens = parts[0] if len(parts) == 1 else _Concatenated(parts)  # (none: fewer tokens than a window)
    where = paths[0] if len(paths) == 1 else f"{paths[0].parent}/{'+'.join(p.name for p in paths)}"
    flags = None
    if "conversations" in meta:
        packed = meta["conversations"]["seq_len"]
        if packed != seq_len:
            raise DataError(f"{Path(data_dir) / META_FILE}: the fine-tuning records were packed into rows of "
                            f"training.seq_len = {packed} + 1 tokens, this run's training.seq_len is {seq_len}: stage "
                            "the data again with this seq_len (the pipeline's stage step does)")
        flag_paths = [Path(data_dir) / file for file in flag_files(meta["splits"][split])]
        flag_parts = [np.memmap(p, dtype=np.uint8, mode="r") for p in flag_paths if p.stat().st_size]
        flags = flag_parts[0] if len(flag_parts) == 1 else _Concatenated(flag_parts)
        if not parts or len(tokens) < seq_len + 1:
            raise DataError(f"{where} holds no row of training.seq_len + 1 = {seq_len + 1} tokens: no record of the "
                            f"{split} split fits (data.too_long, tokens.json's counts)")
        return Corpus(name, tokens, seq_len, weight, meta.get("content_hash", ""), flags)
    if len(tokens) < seq_len + 2:
        raise DataError(f"{where} holds {len(tokens)} tokens, fewer than training.seq_len + 2 = {seq_len + 2}")
    return Corpus(name, tokens, seq_len, weight, meta.get("content_hash", ""))


def open_corpora(data_dir: Path, split: str, seq_len: int) -> list[Corpus]:
    """The corpora of a data folder: its own shards, or each corpus a mixture's tokens.json names."""
    data_dir = Path(data_dir)
    meta = load_meta(data_dir)
    if "mixture" not in meta:
        return [_open_corpus(data_dir, split, seq_len, data_dir.name, 1.0)]
    return [_open_corpus(data_dir / part["dir"], split, seq_len, part["name"], float(part["weight"]))
            for part in meta["mixture"]]


class _PhasePlan:
    """A phase's mixture over the open corpora: which corpus each member is, where its draws go on from, and the
    keys of its permutations."""

    def __init__(self, phase: DataPhase, corpora: list[Corpus]):
        where = {corpus.identity: index for index, corpus in enumerate(corpora)}
        self.phase = phase
        self.mixture = Mixture([c.weight for c in phase.corpora])
        self.members = np.array([where.get(c.identity, -1) for c in phase.corpora], dtype=np.int64)
        self.offsets = np.array([c.offset for c in phase.corpora], dtype=np.int64)
        self.keys = [position if phase.order == "position" else corpus_key(c.name, c.content_hash)
                     for position, c in enumerate(phase.corpora)]

    def missing(self, members: np.ndarray) -> list[str]:
        return [self.phase.corpora[m].identity for m in np.unique(members) if self.members[m] < 0]


@dataclass
class TokenBatches:
    """The samples of one split, in the order of (seed, global sample index) and the run's data phases."""

    corpora: list[Corpus]
    seq_len: int
    batch_size: int
    seed: int
    phases: list[DataPhase] = field(default_factory=list)  # empty: one phase of these corpora, by name
    # the token that begins a document (BOS) where each document of a text window attends only to itself
    # (data.document_mask); fine-tuning rows always mask their records
    document_start: int | None = None

    @property
    def masks_targets(self) -> bool:
        """Whether labels may be IGNORE (fine-tuning rows): token windows of text never are, so a step's loss needs
        no count of the job's targets (trainer.job.step.forward_backward)."""
        return any(corpus.flags is not None for corpus in self.corpora)

    def __post_init__(self) -> None:
        self.current = [(c.name, c.content_hash, c.weight) for c in self.corpora]
        self.mixture = Mixture([w for _, _, w in sorted(self.current)])  # by name: sequential()'s order
        self.set_phases(self.phases or [first_phase(self.current)])

    def set_phases(self, phases: list[DataPhase]) -> None:
        self.phases = list(phases)
        self._plans = [_PhasePlan(phase, self.corpora) for phase in self.phases]
        self._starts = np.array([phase.start for phase in self.phases], dtype=np.int64)

    def continue_phases(self, recorded: list[DataPhase], *, position: int, step: int, first_order: str = "name",
                        on_change: str = "refuse") -> DataPhase | None:
        """At a start, the run's phases (its data_phase records) and the sample stream's position: take them up, and
        return the phase to record when one begins here — phase 0 when none is recorded (first_order: the order
        the resumed checkpoint trained in, its data.order: "position" for a checkpoint of a release before data
        phases, so a run begun then goes on in the order it trained in), a new phase when the corpora changed and
        on_change is new_phase. A change with on_change=refuse is a MixtureChanged naming it."""
        if not recorded:
            self.set_phases([first_phase(self.current, first_order)])
            return self.phases[0]
        self.set_phases(recorded)
        changes = describe_change(recorded[-1], self.current)
        if not changes:
            return None
        if on_change != "new_phase":
            raise MixtureChanged(
                f"data.datasets: the corpora differ from those this run drew its first {position} samples from (data "
                f"phase {recorded[-1].phase}): {'; '.join(changes)}. Continuing would re-order samples already drawn "
                "or repeat them. To go on with this mixture from here, start a new data phase with "
                "--data.on_mixture_change=new_phase (the samples drawn stay drawn; each corpus kept goes on where it "
                "left off: docs/continued-pretraining.md), or train it as a new run (another run.run_id)")
        phase = next_phase(recorded[-1], self.current, start=position, step=step,
                           drawn=self.drawn_by_identity(position))
        self.set_phases([*recorded, phase])
        return phase

    @classmethod
    def open(cls, data_dir: Path, split: str, seq_len: int, batch_size: int, seed: int) -> "TokenBatches":
        return cls(open_corpora(data_dir, split, seq_len), seq_len, batch_size, seed)

    def _located(self, samples: np.ndarray) -> list[tuple[_PhasePlan, np.ndarray, np.ndarray, np.ndarray]]:
        """Per phase the samples fall in: (its plan, which samples, each one's member of its mixture, and its rank
        among that member's draws over every phase)."""
        samples = np.asarray(samples, dtype=np.int64)
        which = np.searchsorted(self._starts, samples, side="right") - 1
        located = []
        for index in np.unique(which):
            plan, mine = self._plans[index], which == index
            members, drawn = plan.mixture.locate(samples[mine] - plan.phase.start)
            located.append((plan, mine, members, drawn + plan.offsets[members]))
        return located

    def windows_of(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(corpus, window) of each global sample index; the corpus an index into self.corpora."""
        samples = np.asarray(samples, dtype=np.int64)
        corpora, windows = np.empty_like(samples), np.empty_like(samples)
        for plan, mine, members, drawn in self._located(samples):
            missing = plan.missing(members)
            if missing:
                raise DataError(f"samples of data phase {plan.phase.phase} (from sample {plan.phase.start}) come from "
                                f"{', '.join(missing)}, which the data folder no longer holds: stage it again to "
                                "train them (a rollback or resume before that phase's end)")
            picked = np.empty_like(drawn)
            for member in np.unique(members):
                corpus = self.corpora[plan.members[member]]
                own = members == member
                epochs, positions = np.divmod(drawn[own], corpus.windows)
                chosen = np.empty_like(positions)
                for epoch in np.unique(epochs):
                    same = epochs == epoch
                    chosen[same] = permute(positions[same], corpus.windows,
                                           epoch_key(self.seed, plan.keys[member], int(epoch)))
                picked[own] = chosen
            corpora[mine], windows[mine] = plan.members[members], picked
        return corpora, windows

    def samples(self, samples: np.ndarray) -> tuple[np.ndarray, ...]:
        """(inputs, labels) of shape [len(samples), seq_len] as int64; where documents are masked (fine-tuning
        rows, data.document_mask) also their position_ids, restarting at each document."""
        corpora, windows = self.windows_of(np.asarray(samples, dtype=np.int64))
        return self._rows(corpora, windows)

    def _rows(self, corpora: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = np.stack([self.corpora[c].window(w) for c, w in zip(corpora, windows)])
        if self.masks_targets:
            flags = np.stack([self.corpora[c].window_flags(w) for c, w in zip(corpora, windows)])
            return labels_and_positions(rows, flags, IGNORE)
        if self.document_start is not None:
            return rows[:, :-1], rows[:, 1:], positions_from_starts(rows[:, :-1] == self.document_start)
        return rows[:, :-1], rows[:, 1:]

    def batch(self, first_sample: int, micro_step: int, rank: int, ranks: int) -> tuple[np.ndarray, np.ndarray]:
        """A rank's micro-batch of the step whose samples start at first_sample."""
        return self.samples(rank_samples(first_sample, micro_step, rank, ranks, self.batch_size))

    def drawn_by_identity(self, consumed: int) -> dict[str, int]:
        """Samples taken from each corpus (by identity: name and content hash), over every phase, by the first
        `consumed` samples of the stream."""
        index = int(np.searchsorted(self._starts, consumed, side="right")) - 1
        plan = self._plans[index]
        drawn = dict(plan.phase.drawn_before)
        counts = plan.mixture.drawn(consumed - plan.phase.start)
        for corpus, count in zip(plan.phase.corpora, counts):
            drawn[corpus.identity] = corpus.offset + count
        return drawn

    def drawn(self, consumed: int) -> dict[str, int]:
        """Samples taken from each corpus of the data folder by the first `consumed` samples of the stream."""
        by_identity = self.drawn_by_identity(consumed)
        return {c.name: by_identity.get(c.identity, 0) for c in self.corpora}

    def drawn_between(self, start: int, end: int) -> dict[str, int]:
        """Samples each corpus gives the stream's samples [start, end) (a skipped window, by dataset)."""
        before = self.drawn(start)
        return {name: count - before[name] for name, count in self.drawn(end).items() if count - before[name]}

    def epochs(self, consumed: int) -> dict[str, float]:
        """Each corpus's epochs (fractional) by the first `consumed` samples: 1.0 when each window was seen once."""
        drawn = self.drawn(consumed)
        return {c.name: drawn[c.name] / c.windows for c in self.corpora}

    def position(self, first_sample: int, next_sample: int) -> dict[str, float]:
        """Where a step left the stream (a metrics record's fields): its first index, the samples and tokens taken
        so far, and each corpus's samples and epochs (fractional: 1.0 when each of its windows was drawn once)."""
        epochs = self.epochs(next_sample)
        return {"first_sample": first_sample, "samples_seen": next_sample, "tokens_seen": next_sample * self.seq_len,
                "epoch": max(epochs.values()),
                **{f"samples/{name}": count for name, count in self.drawn(next_sample).items()},
                **{f"epoch/{name}": epoch for name, epoch in epochs.items()}}

    def sequential(self, max_batches: int) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        """The first windows of each corpus in mixing order (by name), unpermuted (evaluation: the same batches
        every time)."""
        by_name = sorted(range(len(self.corpora)), key=lambda index: self.corpora[index].name)
        count = max_batches * self.batch_size
        members, drawn = self.mixture.locate(np.arange(count))
        corpora = np.array(by_name, dtype=np.int64)[members]
        keep = drawn < np.array([c.windows for c in self.corpora])[corpora]  # a small corpus runs out: skipped
        corpora, drawn = corpora[keep], drawn[keep]
        for first in range(0, len(corpora), self.batch_size):
            yield self._rows(corpora[first:first + self.batch_size], drawn[first:first + self.batch_size])


def rank_samples(first_sample: int, micro_step: int, rank: int, ranks: int, batch_size: int) -> np.ndarray:
    """The global sample indices of one rank's micro-batch: the step's micro_step-th slice of ranks x batch_size,
    this rank's batch_size of it."""
    start = first_sample + (micro_step * ranks + rank) * batch_size
    return np.arange(start, start + batch_size, dtype=np.int64)


def skipped_ranges(first_sample: int, missing_groups: list[int], *, groups: int, group_slice: int,
                   micro_steps: int) -> list[list[int]]:
    """The global indices [start, end) of a step's samples that replica groups missing from it did not train: each
    missing group's slice (its ranks x batch_size) of every micro-step (rank_samples' layout)."""
    return [[start, start + group_slice] for micro in range(micro_steps) for group in missing_groups
            for start in [first_sample + (micro * groups + group) * group_slice]]
