"""The EKS manifests, validated offline: every overlay builds with kustomize; built-in objects pass
kubernetes-validate (strict) and the Trainer / Kueue objects their CRD schemas (tests/data/crds); checkov
finds nothing (skips carry a reason); the IAM policies are least privilege; the cluster values come from
one file; pod security holds everywhere."""

import fnmatch
import json
import re
import subprocess

import pytest
import yaml

from tests.crd_schema import crd_errors, known_kinds
from tests.kube import MANIFESTS, ROOT, kustomize

OVERLAYS = sorted(p.parent for p in (MANIFESTS / "overlays").glob("*/kustomization.yaml"))
TOOLS = ROOT / ".venv-tools" / "bin"
KUBERNETES_VERSION = "1.33.0"  # EKS standard support
NO_SCHEMA = {("monitoring.coreos.com/v1", "PodMonitor")}  # Prometheus Operator CRD: not kept here, checked by shape


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.exists():
        pytest.fail(f"{path} not found: run `make install` (it creates .venv-tools from requirements-tools.txt)")
    return str(path)


@pytest.fixture(scope="module", params=[p.name for p in OVERLAYS])
def built(request, tmp_path_factory):
    text = kustomize(MANIFESTS / "overlays" / request.param)
    path = tmp_path_factory.mktemp(request.param) / "built.yaml"
    path.write_text(text)
    return request.param, path, [o for o in yaml.safe_load_all(text) if o]


def test_base_and_overlays_build():
    assert [p.name for p in OVERLAYS] == ["cpt", "dev", "prod"]
    objects = [o for o in yaml.safe_load_all(kustomize(MANIFESTS / "base")) if o]
    assert all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "resilient-train" for o in objects)


def test_builtin_kinds_validate_strictly(built):
    _, path, _ = built
    result = subprocess.run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, "--quiet", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout


def test_custom_resources_validate_against_their_crds(built):
    _, _, objects = built
    custom = [o for o in objects if "." in o["apiVersion"].split("/")[0] and
              not o["apiVersion"].endswith((".k8s.io/v1",)) and o["apiVersion"].split("/")[0] not in
              ("apps", "policy", "rbac.authorization.k8s.io", "networking.k8s.io", "storage.k8s.io")]
    kinds = {(o["apiVersion"], o["kind"]) for o in custom}
    assert ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime") in kinds
    assert {("kueue.x-k8s.io/v1beta2", k) for k in ("ClusterQueue", "LocalQueue", "ResourceFlavor")} <= kinds
    for obj in custom:
        if (obj["apiVersion"], obj["kind"]) in NO_SCHEMA:
            assert obj["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
            continue
        group, _, version = obj["apiVersion"].rpartition("/")
        assert (group, version, obj["kind"]) in known_kinds(), f"no CRD schema kept for {obj['kind']}"
        assert crd_errors(obj) == [], (obj["kind"], crd_errors(obj))


def test_checkov_finds_nothing(built):
    _, path, _ = built
    result = subprocess.run([tool("checkov"), "-f", str(path), "--framework", "kubernetes", "--compact", "--quiet",
                             "--output", "json"], capture_output=True, text=True)
    report = json.loads(result.stdout)
    report = report[0] if isinstance(report, list) else report
    failed = [(c["check_id"], c["resource"]) for c in report.get("results", {}).get("failed_checks", [])]
    assert failed == []
    for skipped in report.get("results", {}).get("skipped_checks", []):
        assert len(skipped.get("check_result", {}).get("suppress_comment", "")) > 20, skipped["check_id"]


def test_cluster_values_come_from_one_file(built):
    name, path, _ = built
    text = path.read_text()
    values = dict(line.split("=", 1) for line in (MANIFESTS / "overlays" / name / "cluster-values.env").read_text()
                  .splitlines() if line and not line.startswith("#"))
    for key, value in values.items():
        assert not re.search(rf"\b{key}\b", text), f"placeholder {key} left in the {name} build"
        assert value in text, f"{key}={value} not used in the {name} build"
    assert "kind: ConfigMap\nmetadata:\n  annotations:\n    config.kubernetes.io/local-config" not in text


def _pod_specs(objects):
    for obj in objects:
        if obj["kind"] == "Deployment":
            yield obj, obj["spec"]["template"]["spec"]
        if obj["kind"] == "ClusterTrainingRuntime":
            for job in obj["spec"]["template"]["spec"]["replicatedJobs"]:
                yield obj, job["template"]["spec"]["template"]["spec"]


def test_pod_security_everywhere(built):
    name, _, objects = built
    specs = list(_pod_specs(objects))
    assert {o["kind"] for o, _ in specs} == {"Deployment", "ClusterTrainingRuntime"}
    for obj, spec in specs:
        assert spec["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
            assert context["capabilities"]["drop"] == ["ALL"]
            assert context["capabilities"].get("add", []) == []  # EFA needs memlock, not IPC_LOCK
            resources = container["resources"]
            assert resources["requests"] and resources["limits"], container["name"]
    text = yaml.safe_dump_all(objects)
    assert not re.search(r"AKIA[0-9A-Z]{16}|aws_secret_access_key", text, re.IGNORECASE)


def test_prod_sizes_and_gang_admission(built):
    name, _, objects = built
    by_kind = {o["kind"]: o for o in objects}
    runtime = by_kind["ClusterTrainingRuntime"]
    container = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    queue = by_kind["ClusterQueue"]["spec"]["resourceGroups"][0]
    requested = set(container["resources"]["requests"])
    assert requested <= set(queue["coveredResources"])  # Kueue admits only fully covered requests
    if name == "prod":
        assert runtime["spec"]["mlPolicy"]["numNodes"] == 8
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert container["resources"]["limits"]["vpc.amazonaws.com/efa"] == 32


# The prod and cpt configs' base model as the stage step leaves it on FSx (its config.json sizes the TrainJob).
STAGED = {name: [f"--model.init_from={ROOT / 'tests' / 'data' / 'llama-3.1-8b'}"] for name in ("prod", "cpt", "sft")}
OVERLAY_OF = {"sft": "prod"}  # the fine-tuning job runs on the prod cluster


@pytest.mark.parametrize("config", ["prod", "cpt", "sft"])
def test_the_launchers_trainjob_matches_the_runtime(config):
    from components.train.trainjob import build_trainjob
    from trainer.config import load_config

    cfg = load_config(f"pipelines/configs/eks-{config}.yaml", ["--run.run_id=x", *STAGED.get(config, [])])
    overlay = OVERLAY_OF.get(config, config)
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(kustomize(MANIFESTS / "overlays" / overlay)) if o}
    assert ("ClusterTrainingRuntime", job["spec"]["runtimeRef"]["name"]) in objects
    assert ("LocalQueue", job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]) in objects
    assert ("PersistentVolumeClaim", cfg.kubernetes.fsx_pvc) in objects
    assert ("ServiceAccount", cfg.kubernetes.service_account) in objects
    assert ("ServiceAccount", cfg.kubernetes.pipeline_service_account) in objects


@pytest.mark.parametrize("config", ["dev", "prod", "cpt", "sft"])
def test_kueue_admits_each_configs_trainjob_within_its_clusters_quota(config):
    """Kueue admits a workload only when every resource it requests is covered by the ClusterQueue and its total
    fits the flavor's nominalQuota (no cohort to borrow from here): Kueue docs, "Cluster Queue" (resource groups,
    nominalQuota) and "Workload" (admission). A config for more nodes than its cluster's quota waits forever."""
    from components.train.trainjob import build_trainjob
    from trainer.config import load_config

    cfg = load_config(f"pipelines/configs/eks-{config}.yaml", ["--run.run_id=x", *STAGED.get(config, [])])
    overlay = OVERLAY_OF.get(config, config)
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    objects = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(kustomize(MANIFESTS / "overlays" / overlay)) if o}
    runtime = objects[("ClusterTrainingRuntime", cfg.kubernetes.runtime_name)]
    requests = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["resources"]["requests"]
    # Trainer v2.3 merges the TrainJob's resourcesPerNode into the runtime's container: what Kueue sees.
    requests = {**requests, **job["spec"]["trainer"]["resourcesPerNode"]["requests"]}
    [group] = objects[("ClusterQueue", cfg.kubernetes.queue_name)]["spec"]["resourceGroups"]
    quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
    nodes = job["spec"]["trainer"]["numNodes"]
    assert nodes == cfg.training.num_nodes
    for resource, amount in requests.items():
        assert resource in group["coveredResources"], resource
        assert nodes * _quantity(amount) <= _quantity(quota[resource]), (overlay, resource, nodes, amount, quota[resource])


def _quantity(value) -> float:
    """A Kubernetes quantity (apimachinery resource.Quantity) as a number: 1600Gi, 5120Mi, "160", 500m."""
    text = str(value)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("m", 1e-3)):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * factor
    return float(text)


@pytest.mark.parametrize("config", ["eks-prod", "eks-dev", "eks-cpt", "eks-sft"])
def test_the_pipeline_role_reads_every_prefix_the_stage_step_stages(config):
    """The stage step lists (ListObjectsV2: s3:ListBucket with the prefix as s3:prefix) and downloads (GetObject,
    HeadObject: s3:GetObject) every prefix it stages — each corpus, the base model, the tokenizer — as the
    pipeline's role (Service Authorization Reference for Amazon S3). The config's bucket stands for DATA_BUCKET;
    the trainer reads them from FSx, and needs no S3 read of its own."""
    from components.stage.staging import staged_prefixes
    from trainer.config import load_config

    pipeline = json.loads((MANIFESTS / "iam" / "pipeline-policy.json").read_text())
    trainer = json.loads((MANIFESTS / "iam" / "trainer-policy.json").read_text())
    for uri in staged_prefixes(load_config(f"pipelines/configs/{config}.yaml")):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        key = f"{prefix}/config.json"
        assert _allowed(pipeline, "s3:ListBucket", "arn:aws:s3:::DATA_BUCKET", prefix=f"{prefix}/"), uri
        assert _allowed(pipeline, "s3:GetObject", f"arn:aws:s3:::DATA_BUCKET/{key}"), uri
        assert not _allowed(trainer, "s3:GetObject", f"arn:aws:s3:::DATA_BUCKET/{key}"), uri


@pytest.mark.parametrize("policy", sorted((MANIFESTS / "iam").glob("*.json")), ids=lambda p: p.name)
def test_iam_policies_are_least_privilege(policy):
    document = json.loads(policy.read_text())
    for statement in document["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        assert "*" not in actions and not any(a.endswith(":*") for a in actions), statement.get("Sid")
        resources = statement.get("Resource", [])
        resources = resources if isinstance(resources, list) else [resources]
        if "*" in resources:  # only the FSx describe calls, which have no resource-level permissions
            assert all(a.startswith("fsx:Describe") for a in actions), statement["Sid"]


def _allowed(document: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    """IAM's evaluation for what these policies use: Allow statements, exact actions, `*` wildcards in
    resources, and StringLike on s3:prefix (which a ListBucket request must satisfy)."""
    for statement in document["Statement"]:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        if statement["Effect"] != "Allow" or action not in actions:
            continue
        if not any(fnmatch.fnmatchcase(resource, pattern) for pattern in resources):
            continue
        condition = statement.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if condition is not None and not (prefix is not None and any(fnmatch.fnmatchcase(prefix, c) for c in condition)):
            continue
        return True
    return False


def test_the_trainer_role_allows_every_call_of_the_s3_checkpoint_tier():
    """trainer/checkpoint/s3_tier.py lists (ListObjectsV2: s3:ListBucket on the bucket, with the prefix as
    s3:prefix), uploads (PutObject, and for multipart CreateMultipartUpload/UploadPart/CompleteMultipartUpload,
    all authorised by s3:PutObject; AbortMultipartUpload by its own action), downloads (GetObject, HeadObject:
    s3:GetObject) and deletes (s3:DeleteObject) under checkpoint.s3_uri — per the Service Authorization
    Reference for Amazon S3. The documented place is s3://ARTIFACT_BUCKET/checkpoints/ (manifests/iam/README.md)."""
    document = json.loads((MANIFESTS / "iam" / "trainer-policy.json").read_text())
    bucket, key = "arn:aws:s3:::ARTIFACT_BUCKET", "checkpoints/run-1/step-000010/__0_0.distcp"
    assert _allowed(document, "s3:ListBucket", bucket, prefix="checkpoints/run-1/")
    for action in ("s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert _allowed(document, action, f"{bucket}/{key}"), action
    assert not _allowed(document, "s3:ListBucket", bucket, prefix="mlflow/")  # the prefix, not the bucket
    assert not _allowed(document, "s3:PutObject", "arn:aws:s3:::DATA_BUCKET/datasets/x")  # data stays read-only


@pytest.mark.parametrize("config", ["eks-dev", "eks-prod", "eks-cpt", "eks-sft"])
def test_the_roles_allow_every_call_of_the_export(config):
    """The trainer's ranks upload the export (trainer/checkpoint/export_store.py: PutObject, multipart under it,
    AbortMultipartUpload) and read a champion's (ListObjectsV2, GetObject); the pipeline's role probes the prefix
    before training (PutObject, DeleteObject) and checks export-complete.json before registering (GetObject,
    ListObjectsV2) — Service Authorization Reference for Amazon S3. The config's bucket stands for ARTIFACT_BUCKET."""
    from trainer.config import load_config

    cfg = load_config(f"pipelines/configs/{config}.yaml", ["--run.run_id=run-1"])
    assert cfg.eval.export_uri.startswith("s3://")
    prefix = cfg.export_uri(100).split("/", 3)[3]
    bucket = "arn:aws:s3:::ARTIFACT_BUCKET"
    trainer = json.loads((MANIFESTS / "iam" / "trainer-policy.json").read_text())
    pipeline = json.loads((MANIFESTS / "iam" / "pipeline-policy.json").read_text())
    for action in ("s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload"):
        assert _allowed(trainer, action, f"{bucket}/{prefix}/model-00001-of-00004.safetensors"), action
    for action in ("s3:PutObject", "s3:DeleteObject", "s3:GetObject"):
        assert _allowed(pipeline, action, f"{bucket}/{prefix}/export-complete.json"), action
    for document in (trainer, pipeline):
        assert _allowed(document, "s3:ListBucket", bucket, prefix=f"{prefix}/")
    assert not _allowed(trainer, "s3:PutObject", f"{bucket}/mlflow/x")  # the tracking server's store stays its own


@pytest.mark.parametrize("config", ["eks-prod", "eks-cpt", "eks-sft"])
def test_the_8b_jobs_keep_a_durable_copy_the_trainer_may_write(config):
    """A 30-day job's checkpoints outlive a failed file server: FSx is PERSISTENT_2 (SCRATCH_2 keeps one copy) and
    every few commits go to S3, under the prefix the trainer's role may write (s3_tier.py's calls, as above)."""
    from trainer.config import load_config

    cfg = load_config(f"pipelines/configs/{config}.yaml", ["--run.run_id=run-1"])
    assert cfg.kubernetes.fsx_deployment_type == "PERSISTENT_2"
    assert cfg.checkpoint.s3_uri.startswith("s3://") and cfg.checkpoint.s3_every >= 1
    document = json.loads((MANIFESTS / "iam" / "trainer-policy.json").read_text())
    prefix = f"{cfg.checkpoint.s3_uri.split('/', 3)[3]}/run-1"
    bucket = "arn:aws:s3:::ARTIFACT_BUCKET"
    assert _allowed(document, "s3:ListBucket", bucket, prefix=f"{prefix}/")
    for action in ("s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload"):
        assert _allowed(document, action, f"{bucket}/{prefix}/step-000200/__0_0.distcp"), action
