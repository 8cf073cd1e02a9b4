"""The trainer's Prometheus endpoint, scraped over HTTP."""

import urllib.request

from pipelines.local_stack import free_port
from trainer.observe.telemetry import Telemetry


def test_metrics_endpoint_serves_step_loss_stall_recoveries_and_straggler_scores(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    port = free_port()
    telemetry = Telemetry(port, "run-x", rank=0)
    telemetry.observe_step({"step": 7, "loss": 1.25, "tokens_per_second": 900.0, "step_seconds": 0.5},
                           checkpoint_stall=0.125)
    telemetry.observe_recovery("in_process")
    telemetry.observe_straggler({"step": 0.5, "optimizer": 0.42}, is_straggler=True)
    Telemetry(port, "run-x", rank=0).observe_recovery("in_process")  # an in-process restart: same server, same series
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'resilient_train_step{rank="0",run_id="run-x"} 7.0' in body
    assert 'resilient_train_loss{rank="0",run_id="run-x"} 1.25' in body
    assert 'resilient_train_checkpoint_stall_seconds{rank="0",run_id="run-x"} 0.125' in body
    assert 'resilient_train_recoveries_total{mechanism="in_process",rank="0",run_id="run-x"} 2.0' in body
    assert 'resilient_train_straggler{rank="0",run_id="run-x"} 1.0' in body
    assert 'resilient_train_straggler_score{rank="0",run_id="run-x",section="optimizer"} 0.42' in body


def test_off_by_default():
    telemetry = Telemetry(0, "run-x", rank=0)
    telemetry.observe_step({"step": 1, "loss": 1.0, "tokens_per_second": 1.0, "step_seconds": 1.0}, None)
    assert telemetry.enabled is False
