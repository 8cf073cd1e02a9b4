"""The CI/CD workflow: tests through .ci/run, retraining submitted with trigger=ci on the right events,
credentials from the environment only."""

import re
from pathlib import Path

import yaml

WORKFLOW = Path(__file__).parents[2] / ".github" / "workflows" / "retrain.yaml"


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
