"""Data phases: which corpora a run drew from over its sample stream, so that a continuation whose mixture changed
either stops, naming the change, or goes on in a new phase without re-ordering anything it already drew.

    phases = [DataPhase.from_record(r) for r in history.data_phases]
    change = describe_change(phases[-1], corpora)      # [] while the mixture is the one the run trained
    phase = next_phase(phases[-1], corpora, start=next_sample, step=step, drawn=batches.drawn_by_identity(next_sample))

A phase begins at a global sample index; the k-th sample of the stream belongs to the newest phase begun at or
before k, and is the (k - start)-th sample of that phase's mixture (trainer.data.samples: its corpora listed by
name, each by its weight). A corpus the phase shares with an earlier one (the same name and content hash) goes on
with its own windows where it left off (its ``offset``: what the earlier phases drew from it), through the same
permutations, so no window is drawn twice in an epoch across the boundary; a re-staged corpus (another content
hash) is a new corpus. The records are control records (``data_phase``, trainer.run.history): every later start,
whatever it resumes from, orders the stream alike, and a rollback across a boundary trains the old phase's samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from trainer.config.rules import InputError

# How phase 0 keys its corpora: by name (and content), or by position (a run begun before data phases). Every
# checkpoint holds its run's (data.order: an index into ORDERS); one without it is of a release before phases.
ORDERS = ("name", "position")


class MixtureChanged(InputError):
    """A continuation's corpora differ from what the run drew so far, and data.on_mixture_change=refuse."""


@dataclass(frozen=True)
class PhaseCorpus:
    """One corpus of a phase's mixture."""

    name: str
    content_hash: str
    weight: float
    offset: int = 0  # samples the earlier phases drew from this corpus: its windows go on from there

    @property
    def identity(self) -> str:
        return f"{self.name}:{self.content_hash}"


@dataclass(frozen=True)
class DataPhase:
    """The stream's samples from `start` on, until the next phase: this mixture (corpora in mixing order)."""

    phase: int
    start: int  # global sample index of its first sample
    corpora: tuple[PhaseCorpus, ...]
    order: str = "name"
    step: int = 0  # the optimizer step it began at (the run's resume step)
    drawn_before: dict[str, int] = field(default_factory=dict)  # every corpus's draws before it, by identity

    def to_record(self) -> dict[str, Any]:
        return {"phase": self.phase, "start": self.start, "step": self.step, "order": self.order,
                "corpora": [{"name": c.name, "content_hash": c.content_hash, "weight": c.weight, "offset": c.offset}
                            for c in self.corpora], "drawn_before": dict(self.drawn_before)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "DataPhase":
        return cls(phase=record["phase"], start=record["start"], step=record.get("step", 0),
                   order=record.get("order", "name"), drawn_before=dict(record.get("drawn_before") or {}),
                   corpora=tuple(PhaseCorpus(c["name"], c["content_hash"], float(c["weight"]), int(c.get("offset", 0)))
                                 for c in record["corpora"]))


def first_phase(corpora: Iterable[tuple[str, str, float]], order: str = "name") -> DataPhase:
    """Phase 0 of a run from (name, content hash, weight) of each corpus: by name, or (a run begun before data
    phases) in the order given."""
    assert order in ORDERS, order
    listed = [PhaseCorpus(name, content_hash, float(weight)) for name, content_hash, weight in corpora]
    return DataPhase(0, 0, tuple(sorted(listed, key=lambda c: c.name) if order == "name" else listed), order)


def describe_change(phase: DataPhase, corpora: Iterable[tuple[str, str, float]]) -> list[str]:
    """What differs between a phase's mixture and these corpora, each difference in words; [] for none."""
    old = {c.name: c for c in phase.corpora}
    new = {name: (content_hash, float(weight)) for name, content_hash, weight in corpora}
    changes = [f"{name} removed" for name in sorted(old) if name not in new]
    for name, (content_hash, weight) in sorted(new.items()):
        before = old.get(name)
        if before is None:
            changes.append(f"{name} added (weight {weight:g})")
            continue
        if before.content_hash != content_hash:
            changes.append(f"{name} content changed (its tokens' hash {before.content_hash[:12]} -> "
                           f"{content_hash[:12]}: staged again)")
        if before.weight != weight:
            changes.append(f"{name} weight {before.weight:g} -> {weight:g}")
    return changes


def next_phase(newest: DataPhase, corpora: Iterable[tuple[str, str, float]], *, start: int, step: int,
               drawn: dict[str, int]) -> DataPhase:
    """The phase that begins at sample `start` (step `step`) with these corpora; drawn: each corpus identity's
    samples drawn before `start`, over every phase (TokenBatches.drawn_by_identity)."""
    listed = [PhaseCorpus(name, content_hash, float(weight), drawn.get(f"{name}:{content_hash}", 0))
              for name, content_hash, weight in corpora]
    return DataPhase(newest.phase + 1, start, tuple(sorted(listed, key=lambda c: c.name)), "name", step, dict(drawn))
