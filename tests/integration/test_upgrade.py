"""A run folder written by the release before the shared event streams (tests/data/legacy-run-v1: one events file
per rank) resumes under this one with its history, as after an image upgrade of a month-long job: the drill faults
it fired do not fire again, its no-progress streak still counts (the same launch scope), its recoveries are in
the totals; then, after the give-up, a continuation of the run (the train step again) finishes it."""

import json
import shutil
from pathlib import Path

import pytest

from components.train.local import run_local_training
from components.train.report import training_report
from tests.launch import start_launcher
from trainer.env import BUDGET_SINCE_ENV, CRASH_LOOP_EXIT_CODE
from trainer.resilience.budget import attempt_history
from trainer.run.events import read_events
from trainer.run.history import control_state, recent_recoveries
from trainer.run.run_dir import RunDir

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "legacy-run-v1"
LEGACY_SCOPE = "1796000000.0"  # the budget scope every process of the legacy launch had (its BUDGET_SINCE)
SETTINGS = ["--training.num_steps=12", "--checkpoint.interval_steps=2", "--checkpoint.mode=sync",
            "--checkpoint.memory_interval_steps=0", "--checkpoint.keep_last=1", "--resilience.max_restarts=5",
            "--resilience.max_restarts_without_progress=3", "--resilience.heartbeat_timeout=8",
            "--resilience.initial_heartbeat_timeout=90"]


def _legacy_run_folder(tmp_path, token_dir, training_config):
    """The fixture's records in a run folder of this test, with the step-4 checkpoint it resumed from (trained
    again from the same config and data: the weights are not committed, tests/data/legacy-run-v1/README.md)."""
    scratch = training_config(tmp_path / "scratch", "legacy", *SETTINGS, "--training.num_steps=4", "--faults.schedule=")
    run_local_training(scratch, token_dir)
    cfg = training_config(tmp_path, "legacy", *SETTINGS, "--faults.schedule=sigkill@3:rank=1, exception@6:repeat")
    shutil.copytree(FIXTURE, cfg.run_dir, ignore=shutil.ignore_patterns("README.md", "make_fixture.py",
                                                                       "checkpoints-manifest"))
    shutil.copytree(scratch.checkpoint_dir / "step-000004", cfg.checkpoint_dir / "step-000004")
    return cfg


def test_a_run_folder_of_the_earlier_release_resumes_with_its_history(tmp_path, token_dir, training_config):
    cfg = _legacy_run_folder(tmp_path, token_dir, training_config)
    run = RunDir(cfg.run_dir)
    legacy = {path.name: path.read_bytes() for path in run.legacy_events()}
    assert sorted(legacy) == ["rank-0.jsonl", "rank-1.jsonl"]

    # The image is upgraded while the job crash-loops: the same launch (budget scope), this release.
    proc, _ = start_launcher(cfg, token_dir, **{BUDGET_SINCE_ENV: LEGACY_SCOPE})
    assert proc.wait(timeout=600) != 0

    # The streak the earlier release recorded (two recoveries without progress) still counts: two more attempts,
    # not three, reach the limit of 3 — an upgrade that forgot the history would let the crash loop go on.
    gave_up = json.loads(run.gave_up.read_text())
    assert gave_up["streak"] == 3 and gave_up["step"] == 4, gave_up
    attempts = attempt_history(run.path, 0.0)
    assert [a.resumed_step for a in attempts] == [0, 2, 4, 4, 4, 4]
    # The drills fired once per run: the sigkill of the earlier release does not fire again, the repeat one
    # counts on from its third firing (the second attempt here gives up at its resume, before step 6).
    assert [f["key"] for f in read_events(run.path, "fault")] == [
        "sigkill@3:rank=1", *(f"exception@6:rank=0:repeat#{n}" for n in range(1, 5))]
    state = control_state(run.path)
    assert state.recoveries["count"] == 3 and recent_recoveries(run.path)[0]["fault_key"] == "sigkill@3:rank=1"
    assert f"exit code {CRASH_LOOP_EXIT_CODE}" in gave_up["message"]
    # Converted once, in time order; the earlier release's files are left as they were.
    assert json.loads(run.events_format.read_text())["migrated_from"] == ["rank-0.jsonl", "rank-1.jsonl"]
    assert {path.name: path.read_bytes() for path in run.legacy_events()} == legacy
    stalls = read_events(run.path, "checkpoint_stall")
    assert [(s["step"], s["rank"], s["ranks"]) for s in stalls if s["time"] < attempts[4].started] == [(2, 0, 2),
                                                                                                     (4, 0, 2)]

    # The cause fixed (the repeat drill gone), the pipeline runs again with the same run id: a new launch, a
    # full budget; it finishes from step 4, and the run's totals count the earlier release's recoveries too.
    cfg = training_config(tmp_path, "legacy", *SETTINGS, "--faults.schedule=sigkill@3:rank=1")
    outcome = run_local_training(cfg, token_dir)
    assert outcome["steps"] == 12 and outcome["steps_this_launch"] == 8
    report = training_report(run.path, outcome["launched_at"])
    assert report["recovery_totals"]["recoveries"] == control_state(run.path).recoveries["count"] >= 3
    assert 0 < report["goodput"] <= 1
