"""The Trainer: FSDP2 training of a Llama-architecture model in one process of a job (one rank).

    trainer = Trainer(cfg, data_dir)   # process group, lease, model, optimizer, data, checkpointing
    trainer.train()                    # resume, then step until training.num_steps; result.json at the end
    trainer.close()

Collaborators are attributes by role, built by the start-up (trainer.job.startup): `checkpointer`
(trainer.checkpoint.manager) owns saving and where a run resumes from; `resilience` (trainer.resilience.hooks)
gets one call per step; `telemetry` serves /metrics; `fence` stops a superseded trainer. This module holds the
state, the resume and the loop; the command line is trainer.job.cli.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainer.checkpoint import reads as checkpoint_reads
from trainer.checkpoint.backends import BACKGROUND_WRITE_TIMEOUT
from trainer.checkpoint.format import step_dir_name
from trainer.data.batches import skipped_ranges
from trainer.data.phases import ORDERS
from trainer.config import Config
from trainer.job.numeric_recovery import NumericRecovery, past_skipped
from trainer.job.startup import start_process
from trainer.job.schedule import Schedule
from trainer.job.continuation import take_up_data_phases, take_up_schedule
from trainer.job.step import MetricsWriter, clip, forward_backward, mean_targets, step_extras, total
from trainer.model.base import load_base_weights
from trainer.model.build import build_model, copy_initial_weights
from trainer.model.compile_cache import cache_counts
from trainer.model.parallelize import local_shard
from trainer.model.optimizer import initialize_state, optimizer_groups_of
from trainer.observe.flops import StepFigures
from trainer.resilience.in_process import InProcessAttempt
from trainer.resilience.numerics import local_figures
from trainer.run.lease import check_fence_of_this_process
from trainer.run.run_dir import write_json

log = logging.getLogger("trainer")


class Trainer:
    """Owns the model, optimizer, data and checkpointing of one training process."""

    def __init__(self, cfg: Config, data_dir: Path, in_process: InProcessAttempt | None = None):
        self.cfg = cfg
        self.in_process = in_process
        self.data_dir = Path(data_dir)
        # optimizer steps completed; the global sample index the next step starts at (trainer.data.batches)
        self.step, self.next_sample, self.last_loss = 0, 0, float("nan")
        self.schedule = self.saved_schedule = Schedule.of(cfg.training)  # the LR's (trainer.job.schedule)
        self.saved_order = "name"  # the sample order the resumed checkpoint trained in (trainer.data.phases)
        started = start_process(cfg, self.data_dir, in_process, step_of=lambda: self.step)
        # the process in its job
        self.rank, self.world_size, self.device = started.rank, started.world_size, started.device
        self.global_rank, self.replica_groups = started.global_rank, started.replica_groups
        self.watchdog, self.fence, self._own_lease = started.watchdog, started.fence, started.own_lease
        self.run_dir, self.events, self.restart_budget = started.run_dir, started.events, started.restart_budget
        # the model and its data
        self.model, self.model_config, self.optimizer = started.model, started.model_config, started.optimizer
        self.batches, self._weights_pending, self._base_weights = (started.batches, started.weights_pending,
                                                                   started.base_weights)
        # what runs beside the loop, each touched by it in one place
        self.telemetry, self.resilience, self.checkpointer = started.telemetry, started.resilience, started.checkpointer
        self.interval_planner, self.progress = started.interval_planner, started.progress
        self._prefetch, self.evaluator = started.prefetch, started.evaluator
        self._compile_cache = started.compile_cache
        self.replica_groups.attach(self.model, self.live_state, self.load_live_state)
        self.replica_groups.on_heal = self.resilience.note_heal
        # the sample windows never trained (rolled back and skipped: trainer.job.numeric_recovery), run-wide
        self.skip_windows = [list(window) for window in self.resilience.history.skip_windows]
        self.numeric_recovery = NumericRecovery(self, self.resilience.history.rollbacks)
        self.throughput = StepFigures(self.model, cfg.training.seq_len, self.data_parallel_ranks, self.device,
                                      cfg.training.peak_tflops)  # mfu, TFLOP/s and CUDA memory per step

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        optim_state = {"state": optim_state["state"]}  # its groups are the config's at each start (load_state_dict)
        # Tensors, not Python numbers: DCP stores non-tensor items with pickle. RNG state differs per rank,
        # and DCP de-duplicates equal keys across ranks, hence the rank in the key.
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"model": model_state, "optim": optim_state,
                "trainer": {"step": torch.tensor(self.step), "last_loss": torch.tensor(self.last_loss)},
                "data": {"next_sample": torch.tensor(self.next_sample),
                         "order": torch.tensor(ORDERS.index(self.batches.phases[0].order))},  # trainer.data.phases
                "schedule": self.schedule.to_state(),
                "rng": {f"rank{self.rank}": rng}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checkpointer.before_state_changes()
        # AdamW's groups and hyperparameters are this run's config: a checkpoint of another grouping (before
        # optimizer.no_decay every parameter was decayed) resumes into them
        groups = optimizer_groups_of(self.model, self.optimizer)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={**state["optim"], "param_groups": groups})
        self.step, self.last_loss = int(state["trainer"]["step"]), float(state["trainer"]["last_loss"])
        # A checkpoint written before the sample order was kept (it has no data.next_sample) continues at the
        # position its steps would have reached at this global batch.
        stored = state.get("data", {}).get("next_sample")
        self.next_sample = int(stored) if stored is not None else self.step * self.global_batch
        self.saved_schedule = Schedule.from_state(state.get("schedule", {}))  # None: a checkpoint before schedules
        order = state["data"].get("order") if "data" in state else None  # none: a release before data phases
        self.saved_order = ORDERS[int(order)] if order is not None else "position"
        rng = state["rng"].get(f"rank{self.rank}")
        if rng is not None:
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng:
                torch.cuda.set_rng_state(rng["cuda"], self.device)

    def live_state(self) -> dict[str, Any]:
        """What a healing replica group takes from this rank (its peer rank in a live group holds the same
        shards): the local shards of the parameters and of AdamW's state, the step and the last loss."""
        params = list(self.model.parameters())
        return {"step": self.step, "last_loss": self.last_loss, "next_sample": self.next_sample,
                "params": [local_shard(p.detach()) for p in params],
                "optim": [{k: local_shard(v) for k, v in self.optimizer.state[p].items()} for p in params]}

    def load_live_state(self, state: dict[str, Any]) -> None:
        self.checkpointer.before_state_changes()
        with torch.no_grad():
            for p, value, optim in zip(self.model.parameters(), state["params"], state["optim"]):
                local_shard(p).copy_(value)
                for key, tensor in optim.items():
                    local_shard(self.optimizer.state[p][key]).copy_(tensor)
        self.step, self.last_loss = int(state["step"]), float(state["last_loss"])
        self.next_sample = int(state["next_sample"])

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
        elif self._base_weights is not None:  # a first start of continued pre-training
            with self.watchdog.phase("restore_base"):
                restore.update(self._load_base_weights())
            self.optimizer.state.clear()  # fresh, as a fresh run's (a copy that failed its hashes may have written it)
            initialize_state(self.optimizer)
        elif self._weights_pending:  # nothing to resume from after all: the weights a normal build gives
            copy_initial_weights(self.model, build_model(self.model_config, seed=self.cfg.run.seed))
            # A checkpoint that failed its hashes part-way through the load (they are checked as it is read)
            # may have written into the optimizer's state too: a fresh run starts from a fresh one.
            self.optimizer.state.clear()
            initialize_state(self.optimizer)
        self._weights_pending = False
        take_up_schedule(self, resumed=source != "none")  # the LR and the data order this start trains with
        take_up_data_phases(self, resumed=source != "none")
        self.replica_groups.resumed_at(self.step)
        self.numeric_recovery.start(self.step)
        self.resilience.note_resume(step if source != "none" else None, load_started, load_seconds, source, **restore)

    def _load_base_weights(self) -> dict[str, Any]:
        """Collective: each rank reads its shard of the base model (trainer.model.base); what the job read."""
        started = time.perf_counter()
        stats = load_base_weights(self.model, Path(self._base_weights["folder"]), self._base_weights["index"])
        read = torch.tensor([stats["bytes_read"], stats["bytes_read"]], dtype=torch.float64, device=self.device)
        seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=self.device)
        dist.all_reduce(read[:1])
        dist.all_reduce(read[1:], op=dist.ReduceOp.MAX)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        figures = {"base_bytes_read": int(read[0]), "base_max_rank_bytes_read": int(read[1]),
                   "base_read_seconds": float(seconds), "base_weights_bytes": self._base_weights["index"]["bytes"]}
        log.info("base model %s: %.2f GB read by the job (%.2f x its files), at most %.2f GB by a rank, in %.1f s",
                 self._base_weights["folder"], figures["base_bytes_read"] / 1e9,
                 figures["base_bytes_read"] / max(1, figures["base_weights_bytes"]),
                 figures["base_max_rank_bytes_read"] / 1e9, figures["base_read_seconds"])
        if self.rank == 0:  # each replica group reads the weights once
            self.events.write("base_model_loaded", folder=self._base_weights["folder"], ranks=self.world_size,
                              group=self.replica_groups.group,
                              content_hash=self._base_weights["index"]["content_hash"], **figures)
        return figures

    # -- loop --------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float] | None:
        """One optimizer step; None when it was not taken: the replica groups discarded it (a group failed during
        it: it is trained again, with the same data, by the groups left), or a numeric anomaly rolled back."""
        t = self.cfg.training
        started = time.perf_counter()
        self.replica_groups.begin_step(self.step)  # the step's quorum; a healing group takes a live group's state
        lr = self.schedule.lr_at(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Timed sections (trainer.resilience.straggler): each rank's own work; the loss's all-reduce stays out.
        first_sample = past_skipped(self.next_sample, self.skip_windows)
        with self.resilience.section("data"):
            micro_batches = [self.batches.batch(first_sample, micro, self.global_rank, self.data_parallel_ranks)
                             for micro in range(t.grad_accum_steps)]
        data_seconds = time.perf_counter() - started
        with self.resilience.section("forward_backward"):
            local_loss, norm = self.compute(micro_batches, first_sample)
            grad_norm = total(norm)
        # Checked before the optimizer applies them (trainer.resilience.numerics): figures all-reduced anyway.
        job_loss = self.job_mean(local_loss)
        anomaly = self.resilience.numerics.check(self.step + 1, first_sample, job_loss.item() / t.grad_accum_steps,
                                                 float(grad_norm))
        if anomaly is not None:
            resolved = self.numeric_recovery.resolve(anomaly, micro_batches, local_figures(local_loss, self.model),
                                                     started)
            if resolved is None:
                return None
            job_loss, norm, grad_norm = resolved
        with self.resilience.section("optimizer"):
            clip(self.model, norm, t.grad_clip)
            committed = self.replica_groups.should_commit(self.step)
            if committed:
                self.checkpointer.before_state_changes()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if not committed:
            return None
        self.step += 1
        self.next_sample = first_sample + self.global_batch
        replicas_equal = self.replica_groups.replicas_equal(self.model, self.step)
        finding = self.replica_groups.compare_fingerprints(self.model, self.step)  # trainer.resilience.sdc
        if finding is not None and self.numeric_recovery.sdc_found(finding):
            return None
        self.last_loss = job_loss.item() / t.grad_accum_steps
        self.numeric_recovery.after_step(self.step, self.last_loss, float(grad_norm))
        seconds = time.perf_counter() - started
        skipped = self._skipped_samples(first_sample)
        samples_skipped = sum(end - start for start, end in skipped)
        tokens = (self.global_batch - samples_skipped) * t.seq_len
        return {"step": self.step, "loss": self.last_loss, "lr": lr,
                # what this step trained, and what the groups missing from it did not (replica groups)
                "samples": self.global_batch - samples_skipped, "samples_skipped": samples_skipped,
                "grad_norm": float(grad_norm), "step_seconds": seconds, "data_seconds": data_seconds,
                "tokens_per_second": tokens / seconds, **self.throughput.step(tokens, seconds),
                **self.batches.position(first_sample, self.next_sample),
                **({"skipped_samples": skipped} if skipped else {}), **self.replica_groups.figures(),
                **({"replicas_equal": replicas_equal} if replicas_equal is not None else {})}

    def compute(self, micro_batches: list, first_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of the step's micro-batches (trainer.job.step.forward_backward; data whose targets
        may be masked: the loss is the mean over the job's counted targets, a count all-reduced per step)."""
        job_targets = None if not self.batches.masks_targets else lambda counted: mean_targets(
            counted, device=self.device, ranks=self.world_size, micro_batches=len(micro_batches),
            across_groups=self.replica_groups.average_across_groups)
        return forward_backward(self.model, micro_batches, device=self.device, training_cfg=self.cfg.training,
                                drills=self.resilience.numerics.drills, step=self.step + 1, first_sample=first_sample,
                                global_batch=self.global_batch, job_targets=job_targets)

    def job_mean(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The loss summed over micro-batches, averaged over the group's ranks and then over the replica groups
        taking part: every group judges the same figure (its gradients are averaged across groups already)."""
        group_loss = local_loss.clone()
        if self.world_size > 1:
            dist.all_reduce(group_loss, op=dist.ReduceOp.AVG)
        return self.replica_groups.average_across_groups(group_loss)

    @property
    def data_parallel_ranks(self) -> int:
        """Every rank of every replica group: a step's samples are split over all of them."""
        return self.world_size * self.replica_groups.groups

    @property
    def global_batch(self) -> int:
        """Samples a step takes from the stream (trained, or skipped by a replica group missing from it)."""
        return self.cfg.training.batch_size * self.cfg.training.grad_accum_steps * self.data_parallel_ranks

    def _skipped_samples(self, first_sample: int) -> list[list[int]]:
        """The global indices [start, end) of the step's samples that replica groups missing from it did not train."""
        missing = [g for g in range(self.replica_groups.groups) if g not in self.replica_groups.participating_groups]
        return skipped_ranges(first_sample, missing, groups=self.replica_groups.groups,
                              group_slice=self.cfg.training.batch_size * self.world_size,
                              micro_steps=self.cfg.training.grad_accum_steps)

    def should_continue_training(self) -> bool:
        return self.step < self.cfg.training.num_steps

    def train(self) -> dict[str, Any]:
        with self.watchdog.phase("restore"):  # the tiers it reads are phases of their own inside it
            self.resume()
        self.watchdog.enter("first_step")
        started_at_step, started = self.step, time.perf_counter()
        with MetricsWriter(self.run_dir.metrics if self.rank == 0 else None, self.fence) as writer:
            while self.should_continue_training():
                metrics = self.train_step()
                if metrics is None:  # discarded by the replica groups: trained again at once
                    self.resilience.discarded_step(self.step)
                    continue
                self.watchdog.close()  # start-up is over: ft_launcher's heartbeats watch the loop
                if self._compile_cache is not None and self.rank == 0:
                    # This start's first step compiled the blocks or loaded them: what it cost, and from where.
                    self.events.write("compile_cache", step=self.step, folder=str(self._compile_cache),
                                      first_step_seconds=metrics["step_seconds"], **cache_counts())
                    self._compile_cache = None
                metrics.update(self.evaluator.periodic(self.step))  # val_loss every eval.every_steps
                if self.replica_groups.writes_run_files:  # one group writes each step's line
                    writer.write(metrics)
                if self.step % self.cfg.training.log_every == 0 or self.step == 1:
                    log.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s %.1f TFLOP/s/GPU%s", self.step,
                             self.cfg.training.num_steps, metrics["loss"], metrics["lr"], metrics["grad_norm"],
                             metrics["tokens_per_second"], metrics["tflops_per_gpu"], step_extras(metrics))
                self.interval_planner.before_save(self.step, metrics["step_seconds"])
                save_started = time.perf_counter()
                with self.resilience.section("checkpoint_wait"):
                    saved = self.checkpointer.save(self.step, self.state_dict,
                                                   last=not self.should_continue_training())
                self.telemetry.observe_step(metrics, time.perf_counter() - save_started if saved else None)
                self.resilience.after_step(self.step)
                self.progress.observe(self.step, metrics, straggler=self.resilience.stragglers.current)
        tail_started = time.perf_counter()
        with self.resilience.heartbeat.while_waiting("the final checkpoint's write", self._final_write_limit()):
            self.checkpointer.save_final(self.step, self.state_dict)
        final_checkpoint_wait, evaluation_started = time.perf_counter() - tail_started, time.perf_counter()
        checkpoint = str(self.cfg.checkpoint_dir / step_dir_name(self.step)) if self.checkpointer.enabled else None
        evaluation = self.evaluator.final(self.step, checkpoint)  # the model's weights are the champion's after it
        self.progress.finish(self.step, {"loss": self.last_loss}, straggler=self.resilience.stragglers.current)
        result = {"final_checkpoint_wait_seconds": final_checkpoint_wait,
                  "final_evaluation_seconds": time.perf_counter() - evaluation_started,
                  "evaluation": str(self.run_dir.evaluation(self.step)) if evaluation else None,
                  "steps": self.step, "steps_this_launch": self.step - started_at_step,
                  "final_loss": self.last_loss, "wall_seconds": time.perf_counter() - started,
                  "checkpoint_dir": str(self.cfg.checkpoint_dir), "checkpoint": checkpoint,
                  "world_size": self.world_size * self.replica_groups.groups,
                  **self.replica_groups.result(),
                  "num_parameters": sum(p.numel() for p in self.model.parameters()),
                  "metrics_file": str(self.run_dir.metrics), "finished_at": time.time()}
        if self.rank == 0 and self.replica_groups.writes_run_files:
            check_fence_of_this_process(self.run_dir.path)
            write_json(self.run_dir.result, result)
        return result

    def _final_write_limit(self) -> float:
        """How long the final save may be waited for before it counts as hung: three times this launch's longest
        save (write and commit), at least the heartbeat timeout; with none measured, the write's own timeout."""
        longest = self.checkpointer.costs.longest_write_seconds()
        if longest is None:
            return BACKGROUND_WRITE_TIMEOUT.total_seconds()
        return max(3 * longest, self.cfg.resilience.heartbeat_timeout)

    def close(self, wait_for_checkpoint: bool = True, peers_alive: bool = True) -> None:
        """wait_for_checkpoint=False after a fault: the peers may be gone, so the save in flight is dropped.
        peers_alive=False: whatever waits on another rank (a peer replica round) is dropped: it would hang."""
        self.watchdog.close()
        self.resilience.close()
        self.replica_groups.close()
        self.checkpointer.close(wait=wait_for_checkpoint, peers_alive=peers_alive)
        if self._own_lease is not None:
            self._own_lease.release()
        if dist.is_initialized():
            dist.destroy_process_group()
