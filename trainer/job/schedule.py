"""The learning-rate schedule: its kinds, its state in every checkpoint, and what a continuation does with it.

    schedule = Schedule.of(cfg.training)          # what the config asks for, from step 0
    lr = schedule.lr_at(step)                     # the 0-based step being trained
    schedule, decision, why = continue_schedule(saved, Schedule.of(cfg.training), resume_step, restart=False)

Kinds (training.lr_schedule), each after a linear warm-up from the phase's start:
- cosine: from lr to lr x min_lr_ratio at the horizon, then that floor;
- wsd (warm-up, stable, decay: MiniCPM, DeepSeek): lr until the decay's start, then linearly to the floor at the
  horizon; the decay is the horizon's last decay_steps (or decay_fraction of it after the warm-up);
- constant: lr to the end.

The horizon is the config's training.num_steps when the schedule began. A checkpoint holds the schedule it trained
with (its kind, settings, horizon and the step it began at), so a continuation knows it: the LR of every step
already trained stays as it was. A continuation with another num_steps (or other settings) takes the config's
schedule when that gives every step it already trained the same LR (a cosine still in its warm-up, a WSD run not
yet decaying: extending it moves only the decay); else a changed horizon alone keeps the checkpoint's (a cosine
finished at the old horizon trains on at its floor), and any other change is refused, naming it. With
training.lr_schedule_restart the config's schedule begins anew at the step the run resumes from (a re-warm).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config.rules import InputError

KINDS = ("cosine", "wsd", "constant")
# what a continuation may change without touching a trained step's LR (the horizon aside), in the message's words
SETTINGS = {"kind": "training.lr_schedule", "lr": "training.lr", "warmup_steps": "training.warmup_steps",
            "min_lr_ratio": "training.min_lr_ratio", "decay_steps": "training.decay_steps",
            "decay_fraction": "training.decay_fraction"}


class ScheduleChanged(InputError):
    """A continuation's schedule would change the LR of steps already trained, and no new phase was asked for."""


@dataclass(frozen=True)
class Schedule:
    kind: str
    lr: float
    warmup_steps: int
    min_lr_ratio: float
    horizon: int  # the step the decay ends at: training.num_steps when the schedule began
    decay_steps: int = 0  # wsd: the decay's steps; 0 takes decay_fraction
    decay_fraction: float = 0.2
    start: int = 0  # the step this phase of the schedule began at: 0, or where a restart began one

    @classmethod
    def of(cls, training, start: int = 0) -> "Schedule":
        """The schedule training (a TrainingConfig) asks for, beginning at `start`."""
        return cls(training.lr_schedule, training.lr, training.warmup_steps, training.min_lr_ratio,
                   training.num_steps, training.decay_steps, training.decay_fraction, start)

    @property
    def decay_start(self) -> int:
        """wsd: the first step of the decay (never inside the warm-up)."""
        after_warmup = self.start + self.warmup_steps
        length = self.decay_steps or round(self.decay_fraction * max(0, self.horizon - after_warmup))
        return max(after_warmup, self.horizon - length)

    def lr_at(self, step: int) -> float:
        """The LR of the 0-based step `step` (the one being trained)."""
        into = step - self.start
        if into < self.warmup_steps:
            return self.lr * (into + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        if self.kind == "wsd":
            first = self.decay_start
            if step < first:
                return self.lr
            progress = min(1.0, (step - first) / max(1, self.horizon - first))
            return self.lr * (1 - (1 - self.min_lr_ratio) * progress)
        progress = min(1.0, (into - self.warmup_steps) / max(1, self.horizon - self.start - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def to_state(self) -> dict[str, torch.Tensor]:
        """The checkpoint's entry (tensors: DCP pickles anything else)."""
        return {"kind": torch.tensor(KINDS.index(self.kind)), "lr": torch.tensor(self.lr, dtype=torch.float64),
                "warmup_steps": torch.tensor(self.warmup_steps),
                "min_lr_ratio": torch.tensor(self.min_lr_ratio, dtype=torch.float64),
                "horizon": torch.tensor(self.horizon), "decay_steps": torch.tensor(self.decay_steps),
                "decay_fraction": torch.tensor(self.decay_fraction, dtype=torch.float64),
                "start": torch.tensor(self.start)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Schedule | None":
        """A checkpoint's schedule; None for a checkpoint of a release before schedules were kept."""
        if "horizon" not in state:
            return None
        return cls(KINDS[int(state["kind"])], float(state["lr"]), int(state["warmup_steps"]),
                   float(state["min_lr_ratio"]), int(state["horizon"]), int(state["decay_steps"]),
                   float(state["decay_fraction"]), int(state["start"]))

    def describe(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), **({"decay_start": self.decay_start} if self.kind == "wsd" else {})}


def agree_before(one: Schedule, other: Schedule, step: int) -> bool:
    """Both give every step before `step` the same LR (exactly: the same arithmetic on the same numbers). Newest
    first: schedules that part do so in their decay, so a restart of a run that kept its horizon stops at once."""
    return all(one.lr_at(s) == other.lr_at(s) for s in range(step - 1, -1, -1))


def continue_schedule(saved: Schedule | None, wanted: Schedule, step: int, *, restart: bool
                      ) -> tuple[Schedule, str, str]:
    """The schedule a start at `step` trains with, from its checkpoint's (`saved`; None: a first start, or a
    checkpoint of an earlier release) and the config's (`wanted`, from step 0): (schedule, decision, why).
    Decisions: same, new (nothing saved), adopted (the config's: it agrees on every trained step), kept (the
    checkpoint's: only the horizon differs and the config's would move trained steps), restarted (a new phase at
    `step`). ScheduleChanged for any other change without training.lr_schedule_restart."""
    if saved is None:
        return wanted, "new", "no schedule in the checkpoint: the config's"
    ours = dataclasses.replace(wanted, start=saved.start)
    if ours == saved:
        return saved, "same", "the checkpoint's schedule is the config's"
    changed = [f"{SETTINGS[name]} {getattr(saved, name)} -> {getattr(ours, name)}" for name in SETTINGS
               if getattr(saved, name) != getattr(ours, name)]
    horizon = f"training.num_steps {saved.horizon} -> {ours.horizon}"
    if restart:
        return (dataclasses.replace(wanted, start=step), "restarted",
                f"training.lr_schedule_restart: a new phase of the schedule from step {step} "
                f"({'; '.join([*changed, horizon] if saved.horizon != ours.horizon else changed)})")
    if agree_before(saved, ours, step):
        return ours, "adopted", (f"{'; '.join([*changed, horizon] if saved.horizon != ours.horizon else changed)}: "
                                 f"the steps already trained (0-{step - 1}) keep their LR under it")
    if not changed:
        after = "its floor" if saved.kind != "constant" else "lr"
        hint = (f"its decay began at step {saved.decay_start}, before this continuation" if saved.kind == "wsd" else
                "training.lr_schedule=wsd moves only its decay when extended")
        return saved, "kept", (f"{horizon} would change the LR of steps already trained: the checkpoint's horizon "
                               f"{saved.horizon} stays ({saved.kind}: {after} {saved.lr_at(saved.horizon):.3g} from "
                               f"step {saved.horizon} on; {hint}). training.lr_schedule_restart=true starts a new "
                               "phase of the schedule instead")
    raise ScheduleChanged(
        f"{'; '.join(changed)}: the run trained steps 0-{step - 1} with the checkpoint's schedule, and this one "
        f"would change their LR (at step {step} it would be {ours.lr_at(step):.3g} instead of "
        f"{saved.lr_at(step):.3g}). Set training.lr_schedule_restart=true to begin the new schedule at step {step} "
        "(warm-up from there), or keep the checkpoint's settings")
