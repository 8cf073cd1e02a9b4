"""The no-progress rule's arithmetic (trainer.resilience.budget), the schedule items that could never fire, and
the planner's survival figures (trainer.planning.survival) against their simulator."""

import json

import pytest

from trainer.config import ConfigError, load_config
from trainer.planning.goodput import Costs
from trainer.planning.survival import job_survival, pod_restart_budget, poisson_cdf, simulate_survival
from trainer.resilience.budget import (RestartBudget, RestartBudgetExhausted, attempt_history, budget_since,
                                       no_progress_streak)
from trainer.run.events import EventLog
from trainer.run.history import control_state


@pytest.mark.parametrize("resumes, current, streak", [
    ([0], None, 0),                       # the first start is not a recovery
    ([0, 5], 5, 1),                       # recovered at 5, and resumed at 5 again: no progress
    ([0, 5], 9, 0),                       # the state advanced
    ([0, 5, 5, 5], 5, 3),                 # a crash loop at step 5
    ([0, 5, 5, 9], 9, 1),                 # progress ends the count: only the newest run counts
    ([0, 5, None, None], None, 2),        # died in start-up twice: no progress, judged before loading
    ([0, 5, 5], None, 0),                 # the newest ended recovery cannot be judged yet: the count ends
    ([0, 4, 4, 4], 3, 3),                 # resumed from an older copy (the newer one corrupt): no progress
])
def test_the_streak_counts_recoveries_that_did_not_advance_the_state(resumes, current, streak):
    assert no_progress_streak(resumes, current) == streak


def _budget(tmp_path, limit=2, layer="ft_launcher", generation=1, own_generation=False):
    return RestartBudget(tmp_path, rank=0, events=EventLog(tmp_path, 0), limit=limit, in_process_limit=1,
                         layer=layer, generation=generation, process_started_at=0.0, broadcast=lambda value: value,
                         history=control_state(tmp_path, save=True),  # as rank 0 folds it at a start
                         own_generation=own_generation)


def test_the_budget_gives_up_once_and_names_the_step_the_fault_and_the_layer(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILIENT_TRAIN_BUDGET_SINCE", "0")
    events = EventLog(tmp_path, 0)
    for resumed in (0, 7, 7):
        _budget(tmp_path).start()
        events.write("resume", step=resumed, source="memory", path=None)
        EventLog(tmp_path, 1).write("fault", fault_type="exit", key="exit@8:rank=1:repeat", step=7)
    budget = _budget(tmp_path)
    budget.start()  # two ended recoveries, the newest not judged yet: goes on
    with pytest.raises(RestartBudgetExhausted) as caught:
        budget.check(7)
    message = str(caught.value)
    for part in ("2 recoveries in a row made no progress", "max_restarts_without_progress=2", "stuck at step 7",
                 "exit (exit@8:rank=1:repeat) at step 7 on rank 1", "ft_launcher layer", "exit code 42"):
        assert part in message, part
    record = json.loads((tmp_path / "gave_up.json").read_text())
    assert record["generation"] == 1 and record["message"] == message
    # A worker the launcher restarts before it stopped: refused at once, without a new attempt record.
    with pytest.raises(RestartBudgetExhausted):
        _budget(tmp_path).start()
    assert len(attempt_history(tmp_path, 0.0)) == 4
    # A new launch (another generation) starts counting after the give-up.
    assert budget_since(tmp_path) == record["time"]
    _budget(tmp_path, generation=2).start()


def test_separate_launches_have_separate_budgets(tmp_path, monkeypatch):
    """Two torchrun invocations by hand (tests/tier_harness.py resumes the same state again and again) are two
    launches: resuming at the same step in each is no crash loop. Restarts inside one invocation do count."""
    monkeypatch.delenv("RESILIENT_TRAIN_BUDGET_SINCE", raising=False)
    events = EventLog(tmp_path, 0)
    for invocation in range(4):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", f"standalone-{invocation}")
        budget = _budget(tmp_path)
        budget.start()
        events.write("resume", step=7, source="memory", path=None)
        budget.check(7)
    for _ in range(2):  # the same invocation restarting its workers, resuming at 7 every time
        _budget(tmp_path).start()
        events.write("resume", step=7, source="memory", path=None)
    third = _budget(tmp_path)
    third.start()
    with pytest.raises(RestartBudgetExhausted):
        third.check(7)


def test_a_schedule_item_that_could_never_fire_is_refused():
    for item, why in (("kill_before_rename@141:rank=1", "only rank 0 commits"),
                      ("sigkill@5:rank=2", "rank 2 does not exist"),
                      ("checkpoint_writer_crash@4", "checkpoint.enabled is false"),
                      ("slow_rank@4:repeat", "':repeat'")):
        extra = ["--checkpoint.enabled=false"] if "writer" in item else []
        with pytest.raises(ConfigError, match="faults.schedule") as caught:
            load_config("local", [f"--faults.schedule={item}", *extra])
        assert why in str(caught.value), (item, str(caught.value))
    # After the run's last step is allowed (shortening a demo must not mean editing its drill): logged instead.
    assert load_config("local", ["--training.num_steps=50"]).faults.schedule == "sigkill@120:rank=1"


def test_survival_closed_form_agrees_with_the_simulation():
    costs = Costs(nodes=1024, node_mtbf_hours=200, step_seconds=4.0, checkpoint_stall_seconds=0.5)
    closed = job_survival(costs, days=30, recovery_seconds=26.0, fixed=(3700,), limits=(3,))
    assert 0.5 < closed["by_progress"][3] < 0.95  # a regime where either could be wrong
    simulated = simulate_survival(costs, 30, 26.0, ("progress", 3), jobs=400, seed=1)
    assert simulated == pytest.approx(closed["by_progress"][3], abs=0.06)
    small = Costs(nodes=8, node_mtbf_hours=200, step_seconds=4.0, checkpoint_stall_seconds=0.5)
    fixed = job_survival(small, 30, 26.0, fixed=(30,))["fixed"][30]
    assert simulate_survival(small, 30, 26.0, ("fixed", 30), jobs=2000, seed=1) == pytest.approx(fixed, abs=0.04)


def test_at_cluster_scale_a_fixed_count_dies_and_the_progress_rule_survives():
    costs = Costs(nodes=1024, node_mtbf_hours=6335, step_seconds=4.0, checkpoint_stall_seconds=0.5)
    survival = job_survival(costs, days=30, recovery_seconds=26.0)
    assert survival["expected_faults"] == pytest.approx(116.4, abs=0.1)
    assert survival["fixed"][9] < 1e-30  # the old EKS budget: dead within days
    assert survival["by_progress"][3] > 0.9999
    assert pod_restart_budget(costs, 30) == 76
    assert poisson_cdf(2, 1.0) == pytest.approx(0.9196986, abs=1e-6)


def test_the_launchers_watch_signals_again_when_a_stop_was_swallowed(tmp_path):
    """A SIGTERM's exception can be swallowed where it lands (seen in CI: inside ft_launcher's logging
    handler, which reported and dropped it — and the launcher went on restarting workers that exit 42 at once).
    The watch signals again until the launcher has returned."""
    import signal
    import time

    from trainer.launch.launcher import GiveUpWatch
    from trainer.run.run_dir import RunDir, write_json

    received = []

    def swallow_the_first(signum, frame):
        received.append(signum)
        if len(received) == 2:
            raise KeyboardInterrupt  # stands in for ft_launcher's SignalException

    previous = signal.signal(signal.SIGTERM, swallow_the_first)
    write_json(RunDir(tmp_path).gave_up, {"generation": 5, "time": time.time(), "message": "crash loop"})
    watch = GiveUpWatch(tmp_path, 5, interval_seconds=0.05, resend_seconds=0.2).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        watch.stop()
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM, signal.SIGTERM]
    assert watch.matches({"generation": 5}) and not watch.matches({"generation": 4})


def test_started_by_hand_a_give_up_refuses_the_workers_its_launcher_restarts(tmp_path, monkeypatch):
    """Without the pipeline, rank 0 takes a lease generation of its own at every start (trainer.job.startup), so
    a worker ft_launcher restarts after the give-up has a new generation: the give-up is matched by its launch
    scope (this invocation) instead. Seen: test_upgrade had, now and then, one more attempt after the give-up."""
    monkeypatch.delenv("RESILIENT_TRAIN_BUDGET_SINCE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "by-hand")
    events = EventLog(tmp_path, 0)
    for generation, resumed in ((1, 0), (2, 7), (3, 7)):
        _budget(tmp_path, generation=generation, own_generation=True).start()
        events.write("resume", step=resumed, source="memory", path=None)
    budget = _budget(tmp_path, generation=4, own_generation=True)
    budget.start()
    with pytest.raises(RestartBudgetExhausted):
        budget.check(7)
    with pytest.raises(RestartBudgetExhausted):  # restarted by the same invocation: refused, no new attempt
        _budget(tmp_path, generation=5, own_generation=True).start()
    assert len(attempt_history(tmp_path, 0.0)) == 4
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "by-hand-again")  # a new invocation after a fix: a full budget
    _budget(tmp_path, generation=6, own_generation=True).start()


def test_each_replica_group_spends_its_own_budget(tmp_path, monkeypatch):
    """Replica groups restart on their own, so their attempts interleave in the shared control records: a crash
    loop in group 1 (dying before its first step again and again) gives group 1 up — its launchers' give-up, not group 0's —
    while group 0, restarting with progress in between, keeps its budget. Without the group's window the two
    groups' attempts would reset each other's streak (a different launch scope each time) and no crash loop
    would ever end."""
    monkeypatch.setenv("RESILIENT_TRAIN_BUDGET_SINCE", "0")

    def attempt(group: int, resumed: int, trained: bool) -> RestartBudget:
        monkeypatch.setenv("RESILIENT_TRAIN_REPLICA_GROUP", str(group))
        budget = _budget(tmp_path)
        budget.start()
        EventLog(tmp_path, group * 2).write("resume", step=resumed, source="memory", path=None)
        if trained:  # a restart's first step done: its recovery record
            EventLog(tmp_path, group * 2).write("recovery", mechanism="ft_launcher", fault_keys=[])
        return budget

    attempt(0, 0, trained=True)
    attempt(1, 0, trained=True)
    # Group 0 restarts and trains; group 1 restarts from a newer copy each time (the live group saved it) and
    # dies before its first step: no progress, however far its resume moved.
    for group_0_step, group_1_resume in ((10, 8), (20, 16)):
        attempt(0, group_0_step, trained=True).check(group_0_step)
        attempt(1, group_1_resume, trained=False)
    monkeypatch.setenv("RESILIENT_TRAIN_REPLICA_GROUP", "1")
    with pytest.raises(RestartBudgetExhausted):  # two recoveries died untrained: refused before heavy work
        _budget(tmp_path).start()
    record = json.loads((tmp_path / "gave_up.json").read_text())
    assert record["group"] == 1 and "2 recoveries in a row made no progress" in record["message"]
    monkeypatch.setenv("RESILIENT_TRAIN_REPLICA_GROUP", "0")
    _budget(tmp_path).start()  # group 0's next restart is not refused by group 1's give-up
    with pytest.raises(RestartBudgetExhausted):  # group 1's is
        monkeypatch.setenv("RESILIENT_TRAIN_REPLICA_GROUP", "1")
        _budget(tmp_path).start()
    state = control_state(tmp_path)
    assert [a["resumed_step"] for a in state.window(0)["attempts"]][-1] is None  # group 0's newest, running
    assert state.window(None)["attempts"] == []  # no record without a group


def test_a_launcher_stops_on_its_own_groups_give_up_only(tmp_path, monkeypatch):
    from trainer.launch.launcher import GiveUpWatch

    watch = GiveUpWatch(tmp_path, generation=3)
    monkeypatch.setenv("RESILIENT_TRAIN_REPLICA_GROUP", "0")
    assert not watch.matches({"generation": 3, "group": 1}) and watch.matches({"generation": 3, "group": 0})
    monkeypatch.delenv("RESILIENT_TRAIN_REPLICA_GROUP")
    assert watch.matches({"generation": 3}) and not watch.matches({"generation": 2})
