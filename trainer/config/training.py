"""The sections the trainer reads: run, data, model (with its presets), training, checkpoint (resilience and
faults: trainer.config.resilience)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from trainer.config.rules import RUN_ID_PATTERN, check_s3_uri, require


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
        require(bool(self.experiment.strip()), "run.experiment", "must not be empty")
        require(self.run_id == "" or bool(RUN_ID_PATTERN.match(self.run_id)), "run.run_id",
                f"{self.run_id!r} must be 1-63 lowercase letters, digits or '-', starting with a letter or digit")
        require(bool(self.work_dir), "run.work_dir", "must not be empty")
        require(self.seed >= 0, "run.seed", "must be >= 0")


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

    tokenize_tasks: int = 1
    """Tasks that tokenize the staged text (a dsl.ParallelFor, one pod each on EKS), each a group of whole files
    into one token shard: the same tokens and content hash for any number. Raise it for a corpus beyond one pod."""

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
        require(self.stage_mode in ("copy", "dra"), "data.stage_mode", "must be 'copy' or 'dra'")
        if self.stage_mode == "dra":
            require(re.fullmatch(r"fs-[0-9a-f]{8,17}", self.fsx_file_system_id) is not None,
                     "data.fsx_file_system_id", "must be an FSx file system id (fs-0123456789abcdef0) in dra mode")
        events = [e.strip() for e in self.dra_auto_import.split(",") if e.strip()]
        require(all(e in ("NEW", "CHANGED", "DELETED") for e in events), "data.dra_auto_import",
                 "must list NEW, CHANGED and/or DELETED")
        require(self.dra_import_timeout_seconds > 0, "data.dra_import_timeout_seconds", "must be > 0")
        require(self.dra_poll_seconds > 0, "data.dra_poll_seconds", "must be > 0")
        require(self.on_bad_key in ("fail", "skip"), "data.on_bad_key", "must be 'fail' or 'skip'")
        check_s3_uri(self.s3_uri, "data.s3_uri")
        require(bool(re.match(r"^[A-Za-z0-9._-]+$", self.dataset_name)), "data.dataset_name",
                f"{self.dataset_name!r} must be a plain folder name (letters, digits, '.', '_', '-')")
        require(0.0 < self.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
        require(self.max_workers >= 1, "data.max_workers", "must be >= 1")
        require(1 <= self.tokenize_tasks <= 10000, "data.tokenize_tasks", "must be in [1, 10000]")

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
        require(self.preset in MODEL_PRESETS, "model.preset", f"must be one of {sorted(MODEL_PRESETS)}")
        require(self.vocab_size >= 0, "model.vocab_size", "must be >= 0")


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
    """Nodes in the job; locally N > 1 runs a launcher per node, each with its own node memory (docs/node-loss.md)."""

    replica_groups: int = 1
    """HSDP replica groups (R): the job's nodes split into R groups of num_nodes / R nodes; FSDP2 shards the
    model within a group and torchft averages the gradients across groups, so a fault stops one group while
    the others train on (docs/replica-groups.md). 1: pure FSDP over every rank, no torchft (today's path)."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """torch.distributed backend; auto picks nccl when CUDA is available, else gloo."""

    num_threads: int = 1
    """intra-op CPU threads per rank (CPU only); ranks x threads should not exceed the cores."""

    log_every: int = 10
    """Log a training-progress line every this many steps (metrics are recorded every step)."""

    prometheus_port: int = 0
    """Serve Prometheus /metrics from each training process on this port + LOCAL_RANK (0 = off)."""

    timeout_seconds: int = 3600
    """Wall-clock limit for one training launch; the step fails when it is exceeded (a deadline: not relaunched;
    on EKS the TrainJob's activeDeadlineSeconds)."""

    def __post_init__(self) -> None:
        require(0 <= self.prometheus_port <= 65535 - 64, "training.prometheus_port", "must be in [0, 65471]")
        for name in ("num_steps", "batch_size", "seq_len", "grad_accum_steps", "nproc_per_node", "num_nodes",
                     "num_threads", "log_every", "timeout_seconds"):
            require(getattr(self, name) >= 1, f"training.{name}", "must be >= 1")
        require(self.replica_groups >= 1, "training.replica_groups", "must be >= 1")
        require(self.num_nodes % self.replica_groups == 0, "training.replica_groups",
                f"must divide training.num_nodes={self.num_nodes} (each group has num_nodes / replica_groups nodes)")
        require(self.lr > 0, "training.lr", "must be > 0")
        require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", "must be in [0, 1]")
        require(self.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
        require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0")
        require(self.grad_clip >= 0, "training.grad_clip", "must be >= 0 (0 disables clipping)")


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

    async_executor: Literal["process", "thread"] = "thread"
    """Where the torch async writer runs: thread (a thread of the training process, as in the PyTorch docs) or
    process (DCP's background process reading the state staged in shared memory). Measured side by side
    (bench/checkpoint.py, 101 M params, 2 CPU ranks): thread waits less per save (0.27 s vs 0.28 s in steady
    state, 0.36 s vs 0.60 s over all saves) and keeps more throughput (96.0 % vs 94.4 %): the process costs a
    new interpreter importing torch at the first save (12.9 s of CPU beside training) and a copy through
    shared memory at every save."""

    background_nice: int = 10
    """CPU priority (Unix nice, 0-19) of background checkpoint work (the async writer process, the commit
    thread, the peer replica's transfer): with every core busy training, it then takes idle cycles first.
    0 leaves it unchanged."""

    dir: str = ""
    """Checkpoint folder; empty means <data.fsx_root>/runs/<run.run_id>/checkpoints."""

    interval_steps: int | Literal["auto"] = 100
    """Save every this many steps (the last step is always saved). auto: the planner (python -m pipelines plan)
    chooses it from the costs this run measures in its first saves (see auto_probe_steps) and the expected
    fault rate (auto_node_mtbf_hours); the choice and its reasons are logged and kept in the run's events."""

    auto_probe_steps: int = 10
    """With interval_steps=auto: save every this many steps until the third such save, where the interval is
    chosen from the step time, the second save's stall and background time (the first starts the writer)."""

    auto_node_mtbf_hours: float = 6335.0
    """With interval_steps=auto: the mean time between failures of one node (hours). The default is Llama 3's
    fleet (419 unexpected interruptions in 54 days on 2,048 nodes); set your own fleet's figure."""

    keep_last: int = 2
    """Committed checkpoints to keep; older ones are deleted after a newer one commits."""

    resume: bool = True
    """Resume from the newest valid copy of the state when one exists (memory, peer, FSx, S3)."""

    memory_interval_steps: int = 1
    """Node-memory tier: every this many steps each rank copies its state into node-local shared memory that
    outlives the worker process (double buffered, checksummed), so a restarted worker resumes from it without
    reading the file system. 0 = off."""

    memory_dir: str = "/dev/shm/resilient-train"
    """Where the node-memory tier lives: a memory-backed folder (/dev/shm here; on EKS the runtime's
    `node-memory` emptyDir with medium Memory). Each launch keeps its own folder below <memory_dir>/<run_id>/."""

    memory_node_per_rank: bool = False
    """Treat each rank as a node of its own in the memory tier (one machine standing in for several nodes:
    tests, drills and the local demo); on a cluster the ranks of a node share it."""

    peer_replica: bool = True
    """Also keep each rank's memory copy on a peer node (a ring over nodes, over the process group), so the
    ranks of a lost node get their state back from memory instead of storage. Needs two nodes or more."""

    peer_replica_wait: bool = False
    """Wait for each step's replica before the next step starts. False: the transfer runs beside the next step
    (no stall), and a node lost while it is in flight resumes one step earlier (1 step replayed). True: a node
    loss never replays a step, at the cost of the transfer on every step."""

    s3_uri: str = ""
    """S3 tier: every `s3_every` committed checkpoints, upload the committed folder to <s3_uri>/<run_id>/ (the
    manifest last); a start with no valid copy nearer resumes from there. Empty = off."""

    s3_every: int = 1
    """Upload every this many committed checkpoints to s3_uri."""

    def __post_init__(self) -> None:
        require(self.interval_steps == "auto" or self.interval_steps >= 1, "checkpoint.interval_steps",
                "must be >= 1 or auto")
        require(self.auto_probe_steps >= 1, "checkpoint.auto_probe_steps", "must be >= 1")
        require(self.auto_node_mtbf_hours > 0, "checkpoint.auto_node_mtbf_hours", "must be > 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        require(self.memory_interval_steps >= 0, "checkpoint.memory_interval_steps", "must be >= 0 (0 turns it off)")
        require(self.s3_every >= 1, "checkpoint.s3_every", "must be >= 1")
        if self.s3_uri:
            check_s3_uri(self.s3_uri, "checkpoint.s3_uri")
        require(not self.memory_interval_steps or self.memory_dir.startswith("/"), "checkpoint.memory_dir",
                f"{self.memory_dir!r} must be an absolute path (a memory-backed folder such as /dev/shm/...)")
        require(0 <= self.background_nice <= 19, "checkpoint.background_nice", "must be in [0, 19]")
