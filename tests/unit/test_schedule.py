import dataclasses

import pytest
import torch

from trainer.config import load_config
from trainer.job.schedule import Schedule, ScheduleChanged, continue_schedule


def _schedule(*overrides: str) -> Schedule:
    return Schedule.of(load_config(None, list(overrides)).training)


def test_warmup_then_cosine_to_the_floor():
    schedule = _schedule("--training.num_steps=100", "--training.warmup_steps=10", "--training.lr=1.0",
                         "--training.min_lr_ratio=0.1")
    assert schedule.lr_at(0) == pytest.approx(0.1)
    assert schedule.lr_at(9) == pytest.approx(1.0)
    assert schedule.lr_at(10) == pytest.approx(1.0)
    assert schedule.lr_at(100) == pytest.approx(0.1)
    values = [schedule.lr_at(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_run_shorter_than_warmup_is_all_warmup():
    schedule = _schedule("--training.num_steps=5", "--training.warmup_steps=20", "--training.lr=1.0")
    assert [round(schedule.lr_at(s), 3) for s in range(5)] == [0.05, 0.1, 0.15, 0.2, 0.25]


def test_the_cosine_is_the_formula_of_the_release_before_schedules_bit_for_bit():
    """Every run's LR up to its horizon is what the cosine computed before (the fixtures' losses depend on it)."""
    import math

    t = load_config(None, ["--training.num_steps=37", "--training.warmup_steps=5", "--training.lr=3e-4"]).training
    def before(step):  # trainer.job.step.lr_at of the release before schedules
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        progress = (step - t.warmup_steps) / max(1, t.num_steps - t.warmup_steps)
        return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    schedule = Schedule.of(t)
    assert [schedule.lr_at(s) for s in range(37)] == [before(s) for s in range(37)]


def test_past_its_horizon_a_cosine_holds_its_floor_instead_of_rising_again():
    schedule = _schedule("--training.num_steps=30", "--training.warmup_steps=20", "--training.lr=1.0")
    assert [schedule.lr_at(s) for s in (30, 45, 59)] == [pytest.approx(0.1)] * 3


def test_wsd_warms_up_holds_then_decays_over_its_last_steps():
    schedule = _schedule("--training.lr_schedule=wsd", "--training.num_steps=100", "--training.warmup_steps=10",
                         "--training.decay_steps=20", "--training.lr=1.0", "--training.min_lr_ratio=0.0")
    assert schedule.decay_start == 80
    assert schedule.lr_at(9) == 1.0 and schedule.lr_at(10) == schedule.lr_at(80) == 1.0
    assert schedule.lr_at(90) == pytest.approx(0.5) and schedule.lr_at(100) == 0.0 and schedule.lr_at(150) == 0.0
    by_fraction = _schedule("--training.lr_schedule=wsd", "--training.num_steps=110", "--training.warmup_steps=10")
    assert by_fraction.decay_start == 90  # decay_fraction 0.2 of the 100 steps after the warm-up
    constant = _schedule("--training.lr_schedule=constant", "--training.warmup_steps=2", "--training.lr=2.0")
    assert [constant.lr_at(s) for s in (0, 1, 2, 10_000)] == [1.0, 2.0, 2.0, 2.0]


CPT = ["--training.warmup_steps=20", "--training.lr=1.0", "--training.min_lr_ratio=0.1"]


def test_a_cosine_continued_with_more_steps_keeps_the_lr_of_every_step_it_trained():
    """Issue 50: 30 steps, then the same run to 60 (warm-up 20). Recomputed from num_steps=60, step 29 ran at
    0.12 x lr and step 30 would run at 0.87 x lr: a jump by design. The checkpoint's horizon stays instead."""
    saved = _schedule("--training.num_steps=30", *CPT)
    wanted = _schedule("--training.num_steps=60", *CPT)
    assert wanted.lr_at(30) == pytest.approx(0.87, abs=0.005) and saved.lr_at(29) == pytest.approx(0.1, abs=0.03)
    schedule, decision, why = continue_schedule(saved, wanted, 30, restart=False)
    assert decision == "kept" and schedule == saved and "training.num_steps 30 -> 60" in why
    assert [schedule.lr_at(s) for s in range(30)] == [saved.lr_at(s) for s in range(30)]
    assert schedule.lr_at(30) == schedule.lr_at(59) == pytest.approx(0.1)  # its floor, as at its horizon
    # still warming up when extended: no step trained changes, so the new horizon is taken
    early, decision, _ = continue_schedule(saved, wanted, 15, restart=False)
    assert decision == "adopted" and early == wanted


def test_a_wsd_run_extended_before_its_decay_moves_only_the_decay():
    wsd = ["--training.lr_schedule=wsd", "--training.decay_steps=10", *CPT]
    saved, wanted = _schedule("--training.num_steps=60", *wsd), _schedule("--training.num_steps=120", *wsd)
    schedule, decision, _ = continue_schedule(saved, wanted, 40, restart=False)
    assert decision == "adopted" and schedule.decay_start == 110 and saved.decay_start == 50
    assert [schedule.lr_at(s) for s in (39, 40, 49, 50, 109)] == [1.0] * 5
    assert schedule.lr_at(120) == pytest.approx(0.1)
    # extended after its decay began: the decay is kept (going back up to lr would be a jump)
    late, decision, _ = continue_schedule(saved, wanted, 55, restart=False)
    assert decision == "kept" and late == saved and late.lr_at(54) == saved.lr_at(54)


def test_a_change_that_would_move_trained_steps_is_refused_unless_a_new_phase_is_asked_for():
    saved = _schedule("--training.num_steps=60", *CPT)
    lower = _schedule("--training.num_steps=100", *CPT, "--training.lr=0.5")
    with pytest.raises(ScheduleChanged, match=r"training.lr 1.0 -> 0.5: the run trained steps 0-39 .* "
                                              r"training.lr_schedule_restart=true"):
        continue_schedule(saved, lower, 40, restart=False)
    phase, decision, _ = continue_schedule(saved, lower, 40, restart=True)
    assert decision == "restarted" and phase.start == 40 and phase.lr_at(40) == pytest.approx(0.5 / 20)  # re-warm
    assert phase.lr_at(59) == 0.5 and phase.lr_at(100) == pytest.approx(0.05)  # warm-up from 40, cosine to 100
    # the next restart (a fault after the new phase began) finds that phase in the checkpoint: the same, not anew
    again, decision, _ = continue_schedule(phase, lower, 47, restart=True)
    assert decision == "same" and again == phase


def test_a_checkpoint_holds_the_schedule_and_one_of_an_earlier_release_has_none():
    schedule = dataclasses.replace(_schedule("--training.lr_schedule=wsd", "--training.num_steps=77"), start=12)
    state = schedule.to_state()
    assert all(isinstance(value, torch.Tensor) for value in state.values())  # DCP pickles anything else
    assert Schedule.from_state(state) == schedule
    assert Schedule.from_state({}) is None
    new, decision, _ = continue_schedule(None, schedule, 40, restart=False)
    assert (new, decision) == (schedule, "new")


def test_xids_that_take_a_node_out_of_service():
    from trainer.resilience.health import classify_xids

    assert classify_xids([13, 31]) == {"xids": [13, 31], "node_bad": False, "node_bad_xids": []}
    assert classify_xids([79, 94, 94]) == {"xids": [79, 94], "node_bad": True, "node_bad_xids": [94]}


def test_gpu_health_is_a_no_op_on_cpu(tmp_path):
    import torch

    from trainer.resilience.health import GpuHealth
    from trainer.run.events import EventLog

    health = GpuHealth(torch.device("cpu"), EventLog(tmp_path, 0), interval_steps=1)
    assert not health.enabled
    health.maybe_check(1)
    assert not (tmp_path / "events" / "rank-0.jsonl").exists()
