"""Badput by category and the planner's measured costs, read from a run folder (trainer.planning.measured).

Categories after Google's ml-goodput-measurement (github.com/AI-Hypercomputer/ml-goodput-measurement,
`BadputType`: TPU initialization → start-up, data loading, program start-up, wasted progress from
disruption, checkpoint save/load, other): they and the productive time add up to the job's wall time.
"""

from __future__ import annotations

import json

import pytest

from components.train.report import training_report
from trainer.config import load_config
from trainer.env import BUDGET_SINCE_ENV
from trainer.observe.progress import ProgressReporter
from trainer.planning.measured import badput_breakdown, measured_costs
from trainer.run.events import EventLog
from trainer.run.history import control_state
from trainer.run.run_dir import RunDir

T0 = 1_000_000.0


def _write_run(path, *, mode="async"):
    """A 2-rank run of 10 steps of 1 s: start-up 5 s, saves at 4 and 8, a SIGKILL after step 6 recovered by
    ft_launcher from step 4 (steps 5-6 replayed), a final save."""
    run = RunDir(path)
    ranks = [EventLog(path, 0), EventLog(path, 1)]
    ranks[0].write("launch", process_started_at=T0)
    records, now = [], T0 + 5.0
    for step in [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10]:
        if step == 5 and any(r["step"] == 6 for r in records):
            now += 2.0 + 1.5 + 0.5  # detect + re-init + reload
        now += 1.0
        records.append({"step": step, "time": now, "step_seconds": 1.0, "data_seconds": 0.1})
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    for step, wait in ((4, 0.3), (8, 0.5)):  # one record per save, the worst of the two ranks (rank 1: +0.1)
        ranks[0].write("checkpoint_stall", step=step, mode=mode, ranks=2, loop_wait_seconds=wait + 0.1,
                       handoff_seconds=0.05, previous_save_seconds=0.0, barrier_seconds=0.0, memory_seconds=0.0,
                       memory_copies=0, write_seconds=2.0)
    for step in (4, 8):
        ranks[0].write("checkpoint_committed", step=step, mode=mode, bytes=1, blocking_seconds=0.05,
                       write_seconds=2.0, commit_seconds=0.1, background_seconds=2.05, mb_per_second=1.0, path="x")
    ranks[0].write("recovery", fault_key="sigkill@6:rank=1", mechanism="ft_launcher", restart_iteration=1,
                   reloaded_step=4, reload_source="disk", lost_steps=2, detect_and_teardown_seconds=2.0,
                   reinit_seconds=1.5, reload_seconds=0.5, recovery_seconds=5.0)
    run.result.write_text(json.dumps({"finished_at": now + 1.0, "final_checkpoint_wait_seconds": 0.4}))
    return now + 1.0


def test_badput_categories_add_up_to_the_wall_time(tmp_path):
    finished = _write_run(tmp_path)
    split = badput_breakdown(tmp_path)
    seconds = split["badput_seconds"]
    assert split["wall_seconds"] == pytest.approx(finished - T0)
    assert split["productive_seconds"] == pytest.approx(10 * 0.9)
    assert seconds["data_loading"] == pytest.approx(10 * 0.1)
    assert seconds["wasted_progress"] == pytest.approx(2.0)  # steps 5 and 6, computed twice
    assert seconds["infrastructure_recovery"] == pytest.approx(3.5)
    assert seconds["checkpoint_load"] == pytest.approx(0.5)
    assert seconds["checkpoint_save"] == pytest.approx(0.4 + 0.6 + 0.4)  # worst rank per save + the final wait
    assert seconds["startup"] == pytest.approx(5.0)
    assert split["productive_seconds"] + sum(seconds.values()) == pytest.approx(split["wall_seconds"])
    assert split["goodput"] == pytest.approx(9.0 / (finished - T0))


def test_a_rollback_and_a_transient_rerun_are_wasted_progress_and_the_skipped_samples_are_counted(tmp_path):
    """Steps of 1 s. Step 7's NaN came back on its rerun (both passes, 2 s, never a metrics line): rolled back to
    step 4 in 0.3 s, steps 5-6 trained again on other samples, 64 samples skipped. Step 9's spike was transient:
    its kept record's 1.8 s holds its 0.8 s rerun (trainer.job.numeric_recovery)."""
    run, rank0 = RunDir(tmp_path), EventLog(tmp_path, 0)
    rank0.write("launch", process_started_at=T0)
    records, now = [], T0
    for step in [1, 2, 3, 4, 5, 6, "anomaly", 5, 6, 7, 8, 9, 10]:
        if step == "anomaly":
            now += 2.0 + 0.3
            continue
        now += 1.8 if step == 9 else 1.0
        records.append({"step": step, "time": now, "step_seconds": 1.8 if step == 9 else 1.0, "data_seconds": 0.1})
    run.metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    rank0.write("numeric_rerun", step=7, anomaly="nonfinite_loss", verdict="reproducible", seconds=1.0)
    rank0.write("rollback", anomaly_step=7, anomaly="nonfinite_loss", reloaded_step=4, reload_source="memory",
                lost_steps=2, window=[0, 96], samples=64, reload_seconds=0.3, wasted_seconds=2.0)
    rank0.write("numeric_rerun", step=9, anomaly="loss_spike", verdict="transient", seconds=0.8)
    run.result.write_text(json.dumps({"finished_at": now}))

    split = badput_breakdown(tmp_path)
    seconds = split["badput_seconds"]
    assert split["productive_seconds"] == pytest.approx(10 * 0.9 + 0.8 - 0.8)  # the rerun leaves step 9's share
    assert seconds["wasted_progress"] == pytest.approx(2.0 + 2.0 + 0.8)  # steps 5-6 again, step 7, step 9's rerun
    assert seconds["checkpoint_load"] == pytest.approx(0.3)
    assert split["productive_seconds"] + sum(seconds.values()) == pytest.approx(split["wall_seconds"])
    totals = training_report(tmp_path, None)["recovery_totals"]
    assert (totals["rollbacks"], totals["rollback_lost_steps"], totals["samples_skipped_by_rollback"]) == (1, 2, 64)


def test_measured_costs_are_what_the_planner_takes(tmp_path):
    _write_run(tmp_path)
    costs = measured_costs(tmp_path)
    assert costs["step_seconds"] == 1.0
    assert costs["checkpoint_stall_seconds"] == pytest.approx(0.6)  # the second save (the first starts the writer)
    assert costs["checkpoint_background_seconds"] == pytest.approx(2.05)
    assert costs["fsx_reload_seconds"] == 0.5 and costs["restart_seconds"] == 3.5
    assert costs["startup_seconds"] == pytest.approx(5.0)
    assert "memory_stall_seconds" not in costs and "job_restart_seconds" not in costs

    sync_dir = tmp_path / "sync"
    _write_run(sync_dir, mode="sync")
    assert measured_costs(sync_dir)["sync_stall_seconds"] == pytest.approx(0.6)


def test_the_trainjob_status_and_the_report_count_the_run_wall_time_with_one_function(tmp_path):
    """Issue 31: the goodput of the TrainJob status (trainer.observe.progress) and the report's
    (components.train.report) had two origins (the first launch record, written after start-up; the launch).
    Issue 32: both count the run's wall time with trainer.run.history.ControlState.run_wall_seconds — its
    launches' (a continuation adds one; the gaps between launches are nobody's), or, started by hand, from the
    first process."""
    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=start"])
    finished = _write_run(cfg.run_dir)  # its launch record is written now, long after its process started (T0)
    history = control_state(cfg.run_dir)
    status = ProgressReporter(cfg, rank=0, nodes=1, environ={}, history=history,
                              launched_at=history.first_process_started_at)  # started by hand (trainer.job.startup)
    report = training_report(cfg.run_dir, None)
    assert status.wall_seconds(finished) == pytest.approx(report["job_wall_seconds"]) == pytest.approx(finished - T0)

    # A continuation: the train step's earlier launch ran 100 s; this one started 3 s before its first process.
    train_step = EventLog(cfg.run_dir, None)
    train_step.write("train_launch", started_at=T0 - 500.0)
    train_step.write("train_launch_ended", started_at=T0 - 500.0, finished_at=T0 - 400.0)
    launched = T0 - 3.0
    train_step.write("train_launch", started_at=launched)
    status = ProgressReporter(cfg, rank=0, nodes=1, environ={}, history=control_state(cfg.run_dir), launched_at=launched)
    report = training_report(cfg.run_dir, launched)
    assert status.wall_seconds(finished) == pytest.approx(report["job_wall_seconds"])
    assert report["job_wall_seconds"] == pytest.approx(100.0 + finished - launched)
    assert 0 < report["goodput"] <= 1
