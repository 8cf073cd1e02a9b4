"""The sections the trainer reads: run, training, checkpoint (data: trainer.config.data; model and its presets:
trainer.config.model; resilience and faults: trainer.config.resilience)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
class TrainingConfig:
    """The optimisation loop and how it is launched."""

    num_steps: int = 300
    """Optimizer steps to train in total: the schedule's horizon (a continuation with more steps keeps the LR of
    the steps already trained: training.lr_schedule)."""

    batch_size: int = 8
    """Sequences per rank per micro-batch."""

    seq_len: int = 128
    """Tokens per sequence."""

    grad_accum_steps: int = 1
    """Micro-batches accumulated into one optimizer step."""

    loss_chunk: int = 1024
    """Positions whose logits exist at once when the loss is computed (training and evaluation, trainer.model.loss):
    at a 128 k vocabulary 1,024 positions are 0.5 GB of fp32 logits per sequence, a whole 8,192 sequence 4.2 GB."""

    lr: float = 3e-3
    """Peak learning rate (AdamW)."""

    lr_schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """The learning rate after the warm-up (trainer.job.schedule): cosine (decays to lr x min_lr_ratio at the
    horizon, training.num_steps), wsd (warm-up, stable at lr, then a linear decay to lr x min_lr_ratio over the
    horizon's last decay_steps: extending the run moves only the decay), constant (lr to the end). The schedule
    and its horizon are in every checkpoint: a continuation keeps the LR of every step it already trained
    (docs/continued-pretraining.md)."""

    min_lr_ratio: float = 0.1
    """Learning rate at the end of the cosine or WSD decay, as a fraction of lr."""

    warmup_steps: int = 20
    """Linear warm-up steps before the schedule's decay (a run shorter than this is all warm-up)."""

    decay_steps: int = 0
    """lr_schedule=wsd: the decay's length, the last steps of the horizon; 0 takes decay_fraction of it."""

    decay_fraction: float = 0.2
    """lr_schedule=wsd with decay_steps=0: the share of the horizon (after the warm-up) that decays."""

    lr_schedule_restart: bool = False
    """A continuation whose schedule (kind, lr, warm-up, floor, decay or horizon) differs from the one its
    checkpoint trained with: false keeps every step already trained at its LR (the checkpoint's schedule goes on,
    or the new one where it agrees on those steps, and a change that cannot is refused, naming it); true starts a
    new phase of the schedule at the step it resumes from: warm-up from there, the horizon num_steps."""

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

    # -- throughput (trainer.model.parallelize; docs/throughput.md) ----------------------------------------------

    compile: bool | Literal["auto"] = "auto"
    """torch.compile each decoder block and the loss's chunk (inductor). auto: on CUDA, off on the CPU (its compile
    time outweighs a CPU run's gain). A cold start pays the compile (~1 min for 8B); a restart takes the compiled
    code from compile_cache."""

    compile_cache: str = "run"
    """Where inductor's FX-graph and AOTAutograd caches (and Triton's kernels) live, so a restart, on this node or a
    replacement, loads the compiled blocks instead of compiling them again (trainer.model.compile_cache). run: the
    run folder's compile-cache/ (on FSx: every node reads it); a path: that folder (shared by runs); off: torch's
    default, this machine's /tmp. Within it, a folder per torch version, device and model config."""

    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in the backward pass instead of keeping them: full (every decoder layer), selective
    (see selective_ac), none. Less memory for more compute; at sequence length 8,192 an 8B model needs it."""

    selective_ac: int | Literal["op"] = "op"
    """With activation_checkpointing=selective: op (keep the outputs of attention and of every other matmul,
    recompute the rest, as torchtitan's op-level policy does) or N (checkpoint every N-th decoder layer fully)."""

    mixed_precision_param: Literal["auto", "bfloat16", "float32"] = "auto"
    """dtype FSDP2 gathers the parameters in for the forward and backward (the master weights and AdamW's state
    stay fp32). auto: bfloat16 on CUDA, float32 on the CPU (its bf16 matmuls are slower than fp32)."""

    mixed_precision_reduce: Literal["float32", "bfloat16"] = "float32"
    """dtype of the gradients' reduce-scatter (and all-reduce across replicas): float32 sums exactly what
    bfloat16 would round; bfloat16 halves the gradient traffic."""

    reshard_after_forward: Literal["default", "always", "never"] = "default"
    """FSDP2's reshard_after_forward: always frees each block's gathered parameters after its forward (gathered
    again for the backward: least memory), never keeps them (no second all-gather: more memory), default: always
    except the root (its parameters are the backward's first need), as torchtitan does."""

    reduce_gradients: Literal["per_step", "per_micro_batch"] = "per_step"
    """With grad_accum_steps > 1: per_step reduce-scatters the gradients once per optimizer step (FSDP2's
    set_requires_gradient_sync: the micro-batches accumulate unsharded gradients, one buffer of the whole model per
    rank in the reduce dtype: 32 GB in fp32 at 8B); per_micro_batch reduce-scatters after each (least memory, N times the traffic)."""

    data_parallel_replicate_degree: int = 1
    """Native HSDP: the ranks form a (replicate x shard) mesh; FSDP2 shards each parameter over the shard
    dimension and all-reduces the gradients over this many replicas. 1: FSDP over every rank. Not with
    replica_groups > 1 (torchft's groups are the replicas then: docs/throughput.md says when each fits)."""

    peak_tflops: float = 0.0
    """The device's dense bf16 peak (TFLOP/s) that mfu is measured against; 0: from the device's name (H100,
    H200, B200, B300: trainer.observe.flops). Without either (the CPU), tflops_per_gpu is reported, mfu not."""

    def __post_init__(self) -> None:
        require(0 <= self.prometheus_port <= 65535 - 64, "training.prometheus_port", "must be in [0, 65471]")
        for name in ("num_steps", "batch_size", "seq_len", "grad_accum_steps", "loss_chunk", "nproc_per_node",
                     "num_nodes", "num_threads", "log_every", "timeout_seconds"):
            require(getattr(self, name) >= 1, f"training.{name}", "must be >= 1")
        require(self.replica_groups >= 1, "training.replica_groups", "must be >= 1")
        require(self.num_nodes % self.replica_groups == 0, "training.replica_groups",
                f"must divide training.num_nodes={self.num_nodes} (each group has num_nodes / replica_groups nodes)")
        require(self.lr > 0, "training.lr", "must be > 0")
        require(0.0 <= self.min_lr_ratio <= 1.0, "training.min_lr_ratio", "must be in [0, 1]")
        require(self.decay_steps >= 0, "training.decay_steps", "must be >= 0 (0: training.decay_fraction)")
        require(0.0 < self.decay_fraction <= 1.0, "training.decay_fraction", "must be in (0, 1]")
        require(self.warmup_steps >= 0, "training.warmup_steps", "must be >= 0")
        require(self.weight_decay >= 0, "training.weight_decay", "must be >= 0")
        require(self.grad_clip >= 0, "training.grad_clip", "must be >= 0 (0 disables clipping)")
        require(self.selective_ac == "op" or self.selective_ac >= 1, "training.selective_ac",
                "must be op or a layer interval >= 1")
        require(bool(self.compile_cache.strip()), "training.compile_cache", "must be run, off or a folder")
        require(self.peak_tflops >= 0, "training.peak_tflops", "must be >= 0 (0: from the device's name)")
        replicate = self.data_parallel_replicate_degree
        require(replicate >= 1, "training.data_parallel_replicate_degree", "must be >= 1")
        require(replicate == 1 or self.replica_groups == 1, "training.data_parallel_replicate_degree",
                f"={replicate} and training.replica_groups={self.replica_groups} both make replicas of the model: "
                "choose one (replica_groups: torchft, a fault stops one group; data_parallel_replicate_degree: "
                "native HSDP, a fault restarts the job; docs/throughput.md)")
        ranks = self.nproc_per_node * self.num_nodes
        require(ranks % replicate == 0, "training.data_parallel_replicate_degree",
                f"={replicate} must divide the job's {ranks} ranks (training.nproc_per_node x training.num_nodes)")


@dataclass
class OptimizerConfig:
    """AdamW's implementation and which parameters it decays (its lr, weight decay and clipping: training)."""

    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    """fused: one kernel per parameter group (CUDA, and the CPU); foreach: batched per group; for_loop: a
    parameter at a time. auto: fused on CUDA, foreach on the CPU (the path the CPU tests compare; the for-loop's
    values bit for bit)."""

    no_decay: list[str] = field(default_factory=lambda: ["norm", "bias", "embed_tokens"])
    """Parameters whose name contains any of these are not weight-decayed (norms, biases and the embeddings,
    as GPT-3 and Llama train); [] decays every parameter."""

    def __post_init__(self) -> None:
        require(all(isinstance(name, str) and name for name in self.no_decay), "optimizer.no_decay",
                f"must be a list of non-empty name fragments, got {self.no_decay!r}")


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

    memory_interval_steps: int | Literal["auto"] = "auto"
    """Node-memory tier: every this many steps each rank copies its state into node-local shared memory that
    outlives the worker process (double buffered, checksummed), so a restarted worker resumes from it without
    reading the file system. 0 = off. auto: each launch's first 12 steps measure what a copy costs the loop (6 steps
    with a copy, 6 without: the copy and what its background work takes from the next step), then the planner's
    interval for that cost and the faults the copies serve (the nodes x auto_node_mtbf_hours, and the faults drills
    schedule): every step where a copy is cheap beside the steps a fault would replay, less often where it is not
    (trainer.planning.auto). 1 keeps every step's state whatever it costs."""

    memory_copy: Literal["auto", "async", "sync"] = "auto"
    """How the node-memory copy runs (trainer.checkpoint.node_copy). async: off the step's critical path (on CUDA a
    side stream into pinned memory, then a thread hashes it into node memory; the next optimizer step waits only
    for the device-to-host copy); a fault while a copy is in flight replays one step more. sync: the loop copies
    and hashes before the next step. auto: async on CUDA, sync on the CPU, where the thread would take cores the
    ranks train on (bench/overhead.py measures both)."""

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

    @property
    def memory_tier(self) -> bool:
        """Whether the node-memory tier is on (every N steps, or at the planner's interval)."""
        return self.memory_interval_steps == "auto" or self.memory_interval_steps > 0

    def __post_init__(self) -> None:
        require(self.interval_steps == "auto" or self.interval_steps >= 1, "checkpoint.interval_steps",
                "must be >= 1 or auto")
        require(self.auto_probe_steps >= 1, "checkpoint.auto_probe_steps", "must be >= 1")
        require(self.auto_node_mtbf_hours > 0, "checkpoint.auto_node_mtbf_hours", "must be > 0")
        require(self.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
        require(self.memory_interval_steps == "auto" or self.memory_interval_steps >= 0,
                "checkpoint.memory_interval_steps", "must be >= 0 (0 turns it off) or auto")
        require(self.s3_every >= 1, "checkpoint.s3_every", "must be >= 1")
        if self.s3_uri:
            check_s3_uri(self.s3_uri, "checkpoint.s3_uri")
        require(not self.memory_interval_steps or self.memory_dir.startswith("/"), "checkpoint.memory_dir",
                f"{self.memory_dir!r} must be an absolute path (a memory-backed folder such as /dev/shm/...)")
        require(0 <= self.background_nice <= 19, "checkpoint.background_nice", "must be in [0, 19]")
