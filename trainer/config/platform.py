"""The sections only the pipeline and the platform read: evaluation, MLflow, the local stack, Kubernetes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from trainer.config.fsx import throughput_mbps
from trainer.config.rules import check_s3_uri, is_s3_uri, require


@dataclass
class EvalConfig:
    """Evaluation on the training's ranks (periodic and final), the export, and the promotion gate."""

    batch_size: int = 8
    """Sequences per evaluation batch (across the evaluating ranks: each takes its share)."""

    max_batches: int = 20
    """Upper bound on the final evaluation's batches (the held-out split may be smaller)."""

    every_steps: int = 0
    """Periodic validation: every this many steps the training's ranks compute val_loss over the first val_batches
    held-out batches (metrics.jsonl, MLflow; its seconds count as badput 'evaluation'). 0: off."""

    val_batches: int = 2
    """Held-out batches of a periodic validation (the final evaluation takes max_batches)."""

    tasks: str = "multiple_choice"
    """Evaluation tasks besides the loss, comma-separated: a shipped task's name or a module:function entry point
    (trainer.evaluate.tasks) given the sharded model and the tokenizer; empty: none."""

    task_file: str = ""
    """The jsonl the multiple_choice task reads ({question, choices, answer}); empty: the bundled set."""

    lm_eval_tasks: str = ""
    """lm-evaluation-harness tasks run on the training's ranks (the sharded model behind lm-eval's LM interface),
    comma-separated: task YAML files (their dataset a local jsonl/parquet: `dataset_path: json`, `dataset_kwargs:
    {data_files: ...}`, relative paths from the YAML's folder) or names of tasks in eval.lm_eval_include_path. No
    download at run time. Each task's metrics join the record as `lm_eval:<task>` (the gate, MLflow); empty: none."""

    lm_eval_include_path: str = ""
    """A folder of lm-eval task YAMLs (and the data files they name, relative to them) whose task names
    eval.lm_eval_tasks may use (lm-eval's --include_path); or an S3 prefix of one, which the stage step copies onto
    FSx like a corpus."""

    lm_eval_limit: int = 0
    """Documents per lm-eval task (lm-eval's --limit); 0: all of them."""

    lm_eval_chat_template: bool = False
    """Render lm-eval's prompts with the tokenizer's chat template (lm-eval's --apply_chat_template): for a model
    fine-tuned on conversations."""

    tasks_required: bool = False
    """A task that raises fails the gate (no promotion, the step fails naming it); false: the gate records the
    task's error and decides on the held-out loss alone."""

    export_uri: str = ""
    """Where the trained model goes in Hugging Face format, as <export_uri>/<run_id>/step-N/ (sharded safetensors,
    written by the training's ranks, export-complete.json last): an S3 prefix, or a folder; empty: <run dir>/export.
    The registered version's source is this URI; the tracking server never carries the weights."""

    export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    """The exported weights' dtype (training keeps fp32 master weights)."""

    export_max_file_gb: float = 5.0
    """Largest safetensors file of the export, in GB (Hugging Face's default shard size)."""

    champion_missing: Literal["promote", "refuse"] = "promote"
    """A registered champion whose export is gone cannot be evaluated: promote the validated candidate on its own
    evaluation, or refuse. Either way the gate's record says so."""

    prompts: str = "The|Once upon a time|In the beginning"
    """Fixed prompts for greedy sample generations ('|'-separated); logged as generations.json."""

    max_new_tokens: int = 48
    """Tokens generated per prompt (0 = no generations)."""

    register: bool = True
    """Compare with the registered champion and, if better, register the model and move the alias."""

    registered_model_name: str = "resilient-train-llama"
    """MLflow Model Registry name of the model line whose champion the candidate is compared with."""

    promotion_threshold: float = 0.0
    """Relative held-out-loss improvement over the champion required to promote (0.01 = 1 % lower)."""

    promotion_wait_seconds: float = 1800.0
    """Concurrent runs: how long a candidate waits for earlier candidates to be decided before it treats one
    as abandoned (its run died mid-gate). Covers an evaluation of the champion."""

    def __post_init__(self) -> None:
        require(self.batch_size >= 1, "eval.batch_size", "must be >= 1")
        require(self.max_batches >= 1, "eval.max_batches", "must be >= 1")
        require(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0")
        require(self.every_steps >= 0, "eval.every_steps", "must be >= 0 (0: no periodic validation)")
        require(self.val_batches >= 1, "eval.val_batches", "must be >= 1")
        require(self.export_max_file_gb > 0, "eval.export_max_file_gb", "must be > 0")
        if is_s3_uri(self.export_uri):
            check_s3_uri(self.export_uri, "eval.export_uri")
        require(all(part.strip() for part in self.tasks.split(",")) or not self.tasks.strip(), "eval.tasks",
                "an empty entry between commas: list task names or module:function entry points")
        if is_s3_uri(self.lm_eval_include_path):
            check_s3_uri(self.lm_eval_include_path, "eval.lm_eval_include_path")
        require(self.lm_eval_limit >= 0, "eval.lm_eval_limit", "must be >= 0 (0: every document)")
        require(0.0 <= self.promotion_threshold < 1.0, "eval.promotion_threshold", "must be in [0, 1)")
        require(self.promotion_wait_seconds > 0, "eval.promotion_wait_seconds", "must be > 0")
        require(not self.register or bool(self.registered_model_name.strip()), "eval.registered_model_name",
                 "must not be empty when eval.register is true")

    @property
    def lm_eval_task_list(self) -> list[str]:
        return [part.strip() for part in self.lm_eval_tasks.split(",") if part.strip()]

    @property
    def task_list(self) -> list[str]:
        return [part.strip() for part in self.tasks.split(",") if part.strip()]

    @property
    def prompt_list(self) -> list[str]:
        return [p for p in (part.strip() for part in self.prompts.split("|")) if p]


@dataclass
class MlflowConfig:
    """Experiment tracking."""

    tracking_uri: str = ""
    """MLflow tracking URI; empty means a sqlite store at <run.work_dir>/mlflow.db."""

    artifact_location: str = ""
    """Artifact root for a newly created experiment; empty means <run.work_dir>/mlartifacts
    when the store is local, the server's default otherwise."""

    forward_interval_seconds: float = 10.0
    """While training runs, the train step forwards what the run folder accumulated (per-step metrics,
    checkpoint records, faults and recoveries, interval choices, the nodes' system metrics) into the MLflow
    train run every this many seconds (components.forwarder): MLflow is at most about this far behind."""

    step_metric_every: int = 1
    """Per-step metrics (loss, lr, grad norm, step time, tokens/s) reach MLflow every this many steps; every
    checkpoint, fault and recovery is recorded whatever it is. A month at 4 s per step is 650 k steps per metric:
    10 keeps a curve MLflow draws quickly. The run folder keeps every step either way."""

    def __post_init__(self) -> None:
        require(0 < self.forward_interval_seconds <= 3600, "mlflow.forward_interval_seconds", "must be in (0, 3600]")
        require(self.step_metric_every >= 1, "mlflow.step_metric_every", "must be >= 1 (1: every step)")


@dataclass
class LocalConfig:
    """The embedded local stack used when the pipeline runs on one machine."""

    s3_server: bool = True
    """Start an S3-compatible server (moto) on 127.0.0.1 for the run and point boto3 at it."""

    upload_demo_data: bool = True
    """Generate the demo corpus and upload it to data.s3_uri before the pipeline starts."""

    demo_documents: int = 2000
    """Documents in the generated demo corpus."""

    node_replacement_delay_seconds: float = 5.0
    """training.num_nodes > 1: seconds between a node's loss and the start of its replacement (a new node's
    scheduling and start-up on EKS; a warm spare takes seconds, a new instance minutes). Longer than
    resilience.replacement_timeout_seconds, the replacement never comes in time and the whole job restarts."""

    node_loss: Literal["replace", "restart_job"] = "replace"
    """training.num_nodes > 1: what a lost node costs. replace: only that node is replaced (the EKS runtime
    with per-index backoff; docs/node-loss.md); restart_job: every node is stopped and the whole job relaunched
    (a runtime without it — Kubernetes < 1.29, or backoffLimit 0 — and bench/recovery.py's baseline)."""

    node_network: Literal["loopback", "netns"] = "loopback"
    """training.num_nodes > 1: the nodes' network. loopback: every node on this machine's loopback (127.0.0.<index
    + 1>). netns (root only): each node's launcher and workers in a network namespace of their own on a bridge,
    the rendezvous store and the lighthouse in another, so a node can be cut off from the others (the partition,
    flap and partition_store drills) while the run folder stays shared, as FSx is on EKS (docs/network-faults.md)."""

    def __post_init__(self) -> None:
        require(self.demo_documents >= 10, "local.demo_documents", "must be >= 10")
        require(self.node_replacement_delay_seconds >= 0, "local.node_replacement_delay_seconds", "must be >= 0")


@dataclass
class KubernetesConfig:
    """Running on EKS: the train step creates a Kubeflow Trainer TrainJob; the pipeline's pods get these
    settings through kfp-kubernetes. Ignored by the local runner unless enabled."""

    enabled: bool = False
    """Train through a TrainJob on the cluster (the launcher component) instead of on the step's machine."""

    namespace: str = "resilient-train"
    """Namespace of the TrainJobs (and, in multi-user KFP, of the pipeline's pods: the Profile namespace)."""

    kfp_mode: Literal["standalone", "multi-user"] = "multi-user"
    """How Kubeflow Pipelines is installed: 'multi-user' runs the pipeline's pods in the Profile namespace
    kubernetes.namespace (submit and schedule pass it); 'standalone' runs them in kubernetes.kfp_namespace."""

    kfp_namespace: str = "kubeflow"
    """Standalone KFP: the namespace it runs every pipeline pod in (where the FSx claim and the pipeline
    ServiceAccount must exist too: manifests/components/kfp-standalone)."""

    image: str = "ghcr.io/example/resilient-train-trainer:latest"
    """Training image of the TrainJob's pods (docker/trainer.Dockerfile: NGC PyTorch + EFA + NVRx >= 0.6)."""

    pipeline_image: str = "ghcr.io/example/resilient-train-pipeline:latest"
    """Slim CPU image of the pipeline's own steps and the MLflow server (docker/pipeline.Dockerfile)."""

    fsx_deployment_type: Literal["SCRATCH_2", "PERSISTENT_2"] = "SCRATCH_2"
    """The FSx for Lustre file system's deployment type. PERSISTENT_2 for a job whose checkpoints must survive a
    failed file server (SCRATCH_2 keeps one copy); `python -m pipelines plan --from-config` sizes one."""

    fsx_storage_gib: int = 1200
    """Its storage: 1200, 2400 or a multiple of 2400 GiB (trainer.config.fsx: AWS's rule)."""

    fsx_per_unit_throughput: int = 0
    """PERSISTENT_2's throughput tier: 125, 250, 500 or 1000 MB/s per TiB of storage. SCRATCH_2: 0 (its baseline,
    200 MB/s/TiB)."""

    fsx_throughput_mbps: float = 0.0
    """The file system's throughput in MB/s, which the planner's save and reload times, the first heartbeat and the
    start-up timeouts are sized by. 0: its provisioned one, fsx_storage_gib in TiB x the tier; set it to what you
    measured when that is less."""

    progress_interval_seconds: float = 30.0
    """How often rank 0 reports progress: the TrainJob's status.trainerStatus (Kubeflow Trainer >= 2.2, when its
    server is in the pod's environment) and the run folder's trainer_status.json the train step logs."""

    runtime_name: str = "resilient-train-fsdp-nvrx"
    """ClusterTrainingRuntime the TrainJob references (manifests/base/trainer)."""

    queue_name: str = "resilient-train"
    """Kueue LocalQueue for the TrainJob (label kueue.x-k8s.io/queue-name); empty = no Kueue."""

    service_account: str = "resilient-train-trainer"
    """ServiceAccount of the training pods (IRSA: S3 checkpoints and data)."""

    pipeline_service_account: str = "resilient-train-pipeline"
    """ServiceAccount of the pipeline's own pods (IRSA: S3, FSx DRA calls; RBAC: TrainJobs)."""

    fsx_pvc: str = "fsx-claim"
    """PersistentVolumeClaim of the FSx for Lustre file system, mounted at data.fsx_root."""

    gpus_per_node: int = 8
    """nvidia.com/gpu per node (training.nproc_per_node should match)."""

    efa_per_node: int = 32
    """vpc.amazonaws.com/efa devices per node (32 on p5.48xlarge; 0 = no EFA)."""

    shm_size: str = "256Gi"
    """Size of the /dev/shm memory volume (NCCL, dataloaders, async checkpoint staging), in Gi."""

    node_memory_gib: int = 0
    """Size of the node-memory volume (medium: Memory, mounted at checkpoint.memory_dir) in GiB: two copies of
    the node's share of the training state plus two of its peer's. 0 derives it from the model
    (trainer.launch.command.node_memory_gib)."""

    process_memory_gib: int = 256
    """Memory per node for the training processes themselves, on top of /dev/shm and the node-memory volume
    (both count against the pod's memory limit, which is the sum of the three)."""

    node_selector: str = "node.kubernetes.io/instance-type=p5.48xlarge"
    """Training pods' node selector, comma-separated key=value pairs."""

    tolerations: str = "nvidia.com/gpu:NoSchedule"
    """Training pods' tolerations, comma-separated key[=value]:Effect."""

    mlflow_secret: str = "mlflow-credentials"
    """Secret whose keys become the pipeline pods' environment (MLFLOW_TRACKING_USERNAME, …); empty = none."""

    prometheus_port: int = 9400
    """Port of the trainer's /metrics on the cluster (training.prometheus_port is set from it)."""

    launcher_poll_seconds: float = 30.0
    """How often the launcher checks the TrainJob's state."""

    step_retries: int = 2
    """Retries (with backoff) of the stage step and the launcher on the cluster."""

    def __post_init__(self) -> None:
        require(self.progress_interval_seconds >= 1, "kubernetes.progress_interval_seconds", "must be >= 1 second")
        require(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace) is not None and len(self.namespace) <= 63,
                 "kubernetes.namespace", "must be a DNS-1123 label")
        require(bool(self.image.strip()), "kubernetes.image", "must not be empty")
        require(bool(self.pipeline_image.strip()), "kubernetes.pipeline_image", "must not be empty")
        require(self.kfp_mode in ("standalone", "multi-user"), "kubernetes.kfp_mode",
                 "must be 'standalone' or 'multi-user'")
        require(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.kfp_namespace) is not None,
                 "kubernetes.kfp_namespace", "must be a DNS-1123 label")
        provisioned = throughput_mbps(self.fsx_deployment_type, self.fsx_storage_gib, self.fsx_per_unit_throughput)
        require(self.fsx_throughput_mbps >= 0, "kubernetes.fsx_throughput_mbps", "must be >= 0 (0: the provisioned)")
        if not self.fsx_throughput_mbps:
            self.fsx_throughput_mbps = provisioned
        require(self.gpus_per_node >= 0 and self.efa_per_node >= 0, "kubernetes.gpus_per_node",
                 "GPU and EFA counts must be >= 0")
        require(self.launcher_poll_seconds > 0, "kubernetes.launcher_poll_seconds", "must be > 0")
        require(self.step_retries >= 0, "kubernetes.step_retries", "must be >= 0")
        require(re.fullmatch(r"[1-9]\d*Gi", self.shm_size) is not None, "kubernetes.shm_size",
                 f"{self.shm_size!r} must be a whole number of Gi, e.g. 256Gi")
        require(self.node_memory_gib >= 0, "kubernetes.node_memory_gib", "must be >= 0 (0 derives it)")
        require(self.process_memory_gib >= 1, "kubernetes.process_memory_gib", "must be >= 1")
        for pair in filter(None, (p.strip() for p in self.node_selector.split(","))):
            require("=" in pair, "kubernetes.node_selector", f"{pair!r} is not key=value")
        for item in filter(None, (t.strip() for t in self.tolerations.split(","))):
            require(item.rsplit(":", 1)[-1] in ("NoSchedule", "PreferNoSchedule", "NoExecute") and ":" in item,
                     "kubernetes.tolerations", f"{item!r} is not key[=value]:NoSchedule|PreferNoSchedule|NoExecute")

    @property
    def pipeline_namespace(self) -> str:
        """Where KFP runs the pipeline's pods: the Profile namespace (multi-user) or KFP's own (standalone)."""
        return self.namespace if self.kfp_mode == "multi-user" else self.kfp_namespace

    @property
    def node_selector_map(self) -> dict[str, str]:
        return dict(p.strip().split("=", 1) for p in self.node_selector.split(",") if p.strip())

    @property
    def toleration_list(self) -> list[dict[str, str]]:
        tolerations = []
        for item in filter(None, (t.strip() for t in self.tolerations.split(","))):
            key_value, effect = item.rsplit(":", 1)
            key, _, value = key_value.partition("=")
            tolerations.append({"key": key, "operator": "Equal" if value else "Exists", **({"value": value} if value else {}),
                                "effect": effect})
        return tolerations
