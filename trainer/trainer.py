"""The Trainer: FSDP2 training of a Llama-architecture model in one process of a job (one rank).

    trainer = Trainer(cfg, data_dir)   # process group, lease, model, optimizer, data, checkpointing
    trainer.train()                    # resume, then step until training.num_steps; result.json at the end
    trainer.close()

Collaborators are attributes by role: `checkpointer` (trainer.checkpoint.manager) owns saving and where a
run resumes from; `resilience` (trainer.resilience.hooks) gets one call per step; `telemetry` serves
/metrics; `fence` stops a superseded trainer. The command line is trainer.cli.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer import logs
from trainer.checkpoint import reads as checkpoint_reads
from trainer.checkpoint.format import committed_checkpoints, step_dir_name
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.memory import MemoryTier
from trainer.checkpoint.node_store import NODE_STORE_ENV, holds_a_copy
from trainer.checkpoint.prefetch import started_from_environment
from trainer.checkpoint.s3_tier import S3Tier
from trainer.config import Config
from trainer.data import TokenBatches, load_meta
from trainer.events import IN_PROCESS_ITERATION_ENV, EventLog
from trainer.lease import GENERATION_ENV, Fence, RunFolderBusy, RunLease
from trainer.model import build_model_on_meta, copy_initial_weights, load_or_build_model, materialize_on, shard_model
from trainer.optimizer import build_optimizer, initialize_state
from trainer.planning.auto import AutoInterval
from trainer.progress import ProgressReporter
from trainer.resilience.budget import RESTART_COUNT_ENV, RestartBudget, current_layer
from trainer.resilience.faults import startup_hang_drill
from trainer.resilience.hooks import ResilienceHooks
from trainer.resilience.in_process import InProcessAttempt
from trainer.resilience.phases import PhaseWatchdog, exit_hung, parse_startup_timeouts
from trainer.run_dir import RunDir, write_json
from trainer.telemetry import Telemetry
from trainer.tokenizer import load_tokenizer
from trainer.worker_clock import worker_started_at

log = logging.getLogger("trainer")


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to lr, then cosine decay to lr * min_lr_ratio at num_steps (step is 0-based)."""
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.num_steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Trainer:
    """Owns the model, optimizer, data and checkpointing of one training process."""

    def __init__(self, cfg: Config, data_dir: Path, in_process: InProcessAttempt | None = None):
        self.cfg = cfg
        self.in_process = in_process
        if in_process is not None:  # each iteration's events are told apart (trainer.events.current_attempt)
            os.environ[IN_PROCESS_ITERATION_ENV] = str(in_process.iteration)
        self.data_dir = Path(data_dir)
        self.step = 0  # optimizer steps completed
        self.last_loss = float("nan")
        timer = _PhaseTimer()  # where a (re)start's time goes: recorded with the launch
        # First: a start that will resume from FSx reads its share of the checkpoint while the rest starts.
        self._prefetch = started_from_environment(cfg.checkpoint_dir, cfg.checkpoint)
        self.watchdog = self._start_watchdog()  # each start-up phase under its own timeout
        with self.watchdog.phase("rendezvous"):
            self.init_distributed()
        self.watchdog.enter("process_group")
        self.agree_on_restart_count()
        self._own_lease: RunLease | None = None
        self.fence = self.join_lease()
        self.run_dir = RunDir(cfg.run_dir)
        self.events = EventLog(cfg.run_dir, self.rank, fence=self.fence)
        self.restart_budget = RestartBudget(
            cfg.run_dir, rank=self.rank, events=self.events, limit=cfg.resilience.max_restarts_without_progress,
            in_process_limit=cfg.resilience.in_process_max_restarts,
            layer=current_layer(in_process.iteration if in_process else 0), generation=self.fence.generation,
            process_started_at=worker_started_at(), broadcast=self._from_rank_0)
        self.restart_budget.start()  # a crash loop ends here, before the model is built again
        torch.manual_seed(cfg.run.seed)
        timer.done("process_group")
        self.watchdog.enter("model_build")

        meta = load_meta(self.data_dir)
        self._build_model_args = {"model": cfg.model, "vocab_size": meta["vocab_size"],
                                  "special_token_ids": load_tokenizer(meta["tokenizer"]).special_token_ids()}
        # A restart takes its weights from a checkpoint: building (and initialising) them first is waste, so
        # the model is then built on the meta device and only its shards get memory (resume() initialises it
        # after all when no copy turns out to be restorable).
        self._weights_pending = self._a_resume_is_likely()
        model = (build_model_on_meta(**self._build_model_args) if self._weights_pending
                 else load_or_build_model(**self._build_model_args, seed=cfg.run.seed))
        if model.config.vocab_size < meta["vocab_size"]:
            raise ValueError(f"model vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's "
                             f"({meta['vocab_size']}, {self.data_dir}): fix model.vocab_size or data.tokenizer")
        self.model_config = model.config
        if cfg.model.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self._weights_pending:
            self.model = shard_model(model, mixed_precision=self.device.type == "cuda")
            materialize_on(self.model, self.device)
        else:
            self.model = shard_model(model.to(self.device), mixed_precision=self.device.type == "cuda")
        self.model.train()
        timer.done("model")
        self.optimizer = build_optimizer(self.model, cfg.training.lr, cfg.training.weight_decay)
        initialize_state(self.optimizer)
        self.batches = TokenBatches.open(self.data_dir, "train", cfg.training.seq_len, cfg.training.batch_size,
                                         cfg.run.seed)
        timer.done("optimizer_and_data")
        self.telemetry = Telemetry(cfg.training.prometheus_port, cfg.run.run_id, self.rank)
        ckpt = cfg.checkpoint
        memory = (MemoryTier(ckpt, cfg.run.run_id, self.rank, self.world_size,
                             int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
                  if ckpt.enabled and ckpt.memory_interval_steps else None)
        self.resilience = ResilienceHooks(cfg, self.rank, self.world_size, self.events, self.device,
                                          in_process=in_process, telemetry=self.telemetry,
                                          node_memory=memory.store if memory else None)
        self.checkpointer = CheckpointManager(
            cfg.checkpoint_dir, ckpt, rank=self.rank, device=self.device, events=self.events,
            # Checkpoints describe themselves: resume, validation and export need nothing else.
            metadata={"world_size": self.world_size, "run_id": cfg.run.run_id, "config_hash": cfg.config_hash(),
                      "model_config": self.model_config.to_dict(), "tokenizer": meta["tokenizer"],
                      "data_content_hash": meta["content_hash"], "config": cfg.to_dict()},
            memory=memory, s3=S3Tier(ckpt.s3_uri, cfg.run.run_id, cfg.data.s3_endpoint_url) if ckpt.s3_uri else None,
            save_point=self.resilience.injector.at_save_point, fence=self.fence,
        )
        self.checkpointer.prefetch = self._prefetch
        self.checkpointer.phase = self.watchdog.phase
        nodes = memory.nodes if memory is not None else max(
            1, self.world_size // int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        self.interval_planner = AutoInterval(cfg, self.checkpointer, self.events, rank=self.rank, nodes=nodes)
        self.progress = ProgressReporter(cfg, rank=self.rank, nodes=nodes, restarted=self.resilience.is_restart,
                                         run_started_at=self.resilience.injector.run_started_at)
        timer.done("checkpointing")
        self.watchdog.leave()
        self.resilience.start(init_seconds={"imports": timer.started - self.resilience.process_started_at,
                                            **timer.phases})

    # -- set-up ------------------------------------------------------------------------------------

    def _start_watchdog(self) -> PhaseWatchdog:
        rank = int(os.environ.get("RANK", "0"))
        events = EventLog(self.cfg.run_dir, rank)  # no fence yet: the lease is joined after the rendezvous
        return PhaseWatchdog(parse_startup_timeouts(self.cfg.resilience.startup_timeouts),
                             on_hang=lambda phase, seconds, timeout: exit_hung(events, rank, phase, seconds, timeout,
                                                                               step=getattr(self, "step", None)),
                             hang_in=startup_hang_drill(self.cfg.faults.schedule, rank, self.cfg.run_dir, events))

    def init_distributed(self) -> None:
        backend = self.cfg.training.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" not in os.environ:  # plain `python -m trainer`: a group of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            torch.set_num_threads(self.cfg.training.num_threads)
            self.device = torch.device("cpu")
        if self.in_process is None:
            dist.init_process_group(backend=backend)
        else:  # a fresh group per in-process restart iteration, on the application's own store
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            store = dist.TCPStore(os.environ["MASTER_ADDR"], self.in_process.store_port, world_size,
                                  is_master=rank == 0, multi_tenant=True, wait_for_workers=True)
            timeout = datetime.timedelta(seconds=self.cfg.resilience.collective_timeout)
            dist.init_process_group(backend=backend, store=dist.PrefixStore(f"iter{self.in_process.iteration}", store),
                                    rank=rank, world_size=world_size, timeout=timeout)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # One voice for progress; warnings and errors still come from every rank.
        logs.configure(logging.INFO if self.rank == 0 else logging.WARNING, rank=self.rank)

    def agree_on_restart_count(self) -> None:
        """Collective: every rank takes the highest TORCHELASTIC_RESTART_COUNT of the job. Each node's launcher
        counts its own restarts, and a node that replaced a lost one starts at 0 while the survivors restarted
        their workers: without this, a replacement's rank 0 would take the job's restart for a first start."""
        if self.world_size == 1:
            return
        count = torch.tensor([int(os.environ.get(RESTART_COUNT_ENV, "0"))], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        os.environ[RESTART_COUNT_ENV] = str(int(count.item()))

    def join_lease(self) -> Fence:
        """This launch's generation of the run folder's lease (fencing: an older launch's trainers stop).

        Under the pipeline's launcher the generation comes from the environment; started by hand (torchrun,
        python -m trainer), rank 0 takes the lease itself for the life of this process.
        """
        if GENERATION_ENV in os.environ:
            generation, busy = int(os.environ[GENERATION_ENV]), None
        else:
            choice: list = [None, None]
            if self.rank == 0:
                try:
                    self._own_lease = RunLease(self.cfg.run_dir).acquire()
                    choice[0] = self._own_lease.new_generation()
                except RunFolderBusy as err:
                    choice[1] = str(err)
            dist.broadcast_object_list(choice, src=0)
            generation, busy = choice
        if busy is not None:
            raise RunFolderBusy(busy)
        fence = Fence(self.cfg.run_dir, generation)
        fence.check()
        return fence

    def _from_rank_0(self, value: Any) -> Any:
        """Collective: rank 0's value on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _a_resume_is_likely(self) -> bool:
        """Collective: whether any rank sees a copy to resume from (node memory, an FSx checkpoint, S3). A
        cheap look (listings, no verification): resume() falls back to initialising when none restores."""
        ckpt = self.cfg.checkpoint
        if not (ckpt.enabled and ckpt.resume):
            return False
        seen = bool(ckpt.s3_uri or committed_checkpoints(self.cfg.checkpoint_dir)
                    or holds_a_copy(os.environ.get(NODE_STORE_ENV)))
        if self.world_size > 1:
            flag = torch.tensor(int(seen), device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            seen = bool(flag.item())
        return seen

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        # Tensors, not Python numbers: DCP stores non-tensor items with pickle. RNG state differs per rank,
        # and DCP de-duplicates equal keys across ranks, hence the rank in the key.
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"model": model_state, "optim": optim_state,
                "trainer": {"step": torch.tensor(self.step), "last_loss": torch.tensor(self.last_loss)},
                "rng": {f"rank{self.rank}": rng}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(state["trainer"]["step"])
        self.last_loss = float(state["trainer"]["last_loss"])
        rng = state["rng"].get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)

    def resume(self) -> None:
        """Take up the newest state there is; the checkpoint manager decides which (and says why)."""
        load_started, started, read_before = time.time(), time.perf_counter(), checkpoint_reads.bytes_read()
        state = self.state_dict()
        step, source = self.checkpointer.load_latest(state)
        load_seconds = time.perf_counter() - started
        prefetched = (self._prefetch.figures() if self._prefetch is not None
                      else {"prefetch_seconds": 0.0, "prefetch_bytes": 0})
        # Every rank's bytes (what the file system served this resume), the slowest rank's seconds.
        totals = torch.tensor([checkpoint_reads.bytes_read() - read_before + prefetched["prefetch_bytes"]],
                              dtype=torch.int64, device=self.device)
        dist.all_reduce(totals)
        slowest = torch.tensor([load_seconds, prefetched["prefetch_seconds"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        restore = {"fsx_bytes_read": int(totals.item()), "restore_seconds": float(slowest[0]),
                   "restore_overlapped_seconds": float(slowest[1])}
        if restore["fsx_bytes_read"]:
            # The files were read in the prefetch (hidden behind start-up) and the load: the read's own rate.
            restore["restore_gb_per_second"] = restore["fsx_bytes_read"] / 1e9 / max(1e-9, float(slowest.sum()))
            log.info("restore: %.2f GB from FSx, %.1f s of start-up waited for it (%.1f s overlapped), %.2f GB/s",
                     restore["fsx_bytes_read"] / 1e9, restore["restore_seconds"],
                     restore["restore_overlapped_seconds"], restore["restore_gb_per_second"])
        self.restart_budget.check(step if source != "none" else 0)  # did the recoveries before this one progress?
        if source != "none":
            self.load_state_dict(state)
            log.info("resuming at step %d (state from %s)", self.step, source)
        elif self._weights_pending:  # nothing to resume from after all: the weights a normal build gives
            copy_initial_weights(self.model, load_or_build_model(**self._build_model_args, seed=self.cfg.run.seed))
            # A checkpoint that failed its hashes part-way through the load (they are checked as it is read)
            # may have written into the optimizer's state too: a fresh run starts from a fresh one.
            self.optimizer.state.clear()
            initialize_state(self.optimizer)
        self._weights_pending = False
        self.resilience.note_resume(step if source != "none" else None, load_started, load_seconds, source, **restore)

    # -- loop --------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        t = self.cfg.training
        started = time.perf_counter()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        # Timed sections (trainer.resilience.straggler): each rank's own work; the loss's all-reduce stays out.
        with self.resilience.section("data"):
            micro_batches = [self.batches.batch(self.step, micro, self.rank) for micro in range(t.grad_accum_steps)]
        data_seconds = time.perf_counter() - started
        with self.resilience.section("forward_backward"):
            for inputs, labels in micro_batches:
                inputs = torch.from_numpy(inputs).to(self.device)
                labels = torch.from_numpy(labels).to(self.device)
                logits = self.model(input_ids=inputs).logits
                loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
                (loss / t.grad_accum_steps).backward()
                loss_sum += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                       t.grad_clip if t.grad_clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
        with self.resilience.section("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.world_size > 1:  # note: a sync point; the loss is averaged over ranks only for reporting
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)
        self.step += 1
        self.last_loss = loss_sum.item() / t.grad_accum_steps
        seconds = time.perf_counter() - started
        tokens = t.batch_size * t.seq_len * t.grad_accum_steps * self.world_size
        return {"step": self.step, "loss": self.last_loss, "lr": lr,
                "grad_norm": float(grad_norm), "step_seconds": seconds, "data_seconds": data_seconds,
                "tokens_per_second": tokens / seconds}

    def should_continue_training(self) -> bool:
        return self.step < self.cfg.training.num_steps

    def train(self) -> dict[str, Any]:
        with self.watchdog.phase("restore"):  # the tiers it reads are phases of their own inside it
            self.resume()
        self.watchdog.enter("first_step")
        started_at_step, started = self.step, time.perf_counter()
        with _MetricsWriter(self.run_dir.metrics if self.rank == 0 else None, self.fence) as writer:
            while self.should_continue_training():
                metrics = self.train_step()
                self.watchdog.close()  # start-up is over: ft_launcher's heartbeats watch the loop
                writer.write(metrics)
                if self.step % self.cfg.training.log_every == 0 or self.step == 1:
                    log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s", self.step,
                             self.cfg.training.num_steps, metrics["loss"], metrics["lr"], metrics["grad_norm"],
                             metrics["tokens_per_second"])
                self.interval_planner.before_save(self.step, metrics["step_seconds"])
                save_started = time.perf_counter()
                with self.resilience.section("checkpoint_wait"):
                    saved = self.checkpointer.save(self.step, self.state_dict,
                                                   last=not self.should_continue_training())
                self.telemetry.observe_step(metrics, time.perf_counter() - save_started if saved else None)
                self.resilience.after_step(self.step)
                self.progress.observe(self.step, metrics, straggler=self.resilience.stragglers.current)
        tail_started = time.perf_counter()
        self.checkpointer.save_final(self.step, self.state_dict)
        self.progress.finish(self.step, {"loss": self.last_loss}, straggler=self.resilience.stragglers.current)
        result = {"final_checkpoint_wait_seconds": time.perf_counter() - tail_started,
                  "steps": self.step, "steps_this_launch": self.step - started_at_step,
                  "final_loss": self.last_loss, "wall_seconds": time.perf_counter() - started,
                  "checkpoint_dir": str(self.cfg.checkpoint_dir),
                  "checkpoint": (str(self.cfg.checkpoint_dir / step_dir_name(self.step))
                                 if self.checkpointer.enabled else None),
                  "world_size": self.world_size,
                  "num_parameters": sum(p.numel() for p in self.model.parameters()),
                  "metrics_file": str(self.run_dir.metrics), "finished_at": time.time()}
        if self.rank == 0:
            write_json(self.run_dir.result, result)
        return result

    def close(self, wait_for_checkpoint: bool = True, peers_alive: bool = True) -> None:
        """wait_for_checkpoint=False after a fault: the peers may be gone, so the save in flight is dropped.
        peers_alive=False: whatever waits on another rank (a peer replica round) is dropped — a node lost
        mid-round never answers, and waiting for it would hang this rank instead of letting it restart."""
        self.watchdog.close()
        self.resilience.close()
        self.checkpointer.close(wait=wait_for_checkpoint, peers_alive=peers_alive)
        if self._own_lease is not None:
            self._own_lease.release()
        if dist.is_initialized():
            dist.destroy_process_group()


class _MetricsWriter:
    """Appends one JSON line per step (rank 0 only); the file survives restarts and is appended to."""

    def __init__(self, path: Path | None, fence: Fence):
        self.path = path
        self.fence = fence
        self.handle = None

    def __enter__(self) -> "_MetricsWriter":
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handle = self.path.open("a")
        return self

    def write(self, record: dict[str, float]) -> None:
        if self.handle is not None:
            self.fence.check()  # a superseded trainer appends nothing
            self.handle.write(json.dumps({**record, "time": time.time()}) + "\n")
            self.handle.flush()

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.close()


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
