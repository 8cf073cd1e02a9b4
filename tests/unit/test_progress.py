"""TrainJob progress (trainer.observe.progress): status.trainerStatus as Kubeflow Trainer's API admits it, sent the way
its controller's server expects, and never in training's way.

Sources of the rules encoded here:
- the TrainJob CRD of Kubeflow Trainer v2.3.0 (tests/data/crds/trainer_trainjobs.yaml, upstream
  manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml): status.trainerStatus with progressPercentage
  int32 0-100, estimatedRemainingSeconds int32 >= 0, metrics[] of {name, value} strings of 1-64 characters,
  at most 256, and the CEL rule `has(self.lastUpdatedTime)` ("lastUpdatedTime is required when
  trainerStatus is present"), which the schema validator does not run: it is checked here by hand;
- lastUpdatedTime is a metav1.Time: RFC 3339 (the API server parses it with Go's time.RFC3339);
- the client side, as transformers' KubeflowCallback (integrations/integration_utils.py) and the KEP-2779
  design do it: POST {"trainerStatus": ...} to KUBEFLOW_TRAINER_SERVER_URL with the bearer token read from the
  file KUBEFLOW_TRAINER_SERVER_TOKEN names (a projected token that the kubelet rotates), TLS against
  KUBEFLOW_TRAINER_SERVER_CA_CERT.
"""

import datetime
import http.server
import json
import threading
import time

import pytest

from tests.crd_schema import crd_errors
from trainer.config import load_config
from trainer.env import TRAINER_SERVER_TOKEN_ENV, TRAINER_SERVER_URL_ENV
from trainer.observe.progress import (ProgressReporter, StatusSender, expected_remaining_seconds, progress_line,
                                      trainer_status)


def _with_status(status: dict) -> dict:
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": {"name": "run"},
            "spec": {"runtimeRef": {"name": "resilient-train-fsdp-nvrx"}}, "status": {"trainerStatus": status}}


def _admitted(status: dict) -> None:
    assert crd_errors(_with_status(status)) == []
    assert "lastUpdatedTime" in status  # the CEL rule on trainerStatus
    datetime.datetime.strptime(status["lastUpdatedTime"], "%Y-%m-%dT%H:%M:%SZ")


def test_the_status_stays_within_the_crds_limits():
    status = trainer_status(step=37, num_steps=200, eta_seconds=1e12, now=1796180000.0, metrics={
        "loss": 2.123456789, "straggler": "rank 1 optimizer 0.54 " * 10, "empty": "", "missing": None,
        **{f"m{i}": i for i in range(300)}})
    _admitted(status)
    assert status["progressPercentage"] == 18 and status["estimatedRemainingSeconds"] == 2**31 - 1
    values = {m["name"]: m["value"] for m in status["metrics"]}
    assert values["loss"] == "2.123" and len(values["straggler"]) == 64
    assert "empty" not in values and "missing" not in values and len(status["metrics"]) == 256
    # A schema violation is caught (the check can fail): 101 % and a 65-character name.
    assert crd_errors(_with_status({**status, "progressPercentage": 101}))
    assert crd_errors(_with_status({**status, "metrics": [{"name": "n" * 65, "value": "1"}]}))


def test_the_last_step_alone_reports_100_percent():
    assert trainer_status(step=199, num_steps=200, eta_seconds=3, now=0, metrics={})["progressPercentage"] == 99
    assert trainer_status(step=200, num_steps=200, eta_seconds=None, now=0, metrics={})["progressPercentage"] == 99
    done = trainer_status(step=200, num_steps=200, eta_seconds=None, now=0, metrics={}, finished=True)
    assert done["progressPercentage"] == 100 and done["estimatedRemainingSeconds"] == 0
    _admitted(done)


def test_the_eta_includes_the_planners_expected_fault_and_restart_time():
    cfg = load_config("local", ["--checkpoint.auto_node_mtbf_hours=1"])
    plain = 1000 * 2.0
    eta = expected_remaining_seconds(cfg, remaining_steps=1000, step_seconds=2.0, nodes=1, restart_seconds=None)
    slow_restarts = expected_remaining_seconds(cfg, remaining_steps=1000, step_seconds=2.0, nodes=1,
                                               restart_seconds=300.0)
    more_nodes = expected_remaining_seconds(cfg, remaining_steps=1000, step_seconds=2.0, nodes=64,
                                            restart_seconds=None)
    assert plain < eta < slow_restarts and eta < more_nodes


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self, code: int = 200):
        self.requests, self.code = [], code
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/apis/trainer.kubeflow.org/v1alpha1/namespaces/ns/trainjobs/run/status"


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        self.send_response(self.server.code)
        self.end_headers()

    def log_message(self, *args):
        pass


def _wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


def test_the_sender_posts_the_status_with_the_token_read_again_each_time(tmp_path):
    server = _Server()
    token = tmp_path / "token"
    token.write_text("first\n")
    sender = StatusSender(server.url, str(token), ca_file=None)
    sender.send(trainer_status(step=1, num_steps=10, eta_seconds=9, now=time.time(), metrics={"loss": 3.0}))
    assert _wait_for(lambda: len(server.requests) == 1)
    token.write_text("rotated\n")  # the kubelet replaced the projected token
    sender.send(trainer_status(step=2, num_steps=10, eta_seconds=8, now=time.time(), metrics={"loss": 2.0}))
    assert _wait_for(lambda: len(server.requests) == 2)
    sender.close()
    first, second = server.requests
    assert first["auth"] == "Bearer first" and second["auth"] == "Bearer rotated"
    assert first["path"].endswith("/trainjobs/run/status") and set(first["body"]) == {"trainerStatus"}
    _admitted(second["body"]["trainerStatus"])
    assert sender.sent == 2 and sender.failures == 0
    server.shutdown()


def test_a_failing_or_missing_server_never_holds_up_or_stops_training(tmp_path, caplog):
    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=p", "--kubernetes.progress_interval_seconds=1"])
    refusing = _Server(code=500)
    for url in (refusing.url, "http://127.0.0.1:9/status"):  # a 500, and nothing listening
        clock = [1000.0]
        reporter = ProgressReporter(cfg, rank=0, nodes=1, launched_at=990.0, clock=lambda: clock[0],
                                    environ={TRAINER_SERVER_URL_ENV: url, TRAINER_SERVER_TOKEN_ENV: str(tmp_path / "absent")})
        started = time.perf_counter()
        for step in range(1, 40):
            clock[0] += 0.5
            reporter.observe(step, {"loss": 1.0, "tokens_per_second": 100.0})
        assert time.perf_counter() - started < 2.0  # the loop never waits for the server
        reporter.finish(39, {"loss": 1.0})
        assert reporter.sender.failures >= 1 and reporter.sender.sent == 0
    assert "training goes on" in caplog.text
    refusing.shutdown()


def test_the_reporter_throttles_and_writes_the_status_the_train_step_logs(tmp_path):
    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=p", "--training.num_steps=100",
                                "--kubernetes.progress_interval_seconds=30"])
    server = _Server()
    clock = [1000.0]
    reporter = ProgressReporter(cfg, rank=0, nodes=1, launched_at=1000.0, restarted=True,
                                clock=lambda: clock[0], environ={TRAINER_SERVER_URL_ENV: server.url})
    for step in range(1, 61):
        clock[0] += 1.0
        reporter.observe(step, {"loss": 2.5, "tokens_per_second": 500.0}, straggler="rank 1 optimizer 0.54")
        if step in (1, 31):  # the sender keeps only the newest status: let this one go out before the next
            assert _wait_for(lambda: len(server.requests) == (1 if step == 1 else 2))
    reporter.finish(100, {"loss": 2.0})
    # One update per 30 s of training (steps 1, 31) and the last one, forced.
    assert [r["body"]["trainerStatus"]["progressPercentage"] for r in server.requests] == [1, 31, 100]
    status = json.loads(cfg.run_dir.joinpath("trainer_status.json").read_text())
    assert status == server.requests[-1]["body"]["trainerStatus"]
    values = {m["name"]: m["value"] for m in server.requests[1]["body"]["trainerStatus"]["metrics"]}
    assert values["restarts"] == "1" and values["straggler"] == "rank 1 optimizer 0.54"
    assert float(values["goodput"]) == pytest.approx(1.0, abs=0.05)
    line = progress_line(server.requests[1]["body"]["trainerStatus"])
    assert line.startswith("progress 31% (step 31/100), ETA ") and "straggler rank 1 optimizer 0.54" in line
    server.shutdown()


def test_other_ranks_and_runs_without_the_server_send_nothing(tmp_path):
    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=p"])
    assert ProgressReporter(cfg, rank=1, nodes=1, launched_at=0, environ={TRAINER_SERVER_URL_ENV: "http://x"}).sender is None
    local = ProgressReporter(cfg, rank=0, nodes=1, launched_at=0, environ={})
    assert local.sender is None
    local.observe(1, {"loss": 1.0})
    assert cfg.run_dir.joinpath("trainer_status.json").is_file()  # the train step's log still gets it
