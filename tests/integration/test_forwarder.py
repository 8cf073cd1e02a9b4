"""The live forwarder (components.forwarder) against a real MLflow store: a retried step, a crash between the
journal and the cursor, a torn line, a replayed step — no point lost, none duplicated; tables that grow by
appending, system metrics across nodes in a fixed set of keys, a restart that reads only what is new."""

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
    replay = {**_step(2, 4.0), "time": 1_700_000_010.0}  # step 2 replayed after a fault: a second line ...
    _append(metrics, [replay, _step(4, 2.0)])
    again = tracker.start_step("train", one_per_pipeline_run=True)
    assert again == run
    RunFolderForwarder(tracker, again, run_dir).forward(final=True)
    assert _history(tracker, run, "loss") == [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)]  # ... and no second point


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


def test_a_save_is_one_record_and_the_recovery_table_grows_by_appending(tracked):
    run_dir, tracker, run = tracked
    rank0 = EventLog(run_dir, 0)
    rank0.write("checkpoint_committed", step=5, blocking_seconds=0.1, background_seconds=1.0, bytes=100,
                mb_per_second=1.0)
    rank0.write("checkpoint_stall", step=5, ranks=2, loop_wait_seconds=0.7, handoff_seconds=0.3)  # the worst rank's
    rank0.write("recovery", first_step=7, fault_key="sigkill@6:rank=1", fault_keys=["sigkill@6:rank=1"],
                recovery_seconds=1.5, lost_steps=0, reload_seconds=0.1)
    forwarder = RunFolderForwarder(tracker, run, run_dir)
    forwarder.forward()
    assert _history(tracker, run, "checkpoint_loop_wait_seconds") == [(5, 0.7)]
    assert _history(tracker, run, "checkpoint_background_seconds") == [(5, 1.0)]
    assert _history(tracker, run, "recoveries") == [(7, 1.0)] and _history(tracker, run, "lost_steps") == [(7, 0.0)]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracker.tracking_uri)
    first_part = client.download_artifacts(tracker.run_id(run), "recovery_events/part-000000.json")
    table = json.loads(open(first_part).read())
    assert table["data"][0][table["columns"].index("fault_keys")] == "sigkill@6:rank=1"
    rank0.write("recovery", first_step=9, fault_key="exit@8:rank=0", fault_keys=["exit@8:rank=0"],
                recovery_seconds=2.0, lost_steps=1, reload_seconds=0.1)
    RunFolderForwarder(tracker, run, run_dir).forward()  # a restarted forwarder: it counts the rows it sent
    assert _history(tracker, run, "recoveries") == [(7, 1.0), (9, 2.0)]
    parts = sorted(a.path for a in client.list_artifacts(tracker.run_id(run), "recovery_events"))
    assert parts == ["recovery_events/part-000000.json", "recovery_events/part-000001.json"]
    second = json.loads(open(client.download_artifacts(tracker.run_id(run), parts[1])).read())
    assert [row[second["columns"].index("fault_keys")] for row in second["data"]] == ["exit@8:rank=0"]  # only new
    tagged = json.loads(client.get_run(tracker.run_id(run)).data.tags["mlflow.loggedArtifacts"])
    assert {"path": "recovery_events/part-000001.json", "type": "table"} in tagged


def test_step_metrics_at_the_configured_cadence_and_every_event_still_recorded(tracked):
    run_dir, tracker, run = tracked
    _append(RunDir(run_dir).metrics, [_step(step, 10.0 - step / 10) for step in range(1, 13)])
    EventLog(run_dir, 1).write("fault", fault_type="sigkill", key="sigkill@7:rank=1", step=7)
    RunFolderForwarder(tracker, run, run_dir, step_metric_every=5).forward(final=True)
    assert [step for step, _ in _history(tracker, run, "loss")] == [5, 10]
    assert _history(tracker, run, "fault") == [(7, 1.0)]


def test_system_metrics_of_many_nodes_are_a_few_keys_naming_the_worst_node(tracked):
    run_dir, tracker, run = tracked
    samples = RunDir(run_dir).system_samples
    for node, cpu in (("node-0", 20.0), ("node-1", 95.0), ("node-2", 40.0)):
        for at, value in ((1_700_000_000.0, cpu - 10), (1_700_000_010.0, cpu)):  # each node's newest counts
            _append(samples, [{"time": at, "node": node, "sample": 0, "system/cpu_utilization_percentage": value}])
    RunFolderForwarder(tracker, run, run_dir).forward()
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(tracker.tracking_uri).get_run(tracker.run_id(run)).data.metrics
    cpu = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith("system/cpu_utilization_percentage/")}
    assert cpu == {"min": 20.0, "median": 40.0, "max": 95.0, "min_node": 0.0, "max_node": 1.0}
    assert not [k for k in metrics if k.startswith("system/node-")]  # no key per node


def test_a_restarted_forwarder_reads_nothing_before_its_positions(tracked, monkeypatch):
    run_dir, tracker, run = tracked
    _append(RunDir(run_dir).metrics, [_step(step, 1.0) for step in range(1, 1001)])
    EventLog(run_dir, 0).write("recovery", first_step=3, recovery_seconds=1.0, lost_steps=1)
    RunFolderForwarder(tracker, run, run_dir).forward()
    saved = tracker.forwarded_cursor()["offsets"]
    _append(RunDir(run_dir).metrics, [_step(1001, 0.5)])
    import components.forwarder as forwarder_module

    reads = []
    real = forwarder_module.read_new_lines
    monkeypatch.setattr(forwarder_module, "read_new_lines",
                        lambda path, offset=0, **kw: reads.append((str(path), offset)) or real(path, offset, **kw))
    RunFolderForwarder(tracker, run, run_dir).forward()
    assert reads and all(offset == saved.get(str(path).split("/run/", 1)[1], 0) for path, offset in reads)
    assert _history(tracker, run, "loss")[-1] == (1001, 0.5) and _history(tracker, run, "recoveries") == [(3, 1.0)]
