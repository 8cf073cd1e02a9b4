"""The start-up of one training process: every collaborator of the Trainer built under its start-up phase.

    process = start_process(cfg, data_dir, in_process, step_of=lambda: trainer.step)

In order, each phase under the watchdog's timeout (trainer.resilience.phases): the restore prefetch (first: a
start that will resume from FSx reads its share of the checkpoint while the rest starts), ``rendezvous`` (the
process group), ``process_group`` (the job's restart count, the run folder's lease, the restart budget),
``model_build`` (the model, its shards, the optimizer, the data, the checkpoint tiers, the resilience hooks,
the interval planner, the progress report). The loop and the resume are trainer.job.trainer's.

The run's history is read once per start: rank 0 folds the control records (trainer.run.history: a bounded
summary and what was appended since) in the process_group phase and every rank gets its copy in one broadcast;
the budget, the hooks, the planner and the progress report take it from there. No other rank reads it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer.checkpoint.format import committed_checkpoints
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.node_folders import holds_a_copy
from trainer.checkpoint.prefetch import RestorePrefetch, started_from_environment
from trainer.checkpoint.s3_tier import S3Tier
from trainer.config import Config
from trainer.config.rules import is_s3_uri
from trainer.data.batches import TokenBatches
from trainer.data.shards import load_meta
from trainer.data.tokenizer import document_start_token, load_tokenizer
from trainer.env import (GENERATION_ENV, IN_PROCESS_ITERATION_ENV, NODE_GENERATION_ENV, NODE_INDEX_ENV, NODE_RANK_ENV,
                         NODE_REPLACEMENT_ENV, NODE_STORE_ENV, RESTART_COUNT_ENV)
from trainer.evaluate.evaluator import Evaluator
from trainer.evaluate.heldout import Ranks
from trainer.model.base import BASE_INDEX, BaseModelError, index_base_weights, read_base_config, read_index
from trainer.model.build import build_model, build_model_on_meta, model_config_of, materialize_on
from trainer.model.compile_cache import use_compile_cache
from trainer.model.parallelize import compiles, device_mesh, parallelize
from trainer.model.optimizer import build_optimizer, initialize_state
from trainer.observe import logs
from trainer.observe.progress import ProgressReporter
from trainer.observe.telemetry import Telemetry
from trainer.planning.auto import AutoInterval
from trainer.resilience.budget import RestartBudget, current_layer
from trainer.resilience.faults import startup_hang_drill
from trainer.resilience.hooks import ResilienceHooks
from trainer.resilience.in_process import InProcessAttempt
from trainer.resilience.phases import PhaseWatchdog, exit_hung, startup_timeouts
from trainer.resilience import flight_recorder
from trainer.resilience.mesh_replicas import MeshReplicas
from trainer.resilience.replica_groups import Single, group_of_environment, replica_groups_for
from trainer.resilience.worker_clock import worker_started_at
from trainer.run.events import EventLog, current_attempt
from trainer.run.history import ControlState, control_state, launched_at_from_environment
from trainer.run.lease import Fence, RunFolderBusy, RunLease
from trainer.run.run_dir import RunDir


@dataclass
class StartedProcess:
    """What the start-up built, by role."""

    # the process in its job (rank and world size: of its replica group, which is the job when R = 1)
    rank: int
    world_size: int
    global_rank: int  # group * world_size + rank: what data, drills and records are keyed by
    replica_groups: Single  # the groups across which torchft averages (trainer.resilience.replica_groups)
    device: torch.device
    watchdog: PhaseWatchdog
    fence: Fence
    own_lease: RunLease | None  # taken by rank 0 when started by hand (no launch generation in the environment)
    run_dir: RunDir
    events: EventLog
    history: ControlState  # the control records as this start folded them
    restart_budget: RestartBudget
    # the model and its data
    model: torch.nn.Module
    model_config: Any
    weights_pending: bool  # built on the meta device: resume() fills the weights (a copy, the base model, or new)
    base_weights: dict[str, Any] | None  # model.init_from: its folder and index (trainer.model.base)
    optimizer: torch.optim.Optimizer
    batches: TokenBatches
    # what runs beside the loop
    telemetry: Telemetry
    resilience: ResilienceHooks
    checkpointer: CheckpointManager
    interval_planner: AutoInterval
    progress: ProgressReporter
    prefetch: RestorePrefetch | None
    evaluator: Evaluator
    compile_cache: Path | None = None  # where inductor's caches live (trainer.model.compile_cache), when compiling


def start_process(cfg: Config, data_dir: Path, in_process: InProcessAttempt | None,
                  step_of: Callable[[], int | None]) -> StartedProcess:
    """Collective: build one training process's collaborators, each start-up phase under its timeout.
    step_of(): the trainer's step (a hang's record names it)."""
    if in_process is not None:  # each iteration's events are told apart (trainer.run.events.current_attempt)
        os.environ[IN_PROCESS_ITERATION_ENV] = str(in_process.iteration)
    timer = _PhaseTimer()  # where a (re)start's time goes: recorded with the launch
    prefetch = started_from_environment(cfg.checkpoint_dir, cfg.checkpoint)
    watchdog = _start_watchdog(cfg, data_dir, step_of)
    flight_recorder.enable(cfg.run_dir, current_attempt())  # before the process groups: they read it
    with watchdog.phase("rendezvous"):
        rank, world_size, device = init_distributed(cfg, in_process)
    watchdog.enter("process_group")
    agree_on_restart_count(world_size, device)
    fence, own_lease = join_lease(cfg.run_dir, rank)
    global_rank = group_of_environment() * world_size + rank
    events = EventLog(cfg.run_dir, global_rank, fence=fence, group_rank=rank)
    history = from_rank_0(world_size, control_state(cfg.run_dir, save=True) if rank == 0 else None)
    restart_budget = RestartBudget(
        cfg.run_dir, rank=rank, events=events, limit=cfg.resilience.max_restarts_without_progress,
        in_process_limit=cfg.resilience.in_process_max_restarts,
        layer=current_layer(in_process.iteration if in_process else 0), generation=fence.generation,
        process_started_at=worker_started_at(), broadcast=lambda value: from_rank_0(world_size, value),
        history=history, own_generation=GENERATION_ENV not in os.environ)  # the same on every rank
    restart_budget.start()  # a crash loop ends here, before the model is built again
    torch.manual_seed(cfg.run.seed)
    timer.done("process_group")
    watchdog.enter("model_build")

    meta = load_meta(data_dir)
    base_weights = base_weights_of(cfg, rank, world_size)
    tokenizer = load_tokenizer(meta["tokenizer"])
    model_config = model_config_of(cfg.model, cfg.base_model_dir, tokenizer)
    # Weights that come from a checkpoint or the base model are read into each rank's shards: building (and
    # initialising) the whole model first is waste, so it is built on the meta device and only its shards get
    # memory (resume() fills them; with neither a copy nor a base model, it initialises them after all).
    weights_pending = base_weights is not None or a_resume_is_likely(cfg, world_size, device)
    model = build_model_on_meta(model_config) if weights_pending else build_model(model_config, cfg.run.seed)
    mesh = device_mesh(cfg.training, world_size, device)
    compile_cache = (use_compile_cache(cfg.training.compile_cache, cfg.run_dir, model_config.to_dict(), device)
                     if compiles(cfg.training, device) else None)
    model = parallelize(model if weights_pending else model.to(device), cfg.training, device, mesh)
    if weights_pending:
        materialize_on(model, device)
    model.train()
    timer.done("model")
    optimizer = build_optimizer(model, cfg.training, cfg.optimizer, device)
    initialize_state(optimizer)
    batches = TokenBatches.open(data_dir, "train", cfg.training.seq_len, cfg.training.batch_size, cfg.run.seed)
    if cfg.data.document_mask:
        batches.document_start = document_start_token(tokenizer)
    timer.done("optimizer_and_data")

    telemetry = Telemetry(cfg.training.prometheus_port, cfg.run.run_id, rank)
    ckpt = cfg.checkpoint
    ranks_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    memory = (MemoryTier(ckpt, cfg.run.run_id, rank, world_size, ranks_per_node, device)
              if ckpt.enabled and ckpt.memory_tier else None)
    # This launch's start (the train step's); started by hand: the run's first process, else this one.
    launched_at = launched_at_from_environment() or history.first_process_started_at or worker_started_at()
    replica_groups = (MeshReplicas(rank, world_size, mesh, cfg.resilience.replica_check_interval, events, device)
                      if mesh.ndim == 2 else replica_groups_for(cfg, rank, world_size, events, device))
    resilience = ResilienceHooks(cfg, rank, world_size, events, device, in_process=in_process, telemetry=telemetry,
                                 global_rank=global_rank,
                                 node_memory=memory.store if memory else None, launched_at=launched_at,
                                 history=history)
    checkpointer = CheckpointManager(
        cfg.checkpoint_dir, ckpt, rank=rank, device=device, events=events,
        # Checkpoints describe themselves: resume, validation and export need nothing else.
        metadata={"world_size": world_size, "run_id": cfg.run.run_id, "config_hash": cfg.config_hash(),
                  "model_config": model_config.to_dict(), "tokenizer": meta["tokenizer"],
                  "tokenizer_hash": meta.get("tokenizer_hash") or tokenizer.content_hash(),  # (tokens.json's, or older)
                  "base_model": None if base_weights is None else {
                      "init_from": cfg.model.init_from, "content_hash": base_weights["index"]["content_hash"]},
                  "data_content_hash": meta["content_hash"], "config": cfg.to_dict()},
        memory=memory, s3=S3Tier(ckpt.s3_uri, cfg.run.run_id, cfg.data.s3_endpoint_url) if ckpt.s3_uri else None,
        save_point=resilience.injector.at_save_point, fence=fence, prefetch=prefetch, phase=watchdog.phase,
        writes_shared=lambda: replica_groups.writes_run_files)
    nodes = memory.nodes if memory is not None else max(1, world_size // ranks_per_node)
    interval_planner = AutoInterval(cfg, checkpointer, events, rank=rank, nodes=nodes, history=history)
    progress = ProgressReporter(cfg, rank=rank, nodes=nodes, restarted=resilience.is_restart, history=history,
                                launched_at=launched_at, last_checkpoint=lambda: _last_checkpoint(cfg))
    evaluator = Evaluator(cfg, data_dir, model, Ranks(rank, world_size, device, cfg.eval.batch_size,
                                                      cfg.training.loss_chunk),
                          tokenizer_spec=meta["tokenizer"], writes=lambda: replica_groups.writes_run_files,
                          beat=resilience.heartbeat.beat)
    timer.done("checkpointing")
    watchdog.leave()
    resilience.start(init_seconds={"imports": timer.started - resilience.process_started_at, **timer.phases})
    return StartedProcess(
        rank=rank, world_size=world_size, global_rank=global_rank, replica_groups=replica_groups, device=device,
        watchdog=watchdog, fence=fence, own_lease=own_lease,
        run_dir=RunDir(cfg.run_dir), events=events, history=history, restart_budget=restart_budget, model=model,
        model_config=model_config, weights_pending=weights_pending, base_weights=base_weights,
        optimizer=optimizer, batches=batches, telemetry=telemetry, resilience=resilience, checkpointer=checkpointer,
        interval_planner=interval_planner, progress=progress, prefetch=prefetch, evaluator=evaluator,
        compile_cache=compile_cache)


def base_weights_of(cfg: Config, rank: int, world_size: int) -> dict[str, Any] | None:
    """Collective: model.init_from's folder and its weights' index, as rank 0 read it (one read for the job): the
    stage step's (trainer.model.base, checked and hashed there), or for a folder given by hand, its headers
    checked now (no hashing). None without a base model. A bad base model is a BaseModelError on every rank."""
    folder = cfg.base_model_dir
    if folder is None:
        return None
    answer = None
    if rank == 0:
        try:
            index = read_index(cfg.staged_model_dir(cfg.model.init_from) / BASE_INDEX) if is_s3_uri(
                cfg.model.init_from) else None
            answer = (index or index_base_weights(folder, read_base_config(folder), hash_files=False), None)
        except BaseModelError as err:
            answer = (None, str(err))
    index, error = from_rank_0(world_size, answer)
    if error is not None:
        raise BaseModelError(error)
    return {"folder": str(folder), "index": index}


def _start_watchdog(cfg: Config, data_dir: Path, step_of: Callable[[], int | None]) -> PhaseWatchdog:
    rank = group_of_environment() * int(os.environ.get("WORLD_SIZE", "1")) + int(os.environ.get("RANK", "0"))
    events = EventLog(cfg.run_dir, rank)  # no fence yet: the lease is joined after the rendezvous
    return PhaseWatchdog(startup_timeouts(cfg, data_dir),
                         on_hang=lambda phase, seconds, timeout: exit_hung(events, rank, phase, seconds, timeout,
                                                                           step=step_of()),
                         hang_in=startup_hang_drill(cfg.faults.schedule, rank, cfg.run_dir, events))


def init_distributed(cfg: Config, in_process: InProcessAttempt | None) -> tuple[int, int, torch.device]:
    """The process group (a group of one for a plain `python -m trainer`); (rank, world size, device)."""
    backend = cfg.training.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # plain `python -m trainer`: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        torch.set_num_threads(cfg.training.num_threads)
        device = torch.device("cpu")
    if in_process is None:
        dist.init_process_group(backend=backend)
    else:  # a fresh group per in-process restart iteration, on the application's own store
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], in_process.store_port, world_size,
                              is_master=rank == 0, multi_tenant=True, wait_for_workers=True)
        timeout = datetime.timedelta(seconds=cfg.resilience.collective_timeout)
        dist.init_process_group(backend=backend, store=dist.PrefixStore(f"iter{in_process.iteration}", store),
                                rank=rank, world_size=world_size, timeout=timeout)
    rank = dist.get_rank()
    # One voice for progress; warnings and errors still come from every rank.
    logs.configure(logging.INFO if rank == 0 else logging.WARNING, rank=rank)
    return rank, dist.get_world_size(), device


def agree_on_restart_count(world_size: int, device: torch.device) -> None:
    """Collective: every rank takes the highest TORCHELASTIC_RESTART_COUNT of the job. Each node's launcher
    counts its own restarts, and a node that replaced a lost one starts at 0 while the survivors restarted
    their workers: without this, a replacement's rank 0 would take the job's restart for a first start."""
    if world_size == 1:
        return
    # The replacement count too: a replacement that joins before the survivors' workers failed (a node cut off:
    # its peers are blocked, not failed) restarts them as a membership change, which no launcher counts.
    names = (RESTART_COUNT_ENV, NODE_REPLACEMENT_ENV)
    counts = torch.tensor([int(os.environ.get(name) or 0) for name in names], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    for name, count in zip(names, counts.tolist()):
        if count or name in os.environ:
            os.environ[name] = str(int(count))


def node_fence_of_this_process() -> tuple[int, int] | None:
    """(node index, node generation) its launcher claimed (trainer.launch.launcher), or None outside one."""
    generation = os.environ.get(NODE_GENERATION_ENV)
    if not generation:
        return None
    return int(os.environ.get(NODE_INDEX_ENV) or os.environ.get(NODE_RANK_ENV) or 0), int(generation)


def join_lease(run_dir: Path, rank: int) -> tuple[Fence, RunLease | None]:
    """Collective: this launch's generation of the run folder's lease (fencing: an older launch's trainers
    stop), and the lease itself when this process holds it.

    Under the pipeline's launcher the generation comes from the environment; started by hand (torchrun,
    python -m trainer), rank 0 takes the lease itself for the life of this process.
    """
    own_lease = None
    if GENERATION_ENV in os.environ:
        generation, busy = int(os.environ[GENERATION_ENV]), None
    else:
        choice: list = [None, None]
        if rank == 0:
            try:
                own_lease = RunLease(run_dir).acquire()
                choice[0] = own_lease.new_generation()
            except RunFolderBusy as err:
                choice[1] = str(err)
        dist.broadcast_object_list(choice, src=0)
        generation, busy = choice
    if busy is not None:
        raise RunFolderBusy(busy)
    fence = Fence(run_dir, generation, node=node_fence_of_this_process())
    fence.check()
    return fence, own_lease


def from_rank_0(world_size: int, value: Any) -> Any:
    """Collective: rank 0's value on every rank."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def a_resume_is_likely(cfg: Config, world_size: int, device: torch.device) -> bool:
    """Collective: whether any rank sees a copy to resume from (node memory, an FSx checkpoint, S3). A cheap
    look (listings, no verification): resume() falls back to initialising when none restores."""
    ckpt = cfg.checkpoint
    if not (ckpt.enabled and ckpt.resume):
        return False
    seen = bool(ckpt.s3_uri or committed_checkpoints(cfg.checkpoint_dir) or holds_a_copy(os.environ.get(NODE_STORE_ENV)))
    if world_size > 1:
        flag = torch.tensor(int(seen), device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        seen = bool(flag.item())
    return seen


def _last_checkpoint(cfg: Config) -> tuple[int, float] | None:
    """The newest committed FSx checkpoint's step and commit time, for the progress report."""
    committed = committed_checkpoints(cfg.checkpoint_dir)
    return (committed[-1][0], committed[-1][1].stat().st_mtime) if committed else None


class _PhaseTimer:
    def __init__(self) -> None:
        self.started = time.time()
        self._last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase], self._last = now - self._last, now


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
