"""The trainer's launch command, built in one place for both launchers: one machine (the pipeline's train
step, components/train/local.py) and a Kubeflow Trainer TrainJob (components/train/trainjob.py).

    python -m trainer.launcher --node-store=<memory_dir>/<run_id> ft_launcher --max-restarts=3 \
        --ft-initial-rank-heartbeat-timeout=738 ... --nproc-per-node=8 -m trainer --config <run>/config.yaml \
        --data-dir <dataset>

ft_launcher's initial heartbeat timeout must cover everything before the first step: imports, the process
group (NCCL across every rank), the model build and the resume from FSx. Too short, and ft_launcher kills
every resume — a restart loop that never trains. ``initial_heartbeat_timeout`` derives it from the model's
checkpoint size (the real model's: trainer.planning.model_size) and the file system's throughput unless
resilience.initial_heartbeat_timeout is set.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from trainer.config import Config
from trainer.planning.model_size import gib, gpu_memory_of, model_shape
from trainer.resilience import nvrx_compat

MIN_INITIAL_HEARTBEAT_SECONDS = 120.0
# Imports, model build and first step (s), plus NCCL communicator set-up, which grows with the job (s/GPU).
STARTUP_SECONDS, STARTUP_SECONDS_PER_GPU = 60.0, 0.5
SAFETY_FACTOR = 1.5
# --max-restarts when the progress rule alone bounds restarts: what stops a crash loop is exit code 42.
UNCOUNTED_RESTARTS = 1_000_000
# The rendezvous store's port: its own process locally, the runtime's `rendezvous` pod on EKS
# (trainer.rendezvous_store), never a training node, so the rendezvous outlives any node's loss.
RENDEZVOUS_PORT = 29400
RENDEZVOUS_JOB = "rendezvous"


def rendezvous_endpoint_of(job_name: str) -> str:
    """The TrainJob's rendezvous pod: JobSet names a pod <jobset>-<replicated job>-<job index>-<pod index> and
    serves it as <that>.<subdomain>, the subdomain defaulting to the JobSet's name (the TrainJob's)."""
    return f"{job_name}-{RENDEZVOUS_JOB}-0-0.{job_name}:{RENDEZVOUS_PORT}"


def rendezvous_args(cfg: Config, endpoint: str, run_id: str) -> list[str]:
    """c10d rendezvous on the job's own store (is_host=false: no launcher hosts it). Every round waits
    replacement_timeout_seconds for the nodes of a multi-node job — after a node's loss, for its replacement —
    before the launchers give up (trainer.launcher: exit code 43, the whole job restarts)."""
    r = cfg.resilience
    nodes = nodes_per_group(cfg)  # with replica groups, each group is a world (and a rendezvous) of its own
    timeout = r.replacement_timeout_seconds if nodes > 1 else r.rendezvous_timeout
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            f"--rdzv-conf=join_timeout={int(timeout)},is_host=false", f"--nnodes={nodes}"]


def nodes_per_group(cfg: Config) -> int:
    """The nodes of one replica group (the whole job's when training.replica_groups = 1)."""
    return cfg.training.num_nodes // cfg.training.replica_groups


def initial_heartbeat_timeout(cfg: Config, data_dir: Path | None = None) -> tuple[float, str]:
    """(seconds, why): the configured value, or one derived from the resume's size and the job's size."""
    if cfg.resilience.initial_heartbeat_timeout > 0:
        return cfg.resilience.initial_heartbeat_timeout, "resilience.initial_heartbeat_timeout"
    gpus = cfg.training.num_nodes * cfg.training.nproc_per_node
    state_bytes = model_shape(cfg, data_dir).state_bytes
    reload = state_bytes / (cfg.kubernetes.fsx_throughput_mbps * 1e6)
    startup = STARTUP_SECONDS + STARTUP_SECONDS_PER_GPU * gpus
    seconds = max(MIN_INITIAL_HEARTBEAT_SECONDS, round(SAFETY_FACTOR * (reload + startup)))
    why = (f"{SAFETY_FACTOR} x (resume {state_bytes / 1e9:.1f} GB at {cfg.kubernetes.fsx_throughput_mbps:.0f} MB/s = "
           f"{reload:.0f} s + start-up {startup:.0f} s for {gpus} ranks), at least {MIN_INITIAL_HEARTBEAT_SECONDS:.0f} s")
    return float(seconds), why


def node_memory_gib(cfg: Config, data_dir: Path | None = None) -> int:
    """The node-memory volume's size: kubernetes.node_memory_gib, or two slots of this node's share of the
    state (weights + AdamW moments, fp32) and, with a peer replica, two of its peer's, with 10 % headroom."""
    if cfg.kubernetes.node_memory_gib:
        return cfg.kubernetes.node_memory_gib
    state = model_shape(cfg, data_dir).state_bytes
    copies = 4 if cfg.checkpoint.peer_replica and cfg.training.num_nodes > 1 else 2
    return max(1, math.ceil(1.1 * copies * state / cfg.training.num_nodes / 2**30))


def sizing_summary(cfg: Config, data_dir: Path | None = None) -> str:
    """One line of what the launch sized from the model, for the train step's log."""
    shape = model_shape(cfg, data_dir)
    t = cfg.training
    memory = gpu_memory_of(shape, cfg)
    source = f"config.json of {cfg.base_model_dir}" if cfg.model.init_from else f"preset {cfg.model.preset}"
    return (f"model: {shape.parameters / 1e9:.3g} B parameters ({source}), training state "
            f"{gib(shape.state_bytes)}; node memory {node_memory_gib(cfg, data_dir)} GiB; each GPU holds about "
            f"{gib(memory['total'])} (estimate: trainer.planning.model_size)")


def trainer_command(cfg: Config, config_path: Path | str, data_dir: Path | str, *, job_name: str | None = None,
                    python: str | None = None, rendezvous_endpoint: str | None = None) -> list[str]:
    """The launcher and trainer command line of one node. job_name=None: on this machine — every rank
    (--standalone), or, with rendezvous_endpoint, one of training.num_nodes local nodes; else a TrainJob's node,
    where the Trainer's torch plugin sets PET_NNODES and PET_NODE_RANK (the node's index, kept by its
    replacement) and the rendezvous is the job's rendezvous pod."""
    r = cfg.resilience
    # The launchers' own restart counts stay out of the way of the progress rule (trainer.resilience.budget)
    # unless a count is configured.
    max_restarts = r.max_restarts if r.max_restarts >= 0 else UNCOUNTED_RESTARTS
    if r.launcher == "ft_launcher":
        timeout, _ = initial_heartbeat_timeout(cfg, Path(data_dir))
        flags = nvrx_compat.ft_launcher_flags(timeout, r.heartbeat_timeout, max_restarts,
                                              node_health_check_endpoint=r.node_health_check_endpoint)
    else:
        flags = [f"--max-restarts={max_restarts}"]
    if job_name is not None:
        rendezvous = rendezvous_args(cfg, rendezvous_endpoint_of(job_name), job_name)
    elif rendezvous_endpoint is not None:
        rendezvous = rendezvous_args(cfg, rendezvous_endpoint, cfg.run.run_id)
    else:
        rendezvous = ["--standalone"]
    ckpt = cfg.checkpoint
    options = ([f"--node-store={Path(ckpt.memory_dir) / cfg.run.run_id}"]
               if ckpt.enabled and ckpt.memory_tier else [])
    options += ["--fork-server"] if r.warm_start else []
    options.append(f"--run-dir={cfg.run_dir}")  # system metrics, and a stop when the restart budget gives up
    if cfg.training.replica_groups > 1:  # each node joins its group's world (trainer.launch.groups)
        options.append(f"--replica-groups={cfg.training.replica_groups}")
    if rendezvous != ["--standalone"] and cfg.training.num_nodes > 1 and r.store_timeout_seconds > 0:
        options.append(f"--store-timeout={r.store_timeout_seconds:g}")  # a node cut off from the job exits, replaced
    if job_name is not None and cfg.kubernetes.gpus_per_node:  # a TrainJob's node joins only when healthy
        options.append(f"--check-node={cfg.kubernetes.gpus_per_node},{cfg.kubernetes.efa_per_node}")
    # ft_launcher rejects --nproc-per-node=auto: always explicit.
    return [python or sys.executable, "-m", "trainer.launcher", *options, r.launcher, *flags, *rendezvous,
            f"--nproc-per-node={cfg.training.nproc_per_node}", "-m", "trainer", "--config", str(config_path),
            "--data-dir", str(data_dir)]
