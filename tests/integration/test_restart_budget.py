"""The restart budget by progress (trainer.resilience.budget), with real processes on 2 CPU ranks: faults that
training recovers from never exhaust it; a fault that recurs at the same step after every resume ends the
job after resilience.max_restarts_without_progress recoveries, with one message naming the step, the fault
and the layer, at every layer."""

import json

import pytest

from components.train.local import CrashLoop, run_local_training
from trainer.env import CRASH_LOOP_EXIT_CODE
from trainer.resilience.budget import attempt_history
from trainer.run.events import read_events

pytestmark = pytest.mark.integration

FAST = ["--checkpoint.interval_steps=4", "--resilience.heartbeat_timeout=8",
        "--resilience.initial_heartbeat_timeout=90"]


def _crash_loop(cfg, token_dir):
    with pytest.raises(CrashLoop) as caught:
        run_local_training(cfg, token_dir)
    gave_up = json.loads((cfg.run_dir / "gave_up.json").read_text())
    return str(caught.value), gave_up, attempt_history(cfg.run_dir, 0.0)


def test_a_fault_recurring_at_one_step_gives_up_after_the_budget_under_ft_launcher(tmp_path, token_dir,
                                                                                   training_config):
    cfg = training_config(tmp_path, "loop", "--training.num_steps=12", *FAST, "--faults.schedule=exception@6:repeat",
                          "--resilience.max_restarts_without_progress=2")
    message, gave_up, attempts = _crash_loop(cfg, token_dir)

    # First start trains 1-5 and crashes before step 6; two recoveries resume at 5 and crash again; the
    # third recovery finds two in a row without progress and gives up before step 6 is tried again.
    assert [a.layer for a in attempts] == ["first_start", "ft_launcher", "ft_launcher", "ft_launcher"]
    assert [a.resumed_step for a in attempts] == [0, 5, 5, 5]
    assert gave_up["streak"] == 2 and gave_up["layer"] == "ft_launcher" and gave_up["step"] == 5
    for part in ("crash loop", "stuck at step 5", "exception (exception@6:rank=0:repeat#3)", "ft_launcher layer",
                 f"exit code {CRASH_LOOP_EXIT_CODE}", "max_restarts_without_progress=2"):
        assert part in message, (part, message)
    assert [f["key"] for f in read_events(cfg.run_dir, "fault")] == [f"exception@6:rank=0:repeat#{n}" for n in (1, 2, 3)]
    # Nothing of this launch restarted it after the give-up (the local step did not relaunch it either).
    assert len(read_events(cfg.run_dir, "attempt")) == 4


def test_a_crash_loop_without_node_memory_gives_up_although_each_attempt_completes_steps(tmp_path, token_dir,
                                                                                         training_config):
    """Without the memory tier every attempt replays steps 5-7 from the step-4 checkpoint and dies before step 8:
    steps completed, but the state a recovery reads never advances. That is no progress."""
    cfg = training_config(tmp_path, "loop-disk", "--training.num_steps=12", *FAST, "--faults.schedule=exit@8:repeat",
                          "--checkpoint.memory_interval_steps=0", "--checkpoint.mode=sync",
                          "--resilience.max_restarts_without_progress=2")
    _, gave_up, attempts = _crash_loop(cfg, token_dir)
    assert [a.resumed_step for a in attempts] == [0, 4, 4, 4]
    assert gave_up["step"] == 4


def test_the_relaunch_layer_never_relaunches_a_crash_loop(tmp_path, token_dir, training_config):
    """ft_launcher off (max_restarts=0): every fault goes to the job relaunch, which obeys the same rule."""
    cfg = training_config(tmp_path, "loop-relaunch", "--training.num_steps=12", *FAST,
                          "--faults.schedule=sigkill@3:rank=1, exception@6:repeat", "--resilience.max_restarts=0",
                          "--resilience.max_restarts_without_progress=2")
    message, gave_up, attempts = _crash_loop(cfg, token_dir)
    # The sigkill at 3 is recovered (progress: the next resume is at 5); then the loop at 6.
    assert [a.layer for a in attempts] == ["first_start", "job_restart", "job_restart", "job_restart", "job_restart"]
    assert gave_up["layer"] == "job_restart" and "job_restart layer" in message


def test_in_process_restarts_escalate_then_the_job_gives_up(tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "loop-inprocess", "--training.num_steps=12", *FAST,
                          "--faults.schedule=exception@6:repeat", "--resilience.in_process=true",
                          "--resilience.in_process_max_restarts=1", "--resilience.max_restarts_without_progress=3")
    _, gave_up, attempts = _crash_loop(cfg, token_dir)
    layers = [a.layer for a in attempts]
    # One in-process restart without progress: the next in-process attempt finds it when it resumes at the same
    # step and hands over (escalated: not a try of its own); ft_launcher restarts the processes; in-process
    # restarts in the new process; the global budget ends the job at its third recovery without progress.
    assert layers == ["first_start", "in_process", "in_process", "ft_launcher", "in_process", "in_process"], layers
    assert [a.escalated for a in attempts] == [False, False, True, False, False, False]
    assert gave_up["streak"] == 3


def test_a_deterministic_bug_stops_the_job_at_its_second_occurrence_with_its_frame(tmp_path, token_dir,
                                                                                   training_config):
    """bug@6: the same exception at the same line before step 6 on every attempt. The first is a transient
    fault as far as anyone can tell (restart); the second is the same failure again: deterministic, stop —
    after 2 attempts, where the budget by progress alone would take 4 (max_restarts_without_progress=3)."""
    cfg = training_config(tmp_path, "bug", "--training.num_steps=12", *FAST, "--faults.schedule=bug@6")
    message, gave_up, attempts = _crash_loop(cfg, token_dir)

    assert len(attempts) == 2 and [a.resumed_step for a in attempts] == [0, 5]
    assert gave_up["layer"] == "decision" and gave_up["cause"] == "deterministic"
    assert gave_up["frame"]["file"] == "trainer/resilience/faults.py" and gave_up["frame"]["function"] == "_fire"
    assert "raise InjectedBug" in gave_up["traceback"]
    # rank 0's exceptions (the launcher may start the workers once more before it reads gave_up.json: they are
    # stopped in their process group's set-up, with a SIGTERM record, and never attempt a start)
    failures = [f for f in read_events(cfg.run_dir, "rank_failed") if f.get("rank") == 0 and f["how"] == "exception"]
    assert len(read_events(cfg.run_dir, "attempt")) == 2
    assert [(f["cause"], f["decision"]) for f in failures] == [("transient", "restart"), ("deterministic", "stop")]
    assert failures[0]["fingerprint"] == failures[1]["fingerprint"]
    [recovery] = read_events(cfg.run_dir, "recovery") or [None]
    assert recovery is None or recovery["decision"] == "restart"
    for part in ("stopped by cause: InjectedBug", "trainer/resilience/faults.py", "at step 5", "deterministic=stop"):
        assert part in message, (part, message)
