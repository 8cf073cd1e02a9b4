"""One sentence per restart (trainer.resilience.failures) and the start-up watchdog (trainer.resilience.phases),
from records written the way ranks write them."""

import threading
import time

import pytest

from trainer.config.decisions import parse_decisions
from trainer.config.drills import DEFAULT_STARTUP_TIMEOUTS, parse_startup_timeouts
from trainer.config.decisions import classify
from trainer.resilience.failures import explain_restarts, handled_fault_keys, is_lost_peer, record_failure
from trainer.resilience.phases import PhaseWatchdog
from trainer.env import BUDGET_SINCE_ENV
from trainer.run.events import EventLog, read_events

GLOO_PEER_GONE = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                              "[127.0.0.1]:3733. This is typically caused by a remote worker crashing.")


def test_the_first_rank_to_fail_is_named_and_the_others_counted(tmp_path):
    before = time.time()
    record_failure(tmp_path, 2, ValueError("bad batch at step 7: NaN in the logits"), "train", 7)
    for rank in (0, 1, 3):
        record_failure(tmp_path, rank, GLOO_PEER_GONE, "train", 7)
    EventLog(tmp_path, 3).write("rank_failed", how="signal", signal="SIGTERM", message="stopped by SIGTERM",
                                phase="train", step=None, secondary=True)
    [found] = explain_restarts(tmp_path, time.time() + 1, world_size=4)
    assert found["first_failed_rank"] == 2 and found["secondary_errors"] == 4
    assert found["cause"] == ("rank 2 failed first: raised ValueError in training at step 7: bad batch at step 7: "
                              "NaN in the logits; 3 other rank(s) failed after it (lost peer, stopped by the launcher)")
    assert found["silent_ranks"] == [] and before < time.time()


def test_a_rank_killed_without_a_word_is_found_by_its_silence(tmp_path):
    for rank in (0, 2, 3):
        record_failure(tmp_path, rank, GLOO_PEER_GONE, "train", 12)
    [found] = explain_restarts(tmp_path, time.time() + 1, world_size=4)
    assert found["first_failed_rank"] == 1 and "ended without a record of its own" in found["cause"]
    assert "3 other rank(s) failed after it (lost peer)" in found["cause"]


def test_each_failed_attempt_gets_its_sentence_and_a_drill_reads_as_such(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # the attempt every event is stamped with
    EventLog(tmp_path, 1).write("fault", fault_type="sigkill", key="sigkill@30:rank=1", step=30)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "4")  # the restart after it hangs in its start-up
    EventLog(tmp_path, 1).write("hang", phase="restore_fsx", seconds=61.2, timeout_seconds=60.0, step=None)
    record_failure(tmp_path, 0, GLOO_PEER_GONE, "restore_fsx", 0)
    explained = explain_restarts(tmp_path, time.time() + 1, world_size=2)
    assert [found["cause"] for found in explained] == [
        "rank 1 failed first: was killed by SIGKILL after step 30 (drill sigkill@30:rank=1)",
        "rank 1 failed first: hung in start-up phase restore_fsx (no progress for 61 s, timeout 60 s); "
        "1 other rank(s) failed after it (lost peer)"]
    # Records before the last recovery were explained by it (as the hooks write it: the faults it answers, and
    # where its explanation stopped reading).
    EventLog(tmp_path, 0).write("recovery", fault_key="sigkill@30:rank=1", fault_keys=["sigkill@30:rank=1"],
                                failures_offset=explained[-1]["failures_offset"])
    [found] = explain_restarts(tmp_path, time.time() + 1, world_size=2)
    assert found["cause"].startswith("no rank recorded a failure")


def test_peer_errors_are_secondary_and_own_errors_are_not():
    assert is_lost_peer(GLOO_PEER_GONE)
    assert is_lost_peer(RuntimeError("NCCL error: remote process exited or there was a network error"))
    # torchft's quorum call when the group's rank 0, which hosts its manager server, died (a CI run's crash-loop
    # test: counted as this rank's own error, its second occurrence read as deterministic and stopped the group)
    assert is_lost_peer(RuntimeError('status: Unknown, message: "transport error", details: [], metadata: '
                                     'MetadataMap { headers: {} }'))
    assert is_lost_peer(RuntimeError('status: Unavailable, message: "error trying to connect"'))
    assert not is_lost_peer(ValueError("loss is NaN at step 7"))
    assert not is_lost_peer(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))


def test_the_watchdog_names_a_phase_past_its_timeout_and_not_one_left_in_time():
    hung = []
    fired = threading.Event()
    watchdog = PhaseWatchdog({"model_build": 0.3, "first_step": 0.3},
                             on_hang=lambda phase, seconds, timeout: (hung.append((phase, timeout)), fired.set()),
                             poll_seconds=0.05)
    with watchdog.phase("model_build"):
        time.sleep(0.1)  # in time
    time.sleep(0.4)
    assert hung == []
    watchdog.enter("first_step")
    assert fired.wait(5) and hung == [("first_step", 0.3)]
    watchdog.close()


def test_a_restore_tier_inside_restore_has_its_own_clock():
    hung = []
    watchdog = PhaseWatchdog({"restore": 0.5, "restore_fsx": 2.0},
                             on_hang=lambda phase, seconds, timeout: hung.append(phase), poll_seconds=0.05)
    watchdog.enter("restore")
    with watchdog.phase("restore_fsx"):
        time.sleep(0.8)  # longer than restore's timeout: the tier's own clock runs
    assert hung == [] and watchdog.current_phase == "restore"
    time.sleep(0.3)  # restore's clock started again after the tier
    assert hung == []
    time.sleep(0.5)
    assert hung == ["restore"]
    watchdog.close()


def test_startup_timeouts_override_the_defaults_by_name():
    timeouts = parse_startup_timeouts("model_build=5, restore_fsx=7.5")
    assert timeouts == {**DEFAULT_STARTUP_TIMEOUTS, "model_build": 5.0, "restore_fsx": 7.5}
    with pytest.raises(ValueError, match="PHASE one of"):
        parse_startup_timeouts("restore_nvme=5")


def test_a_fault_is_handled_once_a_recovery_names_it_or_it_was_absorbed(tmp_path):
    """The one set of handled faults that the recovery record and the restart's sentence both skip (issue 31):
    a drill that needed no restart (an absorbed slow rank, a writer crash the next save covered) is no cause."""
    log = EventLog(tmp_path, 0)

    def fault(kind: str, step: int) -> str:
        key = f"{kind}@{step}:rank=0"
        log.write("fault", key=key, fault_type=kind, step=step)
        return key

    named = fault("sigkill", 4)
    log.write("recovery", fault_key=named, fault_keys=[named])
    absorbed = fault("slow_rank", 5)
    log.write("fault_absorbed", fault_key=absorbed, why="no restart needed")
    crashed = fault("checkpoint_writer_crash", 6)
    log.write("checkpoint_failed", step=6, fault_key=crashed, error="injected")
    log.write("checkpoint_failed", step=7, fault_key=None, error="a real write failure names no drill")
    fault("exception", 8)
    assert handled_fault_keys(read_events(tmp_path)) == {named, absorbed, crashed}
    [found] = explain_restarts(tmp_path, time.time() + 1, world_size=1)
    assert found["first_failure"] == "raised InjectedFault after step 8 (drill exception@8:rank=0)"


def test_a_failure_records_its_frame_and_the_same_one_again_is_deterministic_and_stops(tmp_path, monkeypatch):
    monkeypatch.setenv(BUDGET_SINCE_ENV, "0")

    def fail():
        raise KeyError("tokens.json has no 'corpus'")

    for attempt in range(2):
        try:
            fail()
        except KeyError as err:
            record = record_failure(tmp_path, 1, err, "train", 7)
        assert record["frame"]["function"] == "fail" and record["frame"]["file"].endswith("test_failures.py")
        assert "raise KeyError" in record["traceback"]
    first, second = [r for r in read_events(tmp_path, "rank_failed")]
    assert (first["cause"], first["decision"]) == ("transient", "restart")
    assert (second["cause"], second["decision"]) == ("deterministic", "stop")
    [found] = explain_restarts(tmp_path, time.time() + 1, world_size=2)
    assert (found["decision"], found["decided_cause"]) == ("restart", "transient")  # the first failure's


@pytest.mark.parametrize("record, gpu, cause", [
    ({"message": "CUDA error: uncorrectable ECC error encountered", "error_type": "RuntimeError"}, None, "hardware"),
    ({"message": "bad", "error_type": "RuntimeError"}, {"node_bad": True, "node_bad_xids": [94]}, "hardware"),
    ({"message": "Connection closed by peer", "error_type": "DistBackendError", "secondary": True}, None, "lost_peer"),
    ({"message": "injected exception", "error_type": "InjectedFault"}, None, "transient"),
    ({"message": "boom", "error_type": "KeyError"}, None, "transient"),
    ({"message": "CUDA out of memory. Tried to allocate 2.00 GiB", "error_type": "OutOfMemoryError"}, None,
     "out_of_memory"),
    ({"message": "CUDA error: out of memory", "error_type": "RuntimeError"}, None, "out_of_memory"),
])
def test_the_rules_of_the_table(record, gpu, cause):
    assert classify({**record, "fingerprint": "f"}, False, gpu)[0] == cause
    # the same failure a second time in the launch: a restart met it again (the exception drill stands for a
    # transient crash however often it repeats)
    again = "deterministic" if cause in ("transient", "out_of_memory") and record["error_type"] != "InjectedFault" \
        else cause
    assert classify({**record, "fingerprint": "f"}, True, gpu)[0] == again


@pytest.mark.parametrize("text, error", [("deterministic=restart,hardware=restart", None),
                                         ("oom=stop", "CAUSE one of"), ("transient=rollback", "only data"),
                                         ("data=restart", "rolled back or stops"), ("hardware=reboot", "one of")])
def test_the_decisions_a_user_overrides(text, error):
    if error is None:
        assert parse_decisions(text) == {"hardware": "restart", "lost_peer": "restart", "deterministic": "restart",
                                         "out_of_memory": "restart", "data": "rollback", "transient": "restart",
                                         "input": "stop"}
    else:
        with pytest.raises(ValueError, match=error):
            parse_decisions(text)


def test_the_oom_killers_count_is_read_from_the_cgroup_and_folded_per_node(tmp_path):
    from trainer.observe.memory import oom_kills
    from trainer.run.history import ControlState

    v2, v1 = tmp_path / "memory.events", tmp_path / "memory.oom_control"
    v2.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kills((v2, v1)) == 2 and oom_kills((tmp_path / "absent", v1)) == 5
    assert oom_kills((tmp_path / "absent",)) is None
    state = ControlState().fold([{"event": "node_oom_kills", "time": 1.0, "node": "pod-3", "oom_kill": 2, "new": 0},
                                 {"event": "node_oom_kills", "time": 2.0, "node": "pod-3", "oom_kill": 3, "new": 1}])
    assert state.oom_kills == {"pod-3": 3}
