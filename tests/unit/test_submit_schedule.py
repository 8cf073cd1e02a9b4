"""submit / schedule against a stand-in for the KFP API (the backend cannot exist here): every body sent
is a kfp-server-api model and round-trips through the generated client's own (de)serializer."""

import inspect
import json
from types import SimpleNamespace

import kfp
import kfp_server_api
import pytest

from pipelines.cli import main
from pipelines.submit import SubmitError, schedule, submit, validate_cron
from trainer.config import load_config

EKS = "pipelines/configs/eks-prod.yaml"


def roundtrip(body, model: str):
    """Serialize as the API client does, and parse back as the server-side model."""
    api = kfp_server_api.ApiClient()
    wire = json.dumps(api.sanitize_for_serialization(body))
    parsed = api.deserialize(SimpleNamespace(data=wire), model)
    assert api.sanitize_for_serialization(parsed) == json.loads(wire)
    return json.loads(wire)


class FakeKfp:
    """Every public call is bound to the real kfp.Client method's signature first (a call the real client
    would reject fails here), and the namespaces it is given are recorded."""

    def __init__(self):
        self.runs, self.recurring, self.disabled, self.deleted = [], [], [], []
        self.namespaces = []
        self._run_api = SimpleNamespace(run_service_create_run=self._create_run)
        self._recurring_run_api = SimpleNamespace(recurring_run_service_create_recurring_run=self._create_recurring)

    def __getattribute__(self, name):
        attribute = object.__getattribute__(self, name)
        if name.startswith("_") or not callable(attribute) or not hasattr(kfp.Client, name):
            return attribute
        real = inspect.signature(getattr(kfp.Client, name))

        def checked(*args, **kwargs):
            bound = real.bind(None, *args, **kwargs)
            if "namespace" in real.parameters:
                object.__getattribute__(self, "namespaces").append(bound.arguments.get("namespace"))
            return attribute(*args, **kwargs)

        return checked

    def get_experiment(self, experiment_name, namespace=None):
        if experiment_name != "resilient-train":
            raise ValueError("no experiment")
        return SimpleNamespace(experiment_id="exp-1")

    def create_experiment(self, name, namespace=None):
        return SimpleNamespace(experiment_id="exp-new")

    def _matching(self, items, filter):
        name = json.loads(filter)["predicates"][0]["string_value"]
        return [item for item in items if item.display_name == name]

    def list_runs(self, experiment_id, filter, page_size, namespace=None):
        return SimpleNamespace(runs=self._matching(self.runs, filter))

    def _create_run(self, run):
        assert isinstance(run, kfp_server_api.V2beta1Run)
        roundtrip(run, "V2beta1Run")
        run.run_id = f"run-{len(self.runs) + 1}"
        self.runs.append(run)
        return run

    def list_recurring_runs(self, experiment_id, filter, page_size, namespace=None):
        return SimpleNamespace(recurring_runs=[r for r in self._matching(self.recurring, filter)
                                               if r.recurring_run_id not in self.deleted])

    def _create_recurring(self, recurring_run):
        assert isinstance(recurring_run, kfp_server_api.V2beta1RecurringRun)
        roundtrip(recurring_run, "V2beta1RecurringRun")
        recurring_run.recurring_run_id = f"rr-{len(self.recurring) + 1}"
        self.recurring.append(recurring_run)
        return recurring_run

    def disable_recurring_run(self, recurring_run_id):
        self.disabled.append(recurring_run_id)

    def delete_recurring_run(self, recurring_run_id):
        self.deleted.append(recurring_run_id)


@pytest.fixture
def cfg():
    return load_config(EKS)


def test_submit_is_idempotent_and_tags_the_trigger(cfg):
    kfp = FakeKfp()
    args = dict(experiment="resilient-train", trigger="ci", key="GH 8812-1", service_account="resilient-train-pipeline",
                dry_run=False)
    first = submit(kfp, cfg, **args)
    again = submit(kfp, cfg, **args)
    assert first == {"action": "submitted", "run_id": "run-1", "display_name": "gh-8812-1"}
    assert again == {"action": "exists", "run_id": "run-1", "display_name": "gh-8812-1"}
    [run] = kfp.runs
    assert run.runtime_config.parameters["overrides"] == ["run.trigger=ci", "run.run_id=gh-8812-1"]
    assert run.service_account == "resilient-train-pipeline" and run.experiment_id == "exp-1"
    assert run.pipeline_spec["pipeline_spec"]["pipelineInfo"]["name"] == "resilient-train"
    assert "kubernetes" in run.pipeline_spec["platform_spec"]["platforms"]


def test_dry_run_prints_the_body_that_would_be_sent(cfg, capsys):
    assert main(["submit", "--config", EKS, "--idempotency-key", "k1", "--trigger", "ci", "--dry-run"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["action"] == "dry-run"
    body = roundtrip(kfp_server_api.ApiClient().deserialize(SimpleNamespace(data=json.dumps(printed["request"])),
                                                            "V2beta1Run"), "V2beta1Run")
    assert body["display_name"] == "k1" and body["runtime_config"]["parameters"]["overrides"][0] == "run.trigger=ci"

    kfp = FakeKfp()
    submit(kfp, cfg, experiment="resilient-train", trigger="ci", key="k1", service_account="resilient-train-pipeline",
           dry_run=False)
    sent = roundtrip(kfp.runs[0], "V2beta1Run")
    sent.pop("run_id")
    assert {k: v for k, v in sent.items() if k != "experiment_id"} == \
        {k: v for k, v in printed["request"].items() if k != "experiment_id"}


def test_schedule_creates_keeps_replaces_and_disables(cfg):
    kfp = FakeKfp()
    args = dict(experiment="resilient-train", name="nightly", service_account="sa", disable=False, dry_run=False)
    created = schedule(kfp, cfg, cron="0 0 2 * * *", **args)
    assert created["action"] == "created"
    body = roundtrip(kfp.recurring[0], "V2beta1RecurringRun")
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
    assert body["max_concurrency"] == "1" and body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["runtime_config"]["parameters"]["overrides"] == ["run.trigger=schedule"]

    assert schedule(kfp, cfg, cron="0 0 2 * * *", **args)["action"] == "unchanged"
    replaced = schedule(kfp, cfg, cron="0 30 3 * * MON-FRI", **args)
    assert replaced == {"action": "replaced", "recurring_run_id": "rr-2", "replaced": ["rr-1"]}
    assert kfp.disabled == ["rr-1"] and kfp.deleted == ["rr-1"]
    assert schedule(kfp, cfg, cron="0 0 2 * * *", **{**args, "disable": True}) == {"action": "disabled",
                                                                                     "recurring_runs": ["rr-2"]}


@pytest.mark.parametrize("cron, message", [
    ("0 2 * * *", "KFP takes 6 fields, seconds first"),
    ("61 0 2 * * *", "second '61' is outside 0-59"),
    ("0 0 24 * * *", "hour '24' is outside 0-23"),
    ("0 0 2 * 13 *", "month '13' is outside 1-12"),
    ("0 0 2 * * FUNDAY", "day of week 'FUNDAY' is outside 0-6"),
    ("0 */0 * * * *", "minute step '0' must be a positive number"),
])
def test_bad_cron_is_refused_before_any_call(cron, message):
    with pytest.raises(SubmitError, match=message):
        validate_cron(cron)


@pytest.mark.parametrize("cron", ["0 0 2 * * *", "0 */15 * * * ?", "30 0 9 ? * MON-FRI", "0 0 0 1 JAN,JUL *",
                                  "@daily", "@every 6h"])
def test_good_cron_passes(cron):
    assert validate_cron(cron) == cron


def test_cli_exits_2_on_a_bad_cron(capsys):
    assert main(["schedule", "--config", EKS, "--name", "n", "--cron", "0 0 2 * *", "--dry-run"]) == 2
    assert "KFP takes 6 fields" in capsys.readouterr().err


def test_a_bad_cron_is_refused_before_any_client_exists(capsys, monkeypatch):
    """The issue's repro: `schedule --cron "61 * * * * *" --host http://127.0.0.1:9` must not even try the host."""
    import kfp

    monkeypatch.setattr(kfp, "Client", lambda **kwargs: pytest.fail("a client was created before validation"))
    assert main(["schedule", "--config", EKS, "--name", "nightly", "--cron", "61 * * * * *",
                 "--host", "http://127.0.0.1:9"]) == 2
    assert "second '61' is outside 0-59" in capsys.readouterr().err
    assert main(["submit", "--config", EKS, "--idempotency-key=---", "--host", "http://127.0.0.1:9"]) == 2
    assert "--idempotency-key '---': needs letters or digits" in capsys.readouterr().err
    assert main(["schedule", "--config", EKS, "--name", " ", "--host", "http://127.0.0.1:9"]) == 2


def test_an_unreachable_kfp_endpoint_is_one_clear_line(capsys):
    from pipelines.local_stack import free_port

    host = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert main(["schedule", "--config", EKS, "--name", "nightly", "--cron", "0 0 2 * * *", "--host", host]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: cannot reach the KFP API at {host}")
    assert "Check --host" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("config, namespace", [("pipelines/configs/eks-prod.yaml", "resilient-train"),
                                               ("pipelines/configs/eks-dev.yaml", None)])
def test_every_kfp_call_carries_the_profile_namespace_in_multi_user_mode(monkeypatch, capsys, config, namespace):
    """Multi-user KFP keeps experiments, runs and recurring runs per Profile namespace (kfp.Client's
    namespace arguments); standalone KFP has none."""
    from pipelines import submit as kfp_submit

    fake = FakeKfp()
    connected = []
    monkeypatch.setattr(kfp_submit, "connect", lambda host, ns: connected.append(ns) or fake)
    assert main(["submit", "--config", config, "--idempotency-key", "retrain-1", "--host", "http://kfp"]) == 0
    assert main(["schedule", "--config", config, "--name", "nightly", "--host", "http://kfp"]) == 0
    assert connected == [namespace, namespace]
    assert fake.namespaces and set(fake.namespaces) == {namespace}
