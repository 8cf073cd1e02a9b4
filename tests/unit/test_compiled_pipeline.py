"""The compiled pipeline: golden IR YAML (regenerate with `make golden`), its DAG, caching, retries and the
kubernetes platform config, and that the IR loads back with kfp."""

import difflib
import json
from pathlib import Path

import pytest
import yaml
from kfp import compiler

from pipelines.pipeline import build_pipeline
from trainer.config import load_config

GOLDEN = Path(__file__).parents[1] / "golden"
CONFIGS = {"local": "local", "eks": "pipelines/configs/eks-prod.yaml"}


def compile_to(tmp_path, name):
    out = tmp_path / f"pipeline-{name}.yaml"
    compiler.Compiler().compile(build_pipeline(load_config(CONFIGS[name])), str(out))
    return out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_compiled_ir_matches_the_golden_file(tmp_path, name):
    fresh = compile_to(tmp_path, name).read_text().splitlines()
    golden = (GOLDEN / f"pipeline-{name}.yaml").read_text().splitlines()
    diff = "\n".join(difflib.unified_diff(golden, fresh, "golden", "compiled", lineterm="", n=1))
    assert not diff, f"compiled pipeline differs from tests/golden (run `make golden` if intended):\n{diff[:3000]}"


def test_dag_caching_and_exit_handler(tmp_path):
    from kfp import components

    path = compile_to(tmp_path, "local")
    assert components.load_component_from_file(str(path)).name == "resilient-train"  # loads back
    spec = yaml.safe_load(path.read_text())
    root = spec["root"]["dag"]["tasks"]
    assert set(root) == {"exit-handler-1", "finalize-run"}
    assert root["finalize-run"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(inner) == {"prepare-run", "fingerprint-data", "stage-data", "for-loop-2", "collect-shards",
                          "record-stage", "train-model", "validate-checkpoint", "evaluate-model"}
    loop = spec["components"]["comp-for-loop-2"]["dag"]["tasks"]
    cached = {name for name, task in {**inner, **loop}.items() if task.get("cachingOptions", {}).get("enableCache")}
    assert cached == {"stage-data", "tokenize-shard", "collect-shards"}  # by the data fingerprint; never training
    fingerprint_only = {"stage_config", "data_fingerprint"}
    assert set(inner["stage-data"]["inputs"]["parameters"]) == fingerprint_only
    # The fan-out: one tokenize task per item of the stage task's list, all of their outputs to one collect task.
    assert inner["for-loop-2"]["parameterIterator"]["items"] == {"inputParameter": "pipelinechannel--stage-data-Output"}
    assert loop["tokenize-shard"]["inputs"]["parameters"]["group"] == {
        "componentInputParameter": "pipelinechannel--stage-data-Output-loop-item"}
    assert set(loop["tokenize-shard"]["inputs"]["parameters"]) == {"group"}  # (the item holds the fingerprint)
    collect = inner["collect-shards"]["inputs"]
    assert set(collect["parameters"]) == fingerprint_only | {"shards"}
    assert collect["parameters"]["shards"]["taskOutputParameter"]["producerTask"] == "for-loop-2"
    assert collect["artifacts"]["staged"]["taskOutputArtifact"]["producerTask"] == "stage-data"
    assert inner["record-stage"]["inputs"]["artifacts"]["dataset"]["taskOutputArtifact"]["producerTask"] == "collect-shards"
    assert inner["train-model"]["dependentTasks"] == ["record-stage"]
    defaults = spec["root"]["inputDefinitions"]["parameters"]
    assert json.loads(defaults["config_json"]["defaultValue"])["model"]["preset"] == "tiny"
    assert "platforms" not in spec  # the local pipeline has no cluster settings


def test_cluster_settings_retries_and_image(tmp_path):
    documents = list(yaml.safe_load_all(compile_to(tmp_path, "eks").read_text()))
    spec, platform = documents
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert inner["stage-data"]["retryPolicy"] == {"backoffDuration": "60s", "backoffFactor": 2.0,
                                                 "backoffMaxDuration": "900s", "maxRetryCount": 2}
    assert inner["train-model"]["retryPolicy"]["maxRetryCount"] == 2
    tokenize = spec["components"]["comp-for-loop-2"]["dag"]["tasks"]["tokenize-shard"]
    assert tokenize["retryPolicy"] == inner["stage-data"]["retryPolicy"]
    assert "retryPolicy" not in inner["validate-checkpoint"]
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in executors.items():
        assert executor["pvcMount"][0]["mountPath"] == "/fsx", name
        assert executor["secretAsEnv"][0]["secretName"] == "mlflow-credentials" and executor["secretAsEnv"][0]["optional"]
    assert executors["exec-train-model"]["activeDeadlineSeconds"] == str(259200 + 3600)
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert images == {"123456789012.dkr.ecr.us-east-1.amazonaws.com/resilient-train-pipeline:0.1.0"}  # CPU image
    resources = spec["deploymentSpec"]["executors"]["exec-validate-checkpoint"]["container"]["resources"]
    assert resources["memoryRequest"] == pytest.approx(8.589934592)  # 8Gi, in GB as KFP stores it: it streams
    gate = spec["deploymentSpec"]["executors"]["exec-evaluate-model"]["container"]["resources"]
    assert gate["memoryRequest"] == pytest.approx(2.147483648)  # 2Gi: the gate loads no weights
