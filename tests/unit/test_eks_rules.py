"""What a real EKS cluster would refuse, encoded as its own rules (each test cites where the rule comes
from), for each overlay with the config that targets it: pipelines/configs/eks-<overlay>.yaml (and eks-sft.yaml, the
fine-tuning job on the prod cluster).

Schemas prove shape; these prove that the first `submit` can run: the pipeline's ServiceAccount has what
Kubeflow Pipelines and the launcher need where they need it, every pod passes its namespace's Pod Security
level, the FSx roots are writable by the uid the pods run as, MLflow answers the URI the config uses, Kueue
manages TrainJobs, and preemption does not spend the JobSet's restarts.
"""

import json
import os
import re
import subprocess
import textwrap
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from components.train.trainjob import build_trainjob
from tests.kube import MANIFESTS, ROOT, build, grants, pod_template_objects, pod_templates
from tests.pod_security import violations
from trainer.config import load_config

OVERLAYS = ["dev", "prod", "cpt"]
# Each EKS config and the overlay of the cluster it runs on (eks-<name>.yaml; the fine-tuning job shares prod's).
CONFIG_CLUSTERS = {"dev": "dev", "prod": "prod", "cpt": "cpt", "sft": "prod"}
# What the stage step puts on FSx before a TrainJob is built: the base model's config.json, which sizes the job.
STAGED_BASE_CONFIG = ROOT / "tests" / "data" / "llama-3.1-8b"


@pytest.fixture(scope="module", params=sorted(CONFIG_CLUSTERS))
def cluster(request):
    """(overlay name, its built objects, the EKS config that targets it)."""
    staged = [f"--model.init_from={STAGED_BASE_CONFIG}"] if request.param != "dev" else []
    cfg = load_config(ROOT / "pipelines" / "configs" / f"eks-{request.param}.yaml", ["--run.run_id=first-run", *staged])
    overlay = CONFIG_CLUSTERS[request.param]
    return overlay, build(MANIFESTS / "overlays" / overlay), cfg


def one(objects, kind, name, namespace=None):
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name
             and (namespace is None or o["metadata"].get("namespace") == namespace)]
    assert len(found) == 1, f"{kind} {namespace}/{name}: {len(found)} found"
    return found[0]


def runtime_pod(objects):
    runtime = one(objects, "ClusterTrainingRuntime", "resilient-train-fsdp-nvrx")
    return runtime, runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


# -- 1. KFP's namespace and ServiceAccount --------------------------------------------------------------

# What KFP v2 needs of a run's ServiceAccount in the namespace its pods run in: the driver reads the
# `kfp-launcher` ConfigMap and the object-store Secret and lists the run's pods; the launcher and Argo's
# executor report through workflowtaskresults and read pods and logs. Source: kubeflow/pipelines
# manifests/kustomize/base/pipeline/pipeline-runner-role.yaml (Role pipeline-runner) and, in the same file,
# ml-pipeline-executor-plugin-role; Argo Workflows docs, "Workflow RBAC" (executor: workflowtaskresults
# create, patch).
KFP_RUN_NEEDS = [("", "configmaps", "get"), ("", "configmaps", "list"), ("", "configmaps", "watch"),
                 ("", "secrets", "get"), ("", "pods", "get"), ("", "pods", "list"), ("", "pods", "watch"),
                 ("", "pods/log", "get"), ("argoproj.io", "workflowtaskresults", "create"),
                 ("argoproj.io", "workflowtaskresults", "patch")]
# What the TrainJob launcher (components/train/trainjob.py) does in the training namespace, and cluster-wide.
LAUNCHER_NEEDS = [("trainer.kubeflow.org", "trainjobs", verb) for verb in ("create", "get", "list", "watch", "delete")] + [
    ("", "pods", "list"), ("", "pods/log", "get")]


def test_the_pipeline_service_account_has_what_kfp_and_the_launcher_need_where_they_need_it(cluster):
    name, objects, cfg = cluster
    k8s = cfg.kubernetes
    pipeline_ns = k8s.pipeline_namespace
    assert pipeline_ns == ("kubeflow" if name == "dev" else "resilient-train")  # standalone / multi-user
    account = one(objects, "ServiceAccount", k8s.pipeline_service_account, pipeline_ns)
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    granted = grants(objects, k8s.pipeline_service_account, pipeline_ns)
    missing = [need for need in KFP_RUN_NEEDS if (pipeline_ns, *need) not in granted]
    missing += [need for need in LAUNCHER_NEEDS if (k8s.namespace, *need) not in granted]
    missing += [need for need in [("trainer.kubeflow.org", "clustertrainingruntimes", "get")] if ("*", *need) not in granted]
    assert missing == [], f"{name}: the pipeline ServiceAccount cannot {missing}"
    assert not any(verb == "*" or resource == "*" for _, _, resource, verb in granted)  # least privilege
    # The FSx claim the steps mount must exist where the steps run, and where the trainers run.
    one(objects, "PersistentVolumeClaim", k8s.fsx_pvc, pipeline_ns)
    one(objects, "PersistentVolumeClaim", k8s.fsx_pvc, k8s.namespace)


def test_submit_and_schedule_pass_the_profile_namespace_in_multi_user_mode_only():
    from pipelines.submit import kfp_namespace

    prod = load_config(ROOT / "pipelines/configs/eks-prod.yaml")
    dev = load_config(ROOT / "pipelines/configs/eks-dev.yaml")
    assert kfp_namespace(prod) == "resilient-train" and kfp_namespace(dev) is None
    assert kfp_namespace(dev, "other") == "other"


def test_the_ci_identity_may_do_exactly_what_submit_and_schedule_ask_of_kfp(capsys, monkeypatch):
    """Multi-user KFP authorises every call with a SubjectAccessReview on group pipelines.kubeflow.org in the
    Profile namespace, with the server's own resource and verb for it (tests/kfp_api.py, AUTHORIZED_AS: recurring
    runs are `jobs`, kubeflow/pipelines backend/src/apiserver/server/job_server.go; names in common/const.go).
    The stand-in grants what the built overlay's Role for resilient-train-ci grants, and refuses the rest with
    403; submit and schedule must get through every path they have, and the Role grant nothing they never ask."""
    from pipelines.cli import main
    from tests.kfp_api import FakeKfpApi

    objects = build(MANIFESTS / "overlays" / "prod")
    cfg = load_config(ROOT / "pipelines/configs/eks-prod.yaml")
    granted = {(ns, resource, verb) for ns, group, resource, verb in grants(objects, "resilient-train-ci", cfg.kubernetes.namespace)
               if group == "pipelines.kubeflow.org"}
    monkeypatch.setenv("KF_PIPELINES_TOKEN", "t")
    config = str(ROOT / "pipelines/configs/eks-prod.yaml")
    with FakeKfpApi(multi_user=True, token="t", allowed=granted) as api:
        for argv in (["submit", "--idempotency-key", "gh-1"], ["submit", "--idempotency-key", "gh-1"],
                     ["submit", "--idempotency-key", "gh-2"], ["schedule", "--name", "nightly"],
                     ["schedule", "--name", "nightly"], ["schedule", "--name", "nightly", "--cron", "0 0 3 * * *"],
                     ["schedule", "--name", "nightly", "--disable"]):
            assert main([*argv, "--config", config, "--host", api.url]) == 0, capsys.readouterr().err
    assert api.denied == []
    assert set(api.authorized) == granted, f"granted but never used: {granted - set(api.authorized)}"


def test_the_ci_group_may_mint_the_token_and_reach_kfps_api_and_nothing_more():
    """The workflow's kubectl calls (.github/workflows/retrain.yaml): `create token resilient-train-ci` (a create
    on serviceaccounts/token) and `port-forward svc/ml-pipeline`, which gets the Service, lists its pods by the
    selector and creates pods/portforward on one (kubernetes/kubectl pkg/cmd/portforward/portforward.go,
    AttachablePodForObject). The access entry's group gets exactly these."""
    objects = build(MANIFESTS / "ci-access")
    roles = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objects if o["kind"] == "Role"}
    granted = set()
    for binding in (o for o in objects if o["kind"] == "RoleBinding"):
        assert binding["subjects"] == [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                                        "name": "resilient-train-ci"}]
        namespace = binding["metadata"]["namespace"]
        for rule in roles[(namespace, binding["roleRef"]["name"])]["rules"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    for name in rule.get("resourceNames", ["*"]):
                        granted.add((namespace, resource, verb, name))
    assert granted == {("resilient-train", "serviceaccounts/token", "create", "resilient-train-ci"),
                       ("kubeflow", "services", "get", "ml-pipeline"), ("kubeflow", "pods", "get", "*"),
                       ("kubeflow", "pods", "list", "*"), ("kubeflow", "pods/portforward", "create", "*")}
    workflow = (ROOT / ".github" / "workflows" / "retrain.yaml").read_text()
    assert "create token resilient-train-ci" in workflow and "port-forward svc/ml-pipeline" in workflow


def test_each_role_trusts_its_service_account_where_the_overlay_puts_it(tmp_path):
    """IRSA: STS answers AssumeRoleWithWebIdentity only when the token's `sub`, system:serviceaccount:<namespace>:
    <name>, meets the role's trust condition (EKS User Guide, "Assign IAM roles to Kubernetes service accounts").
    The commands of docs/first-run-on-eks.md, step 3, run as written (a stand-in `aws` records its calls) for a
    multi-user and a standalone overlay: every role is created with the trust of its own ServiceAccount's namespace
    (standalone KFP moves the pipeline's to `kubeflow`), named as cluster-values.env names it, with its permission
    policy filled in."""
    doc = (ROOT / "docs" / "first-run-on-eks.md").read_text()
    block = doc.split("<!-- tests/unit/test_eks_rules.py runs the next block with a stand-in `aws` -->", 1)[1]
    script = textwrap.dedent(block.split("```bash\n", 1)[1].split("```", 1)[0])
    stub = tmp_path / "bin" / "aws"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "$@" >> "$AWS_CALLS"\ncase "$1 $2" in\n'
                    '  "sts get-caller-identity") echo 210987654321 ;;\n'
                    '  "eks describe-cluster") echo https://oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE ;;\nesac\n')
    stub.chmod(0o755)
    for overlay in ("prod", "dev"):
        out = tmp_path / overlay
        calls = tmp_path / f"{overlay}.calls"
        text = script.replace("OVERLAY=prod", f"OVERLAY={overlay}").replace("build/iam", str(out))
        env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "AWS_CALLS": str(calls)}
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=ROOT, env=env, capture_output=True,
                              text=True)
        assert proc.returncode == 0, proc.stderr
        accounts = {o["metadata"]["name"]: o for o in build(MANIFESTS / "overlays" / overlay)
                    if o["kind"] == "ServiceAccount" and "eks.amazonaws.com/role-arn" in o["metadata"].get("annotations", {})}
        created = [line.split() for line in calls.read_text().splitlines() if line.startswith("iam create-role")]
        assert len(created) == len(accounts) == 3
        for account in accounts.values():
            role = account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].rsplit("/", 1)[1]
            [call] = [c for c in created if c[c.index("--role-name") + 1] == role]
            trust = json.loads(Path(call[call.index("--assume-role-policy-document") + 1].removeprefix("file://")).read_text())
            condition = trust["Statement"][0]["Condition"]["StringEquals"]
            subject = f"system:serviceaccount:{account['metadata']['namespace']}:{account['metadata']['name']}"
            assert condition["oidc.eks.us-east-1.amazonaws.com/id/EXAMPLE:sub"] == subject
            assert trust["Statement"][0]["Principal"]["Federated"].startswith("arn:aws:iam::210987654321:oidc-provider/")
            policy = (out / f"{role}-policy.json").read_text()
            assert not re.search(r"AWS_ACCOUNT_ID|AWS_REGION|DATA_BUCKET|ARTIFACT_BUCKET|FSX_FILE_SYSTEM_ID", policy)
            json.loads(policy)
        if overlay == "dev":
            assert accounts["resilient-train-pipeline"]["metadata"]["namespace"] == "kubeflow"


# -- 2. Pod Security Admission ----------------------------------------------------------------------------

def test_every_pod_template_passes_the_pod_security_level_its_namespace_enforces(cluster):
    """Pod Security Admission rejects at creation a pod that breaks its namespace's enforced level
    (pod-security.kubernetes.io/enforce; Kubernetes docs, "Pod Security Admission"). IPC_LOCK, for one, is
    not in Baseline's capability list: pods that add it are never created."""
    name, objects, cfg = cluster
    levels = {o["metadata"]["name"]: o["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
              for o in objects if o["kind"] == "Namespace"}
    assert levels == {"resilient-train": "baseline"}
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    checked = 0
    for obj, namespace, pod in pod_templates(objects):
        if obj["kind"] == "ClusterTrainingRuntime":  # its pods run where the TrainJob is, with the launcher's patch
            namespace = cfg.kubernetes.namespace
            pod = {**pod, "volumes": [*pod["volumes"], *patch["volumes"]]}
        level = levels.get(namespace, "baseline")
        assert violations(pod, level) == [], (name, obj["kind"], obj["metadata"]["name"])
        checked += 1
    # the runtime's node, rendezvous and lighthouse pods, MLflow, fsx-prepare, and the p5 clusters' warm spare
    assert checked == (5 if name == "dev" else 6)


# -- 2b. Istio in Profile namespaces ---------------------------------------------------------------------

# Kubeflow's profile controller labels every Profile namespace istio-injection=enabled (kubeflow/kubeflow
# components/profile-controller/controllers/profile_controller.go, istioInjectionLabel).
PROFILE_NAMESPACE_LABELS = {"istio-injection": "enabled"}
SIDECAR = "sidecar.istio.io/inject"


def istio_injects(namespace_labels: dict[str, str], pod_metadata: dict) -> bool:
    """Istio's injection policy (istio.io, Setup > Additional setup > Sidecar injection, "Controlling the
    injection policy"): the namespace label istio-injection and the pod label sidecar.istio.io/inject; if either
    is disabled the pod is not injected, else if either is enabled it is; neither set: not injected
    (enableNamespacesByDefault is off by default)."""
    pod = pod_metadata.get("labels", {}).get(SIDECAR)
    namespace = namespace_labels.get("istio-injection")
    if pod == "false" or namespace == "disabled":
        return False
    return pod == "true" or namespace == "enabled"


def test_no_pod_gets_an_istio_sidecar_in_the_profile_namespace(cluster):
    """A sidecar in a Profile namespace sits in front of every port a pod opens: the training pods' NCCL/gloo
    collectives, torchft's manager and the metrics port, the rendezvous store (29400), the lighthouse (29510) and
    MLflow (5000) would take connections only through Envoy, with mTLS the training pods (which have no sidecar)
    cannot speak, and a Job's sidecar outlives its container so the Job never completes. Kubeflow's rule for
    training jobs in a user namespace: annotate the pods sidecar.istio.io/inject: "false" (kubeflow.org, "PyTorch
    Training (PyTorchJob)": "doesn't work in a user namespace by default because of Istio automatic sidecar
    injection"). Istio reads the pod label (current) and the annotation (older releases): both are set."""
    name, objects, _ = cluster
    assert istio_injects(PROFILE_NAMESPACE_LABELS, {"labels": {}})  # the rule would catch a pod left out
    seen = set()
    for obj, _, template in pod_template_objects(objects):
        metadata = template.get("metadata", {})
        pod_name = metadata.get("labels", {}).get("app.kubernetes.io/name")
        assert not istio_injects(PROFILE_NAMESPACE_LABELS, metadata), (name, obj["kind"], pod_name)
        assert metadata.get("annotations", {}).get(SIDECAR) == "false", (name, pod_name)
        seen.add(pod_name)
    assert {"resilient-train-trainer", "resilient-train-rendezvous", "resilient-train-lighthouse", "mlflow",
            "fsx-prepare"} <= seen


def test_long_running_pods_meet_restricted_and_only_the_preparation_runs_as_root(cluster):
    _, objects, _ = cluster
    for obj, _, pod in pod_templates(objects):
        problems = violations(pod, "restricted")
        if obj["metadata"]["name"] == "fsx-prepare":
            assert problems and all("non-root" in p or "CHOWN" in p or "FOWNER" in p for p in problems), problems
        else:
            assert problems == [], (obj["kind"], problems)


def test_the_checker_refuses_what_admission_refuses():
    pod = {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}],
           "volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    assert any("IPC_LOCK" in p for p in violations(pod, "baseline"))
    assert any("hostPath" in p for p in violations(pod, "baseline"))
    assert violations({"containers": [{"name": "c"}]}, "baseline") == []
    assert len(violations({"containers": [{"name": "c"}]}, "restricted")) == 4


def test_efa_memlock_is_checked_at_start_instead_of_a_capability():
    import resource

    from trainer.resilience.health import efa_memlock_check

    assert efa_memlock_check({}) is None
    unlimited = efa_memlock_check({"FI_PROVIDER": "efa"},
                                  getrlimit=lambda r: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert unlimited["ok"] is True
    limited = efa_memlock_check({"FI_PROVIDER": "efa"}, getrlimit=lambda r: (65536, 65536))
    assert limited["ok"] is False and "LimitMEMLOCK=infinity" in limited["fix"]


# -- 3. FSx write permissions -----------------------------------------------------------------------------

def test_the_fsx_roots_the_pipeline_writes_are_prepared_for_the_uid_its_pods_run_as(cluster):
    """FSx's root and DRA-imported data without POSIX metadata are root-owned (FSx for Lustre User Guide,
    "POSIX metadata support for data repositories"); the CSI driver does not apply fsGroup to this volume. The
    preparation Job must create, as root, exactly the folders the config writes below, for the uid and gid
    the pods run as."""
    _, objects, cfg = cluster
    job = one(objects, "Job", "fsx-prepare", cfg.kubernetes.namespace)
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "fsx"]
    assert {"name": "fsx", "persistentVolumeClaim": {"claimName": cfg.kubernetes.fsx_pvc}} in pod["volumes"]
    assert mount["mountPath"] == env["FSX_ROOT"] == str(cfg.fsx_root)
    script = container["args"][0]
    for folder in (cfg.run_dir.parent, cfg.dataset_dir.parent):  # runs/, datasets/
        assert f"$FSX_ROOT/{folder.relative_to(cfg.fsx_root)}" in script
    assert 'chown "$APP_UID:$APP_GID"' in script and "chmod 2775" in script
    _, trainer_pod = runtime_pod(objects)
    assert (env["APP_UID"], env["APP_GID"]) == (str(trainer_pod["securityContext"]["runAsUser"]),
                                                str(trainer_pod["securityContext"]["runAsGroup"]))
    for dockerfile in ("pipeline.Dockerfile", "trainer.Dockerfile"):
        assert re.search(rf"^USER {env['APP_UID']}$", (ROOT / "docker" / dockerfile).read_text(), re.M), dockerfile
    assert pod["securityContext"]["runAsUser"] == 0
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}


def test_an_fsx_root_the_pipeline_cannot_write_says_how_to_prepare_it(tmp_path, monkeypatch):
    """What uid 10001 meets on an unprepared FSx root: EACCES from mkdir (simulated: tests may run as root)."""
    import pathlib

    from components.prepare.step import RunFolderError, run_prepare
    from components.stage.s3_copy import StageError
    from components.stage.staging import stage_dataset

    cfg = load_config("local", [f"--run.work_dir={tmp_path}", "--run.run_id=denied"])
    real_mkdir = pathlib.Path.mkdir

    def denied(self, *args, **kwargs):
        if self.is_relative_to(cfg.fsx_root):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", denied)
    with pytest.raises(RunFolderError, match=r"cannot create .*/runs/denied as uid \d+.*fsx-prepare"):
        run_prepare(cfg)
    with pytest.raises(StageError, match=r"cannot create .*datasets/demo as uid \d+.*fsx-prepare"):
        stage_dataset(cfg.data, cfg.dataset_dir, cfg.fsx_root)


# -- 6. MLflow reachability -------------------------------------------------------------------------------

def test_the_tracking_uri_is_the_service_the_overlay_builds_and_an_allowed_host(cluster):
    """MLflow >= 3.5 refuses requests whose Host header is not in --allowed-hosts (localhost and private IPs
    by default; /health is exempt, so probes stay green): mlflow/server/security_utils.py,
    is_allowed_host_header and get_default_allowed_hosts, used here as the server uses them."""
    from mlflow.server.security_utils import get_default_allowed_hosts, is_allowed_host_header

    name, objects, cfg = cluster
    uri = urlparse(cfg.mlflow.tracking_uri)
    service_name, namespace, *rest = uri.hostname.split(".")
    assert rest in ([], ["svc"], ["svc", "cluster", "local"]), uri.hostname
    service = one(objects, "Service", service_name, namespace)
    assert uri.port in [p["port"] for p in service["spec"]["ports"]]
    deployment = one(objects, "Deployment", "mlflow", namespace)
    args = " ".join(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    allowed = re.search(r'--allowed-hosts "([^"]+)"', args).group(1).split(",")
    host_header = uri.netloc  # what the MLflow client (requests) sends for a non-default port
    assert is_allowed_host_header(allowed, host_header), (host_header, allowed)
    assert not is_allowed_host_header(get_default_allowed_hosts(), host_header)  # without the flag: refused
    policy = one(objects, "NetworkPolicy", "mlflow", namespace)
    sources = policy["spec"]["ingress"][0]["from"]
    pipeline_ns = cfg.kubernetes.pipeline_namespace
    assert {"podSelector": {}} in sources if pipeline_ns == namespace else \
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": pipeline_ns}}} in sources


# -- 7. NVRx and JobSet at scale ---------------------------------------------------------------------------

def test_the_initial_heartbeat_covers_a_resume_from_fsx_at_scale(cluster):
    from trainer.launch.command import initial_heartbeat_timeout
    from trainer.planning.model_size import model_shape

    _, _, cfg = cluster
    seconds, why = initial_heartbeat_timeout(cfg)
    resume = model_shape(cfg).parameters * 12 / (cfg.kubernetes.fsx_throughput_mbps * 1e6)
    assert seconds >= resume + 60 and seconds >= 120, why
    command = build_trainjob(cfg, "/fsx/datasets/v1")["spec"]["trainer"]["command"]
    assert f"--ft-initial-rank-heartbeat-timeout={seconds}" in command
    assert any(a.startswith("--rdzv-conf=join_timeout=") for a in command)
    # A multi-node job's nodes watch the rendezvous store (a node cut off from it exits to be replaced).
    store_watch = [f"--store-timeout={cfg.resilience.store_timeout_seconds:g}"] if cfg.training.num_nodes > 1 else []
    assert command[:8 + len(store_watch)] == [
        "python", "-m", "trainer.launcher", f"--node-store=/node-memory/{cfg.run.run_id}", "--fork-server",
        f"--run-dir={cfg.run_dir}", *store_watch,
        f"--check-node={cfg.kubernetes.gpus_per_node},{cfg.kubernetes.efa_per_node}", "ft_launcher"]


def test_the_node_memory_tier_has_a_memory_volume_that_holds_it_and_the_pod_limit_covers_it(cluster):
    """An emptyDir with medium: Memory is tmpfs and counts against the container's memory limit (Kubernetes
    docs, "emptyDir"); it outlives container restarts but not the pod, which is what the tier needs. It must
    hold two copies of the node's share of the state and, with several nodes, two of its peer's
    (trainer.checkpoint.memory)."""
    from trainer.planning.model_size import model_shape

    _, _, cfg = cluster
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    pod = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "node-memory"]
    assert volume["emptyDir"]["medium"] == "Memory"
    size_gib = int(volume["emptyDir"]["sizeLimit"].removesuffix("Gi"))
    per_node = model_shape(cfg).parameters * 12 / cfg.training.num_nodes
    copies = 4 if cfg.training.num_nodes > 1 else 2  # one node: no peer to keep a replica for
    assert size_gib * 2**30 >= copies * per_node
    assert {"name": "node-memory", "mountPath": cfg.checkpoint.memory_dir} in pod["containers"][0]["volumeMounts"]
    limit = int(job["spec"]["trainer"]["resourcesPerNode"]["limits"]["memory"].removesuffix("Gi"))
    shm = int(cfg.kubernetes.shm_size.removesuffix("Gi"))
    assert limit >= size_gib + shm + cfg.kubernetes.process_memory_gib
    assert limit <= 2048  # p5.48xlarge: 2 TiB of memory


def test_node_rank_0_hosts_the_rendezvous_explicitly_and_unknown_flags_are_dropped_for_old_nvrx(monkeypatch):
    from trainer.resilience import nvrx_compat

    args = ["--max-restarts=3", "--ft-node-health-check-endpoint=/var/run/nvhcd.sock", "--rdzv-backend=c10d",
            "--ft-max-no-progress-cycles=0", "--rdzv-conf=join_timeout=600", "-m", "trainer"]
    monkeypatch.setattr(nvrx_compat, "nvrx_version", lambda: "0.4.1")
    old = nvrx_compat.runtime_launcher_args("ft_launcher", args, {"PET_NODE_RANK": "0"})
    assert "--ft-node-health-check-endpoint=/var/run/nvhcd.sock" not in old
    assert "--ft-max-no-progress-cycles=0" not in old  # 0.4.1's argparse would refuse it
    assert "--rdzv-conf=join_timeout=600,is_host=true" in old
    monkeypatch.setattr(nvrx_compat, "nvrx_version", lambda: "0.5.0")
    middle = nvrx_compat.runtime_launcher_args("ft_launcher", args, {"PET_NODE_RANK": "3"})
    assert "--ft-node-health-check-endpoint=/var/run/nvhcd.sock" in middle
    assert "--ft-max-no-progress-cycles=0" not in middle
    monkeypatch.setattr(nvrx_compat, "nvrx_version", lambda: "0.7.0")
    new = nvrx_compat.runtime_launcher_args("ft_launcher", args, {"PET_NODE_RANK": "3"})
    assert "--ft-node-health-check-endpoint=/var/run/nvhcd.sock" in new
    # >= 0.6: its own no-progress tracker off (v0.6.0 launcher.py: "--ft-max-no-progress-cycles ... Set to 0 or
    # -1 to disable"); the one rule is trainer.resilience.budget's.
    assert "--ft-max-no-progress-cycles=0" in new
    assert "--rdzv-conf=join_timeout=600,is_host=false" in new
    assert nvrx_compat.runtime_launcher_args("ft_launcher", ["--standalone"], {}) == ["--standalone"]
    # The job's own rendezvous store (is_host=false already): node 0 does not take it over.
    external = ["--rdzv-backend=c10d", "--rdzv-conf=join_timeout=600,is_host=false"]
    assert nvrx_compat.runtime_launcher_args("torchrun", external, {"PET_NODE_RANK": "0"}) == external


def test_a_node_keeps_its_group_rank_through_every_rendezvous_round():
    """NVRx >= 0.6's barrier rendezvous orders nodes by an infrastructure rank: SLURM's, else GROUP_RANK
    (v0.6.0 fault_tolerance/utils.py get_infrastructure_rank); the launcher gives it the node's index, which a
    replacement pod keeps. A value already set (SLURM, an operator) is left alone."""
    from trainer.resilience.nvrx_compat import stable_node_rank

    assert stable_node_rank({"PET_NODE_RANK": "5"}) == {"GROUP_RANK": "5"}
    assert stable_node_rank({"PET_NODE_RANK": "5", "GROUP_RANK": "2"}) == {}
    assert stable_node_rank({}) == {}


# The Kubernetes Job controller's podFailurePolicy, as kubernetes pkg/controller/job/pod_failure_policy.go
# (matchPodFailurePolicy) applies it: rules in order, the first match acts; onExitCodes with operator In matches
# a container (the named one, if containerName is set) that terminated with a listed non-zero code;
# onPodConditions matches a pod condition of that type with status True. FailJob fails the Job with reason
# PodFailurePolicy (batch/v1 JobReasonPodFailurePolicy) and the message
#   "Container %s for pod %s/%s failed with exit code %v matching %v rule at index %d"  (exit codes)
#   "Pod %s/%s has condition %v matching %v rule at index %d"                          (conditions).
# Ignore: "the counter towards the .backoffLimit is not incremented and a replacement pod is created" (the
# batch/v1 API, PodFailurePolicyRule.action). A failure no rule matches counts: with backoffLimitPerIndex (an
# Indexed Job) against its own index — pkg/controller/job/indexed_job_utils.go: the pod of a failed attempt is
# replaced with the same completion index until that index's failure count exceeds backoffLimitPerIndex, then
# the index is failed; once failed indexes exceed maxFailedIndexes the Job fails with reason
# MaxFailedIndexesExceeded (job_controller.go). Without it, against backoffLimit (reason BackoffLimitExceeded).
def job_controller(job_spec, *, exit_code=None, condition=None, pod="resilient-train/rt-x-node-0-3-abcde",
                   index_failures_before=0):
    """(reason, message) when the Job fails, or ("Replaced", why) when only the pod is recreated."""
    for index, rule in enumerate(job_spec["podFailurePolicy"]["rules"]):
        codes = rule.get("onExitCodes")
        matched = None
        if codes and exit_code and codes.get("containerName", "node") == "node" and codes["operator"] == "In" \
                and exit_code in codes["values"]:
            matched = f"Container node for pod {pod} failed with exit code {exit_code} matching {rule['action']} rule at index {index}"
        if condition and any(c["type"] == condition for c in rule.get("onPodConditions", [])):
            matched = f"Pod {pod} has condition {condition} matching {rule['action']} rule at index {index}"
        if matched and rule["action"] == "FailJob":
            return "PodFailurePolicy", matched
        if matched and rule["action"] == "Ignore":
            return "Replaced", "ignored: not counted"
        if matched:
            break  # Count: the default handling
    if "backoffLimitPerIndex" in job_spec:
        if index_failures_before + 1 <= job_spec["backoffLimitPerIndex"]:
            return "Replaced", f"index failure {index_failures_before + 1} of {job_spec['backoffLimitPerIndex']}"
        if 1 > job_spec.get("maxFailedIndexes", 1 << 31):
            return "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number of failed indexes"
        return "Replaced", "index failed; the others go on"
    if job_spec.get("backoffLimit", 6) == 0:
        return "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    return "Replaced", "counted against backoffLimit"


# JobSet's failure policy (the JobSet API, FailurePolicy.rules, in the Trainer CRD's descriptions; jobset
# pkg/controllers/failure_policy.go): rules in order, only the first matching rule acts; a rule matches when
# one of its onJobFailureReasons equals the reason (empty: any) and one of its onJobFailureMessagePatterns
# matches the message (Go regexp.MatchString: unanchored; empty: any). No match: RestartJobSet, which counts
# against maxRestarts.
def jobset_controller(policy, reason, message):
    if reason == "Replaced":
        return "ReplacePod"  # the Job did not fail: the JobSet does nothing
    for rule in policy["rules"]:
        reasons, patterns = rule.get("onJobFailureReasons", []), rule.get("onJobFailureMessagePatterns", [])
        if (not reasons or reason in reasons) and (not patterns or any(re.search(p, message) for p in patterns)):
            return rule["action"]
    return "RestartJobSet"


def node_job(runtime) -> dict:
    [job] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "node"]
    return job["template"]["spec"]


def test_a_lost_node_replaces_one_pod_a_crash_loop_fails_the_jobset_and_no_replacement_restarts_it(cluster):
    """What each end of a node's pod does to the job (trainer.launch.node_lifecycle's table), through the Job and JobSet
    controllers' rules: a node lost or evicted replaces that pod only (the others keep their memory); exit 42
    (the restart budget's verdict) fails the JobSet; exit 43 (no replacement in time) and a node that keeps
    failing restart every pod."""
    from trainer.env import CRASH_LOOP_EXIT_CODE, REPLACEMENT_TIMEOUT_EXIT_CODE

    _, objects, _ = cluster
    runtime, _ = runtime_pod(objects)
    policy = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert policy["restartStrategy"] == "BlockingRecreate"  # no two generations on FSx at once
    job_spec = node_job(runtime)

    def outcome(**pod):
        return jobset_controller(policy, *job_controller(job_spec, **pod))

    assert outcome(exit_code=CRASH_LOOP_EXIT_CODE) == "FailJobSet"
    assert outcome(exit_code=REPLACEMENT_TIMEOUT_EXIT_CODE) == "RestartJobSet"
    for other in (1, 2, 3, 137, 139, 143):  # a launcher error, a bad config, SIGKILL/OOM, SIGSEGV, SIGTERM
        assert outcome(exit_code=other) == "ReplacePod", other
        assert outcome(exit_code=other, index_failures_before=job_spec["backoffLimitPerIndex"]) == "RestartJobSet"
    for _ in range(100):  # a disruption never counts, however often
        assert outcome(condition="DisruptionTarget", index_failures_before=job_spec["backoffLimitPerIndex"]) == "ReplacePod"
    # Rule names the JobSet API accepts (its validation pattern, in the CRD's description of `name`).
    assert all(re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"]) for rule in policy["rules"])
    # In a value list for operator In, 0 is refused and values are sorted and unique (the Job API).
    for rule in job_spec["podFailurePolicy"]["rules"]:
        values = rule.get("onExitCodes", {}).get("values", [1])
        assert 0 not in values and values == sorted(set(values))


def test_the_node_job_is_one_the_api_server_admits(cluster):
    """kubernetes pkg/apis/batch/validation/validation.go: backoffLimitPerIndex and maxFailedIndexes only on an
    Indexed Job (maxFailedIndexes only with backoffLimitPerIndex); podFailurePolicy only with restartPolicy Never,
    and then podReplacementPolicy must be Failed (the API: "When using podFailurePolicy, Failed is the only
    allowed value"). A global backoffLimit would also cap the replacements: left to its default (MaxInt32 when
    backoffLimitPerIndex is set)."""
    _, objects, _ = cluster
    runtime, _ = runtime_pod(objects)
    job_spec = node_job(runtime)
    assert job_spec["completionMode"] == "Indexed"
    assert job_spec["template"]["spec"]["restartPolicy"] == "Never"
    assert job_spec["podReplacementPolicy"] == "Failed"
    assert "backoffLimit" not in job_spec
    assert job_spec["maxFailedIndexes"] == 0 and job_spec["backoffLimitPerIndex"] >= 1
    actions = {"Ignore", "FailJob", "FailIndex", "Count"}
    assert all(rule["action"] in actions for rule in job_spec["podFailurePolicy"]["rules"])
    # The job succeeds when its nodes do; the rendezvous pod is not a node.
    success = runtime["spec"]["template"]["spec"]["successPolicy"]
    assert success == {"operator": "All", "targetReplicatedJobs": ["node"]}


def test_the_rendezvous_lives_outside_every_node(cluster):
    """Every node's launcher meets at the rendezvous pod's store (is_host=false: no node hosts it), at the address
    JobSet gives that pod (<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>, the subdomain being the
    JobSet's name unless network.subdomain says otherwise: jobset pkg/controllers/jobset_controller.go,
    constructJob / GenPodName)."""
    from trainer.launch.command import RENDEZVOUS_PORT, rendezvous_endpoint_of

    _, objects, cfg = cluster
    runtime, _ = runtime_pod(objects)
    assert "network" not in runtime["spec"]["template"]["spec"] or \
        "subdomain" not in runtime["spec"]["template"]["spec"]["network"]
    [rendezvous] = [j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"] if j["name"] == "rendezvous"]
    assert rendezvous.get("replicas", 1) == 1
    pod = rendezvous["template"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["command"][:3] == ["python", "-m", "trainer.rendezvous_store"]
    assert str(RENDEZVOUS_PORT) in container["command"] and container["image"] == node_pod_image(runtime)
    assert "nvidia.com/gpu" not in container["resources"]["limits"]  # not a training node
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    command = job["spec"]["trainer"]["command"]
    name = job["metadata"]["name"]
    assert f"--rdzv-endpoint={rendezvous_endpoint_of(name)}" in command
    assert rendezvous_endpoint_of(name) == f"{name}-rendezvous-0-0.{name}:{RENDEZVOUS_PORT}"
    conf = next(a for a in command if a.startswith("--rdzv-conf="))
    assert "is_host=false" in conf and f"join_timeout={int(cfg.resilience.replacement_timeout_seconds)}" in conf
    # The TrainJob tells the store how many nodes finish before it exits.
    patches = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    [patch] = [p for p in patches if p["name"] == "rendezvous"]
    env = patch["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env == [{"name": "RESILIENT_TRAIN_RENDEZVOUS_NODES", "value": str(cfg.training.num_nodes)}]


def test_a_warm_spare_holds_a_whole_node_and_yields_to_a_replacement(cluster):
    """kube-scheduler's preemption (Kubernetes docs, "Pod Priority and Preemption"; DefaultPreemption plugin):
    a pending pod may evict pods of lower priority only, and a pod with preemptionPolicy Never evicts nobody.
    A training pod has no priorityClassName (priority 0 without a globalDefault class). A spare must request
    what a training pod does, so that it holds (and frees) one whole node."""
    name, objects, cfg = cluster
    spares = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "resilient-train-spare"]
    if name == "dev":
        assert spares == []  # optional: the dev overlay has none
        return
    [spare] = spares
    [priority] = [o for o in objects if o["kind"] == "PriorityClass"]
    pod = spare["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == priority["metadata"]["name"]
    assert priority["value"] < 0 and priority["preemptionPolicy"] == "Never" and not priority.get("globalDefault")
    runtime, node_pod = runtime_pod(objects)
    assert "priorityClassName" not in node_pod
    [container] = pod["containers"]
    training = node_pod["containers"][0]["resources"]["requests"]
    for resource in ("nvidia.com/gpu", "vpc.amazonaws.com/efa"):
        assert container["resources"]["requests"][resource] == training[resource]
    assert pod["nodeSelector"] == node_pod["nodeSelector"] and container["image"] == node_pod_image(runtime)
    command = container["command"]
    assert command[:3] == ["python", "-m", "trainer.node_health"] and "--hold" in command
    assert command[command.index("--gpus") + 1] == str(training["nvidia.com/gpu"])
    assert command[command.index("--efa") + 1] == str(training["vpc.amazonaws.com/efa"])


def node_pod_image(runtime) -> str:
    return node_job(runtime)["template"]["spec"]["containers"][0]["image"]


def test_the_jobsets_restart_budget_covers_the_pod_faults_the_planner_expects(cluster):
    """maxRestarts only backstops failures outside the training (the rule ends crash loops): it must not end a
    healthy 30-day job of the overlay's size that loses nodes at the planner's rate."""
    from trainer.planning.goodput import Costs
    from trainer.planning.survival import pod_restart_budget

    _, objects, cfg = cluster
    runtime, _ = runtime_pod(objects)
    max_restarts = runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"]
    costs = Costs(nodes=cfg.training.num_nodes, node_mtbf_hours=cfg.checkpoint.auto_node_mtbf_hours, step_seconds=4.0,
                  checkpoint_stall_seconds=0.5)
    assert max_restarts >= pod_restart_budget(costs, days=30)
    # Each node runs the launcher with the run folder: what makes a give-up end the pod with exit code 42.
    command = build_trainjob(cfg, "/fsx/datasets/v1")["spec"]["trainer"]["command"]
    assert f"--run-dir={cfg.run_dir}" in command and "--max-restarts=1000000" in command


# -- 10. Kueue, caching, one config per overlay ------------------------------------------------------------

# A cluster's Kueue Configuration as other teams leave it: other frameworks, fair sharing, tuned controllers.
CLUSTER_KUEUE_CONFIG = """
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
health: {healthProbeBindAddress: ":8081"}
controller:
  groupKindConcurrency: {Job.batch: 10, Workload.kueue.x-k8s.io: 10}
fairSharing: {enable: true}
integrations:
  frameworks: ["batch/job", "ray.io/rayjob", "pod"]
  podOptions:
    namespaceSelector: {matchExpressions: [{key: kubernetes.io/metadata.name, operator: NotIn, values: [kube-system]}]}
"""


def test_kueue_manages_trainjobs_and_the_cluster_keeps_its_own_configuration(capsys, tmp_path):
    """Kueue manages a TrainJob only when its Configuration lists the integration, whose name is
    "trainer.kubeflow.org/trainjob" (kubernetes-sigs/kueue pkg/controller/jobs/trainjob/trainjob_controller.go,
    FrameworkName); the Configuration is one per cluster (ConfigMap kueue-manager-config, key
    controller_manager_config.yaml, in kueue-system, API config.kueue.x-k8s.io/v1beta2, Kueue >= 0.15). The project
    states what it needs and merges that in; everything else stays the cluster's."""
    from pipelines.kueue_config import KueueConfigError, main, merge, needs

    wanted = needs()
    assert "trainer.kubeflow.org/trainjob" in wanted["integrations"]["frameworks"]
    assert wanted["manageJobsWithoutQueueName"] is False  # fsx-prepare and KFP's pods are not queued
    assert wanted["waitForPodsReady"]["enable"] is True
    assert not (MANIFESTS / "kueue-config" / "kustomization.yaml").exists()  # nothing replaces the cluster's file

    current = tmp_path / "current.yaml"
    current.write_text(CLUSTER_KUEUE_CONFIG)
    assert main([str(current)]) == 0
    merged = yaml.safe_load(capsys.readouterr().out)
    cluster = yaml.safe_load(CLUSTER_KUEUE_CONFIG)
    assert merged["integrations"]["frameworks"] == ["batch/job", "ray.io/rayjob", "pod", "trainer.kubeflow.org/trainjob"]
    for key in ("health", "controller", "fairSharing"):
        assert merged[key] == cluster[key]
    assert merged["integrations"]["podOptions"] == cluster["integrations"]["podOptions"]
    assert merged["waitForPodsReady"]["enable"] is True and merged["manageJobsWithoutQueueName"] is False
    assert merge(merged) == merged  # idempotent: applying it twice changes nothing

    own_timeout = {**cluster, "waitForPodsReady": {"enable": True, "timeout": "30m"}}
    assert merge(own_timeout)["waitForPodsReady"] == {"enable": True, "timeout": "30m"}
    with pytest.raises(KueueConfigError, match="manageJobsWithoutQueueName is true.*managedJobsNamespaceSelector"):
        merge({**cluster, "manageJobsWithoutQueueName": True})
    assert merge({**cluster, "manageJobsWithoutQueueName": True,
                  "managedJobsNamespaceSelector": {"matchLabels": {"kueue-managed": "true"}}})
    current.write_text("apiVersion: v1\nkind: ConfigMap\n")
    assert main([str(current)]) == 2
    assert "not a Kueue Configuration" in capsys.readouterr().err


def test_kueue_pins_only_the_training_pods_to_gpu_nodes(cluster):
    """The TrainJob's pod sets through Kueue's flavor assignment, then kube-scheduler's node filters
    (tests/scheduling.py, with sources): the training pods land only on GPU nodes of the job's type; the rendezvous
    store and the lighthouse get the system flavor and never land on a GPU node, tainted or not (docs/node-loss.md:
    they must outlive any training node)."""
    from tests.scheduling import assign_flavors, fits
    from tests.unit.test_manifests import _quantity

    name, objects, cfg = cluster
    runtime, node_pod = runtime_pod(objects)
    job = build_trainjob(cfg, "/fsx/datasets/v1")
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    resources = job["spec"]["trainer"]["resourcesPerNode"]
    container = {**node_pod["containers"][0], "resources": {
        "requests": {**node_pod["containers"][0]["resources"]["requests"], **resources["requests"]}}}
    training = {**node_pod, "containers": [container], "nodeSelector": {**node_pod.get("nodeSelector", {}),
                                                                        **patch.get("nodeSelector", {})},
                "tolerations": patch.get("tolerations", node_pod.get("tolerations", []))}
    jobs = {j["name"]: j["template"]["spec"]["template"]["spec"] for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    pod_sets = [("node", job["spec"]["trainer"]["numNodes"], training), ("rendezvous", 1, jobs["rendezvous"]),
                ("lighthouse", 1, jobs["lighthouse"])]
    flavors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ResourceFlavor"}
    queue = one(objects, "ClusterQueue", "resilient-train")
    gpu_type = cfg.kubernetes.node_selector_map["node.kubernetes.io/instance-type"]
    gpu_node = {"labels": {"node.kubernetes.io/instance-type": gpu_type},
                "taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}
    untainted_gpu_node = {"labels": {"node.kubernetes.io/instance-type": gpu_type}}
    system_node = {"labels": {"node.kubernetes.io/instance-type": "m6i.2xlarge"}}

    admitted = assign_flavors(pod_sets, queue, flavors, _quantity)
    flavor, pod = admitted["node"]
    assert flavor == "gpu-nodes" and fits(pod, gpu_node) and not fits(pod, system_node), name
    for support in ("rendezvous", "lighthouse"):
        flavor, pod = admitted[support]
        assert flavor == "system-nodes", (name, support, flavor)
        assert fits(pod, system_node) and not fits(pod, gpu_node) and not fits(pod, untainted_gpu_node), (name, support)

    # The rule catches the old layout: one flavor, no affinity; the rendezvous then lands on a GPU node.
    old_queue = {"spec": {"resourceGroups": [{**queue["spec"]["resourceGroups"][0],
                                              "flavors": queue["spec"]["resourceGroups"][0]["flavors"][:1]}]}}
    old_rendezvous = {k: v for k, v in jobs["rendezvous"].items() if k != "affinity"}
    _, pod = assign_flavors([("rendezvous", 1, old_rendezvous)], old_queue, flavors, _quantity)["rendezvous"]
    assert fits(pod, gpu_node)


def test_the_stage_tasks_cache_key_holds_no_per_run_value():
    """KFP's cache key is the task's component spec and its input values: the stage task must get nothing
    that differs between runs over the same data (run id, trigger) — submit adds run.run_id to overrides."""
    import json

    from components.stage.step import staging_config_json

    ir = next(yaml.safe_load_all((ROOT / "tests" / "golden" / "pipeline-eks.yaml").read_text()))
    dag = ir["root"]["dag"]["tasks"]["exit-handler-1"]
    stage = ir["components"][dag["componentRef"]["name"]]["dag"]["tasks"]["stage-data"]
    inputs = stage["inputs"]["parameters"]
    assert all("taskOutputParameter" in value and value["taskOutputParameter"]["producerTask"] == "fingerprint-data"
               for value in inputs.values()), inputs
    prod = ROOT / "pipelines" / "configs" / "eks-prod.yaml"
    one_run = load_config(prod, ["--run.run_id=a", "--run.trigger=ci", "--training.lr=1e-4"])
    another = load_config(prod, ["--run.run_id=b", "--run.trigger=schedule"])
    assert staging_config_json(one_run) == staging_config_json(another)
    assert json.loads(staging_config_json(one_run))["data"]["s3_uri"] == one_run.data.s3_uri
    assert staging_config_json(load_config(prod, ["--data.s3_uri=s3://other-bucket/x"])) != staging_config_json(another)


def test_each_overlay_has_a_config_that_matches_what_it_builds(cluster):
    name, objects, cfg = cluster
    k8s = cfg.kubernetes
    values = dict(line.split("=", 1) for line in (MANIFESTS / "overlays" / name / "cluster-values.env").read_text()
                  .splitlines() if line and not line.startswith("#"))
    runtime, pod = runtime_pod(objects)
    container = pod["containers"][0]
    limits = container["resources"]["limits"]
    assert k8s.node_selector_map == {"node.kubernetes.io/instance-type": values["GPU_INSTANCE_TYPE"]}
    assert k8s.gpus_per_node == limits["nvidia.com/gpu"] == cfg.training.nproc_per_node
    assert k8s.efa_per_node == limits.get("vpc.amazonaws.com/efa", 0)
    assert (k8s.image, k8s.pipeline_image) == (values["IMAGE"], values["PIPELINE_IMAGE"])
    assert k8s.runtime_name == runtime["metadata"]["name"]
    one(objects, "LocalQueue", k8s.queue_name, k8s.namespace)
    one(objects, "ServiceAccount", k8s.service_account, k8s.namespace)
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["fsx"] == str(cfg.fsx_root)
    assert cfg.data.fsx_file_system_id in ("", values["FSX_FILE_SYSTEM_ID"])
    assert cfg.training.num_nodes <= runtime["spec"]["mlPolicy"]["numNodes"] or name == "prod"
    if k8s.efa_per_node:
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
