"""What the loop does with a numeric anomaly (trainer.resilience.numerics): execute the step again on the same
batch, then go on with the clean result, or roll back and skip a window of samples.

The rollback (PaLM, section 5.1): training goes back to the newest state at or before step S - rollback_steps, S
the anomaly's step, from whichever tier holds it (node memory, a peer's replica, FSx, S3; node memory holds the
newest step or two, so going further back reads the FSx checkpoint at or before that step), and the samples
[first - rollback_steps x B, first + skip_steps x B) are skipped, B the global batch and first the anomalous
batch's first sample: whatever of them the checkpoint has not trained yet is never trained. Without a
checkpoint, training goes on from where it is: the anomalous step was never applied. The checkpoints
after the one it went back to belong to the abandoned branch and are dropped from every tier, so that no
later resume takes one up. The window is a control record (``data_skipped``), so every later start of the run
skips it too, whatever it resumes from.

Rollbacks in a row that do not get past the step of the one before end the run like a crash loop, after
``resilience.max_restarts_without_progress`` of them (trainer.resilience.budget), naming the steps and windows.

An episode (the anomalies rolled back, one after another) stays open until training gets rollback_steps +
skip_steps steps past its newest anomaly. While it is open, retention keeps the newest FSx checkpoint from
before its first anomaly beside checkpoint.keep_last: the checkpoints written after it never push out the last
weights known to be good. Its bounds are in the rollback records, so a restart reopens it.

``resilience.decisions`` may say data=stop: a reproducible anomaly then ends the run (gave_up.json) instead.
The replica groups' fingerprint findings (trainer.resilience.sdc) land here too: ``sdc_found``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.config.decisions import parse_decisions
from trainer.job.step import total
from trainer.resilience.node_exit import in_a_node_of_many, kill_this_node
from trainer.resilience.straggler import node_name
from trainer.resilience.numerics import Anomaly, local_figures

log = logging.getLogger(__name__)


def past_skipped(sample: int, windows: list[list[int]]) -> int:
    """The first sample at or after `sample` that no skipped window [start, end) holds."""
    moved = True
    while moved:
        moved = False
        for start, end in windows:
            if start <= sample < end:
                sample, moved = end, True
    return sample


class NumericRecovery:
    """The rerun and the rollback of one Trainer (collective: every rank of the job calls it alike)."""

    def __init__(self, trainer, rollbacks: list[dict[str, Any]]):
        """trainer: the Trainer (trainer.job.trainer, which builds this); rollbacks: the run's rollback records
        (trainer.run.history), the newest last."""
        self.trainer = trainer
        self.strikes: dict[str, int] = dict(trainer.resilience.history.sdc_strikes)  # node -> SDC findings naming it
        newest = rollbacks[-1] if rollbacks else None
        # {"pinned_step", "until"}: the open episode; reopened by start() when the run has not got past it
        self.episode = ({"pinned_step": newest.get("pinned_step"), "until": newest["episode_until"]}
                        if newest and newest.get("episode_until") is not None else None)

    def start(self, step: int) -> None:
        """After the resume: an episode the run has not got past keeps its checkpoint pinned."""
        if self.episode is not None and step < self.episode["until"]:
            self.trainer.checkpointer.pin(self.episode["pinned_step"])
        else:
            self.episode = None

    def after_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Each applied step: its figures join the window the next ones are judged against; an episode that
        training got past is closed, and its checkpoint unpinned; a bitflip drill due flips its bit."""
        numerics = self.trainer.resilience.numerics
        numerics.accept(loss, grad_norm)
        numerics.drills.flip_parameter(self.trainer.model, step)
        if self.episode is not None and step >= self.episode["until"]:
            if self.trainer.rank == 0:
                self.trainer.events.write("numeric_episode_closed", step=step,
                                          pinned_step=self.episode["pinned_step"])
            self.trainer.checkpointer.pin(None)
            self.episode = None

    def resolve(self, anomaly: Anomaly, micro_batches: list, first: torch.Tensor, step_started: float) -> \
            tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Execute the step again: its (job's loss, gradient norm as computed, its total) when it is clean the
        second time, the gradients in place for the clipping and the optimizer; None after a rollback (the step
        is not taken). first: this rank's own figures of the first pass (numerics.local_figures); step_started:
        the step's perf_counter start (a rolled-back step's seconds are wasted progress)."""
        trainer = self.trainer
        guard = trainer.resilience.numerics
        trainer.optimizer.zero_grad(set_to_none=True)
        rerun_started = time.perf_counter()
        local_loss, norm = trainer.compute(micro_batches, anomaly.first_sample)
        grad_norm = total(norm)
        job_loss = trainer.job_mean(local_loss)
        verdict = guard.after_rerun(anomaly, job_loss.item() / trainer.cfg.training.grad_accum_steps,
                                    float(grad_norm), first, local_figures(local_loss, trainer.model),
                                    seconds=time.perf_counter() - rerun_started)
        if verdict == "transient":
            self._absorbed(f"transient at step {anomaly.step}: clean on the same batch again, trained on")
            return job_loss, norm, grad_norm
        trainer.optimizer.zero_grad(set_to_none=True)
        if parse_decisions(trainer.cfg.resilience.decisions)["data"] == "stop":
            trainer.restart_budget.give_up(
                f"stopped by cause: {anomaly.kind} at step {anomaly.step} came back when the step was executed again "
                f"on the same batch (samples from {anomaly.first_sample}): the data or divergence, and "
                "resilience.decisions says data=stop. The newest checkpoint before it stands.", step=anomaly.step,
                cause="data")
        self.roll_back_and_skip(anomaly, wasted_seconds=time.perf_counter() - step_started)
        return None

    def roll_back_and_skip(self, anomaly: Anomaly, wasted_seconds: float = 0.0) -> None:
        """wasted_seconds: what the anomaly's step computed before it was abandoned (both passes)."""
        trainer, cfg = self.trainer, self.trainer.cfg.resilience
        batch = trainer.global_batch
        window = [max(0, anomaly.first_sample - cfg.rollback_steps * batch), anomaly.first_sample + cfg.skip_steps * batch]
        # the newest state at or before S - rollback_steps (PaLM's ~100 steps back: a cause in the optimizer's
        # state is not replayed), and never the anomalous step itself: rollback_steps 0 and 1 go back to S - 1
        target = max(0, min(anomaly.step - 1, anomaly.step - cfg.rollback_steps))
        trainer.checkpointer.wait()  # the saves in flight land: every tier then holds what it says
        if self.episode is None or trainer.step >= self.episode["until"]:  # a new episode: pin what came before it
            self.episode = {"pinned_step": trainer.checkpointer.newest_committed_at_or_before(target), "until": 0}
        self.episode["until"] = anomaly.step + cfg.rollback_steps + cfg.skip_steps
        trainer.checkpointer.pin(self.episode["pinned_step"])
        reload_started = time.perf_counter()
        before, step, source = self._go_back(target)
        reload_seconds = time.perf_counter() - reload_started
        if source == "in_memory":  # nothing at or before the target: the anomaly was never applied
            log.warning("no checkpoint before step %d: training goes on from step %d, where the anomaly's step "
                        "was not applied", anomaly.step, step)
        untrained = [max(window[0], trainer.next_sample), window[1]]  # what the checkpoint has not trained yet
        record = {"anomaly_step": anomaly.step, "anomaly": anomaly.kind, "target_step": target,
                  "reloaded_step": step, "reload_source": source, "lost_steps": before - step,
                  "window": window, "samples": untrained[1] - untrained[0],
                  "by_dataset": trainer.batches.drawn_between(*untrained),
                  "pinned_step": self.episode["pinned_step"], "episode_until": self.episode["until"],
                  # the goodput's badput (trainer.planning.measured): checkpoint_load and wasted_progress
                  "reload_seconds": reload_seconds, "wasted_seconds": wasted_seconds}
        trainer.restart_budget.rolled_back(record)  # records it; gives up after too many rollbacks without progress
        if trainer.rank == 0:
            trainer.events.write("data_skipped", step=anomaly.step, start=untrained[0], end=untrained[1],
                                 samples=record["samples"], by_dataset=record["by_dataset"], why=anomaly.kind)
        trainer.skip_windows.append(untrained)
        dist.barrier()  # the records are written before any copy of the abandoned branch goes
        trainer.checkpointer.drop_after(step)
        trainer.replica_groups.resumed_at(step)  # every group went back alike: torchft's count follows
        self._absorbed(f"reproducible at step {anomaly.step}: rolled back to step {step} ({source}) and skipped "
                       f"samples [{window[0]}, {window[1]})")
        log.error("rolled back from step %d to step %d (%s) and skipping samples [%d, %d) (%s): %d steps lost",
                  before, step, source, window[0], window[1], _datasets(record["by_dataset"]), before - step)

    def _go_back(self, at_most: int) -> tuple[int, int, str]:
        """Collective: the newest copy not after step `at_most`, from any tier: (step before, step now, its
        source; "in_memory" when there was none and the state stays as it is)."""
        trainer = self.trainer
        before, state = trainer.step, trainer.state_dict()
        step, source = trainer.checkpointer.load_latest(state, at_most=at_most)
        if source != "none":
            trainer.load_state_dict(state)
        else:
            step, source = trainer.step, "in_memory"
        trainer.resilience.numerics.resumed(trainer.run_dir.metrics, step)  # the window of the steps it goes on from
        return before, step, source

    def sdc_found(self, finding: dict[str, Any]) -> bool:
        """Collective. The replica groups' fingerprints differ (trainer.resilience.sdc): with a majority, each
        minority group heals from the others at the next quorum; without one (R = 2), every group rolls back to
        the last step whose fingerprints agreed. True when this group's state was replaced (the step is not
        recorded). The ranks a majority names strike their nodes; a node at resilience.sdc_strikes is replaced."""
        trainer, cfg = self.trainer, self.trainer.cfg.resilience
        groups = trainer.replica_groups
        named = finding["majority"] and groups.group in finding["ranks"].get(trainer.rank, [])
        action = ("heal" if groups.group in finding["minority"] else "none") if finding["majority"] else "rollback"
        if trainer.rank == 0:
            trainer.events.write("sdc_found", step=finding["step"], group=groups.group, action=action,
                                 ranks={str(r): g for r, g in finding["ranks"].items()}, majority=finding["majority"],
                                 last_agreed_step=finding["last_agreed_step"])
        log.error("silent data corruption: the replica groups' parameters differ after step %d (rank positions and "
                  "the groups apart: %s); this group %s", finding["step"], finding["ranks"],
                  {"heal": "heals from the others", "none": "goes on",
                   "rollback": f"rolls back to step {finding['last_agreed_step']}"}[action])
        if named:
            self._strike(finding["step"], cfg.sdc_strikes)
        self._absorbed(f"the fingerprints after step {finding['step']} told it: {action}")
        if action == "heal":
            groups.heal_from_the_others()
        if action != "rollback":
            return False
        trainer.checkpointer.wait()
        _, step, source = self._go_back(finding["last_agreed_step"])
        if source == "in_memory":
            trainer.restart_budget.give_up(
                f"silent data corruption after step {finding['step']}: the replica groups' parameters differ and no "
                f"checkpoint at or before step {finding['last_agreed_step']} (the last whose fingerprints agreed) "
                "is left to go back to; with two groups nothing tells which is right. Start the run again from its "
                "newest checkpoint that validates.", layer="decision", step=finding["step"])
        dist.barrier()
        trainer.checkpointer.drop_after(step)
        groups.resumed_at(step)
        return True

    def _strike(self, step: int, limit: int) -> None:
        """This rank's node is named by a finding: one more strike, and replaced at the limit."""
        node = node_name()
        self.strikes[node] = self.strikes.get(node, 0) + 1
        self.trainer.events.write("sdc_strike", step=step, node=node, strikes=self.strikes[node], limit=limit)
        if self.strikes[node] >= limit:
            why = f"silent data corruption: named by {self.strikes[node]} fingerprint findings (resilience.sdc_strikes)"
            if in_a_node_of_many():
                self.trainer.events.write("rank_failed", how="sdc", message=why, step=step, phase="train",
                                          secondary=False)
                kill_this_node(why)
            log.error("%s, but this rank is not on a node of a multi-node job: it stays", why)

    def _absorbed(self, why: str) -> None:
        """The drills this rank fired in the step are answered: no restart follows them."""
        for key in self.trainer.resilience.numerics.drills.take_fired():
            self.trainer.events.write("fault_absorbed", fault_key=key, why=why)


def _datasets(by_dataset: dict[str, Any]) -> str:
    return ", ".join(f"{count} of {name}" for name, count in by_dataset.items()) or "no dataset"
