"""The local pipeline's MLflow deliverer (components/delivery.py): while the driving process holds the spool,
steps in other processes journal without importing MLflow and still get run ids; when it is gone (or cannot
reach the server) they deliver for themselves, and nothing is lost or doubled."""

import json
import subprocess
import sys
import textwrap

import pytest

from components.context import tracker
from components.delivery import SpoolDeliverer
from components.tracking import DELIVERER_UNREACHABLE
from trainer.config import load_config

pytestmark = pytest.mark.integration

# A pipeline step in its own process: prepare's and a step's records, then the ids that need delivery.
STEP = textwrap.dedent("""
    import json, sys, time
    from components.context import tracker
    from trainer.config import load_config
    cfg = load_config("local", sys.argv[1:])
    mlflow = tracker(cfg)
    mlflow.start_parent(params={"a": "1"}, tags={})
    run = mlflow.start_step("validate")
    mlflow.log_metrics(run, [{"step": s, "loss": 1.0 / s, "time": 1_700_000_000 + s} for s in range(1, 21)])
    journaled_without_mlflow = "mlflow" not in sys.modules
    started = time.monotonic()
    ids = {"parent": mlflow.run_id(), "step": mlflow.run_id(run)}
    mlflow.end_run(run, "FINISHED")
    print(json.dumps({"journaled_without_mlflow": journaled_without_mlflow, "ids": ids, "run": run,
                      "pending": mlflow.pending(), "id_seconds": time.monotonic() - started}))
""")


def _step(cfg_args, cwd):
    done = subprocess.run([sys.executable, "-c", STEP, *cfg_args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _args(tmp_path, run_id):
    return [f"--run.work_dir={tmp_path / 'work'}", f"--run.run_id={run_id}"]


def test_steps_journal_and_the_deliverer_delivers_once(tmp_path, request):
    from mlflow.tracking import MlflowClient

    args = _args(tmp_path, "delivered")
    cfg = load_config("local", args)
    with SpoolDeliverer(tracker(cfg)):
        out = _step(args, request.config.rootpath)
    assert out["journaled_without_mlflow"]  # the step paid for no MLflow import
    assert all(out["ids"].values()) and out["pending"] == 0
    client = MlflowClient(cfg.tracking_uri)
    history = client.get_metric_history(out["ids"]["step"], "loss")
    assert sorted(m.step for m in history) == list(range(1, 21))  # each once
    assert client.get_run(out["ids"]["step"]).info.status == "FINISHED"  # delivered by the deliverer's exit
    assert client.get_run(out["ids"]["step"]).data.tags["mlflow.parentRunId"] == out["ids"]["parent"]


def test_without_a_live_deliverer_steps_deliver_for_themselves(tmp_path, request):
    args = _args(tmp_path, "no-deliverer")
    cfg = load_config("local", args)
    deliverer = SpoolDeliverer(tracker(cfg)).__enter__()
    deliverer.__exit__(None, None, None)  # a driver that went away: its lock file stays, unlocked
    out = _step(args, request.config.rootpath)
    assert not out["journaled_without_mlflow"] and all(out["ids"].values()) and out["pending"] == 0


def test_a_deliverer_that_cannot_reach_the_server_does_not_hold_steps_up(tmp_path, request):
    """The server is down: the step gets no ids and a pending count after its own attempt, not after the
    60 s it would wait for a deliverer that is making progress."""
    args = [*_args(tmp_path, "outage"), "--mlflow.tracking_uri=http://127.0.0.1:9"]  # nothing listens on port 9
    cfg = load_config("local", args)
    with SpoolDeliverer(tracker(cfg), interval=0.05):
        out = _step(args, request.config.rootpath)
        assert (cfg.run_dir / "mlflow-spool" / DELIVERER_UNREACHABLE).exists()
    assert out["ids"] == {"parent": None, "step": None} and out["pending"] == 4  # all four records kept
    assert out["id_seconds"] < 30
