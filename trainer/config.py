"""The one configuration tree of resilient-train.

Every section is a dataclass; every field has a docstring right under it and is checked in
``__post_init__``. A run's configuration is loaded from YAML and then adjusted with
``--section.key=value`` overrides (the same syntax on the CLI, in ``make demo ARGS=…`` and in the KFP
pipeline's ``overrides`` parameter), so defaults live here and nowhere else.

    cfg = load_config("local", ["--training.num_steps=50"])
    cfg.training.num_steps  # 50

This module imports neither torch nor KFP: the CLI, the components and the trainer all use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.faults import FAULT_TYPES, parse_schedule

CONFIG_DIR = Path(__file__).resolve().parent.parent / "pipelines" / "configs"

_RUN_ID_PATTERN = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


class ConfigError(ValueError):
    """A user mistake in a configuration file or override; the message names the field."""


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{name}: {message}")


# General purpose bucket names (Amazon S3 User Guide, "General purpose bucket naming rules"): 3-63 characters
# of lowercase letters, digits, '.' and '-', starting and ending with a letter or digit, no '..', not an IPv4
# address, none of the reserved prefixes and suffixes.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_BUCKET_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_BUCKET_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")


def check_s3_uri(uri: str, name: str) -> None:
    """s3://bucket/prefix with a valid bucket name and no empty segment in the prefix; names the field."""
    _require(uri.startswith("s3://") and len(uri) > len("s3://"), name, f"{uri!r} must look like s3://bucket/prefix")
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    _require(bool(_BUCKET.match(bucket)), name,
             f"bucket {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, '.' or '-', "
             "starting and ending with a letter or digit)")
    _require(".." not in bucket and not re.fullmatch(r"\d+\.\d+\.\d+\.\d+", bucket)
             and not bucket.startswith(_BUCKET_RESERVED_PREFIXES) and not bucket.endswith(_BUCKET_RESERVED_SUFFIXES),
             name, f"bucket {bucket!r} is not a valid S3 bucket name (no '..', not an IP address, no reserved "
                   "prefix or suffix)")
    _require("//" not in prefix.rstrip("/") and not prefix.startswith("/"), name,
             f"prefix {prefix!r} has an empty segment ('//'): S3 keys would not match the folders staged")


@dataclass
class RunConfig:
    """Identity and bookkeeping of one pipeline run."""

    experiment: str = "resilient-train"
    """MLflow experiment that receives the parent run and its nested step runs."""

    run_id: str = ""
    """Run identifier (lowercase letters, digits, '-'); empty means one is generated at start."""

    work_dir: str = "work"
    """Local working directory: the MLflow store and (unless data.fsx_root is set) the FSx stand-in."""

    trigger: Literal["manual", "schedule", "ci"] = "manual"
    """What started the run; recorded as an MLflow tag so runs can be compared by origin."""

    seed: int = 1234
    """Seed for model initialisation and data order; the same seed reproduces the same losses on CPU."""

    def __post_init__(self) -> None:
        _require(bool(self.experiment.strip()), "run.experiment", "must not be empty")
        _require(
            self.run_id == "" or bool(_RUN_ID_PATTERN.match(self.run_id)),
            "run.run_id",
            f"{self.run_id!r} must be 1-63 lowercase letters, digits or '-', starting with a letter or digit",
        )
        _require(bool(self.work_dir), "run.work_dir", "must not be empty")
        _require(self.seed >= 0, "run.seed", "must be >= 0")


@dataclass
class DataConfig:
    """Where the training data comes from (S3) and where the trainer reads it (the FSx mount)."""

    s3_uri: str = "s3://resilient-train-data/datasets/demo"
    """S3 prefix holding the raw text (*.txt, *.jsonl with a "text" field) to stage, as s3://bucket/prefix."""

    fsx_root: str = ""
    """FSx for Lustre mount path (a local directory locally); empty means <run.work_dir>/fsx."""

    dataset_name: str = "demo"
    """Folder under <fsx_root>/datasets that receives the staged files and token shards."""

    s3_endpoint_url: str = ""
    """S3 endpoint override (e.g. an S3-compatible server); empty uses boto3's standard resolution
    (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, then AWS)."""

    tokenizer: str = "byte"
    """'byte' (built-in byte-level tokenizer, no files) or a folder with an HF tokenizer.json."""

    val_fraction: float = 0.05
    """Fraction of the documents held out for evaluation (chosen deterministically by document hash)."""

    max_workers: int = 8
    """Parallel S3 downloads during staging."""

    stage_mode: Literal["copy", "dra"] = "copy"
    """'copy': parallel verified download onto any POSIX path (local disk, NVMe, EFS, the local demo);
    'dra': link the FSx for Lustre file system to the S3 prefix with a Data Repository Association and
    import its metadata (file contents load on first read, or are preloaded)."""

    delete_removed: bool = False
    """Copy mode: delete staged files whose objects are no longer in S3."""

    fsx_file_system_id: str = ""
    """DRA mode: the FSx for Lustre file system mounted at fsx_root (fs-…)."""

    dra_auto_import: str = "NEW,CHANGED,DELETED"
    """DRA mode: S3 events the file system imports automatically (comma-separated; empty = none)."""

    dra_import_timeout_seconds: float = 3600.0
    """DRA mode: the longest wait for the DRA to become AVAILABLE and for the metadata import task."""

    dra_poll_seconds: float = 15.0
    """DRA mode: first polling interval for DRA and task state (doubles up to 8x)."""

    preload: bool = True
    """DRA mode: preload file contents with `lfs hsm_restore` when the lfs tool exists (else lazy load)."""

    require_lustre_mount: bool = True
    """DRA mode: refuse to stage unless fsx_root is a Lustre mount (false only for dry runs and tests)."""

    on_bad_key: Literal["fail", "skip"] = "fail"
    """What to do with an S3 key that cannot safely become a file below the dataset folder ('..', '.', empty
    segments, NUL, a segment over NAME_MAX, a file that other keys use as a folder, two keys on one path):
    'fail' the stage naming the keys, or 'skip' them with a warning (counted in the stage manifest)."""

    def __post_init__(self) -> None:
        _require(self.stage_mode in ("copy", "dra"), "data.stage_mode", "must be 'copy' or 'dra'")
        if self.stage_mode == "dra":
            _require(re.fullmatch(r"fs-[0-9a-f]{8,17}", self.fsx_file_system_id) is not None,
                     "data.fsx_file_system_id", "must be an FSx file system id (fs-0123456789abcdef0) in dra mode")
        events = [e.strip() for e in self.dra_auto_import.split(",") if e.strip()]
        _require(all(e in ("NEW", "CHANGED", "DELETED") for e in events), "data.dra_auto_import",
                 "must list NEW, CHANGED and/or DELETED")
        _require(self.dra_import_timeout_seconds > 0, "data.dra_import_timeout_seconds", "must be > 0")
        _require(self.dra_poll_seconds > 0, "data.dra_poll_seconds", "must be > 0")
        _require(self.on_bad_key in ("fail", "skip"), "data.on_bad_key", "must be 'fail' or 'skip'")
        check_s3_uri(self.s3_uri, "data.s3_uri")
        _require(
            bool(re.match(r"^[A-Za-z0-9._-]+$", self.dataset_name)),
            "data.dataset_name",
            f"{self.dataset_name!r} must be a plain folder name (letters, digits, '.', '_', '-')",
        )
        _require(0.0 < self.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
        _require(self.max_workers >= 1, "data.max_workers", "must be >= 1")

    @property
    def bucket(self) -> str:
        return self.s3_uri[len("s3://") :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        parts = self.s3_uri[len("s3://") :].split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # A few M params: the CPU demo and the tests.
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=3, num_attention_heads=8,
                 num_key_value_heads=4, max_position_embeddings=512, rope_theta=10000.0,
                 tie_word_embeddings=False),
    # ~100 M params with the byte vocabulary: CPU benchmarks.
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=2048, rope_theta=500000.0,
                  tie_word_embeddings=False),
    # Llama-3.2-1B's shape.
    "llama3-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                      tie_word_embeddings=True),
    # Llama-3.1-8B's shape.
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
                        tie_word_embeddings=False),
}


@dataclass
class ModelConfig:
    """The Llama-architecture model."""

    preset: Literal["tiny", "small", "llama3-1b", "llama3.1-8b"] = "tiny"
    """Architecture preset (layer count and widths); see MODEL_PRESETS. Ignored when init_from is set."""

    init_from: str = ""
    """HF-format weights folder (config.json + *.safetensors, e.g. staged onto FSx) to start from;
    empty starts from random weights. A checkpoint to resume from takes precedence."""

    vocab_size: int = 0
    """Vocabulary size; 0 means the tokenizer's (the built-in byte tokenizer has 258)."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (less memory, ~30 % more compute)."""

    def __post_init__(self) -> None:
        _require(self.preset in MODEL_PRESETS, "model.preset", f"must be one of {sorted(MODEL_PRESETS)}")
        _require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0")


@dataclass
class TrainingConfig:
    """The optimisation loop and how it is launched."""

    num_steps: int = 300
    """Optimizer steps to train in total."""

    batch_size: int = 8
    """Sequences per rank per micro-batch."""

    seq_len: int = 128
    """Tokens per sequence."""

    grad_accum_steps: int = 1
    """Micro-batches accumulated into one optimizer step."""

    lr: float = 3e-3
    """Peak learning rate (AdamW)."""

    min_lr_ratio: float = 0.1
    """Learning rate at the end of the cosine decay, as a fraction of lr."""

    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay (a run shorter than this is all warm-up)."""

    weight_decay: float = 0.1
    """AdamW weight decay."""

    grad_clip: float = 1.0
    """Maximum global gradient norm; 0 disables clipping."""

    nproc_per_node: int = 2
    """Training processes per node (GPUs per node on EKS; CPU ranks locally)."""

    num_nodes: int = 1
    """Nodes in the training job (1 locally)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto picks nccl when CUDA is available, else gloo."""

    num_threads: int = 1
    """intra-op CPU threads per rank (CPU only); ranks x threads should not exceed the cores."""

    log_every: int = 10
    """Log a training-progress line every this many steps (metrics are recorded every step)."""

    prometheus_port: int = 0
    """Serve Prometheus /metrics from each training process on this port + LOCAL_RANK (0 = off)."""

    timeout_seconds: int = 3600
    """Wall-clock limit for the whole training launch; the step fails when it is exceeded."""

    def __post_init__(self) -> None:
        _require(0 <= self.prometheus_port <= 65535 - 64, "training.prometheus_port", "must be in [0, 65471]")
        for name in ("num_steps", "batch_size", "seq_len", "grad_accum_steps", "nproc_per_node", "num_nodes",
                     "num_threads", "log_every", "timeout_seconds"):
            _require(getattr(self, name) >= 1, f"training.{name}", "must be >= 1")
        _require(self.lr > 0, "training.lr", "must be > 0")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", "must be in [0, 1]")
        _require(self.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
        _require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0")
        _require(self.grad_clip >= 0, "training.grad_clip", "must be >= 0 (0 disables clipping)")


@dataclass
class CheckpointConfig:
    """Sharded DCP checkpoints on the FSx mount."""

    enabled: bool = True
    """Save checkpoints at all (off only for benchmarks and throw-away runs)."""

    mode: Literal["sync", "async"] = "async"
    """async: the loop blocks only while the state is copied to host memory, the write runs in the
    background; sync: the loop waits for the whole write (baseline)."""

    async_backend: Literal["auto", "torch", "nvrx"] = "auto"
    """Writer for async mode: nvrx (NVRx async DCP writer, CUDA only), torch (dcp.async_save in a
    background process on its own gloo group; CPU or CUDA), auto (nvrx on CUDA when installed, else torch)."""

    background_nice: int = 10
    """CPU priority (Unix nice, 0-19) of background checkpoint work (the async writer process, the commit
    thread): with every core busy training, it then takes idle cycles first. 0 leaves it unchanged."""

    dir: str = ""
    """Checkpoint folder; empty means <data.fsx_root>/runs/<run.run_id>/checkpoints."""

    interval_steps: int = 100
    """Save every this many steps (the last step is always saved)."""

    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted after a newer one commits."""

    resume: bool = True
    """Resume from the newest committed checkpoint in `dir` when one exists."""

    def __post_init__(self) -> None:
        _require(self.interval_steps >= 1, "checkpoint.interval_steps", "must be >= 1")
        _require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        _require(0 <= self.background_nice <= 19, "checkpoint.background_nice", "must be in [0, 19]")


@dataclass
class ResilienceConfig:
    """Recovery layers: ft_launcher (in-job restart) and a bounded relaunch of the whole job."""

    in_process: bool = False
    """Layer 1: NVRx in-process restart (inprocess.Wrapper) — a Python exception or hang is recovered without
    ending the processes: the process group is rebuilt and state reloaded. Process deaths go to layer 2."""

    in_process_max_restarts: int = 3
    """In-process restarts per launch before a fault escalates to the launcher (layer 2)."""

    collective_timeout: float = 5.0
    """gloo collective timeout (seconds) under in-process restart: on gloo only this timeout releases a
    rank blocked in a collective whose peer failed, so it must stay below soft_timeout."""

    soft_timeout: float = 20.0
    """In-process: seconds without progress (one ping per step) before a rank is declared hung."""

    memory_snapshot_interval_steps: int = 10
    """In-process: every this many steps each rank keeps a copy of its training state in host memory; a
    restart reloads it instead of the checkpoint when it is newer and the same step on all ranks. 0 = off."""

    launcher: Literal["ft_launcher", "torchrun"] = "ft_launcher"
    """ft_launcher restarts the workers after a crash, SIGKILL, OOM-style exit or hang (missed heartbeats)
    while keeping the launcher and rendezvous; torchrun has no hang detection (baseline)."""

    max_restarts: int = 3
    """In-job restarts before the launcher gives up (then the job-level relaunch takes over)."""

    initial_heartbeat_timeout: float = 0.0
    """Seconds a worker may take from start to its first heartbeat: imports, process group (NCCL across every
    rank), model build, checkpoint load from FSx and the first step. 0 derives it from the model's
    checkpoint size, kubernetes.fsx_throughput_mbps and the GPU count (at least 120 s; see
    trainer.launch_args.initial_heartbeat_timeout); too short, and ft_launcher kills every resume."""

    heartbeat_timeout: float = 60.0
    """Seconds without a heartbeat (one per step) after which ft_launcher declares a rank hung and restarts."""

    rendezvous_timeout: float = 600.0
    """Seconds the launchers' c10d rendezvous waits for every node to join (rdzv-conf join_timeout)."""

    node_health_check_endpoint: str = ""
    """NVRx >= 0.5: a node health check service (Unix socket, e.g. /var/run/nvhcd.sock) ft_launcher asks
    before each rendezvous; empty = none (older NVRx ignores it, saying so)."""

    gpu_health_interval_steps: int = 100
    """Check the GPU through NVML (ECC, retired/remapped memory, critical XIDs) every this many steps;
    0 turns it off. A no-op on machines without NVIDIA drivers."""

    job_restarts: int = 1
    """Relaunches of the whole training job after the launcher gives up (locally; a TrainJob restart on EKS)."""

    def __post_init__(self) -> None:
        _require(self.max_restarts >= 0, "resilience.max_restarts", "must be >= 0")
        _require(self.job_restarts >= 0, "resilience.job_restarts", "must be >= 0")
        _require(self.initial_heartbeat_timeout >= 0, "resilience.initial_heartbeat_timeout",
                 "must be >= 0 (0 derives it from the checkpoint size)")
        _require(self.rendezvous_timeout > 0, "resilience.rendezvous_timeout", "must be > 0")
        _require(self.heartbeat_timeout > 0, "resilience.heartbeat_timeout", "must be > 0")
        _require(self.memory_snapshot_interval_steps >= 0, "resilience.memory_snapshot_interval_steps",
                 "must be >= 0 (0 turns the in-memory copy off)")
        _require(self.in_process_max_restarts >= 1, "resilience.in_process_max_restarts", "must be >= 1")
        _require(0 < self.collective_timeout < self.soft_timeout, "resilience.collective_timeout",
                 f"must be in (0, resilience.soft_timeout={self.soft_timeout})")


@dataclass
class FaultsConfig:
    """Fault injection for drills, tests and benchmarks; off unless a schedule is given. Always logged."""

    schedule: str = ""
    """Comma-separated faults, TYPE@STEP or TYPE@t=SECONDS with an optional :rank=R, e.g.
    'sigkill@120:rank=1, hang@200'. Types: exception, hang, hang_in_collective, sigkill, exit (OOM-like,
    code 137), slow_rank, checkpoint_writer_crash, and the save drills kill_during_shard_write,
    kill_before_manifest, kill_before_rename, kill_before_parent_fsync, kill_during_retention (SIGKILL at that
    sub-step of the first save of step >= STEP). Each fault fires once per run, so a replayed step does not
    fire it again."""

    mtbf_steps: float = 0.0
    """Add a seeded random schedule with this mean number of steps between faults (0: none)."""

    random_types: str = "exception,sigkill"
    """Fault types the random schedule draws from (comma-separated)."""

    seed: int = 0
    """Seed of the random schedule (fault steps, types and ranks)."""

    slow_seconds: float = 5.0
    """How long a slow_rank fault stalls its rank."""

    def __post_init__(self) -> None:
        _require(self.mtbf_steps >= 0, "faults.mtbf_steps", "must be >= 0")
        _require(self.slow_seconds >= 0, "faults.slow_seconds", "must be >= 0")
        for name in (t.strip() for t in self.random_types.split(",") if t.strip()):
            _require(name in FAULT_TYPES, "faults.random_types", f"{name!r} is not one of {list(FAULT_TYPES)}")
        try:
            parse_schedule(self.schedule)
        except ValueError as err:
            raise ConfigError(f"faults.schedule: {err}") from err


@dataclass
class EvalConfig:
    """Held-out evaluation of the validated checkpoint."""

    batch_size: int = 8
    """Sequences per evaluation batch."""

    max_batches: int = 20
    """Upper bound on evaluation batches (the held-out split may be smaller)."""

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
        _require(self.batch_size >= 1, "eval.batch_size", "must be >= 1")
        _require(self.max_batches >= 1, "eval.max_batches", "must be >= 1")
        _require(self.max_new_tokens >= 0, "eval.max_new_tokens", "must be >= 0")
        _require(0.0 <= self.promotion_threshold < 1.0, "eval.promotion_threshold", "must be in [0, 1)")
        _require(self.promotion_wait_seconds > 0, "eval.promotion_wait_seconds", "must be > 0")
        _require(not self.register or bool(self.registered_model_name.strip()), "eval.registered_model_name",
                 "must not be empty when eval.register is true")

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


@dataclass
class LocalConfig:
    """The embedded local stack used when the pipeline runs on one machine."""

    s3_server: bool = True
    """Start an S3-compatible server (moto) on 127.0.0.1 for the run and point boto3 at it."""

    upload_demo_data: bool = True
    """Generate the demo corpus and upload it to data.s3_uri before the pipeline starts."""

    demo_documents: int = 2000
    """Documents in the generated demo corpus."""

    def __post_init__(self) -> None:
        _require(self.demo_documents >= 10, "local.demo_documents", "must be >= 10")


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

    fsx_throughput_mbps: float = 240.0
    """Read throughput of the FSx file system in MB/s (SCRATCH_2: 200 MB/s per TiB of capacity), used to
    size how long a resume may take (resilience.initial_heartbeat_timeout=0)."""

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
    """Size of the /dev/shm memory volume (NCCL, dataloaders, async checkpoint staging)."""

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
        _require(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.namespace) is not None and len(self.namespace) <= 63,
                 "kubernetes.namespace", "must be a DNS-1123 label")
        _require(bool(self.image.strip()), "kubernetes.image", "must not be empty")
        _require(bool(self.pipeline_image.strip()), "kubernetes.pipeline_image", "must not be empty")
        _require(self.kfp_mode in ("standalone", "multi-user"), "kubernetes.kfp_mode",
                 "must be 'standalone' or 'multi-user'")
        _require(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", self.kfp_namespace) is not None,
                 "kubernetes.kfp_namespace", "must be a DNS-1123 label")
        _require(self.fsx_throughput_mbps > 0, "kubernetes.fsx_throughput_mbps", "must be > 0")
        _require(self.gpus_per_node >= 0 and self.efa_per_node >= 0, "kubernetes.gpus_per_node",
                 "GPU and EFA counts must be >= 0")
        _require(self.launcher_poll_seconds > 0, "kubernetes.launcher_poll_seconds", "must be > 0")
        _require(self.step_retries >= 0, "kubernetes.step_retries", "must be >= 0")
        for pair in filter(None, (p.strip() for p in self.node_selector.split(","))):
            _require("=" in pair, "kubernetes.node_selector", f"{pair!r} is not key=value")
        for item in filter(None, (t.strip() for t in self.tolerations.split(","))):
            _require(item.rsplit(":", 1)[-1] in ("NoSchedule", "PreferNoSchedule", "NoExecute") and ":" in item,
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


@dataclass
class Config:
    """A whole run: one section per concern."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        # The loader already refuses inf/nan; this covers a Config built in code.
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for item in dataclasses.fields(values):
                value = getattr(values, item.name)
                if isinstance(value, float):
                    _require(math.isfinite(value), f"{section.name}.{item.name}", f"must be a finite number, got {value}")

    # Derived paths, resolved against run.work_dir; the stored fields stay as the user wrote them.
    @property
    def work_dir(self) -> Path:
        return Path(self.run.work_dir).expanduser().resolve()

    @property
    def fsx_root(self) -> Path:
        return Path(self.data.fsx_root).expanduser().resolve() if self.data.fsx_root else self.work_dir / "fsx"

    @property
    def dataset_dir(self) -> Path:
        return self.fsx_root / "datasets" / self.data.dataset_name

    @property
    def run_dir(self) -> Path:
        """This run's folder on the shared file system: config, step results, logs, metrics,
        checkpoints (by default) and summary.json. On EKS every pod sees it through the FSx mount."""
        assert self.run.run_id, "run.run_id must be set before run paths are used"
        return self.fsx_root / "runs" / self.run.run_id

    @property
    def checkpoint_dir(self) -> Path:
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir).expanduser().resolve()
        return self.run_dir / "checkpoints"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.work_dir / 'mlflow.db'}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One line of JSON (also valid YAML): what the KFP pipeline's config_json parameter carries."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        """Hash of everything that shapes training (not run identity or local plumbing)."""
        shaping = {k: v for k, v in self.to_dict().items() if k in ("data", "model", "training")}
        shaping["data"] = {k: v for k, v in shaping["data"].items() if k not in ("fsx_root", "s3_endpoint_url")}
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------
# Loading: YAML + overrides, with errors that name the field.


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(name: str, annotation: Any, value: Any) -> Any:
    """Convert a YAML value or an override string to the field's type, or raise naming the field."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"unsupported annotation for {name}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{name}: must be a finite number, got {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {annotation!r} for {name}")


def _unknown(kind: str, name: str, valid: list[str]) -> ConfigError:
    return ConfigError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid)}")


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (parsed YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"configuration must be a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
    built: dict[str, Any] = {}
    for section_name, values in raw.items():
        if section_name not in sections:
            raise _unknown("section", section_name, list(sections))
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section_name}: expected a mapping of keys, got {values!r}")
        section_cls = sections[section_name]
        types_ = _field_types(section_cls)
        kwargs = {}
        for key, value in values.items():
            full = f"{section_name}.{key}"
            if key not in types_:
                raise _unknown("key", full, [f"{section_name}.{k}" for k in types_])
            kwargs[key] = _coerce(full, types_[key], value)
        built[section_name] = section_cls(**kwargs)
    return Config(**built)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, str]]:
    """Turn ['--training.num_steps=5', 'run.seed=1'] into {'training': {'num_steps': '5'}, ...}."""
    nested: dict[str, dict[str, str]] = {}
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        key, sep, value = text.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return nested


def resolve_config_path(config: str | Path) -> Path:
    """A path to a YAML file, or the name of a bundled config (e.g. 'local' for configs/local.yaml)."""
    path = Path(config).expanduser()
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{config}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config file {str(config)!r} not found; pass a YAML path or one of: {', '.join(names)}")


def load_config(config: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (path or bundled name; None for defaults) and apply overrides."""
    raw: dict[str, Any] = {}
    if config is not None:
        path = resolve_config_path(config)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return merge_overrides(raw, overrides)


def merge_overrides(raw: dict[str, Any], overrides: list[str]) -> Config:
    merged = {section: dict(values or {}) for section, values in raw.items()}
    for section, values in parse_overrides(list(overrides)).items():
        merged.setdefault(section, {}).update(values)
    return config_from_dict(merged)


def config_from_yaml_text(text: str, overrides: list[str] = ()) -> Config:
    """Config from YAML or JSON text (JSON is YAML) plus overrides."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"configuration text is not valid YAML/JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError("configuration YAML must be a mapping of sections")
    return merge_overrides(raw, overrides)
