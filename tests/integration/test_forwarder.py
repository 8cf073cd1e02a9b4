"""The live forwarder (components.forwarder) against a real MLflow store: a retried step, a crash between the
journal and the cursor, a torn line, an outage — no point lost, none duplicated."""

import json

import pytest

from components.forwarder import RunFolderForwarder
from components.tracking import Tracker
from trainer.run.events import EventLog
from trainer.run.run_dir import RunDir

pytestmark = pytest.mark.integration


def _append(path, records, torn: str = ""):
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in records) + torn)


def _step(step, loss):
    return {"step": step, "loss": loss, "lr": 0.1, "time": 1_700_000_000.0 + step}


def _history(tracker, run, key):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.tracking_uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id(run), key))


@pytest.fixture
def tracked(tmp_path):
    run_dir = tmp_path / "run"
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "forwarding", "fw", run_dir,
                      artifact_location=(tmp_path / "artifacts").as_uri())
    tracker.start_parent({}, {})
    run = tracker.start_step("train", one_per_pipeline_run=True)
    return run_dir, tracker, run


def test_a_retried_step_continues_where_the_journal_stopped(tracked):
    run_dir, tracker, run = tracked
    metrics = RunDir(run_dir).metrics
    _append(metrics, [_step(1, 5.0), _step(2, 4.0)], torn='{"step": 3, "lo')  # step 3 is still being written
    assert RunFolderForwarder(tracker, run, run_dir).forward() == 4  # loss and lr of steps 1-2
    # The step dies and is retried: a new forwarder, the same train run, the rest of the file.
    with metrics.open("a") as handle:
        handle.write('ss": 3.0, "lr": 0.1, "time": 1700000003.0}\n')
    replay = {**_step(2, 4.0), "time": 1_700_000_010.0}  # step 2 replayed after a fault: a second line, a second point
    _append(metrics, [replay, _step(4, 2.0)])
    again = tracker.start_step("train", one_per_pipeline_run=True)
    assert again == run
    RunFolderForwarder(tracker, again, run_dir).forward(final=True)
    assert _history(tracker, run, "loss") == [(1, 5.0), (2, 4.0), (2, 4.0), (3, 3.0), (4, 2.0)]


def test_rows_journaled_twice_after_a_crash_are_not_duplicated(tracked, monkeypatch):
    run_dir, tracker, run = tracked
    _append(RunDir(run_dir).metrics, [_step(1, 5.0), _step(2, 4.0)])
    real_write_json = __import__("components.tracking", fromlist=["write_json"]).write_json

    def crash_before_the_cursor(path, payload, **kwargs):
        if path.name == "forwarded.json":
            raise KeyboardInterrupt("killed between the journal and the cursor")
        return real_write_json(path, payload, **kwargs)

    monkeypatch.setattr("components.tracking.write_json", crash_before_the_cursor)
    with pytest.raises(KeyboardInterrupt):
        RunFolderForwarder(tracker, run, run_dir).forward()
    monkeypatch.setattr("components.tracking.write_json", real_write_json)
    RunFolderForwarder(tracker, run, run_dir).forward(final=True)  # journals the same rows again
    tracker.flush()
    assert _history(tracker, run, "loss") == [(1, 5.0), (2, 4.0)]


def test_commits_wait_for_every_ranks_stall_and_recoveries_make_a_table(tracked):
    run_dir, tracker, run = tracked
    rank0, rank1 = EventLog(run_dir, 0), EventLog(run_dir, 1)
    rank0.write("checkpoint_stall", step=5, loop_wait_seconds=0.2, handoff_seconds=0.1)
    rank0.write("checkpoint_committed", step=5, blocking_seconds=0.1, background_seconds=1.0, bytes=100,
                mb_per_second=1.0)
    forwarder = RunFolderForwarder(tracker, run, run_dir)
    (RunDir(run_dir).events_of(1)).touch()
    forwarder.forward()  # rank 1's stall is not in yet: the commit waits
    assert _history(tracker, run, "checkpoint_loop_wait_seconds") == []
    rank1.write("checkpoint_stall", step=5, loop_wait_seconds=0.7, handoff_seconds=0.3)
    forwarder = RunFolderForwarder(tracker, run, run_dir)  # a retried step: the waiting commit is not lost
    rank0.write("recovery", first_step=7, fault_key="sigkill@6:rank=1", fault_keys=["sigkill@6:rank=1"],
                recovery_seconds=1.5, lost_steps=0, reload_seconds=0.1)
    forwarder.forward()
    assert _history(tracker, run, "checkpoint_loop_wait_seconds") == [(5, 0.7)]  # the worst rank
    assert _history(tracker, run, "recoveries") == [(7, 1.0)] and _history(tracker, run, "lost_steps") == [(7, 0.0)]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.tracking_uri)
    table = json.loads(open(client.download_artifacts(tracker.run_id(run), "recovery_events.json")).read())
    assert table["data"][0][table["columns"].index("fault_keys")] == "sigkill@6:rank=1"
    rank0.write("recovery", first_step=9, fault_key="exit@8:rank=0", fault_keys=["exit@8:rank=0"],
                recovery_seconds=2.0, lost_steps=1, reload_seconds=0.1)
    forwarder.forward()
    table = json.loads(open(client.download_artifacts(tracker.run_id(run), "recovery_events.json")).read())
    assert len(table["data"]) == 2  # replaced as it grows, not appended to
