"""What a start takes up after its resume: the learning-rate schedule (trainer.job.schedule) and the data phases
(trainer.data.phases) it trains with, each decided alike on every rank and recorded once by rank 0.

A continuation (the same run id again: more steps, a changed mixture, an upgraded image) and every restart after a
fault go through here: each finds the run's decisions in the checkpoint (the schedule) and the control records (the
data phases), so a fault after a continuation resumes the continuation, not the run before it.
"""

from __future__ import annotations

import logging

from trainer.data.phases import DataPhase
from trainer.job.schedule import Schedule, continue_schedule

log = logging.getLogger(__name__)


def take_up_schedule(trainer, *, resumed: bool) -> None:
    """The schedule from the resumed checkpoint's and the config's (a ScheduleChanged, an InputError, when the
    config would change the LR of trained steps without training.lr_schedule_restart)."""
    training = trainer.cfg.training
    saved = trainer.saved_schedule if resumed else None
    trainer.schedule, decision, why = continue_schedule(saved, Schedule.of(training), trainer.step,
                                                        restart=training.lr_schedule_restart)
    if decision in ("kept", "restarted", "adopted"):
        log.warning("learning-rate schedule at step %d: %s (%s)", trainer.step, decision, why)
    if trainer.rank == 0 and trainer.replica_groups.writes_run_files:
        trainer.events.write("lr_schedule", step=trainer.step, decision=decision, why=why,
                             lr_at_step=trainer.schedule.lr_at(trainer.step), **trainer.schedule.describe())


def take_up_data_phases(trainer, *, resumed: bool) -> None:
    """The run's data phases on its batches, and the one that begins here, if any (a MixtureChanged, an
    InputError, when the corpora changed and data.on_mixture_change=refuse)."""
    recorded = [DataPhase.from_record(record) for record in trainer.resilience.history.data_phases]
    begun = trainer.batches.continue_phases(recorded, position=trainer.next_sample, step=trainer.step,
                                            first_order=trainer.saved_order if resumed else "name",
                                            on_change=trainer.cfg.data.on_mixture_change)
    if begun is None:
        return
    if begun.phase > 0:
        log.warning("data phase %d from sample %d (step %d): %s", begun.phase, begun.start, begun.step,
                    ", ".join(f"{c.name} x{c.weight:g} from its sample {c.offset}" for c in begun.corpora))
    if trainer.rank == 0 and trainer.replica_groups.writes_run_files:
        trainer.events.write("data_phase", **begun.to_record())
