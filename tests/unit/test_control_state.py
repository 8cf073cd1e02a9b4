"""The control records folded (trainer.run.history): a start reads a bounded summary and what was appended since,
and what it keeps is what the restart budget, the drills and the reports need — however many faults."""

import json
import random

from trainer.resilience.budget import no_progress_streak
from trainer.run.events import EventLog
from trainer.run.history import RECENT_RECOVERIES, ControlState, control_state, recent_recoveries, whole_history
from trainer.run.run_dir import RunDir


def _restart(log, *, resumed, fault_key=None, recovery=True, scope="step:1"):
    log.write("attempt", layer="ft_launcher", pid=1, generation=1, scope=scope)
    log.write("resume", step=resumed, source="memory", path=None)
    if recovery:
        log.write("recovery", fault_key=fault_key, fault_keys=[fault_key] if fault_key else [], mechanism="ft_launcher",
                  recovery_seconds=2.0, lost_steps=1, first_step=resumed + 1, failures_offset=0)


def test_a_start_reads_the_summary_and_only_what_was_appended_since(tmp_path):
    log = EventLog(tmp_path, 0)
    log.write("attempt", layer="first_start", pid=1, generation=1, scope="step:1")
    log.write("fault", fault_type="sigkill", key="sigkill@5:rank=0", step=5)
    _restart(log, resumed=4, fault_key="sigkill@5:rank=0")
    first = control_state(tmp_path, save=True)
    assert first.offset == RunDir(tmp_path).control_log.stat().st_size
    _restart(log, resumed=9)
    again = control_state(tmp_path, save=True)  # the snapshot, and the one restart after it
    whole = ControlState().fold([json.loads(line) for line in RunDir(tmp_path).control_log.read_text().splitlines()
                                 if line.strip()])
    assert {**again.to_json(), "offset": 0} == {**whole.to_json(), "offset": 0}
    assert again.recoveries["count"] == 2 and again.fired_fault_keys == ["sigkill@5:rank=0"]
    assert again.unhandled_faults == []  # the recovery named it


def test_trimming_keeps_every_no_progress_streak_the_budget_can_count():
    """The window drops the attempts a streak can no longer reach; for every history and every moment, the streak
    the budget counts on the window is the one it would count on the whole history."""
    rnd = random.Random(7)
    for _ in range(300):
        trimmed, whole = ControlState(), ControlState()
        now = 0.0
        for _ in range(rnd.randrange(1, 25)):
            now += 1.0
            attempt = {"event": "attempt", "time": now, "layer": "ft_launcher", "scope": "s"}
            for state, keep in ((trimmed, False), (whole, True)):
                state.fold([attempt], whole=keep)
            resumed = rnd.choice([None, rnd.randrange(0, 6), rnd.randrange(0, 6)])
            events = []
            if resumed is not None:
                events.append({"event": "resume", "time": now + 0.1, "step": resumed})
            if rnd.random() < 0.1:
                events.append({"event": "escalated", "time": now + 0.2})
            for current in (None, rnd.randrange(0, 7)):  # the budget's checks before and after the resume
                counted = [[a["resumed_step"] for a in s.attempts[:-1] if not a["escalated"]] for s in (trimmed, whole)]
                assert no_progress_streak(counted[0], current) == no_progress_streak(counted[1], current)
            for state, keep in ((trimmed, False), (whole, True)):
                state.fold(events, whole=keep)


def test_what_a_start_reads_stays_bounded_after_the_hundredth_fault(tmp_path):
    log = EventLog(tmp_path, 0)
    log.write("attempt", layer="first_start", pid=1, generation=1, scope="step:1")
    sizes = {}
    for fault in range(1, 201):  # every restart progressed: 200 recoveries in one launch
        _restart(log, resumed=10 * fault)
        if fault in (20, 200):
            control_state(tmp_path, save=True)
            sizes[fault] = RunDir(tmp_path).control_state.stat().st_size
    state = control_state(tmp_path)
    assert state.recoveries["count"] == 200
    recent = recent_recoveries(tmp_path)  # read back from the end of the control records
    assert [r["first_step"] for r in recent] == [10 * fault + 1 for fault in range(201 - RECENT_RECOVERIES, 201)]
    assert len(state.attempts) <= 3 and state.attempts_total == 201  # the last progress, the ended one, the running one
    assert sizes[200] <= sizes[20] + 64  # a few more digits in the counters, nothing per fault
    assert len(whole_history(tmp_path).attempts) == 201  # tests and tools can still see every attempt
