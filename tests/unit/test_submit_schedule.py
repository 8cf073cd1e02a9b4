"""submit / schedule through the real kfp.Client against a stand-in for the KFP API server (tests/kfp_api.py:
the backend cannot exist here): every body sent is parsed strictly as a kfp-server-api model, every call is
authorised as the server would, and what the KFP UI shows (pipelines, versions, runs, recurring runs) is kept."""

import json

import kfp_server_api
import pytest

from pipelines.cli import main
from pipelines.cron import CronError, validate_cron
from pipelines.submit import ensure_pipeline_version, pipeline_content
from tests.kfp_api import FakeKfpApi, strict

EKS = "pipelines/configs/eks-prod.yaml"  # multi-user KFP, Profile namespace resilient-train
DEV = "pipelines/configs/eks-dev.yaml"  # standalone KFP
TOKEN = "ci-token"


@pytest.fixture
def kfp_api(monkeypatch):
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)
    with FakeKfpApi(multi_user=True, token=TOKEN) as api:
        yield api


def run_cli(capsys, *argv) -> dict:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_submit_uploads_the_pipeline_once_per_content_and_is_idempotent(kfp_api, capsys):
    submit = ["submit", "--config", EKS, "--trigger", "ci", "--host", kfp_api.url]
    first = run_cli(capsys, *submit, "--idempotency-key", "GH 8812-1")
    assert first["action"] == "submitted" and first["display_name"] == "gh-8812-1"
    assert first["pipeline_version"] == "uploaded"
    assert run_cli(capsys, *submit, "--idempotency-key", "GH 8812-1") == {
        "action": "exists", "run_id": first["run_id"], "display_name": "gh-8812-1"}
    second = run_cli(capsys, *submit, "--idempotency-key", "gh-8813")
    assert second["pipeline_version"] == "reused" and second["pipeline_version_id"] == first["pipeline_version_id"]
    assert len(kfp_api.uploads) == 1 and len(kfp_api.pipelines) == 1

    # Other code (here another image) is another version of the same pipeline, named by its content.
    changed = run_cli(capsys, *submit, "--idempotency-key", "gh-8814",
                      "--kubernetes.pipeline_image=registry.example.com/pipeline@sha256:" + "1" * 64)
    assert changed["pipeline_version"] == "uploaded" and changed["pipeline_id"] == first["pipeline_id"]
    assert changed["content_sha256"] != first["content_sha256"]
    [pipeline] = kfp_api.pipelines.values()
    assert pipeline == {"pipeline_id": first["pipeline_id"], "name": "resilient-train", "display_name": "resilient-train",
                        "description": f"content sha256:{first['content_sha256']}", "namespace": "resilient-train"}
    names = sorted(v["display_name"] for v in kfp_api.versions.values())
    assert names == sorted(["resilient-train", f"resilient-train-{changed['content_sha256'][:12]}"])

    runs = [body for _, collection, body in kfp_api.bodies if collection == "runs"]
    assert len(runs) == 3 and all("pipeline_spec" not in run for run in runs)  # from the version, not inline
    run = runs[0]
    assert run["pipeline_version_reference"] == {"pipeline_id": first["pipeline_id"],
                                                 "pipeline_version_id": first["pipeline_version_id"]}
    assert run["runtime_config"]["parameters"]["overrides"] == ["run.trigger=ci", "run.run_id=gh-8812-1"]
    assert run["service_account"] == "resilient-train-pipeline"
    [experiment] = kfp_api.experiments.values()
    assert run["experiment_id"] == experiment["experiment_id"] and experiment["namespace"] == "resilient-train"


def test_dry_run_prints_the_body_the_client_sends(kfp_api, capsys):
    printed = run_cli(capsys, "submit", "--config", EKS, "--idempotency-key", "k1", "--trigger", "ci", "--dry-run")
    assert printed["action"] == "dry-run" and printed["pipeline"] == "resilient-train"
    assert printed["pipeline_version"] == f"resilient-train-{printed['content_sha256'][:12]}"
    strict(printed["request"], "V2beta1Run")
    sent = run_cli(capsys, "submit", "--config", EKS, "--idempotency-key", "k1", "--trigger", "ci",
                   "--host", kfp_api.url)
    [(_, _, body)] = [b for b in kfp_api.bodies if b[1] == "runs"]
    ids = ("experiment_id", "pipeline_version_reference")
    assert {k: v for k, v in body.items() if k not in ids} == {k: v for k, v in printed["request"].items()
                                                               if k not in ids}
    assert sent["content_sha256"] == printed["content_sha256"]

    scheduled = run_cli(capsys, "schedule", "--config", EKS, "--name", "nightly", "--dry-run")
    strict(scheduled["request"], "V2beta1RecurringRun")
    run_cli(capsys, "schedule", "--config", EKS, "--name", "nightly", "--host", kfp_api.url)
    [(_, _, body)] = [b for b in kfp_api.bodies if b[1] == "recurringruns"]
    assert {k: v for k, v in body.items() if k not in ids} == {k: v for k, v in scheduled["request"].items()
                                                               if k not in ids}


def test_schedule_creates_keeps_replaces_and_disables(kfp_api, capsys):
    schedule = ["schedule", "--config", EKS, "--name", "nightly", "--host", kfp_api.url]
    created = run_cli(capsys, *schedule, "--cron", "0 0 2 * * *")
    assert created["action"] == "created"
    [body] = [b for _, c, b in kfp_api.bodies if c == "recurringruns"]
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *"}}
    assert body["max_concurrency"] == 1 and body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["runtime_config"]["parameters"]["overrides"] == ["run.trigger=schedule"]
    assert body["pipeline_version_reference"]["pipeline_version_id"] == created["pipeline_version_id"]

    assert run_cli(capsys, *schedule, "--cron", "0 0 2 * * *")["action"] == "unchanged"
    replaced = run_cli(capsys, *schedule, "--cron", "0 30 3 * * MON-FRI")
    assert replaced["action"] == "replaced" and replaced["replaced"] == [created["recurring_run_id"]]
    assert list(kfp_api.recurring) == [replaced["recurring_run_id"]]  # the old one disabled, then deleted
    assert run_cli(capsys, *schedule, "--disable") == {"action": "disabled",
                                                       "recurring_runs": [replaced["recurring_run_id"]]}
    assert kfp_api.recurring[replaced["recurring_run_id"]]["mode"] == "DISABLE"
    assert len(kfp_api.uploads) == 1  # one content, one upload


def test_two_submitters_racing_to_upload_the_same_content_share_one_version(kfp_api, tmp_path):
    """The second upload of a name KFP already holds is a 409 (pipeline_upload_server.go): look again."""
    import kfp

    from pipelines.submit import compile_package
    from trainer.config import load_config

    content = pipeline_content(compile_package(load_config(EKS), tmp_path))
    client = kfp.Client(host=kfp_api.url, namespace="resilient-train", existing_token=TOKEN)
    first = ensure_pipeline_version(client, content, "resilient-train")
    listed = client.list_pipelines
    calls = []

    def stale_once(**kwargs):  # the other submitter's upload lands between our look and our upload
        calls.append(kwargs)
        if len(calls) == 1:
            return kfp_server_api.V2beta1ListPipelinesResponse(pipelines=[])
        return listed(**kwargs)

    client.list_pipelines = stale_once
    again = ensure_pipeline_version(client, content, "resilient-train")
    assert (again.pipeline_id, again.version_id, again.uploaded) == (first.pipeline_id, first.version_id, False)
    assert len(calls) == 2 and len(kfp_api.pipelines) == 1 and len(kfp_api.versions) == 1  # the 409ed upload kept nothing


def test_a_token_kfp_does_not_accept_is_one_clear_line(kfp_api, monkeypatch, capsys):
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "minted-for-another-audience")
    assert main(["submit", "--config", EKS, "--idempotency-key", "k", "--host", kfp_api.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: the KFP API at {kfp_api.url} refused the credentials (401: ")
    assert "--audience=pipelines.kubeflow.org" in err[-1]


@pytest.mark.parametrize("cron, message", [
    ("0 2 * * *", "KFP takes 6 fields, seconds first"),
    ("61 0 2 * * *", "second '61' is outside 0-59"),
    ("0 0 24 * * *", "hour '24' is outside 0-23"),
    ("0 0 2 * 13 *", "month '13' is outside 1-12"),
    ("0 0 2 * * FUNDAY", "day of week 'FUNDAY' is outside 0-6"),
    ("0 */0 * * * *", "minute step '0' must be a positive number"),
])
def test_bad_cron_is_refused_before_any_call(cron, message):
    with pytest.raises(CronError, match=message):
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


@pytest.mark.parametrize("config, multi_user, namespace", [(EKS, True, "resilient-train"), (DEV, False, None)])
def test_every_kfp_call_carries_the_profile_namespace_in_multi_user_mode(monkeypatch, capsys, config, multi_user,
                                                                         namespace):
    """Multi-user KFP keeps pipelines, experiments, runs and recurring runs per Profile namespace; standalone KFP
    has none (the pipeline is a shared one)."""
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)
    with FakeKfpApi(multi_user=multi_user, token=TOKEN) as api:
        run_cli(capsys, "submit", "--config", config, "--idempotency-key", "retrain-1", "--host", api.url)
        run_cli(capsys, "schedule", "--config", config, "--name", "nightly", "--host", api.url)
        [pipeline] = api.pipelines.values()
        [experiment] = api.experiments.values()
        assert pipeline.get("namespace") == namespace and experiment.get("namespace") == namespace
        assert {ns for ns, _, _ in api.authorized} == ({namespace} if multi_user else set())


def test_a_verb_the_role_lacks_is_named_in_the_error(monkeypatch, capsys):
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)
    with FakeKfpApi(multi_user=True, token=TOKEN, allowed={("resilient-train", "experiments", "list")}) as api:
        assert main(["submit", "--config", EKS, "--idempotency-key", "k", "--host", api.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "(403: User cannot create experiments in namespace resilient-train" in err and "rbac/ci.yaml" in err


def test_no_private_kfp_client_api_is_called_anywhere():
    """kfp.Client's generated APIs (_run_api, _recurring_run_api, …) and its underscore helpers are not its
    interface: a kfp upgrade may change them. The stand-in server would accept their calls, so read the code."""
    import ast
    from pathlib import Path

    root = Path(__file__).parents[2]
    private = []
    for path in [*root.glob("pipelines/*.py"), *root.glob("components/**/*.py"), *root.glob("trainer/**/*.py")]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and node.attr.endswith("_api"):
                private.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kfp") and \
                    any(alias.name.startswith("_") for alias in node.names):
                private.append(f"{path.relative_to(root)}:{node.lineno} from {node.module} import _…")
    assert private == []
