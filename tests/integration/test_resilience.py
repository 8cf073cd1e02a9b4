"""Injected faults recovered by ft_launcher (in-job) and by a job-level relaunch, on 2 CPU ranks."""

import pytest

from components.train.local import TrainingError, run_local_training
from trainer.run.events import read_events
from tests.metrics import STEADY, first_steps, losses_by_step

pytestmark = pytest.mark.integration

STEPS = [*STEADY, "--training.num_steps=24", "--checkpoint.interval_steps=2", "--checkpoint.keep_last=2",
         "--resilience.heartbeat_timeout=8", "--resilience.initial_heartbeat_timeout=90"]
# Every fault type that needs a restart, on alternating ranks, in one run.
SCHEDULE = ("exception@3:rank=0, sigkill@7:rank=1, exit@11:rank=0, hang@15:rank=1, "
            "hang_in_collective@18:rank=0, checkpoint_writer_crash@20:rank=1, slow_rank@22:rank=0")


def _losses(cfg):
    return losses_by_step(cfg.run_dir / "metrics.jsonl")


def test_every_fault_type_is_recovered_with_bit_identical_losses(tmp_path, token_dir, training_config,
                                                               clean_reference):
    # Default budgets: seven faults with progress between them spend nothing (trainer.resilience.budget).
    faulty = training_config(tmp_path / "faulty", "faulty", *STEPS, f"--faults.schedule={SCHEDULE}")
    result = run_local_training(faulty, token_dir)

    assert result["steps"] == 24
    assert _losses(faulty) == first_steps(clean_reference, 24)  # every step, replays included, bit-identical
    assert result["final_loss"] == clean_reference[24]

    faults = read_events(faulty.run_dir, "fault")
    assert [f["fault_type"] for f in faults] == ["exception", "sigkill", "exit", "hang", "hang_in_collective",
                                                 "checkpoint_writer_crash", "slow_rank"]
    recoveries = read_events(faulty.run_dir, "recovery")
    recovered = {r["fault_key"]: r for r in recoveries}
    for fault in faults[:-2]:  # the writer crash and slow_rank need no restart
        record = recovered.get(fault["key"])
        assert record is not None, f"no recovery recorded for {fault['key']}"
        assert record["mechanism"] == "ft_launcher" and record["fault_keys"] == [fault["key"]]
        assert record["reloaded_step"] <= fault["step"]
        assert record["lost_steps"] == fault["step"] - record["reloaded_step"]
        assert record["recovery_seconds"] > 0 and record["reload_seconds"] >= 0
        # One sentence per restart, from the ranks' own records: the drilled rank, first (trainer.resilience.failures).
        assert record["cause"].startswith(f"rank {fault['rank']} failed first: ") and fault["key"] in record["cause"]
    hang = recovered["hang@15:rank=1"]
    assert hang["detect_and_teardown_seconds"] >= 8  # the heartbeat timeout had to expire first
    # The collective each fault left waiting, from the ranks' flight-recorder dumps (trainer.resilience.
    # flight_recorder): the hung rank never reached the one its peer waited in; the killed rank left no dump; the
    # rank hung in a collective of its own was alone in it while its peer entered the next step's.
    assert (hang["hung_collective"]["waiting"], hang["hung_collective"]["behind"]) == ([0], [1])
    assert recovered["sigkill@7:rank=1"]["hung_collective"]["absent"] == [1]
    in_collective = recovered["hang_in_collective@18:rank=0"]["hung_collective"]
    entered = {**{str(r): in_collective["collective"] for r in in_collective["waiting"]}, **in_collective["mismatched"]}
    assert entered["0"] == "gloo:all_reduce" and set(entered) == {"0", "1"}  # named after whichever entered first
    assert "instead" in recovered["hang_in_collective@18:rank=0"]["cause"]
    # The writer of rank 1 failed half-way through the step-20 save (the default thread writer): the save was
    # reported failed on every rank, never committed, and the next save committed.
    failed = read_events(faulty.run_dir, "checkpoint_failed")
    assert {(e["rank"], e["step"]) for e in failed if e["step"] == 20} == {(0, 20), (1, 20)}
    [writer_crash] = [e for e in failed if e["rank"] == 1]
    assert writer_crash["fault_key"] == "checkpoint_writer_crash@20:rank=1"
    # Rank 0's record of the same save may come first in the event store: its writer saw the peer's reset.
    assert "injected checkpoint_writer_crash@20:rank=1" in writer_crash["error"]
    committed = [e["step"] for e in read_events(faulty.run_dir, "checkpoint_committed")]
    assert 20 not in committed and 22 in committed
    # Any other save reported failed was in flight when a peer died (a survivor may record it before it is
    # stopped): never committed.
    assert not {e["step"] for e in failed} & set(committed)
    assert not (faulty.run_dir / "checkpoints" / "step-000020.tmp").exists()
    [absorbed] = read_events(faulty.run_dir, "fault_absorbed")
    assert absorbed["fault_key"] == "slow_rank@22:rank=0" and "no restart needed" in absorbed["why"]
    assert not {"checkpoint_writer_crash@20:rank=1", "slow_rank@22:rank=0"} & set(recovered)


def test_when_the_launcher_gives_up_the_job_is_relaunched(tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "escalate", "--training.num_steps=10", "--checkpoint.interval_steps=2",
                          "--faults.schedule=sigkill@5:rank=1", "--resilience.max_restarts=0",
                          "--resilience.job_restarts=1")
    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 10
    [recovery] = read_events(cfg.run_dir, "recovery")
    assert recovery["mechanism"] == "job_restart" and recovery["fault_type"] == "sigkill"
    # The step-4 save may still have been in flight when the fault hit: then step 2 is the newest committed.
    assert recovery["reloaded_step"] in (2, 4) and recovery["lost_steps"] == 5 - recovery["reloaded_step"]


def test_without_job_restarts_the_failure_is_reported(tmp_path, token_dir, training_config):
    cfg = training_config(tmp_path, "gives-up", "--training.num_steps=6", "--faults.schedule=exception@2:rank=0",
                          "--resilience.max_restarts=0", "--resilience.job_restarts=0")
    with pytest.raises(TrainingError, match="InjectedFault: injected exception at step 2 on rank 0"):
        run_local_training(cfg, token_dir)


def test_in_process_restart_recovers_exceptions_and_hangs_and_escalates(tmp_path, token_dir, training_config,
                                                                        clean_reference):
    steps = [*STEADY, "--training.num_steps=20", "--checkpoint.interval_steps=2", "--resilience.heartbeat_timeout=30"]

    # exception and hang: in-process; the process death goes to ft_launcher; in the new process three more
    # exceptions are in-process too: training progressed between them, so none counts against
    # in_process_max_restarts=2 (escalation on a run without progress: test_restart_budget.py).
    schedule = ("exception@4:rank=1, hang@8:rank=0, sigkill@12:rank=1, exception@14:rank=0, exception@16:rank=1, "
                "exception@18:rank=0")
    faulty = training_config(tmp_path / "faulty", "faulty", *steps, f"--faults.schedule={schedule}",
                             "--resilience.in_process=true", "--resilience.in_process_max_restarts=2",
                             "--resilience.job_restarts=0")
    result = run_local_training(faulty, token_dir)

    assert result["steps"] == 20
    assert _losses(faulty) == first_steps(clean_reference, 20)
    by_fault = {r["fault_key"]: r for r in read_events(faulty.run_dir, "recovery")}
    assert by_fault["exception@4:rank=1"]["mechanism"] == "in_process"
    assert by_fault["hang@8:rank=0"]["mechanism"] == "in_process"
    assert by_fault["sigkill@12:rank=1"]["mechanism"] == "ft_launcher"
    assert by_fault["exception@14:rank=0"]["mechanism"] == "in_process"
    assert by_fault["exception@16:rank=1"]["mechanism"] == "in_process"
    assert by_fault["exception@18:rank=0"]["mechanism"] == "in_process"  # a count of restarts escalated this
    assert by_fault["exception@4:rank=1"]["recovery_seconds"] < 15
    # Both layers reload the node-memory copy of the fault's step (it outlives the worker process too):
    # nothing lost, nothing read from disk.
    for key in by_fault:
        assert (by_fault[key]["reload_source"], by_fault[key]["reloaded_step"], by_fault[key]["lost_steps"]) == \
            ("memory", by_fault[key]["fault_step"], 0), by_fault[key]
