"""Numeric faults caught in the step they happen: a non-finite or spiking loss or gradient norm.

    anomaly = guard.check(step, first_sample, loss, grad_norm)  # before the optimizer step; None: apply it
    verdict = guard.after_rerun(anomaly, loss, grad_norm, ...)  # the same batch again: transient or reproducible

The loss and the gradient norm are all-reduced in every step anyway (the loss for the report, the norm for the
clipping), so every rank of a group judges the same numbers and comes to the same decision without another
collective. An anomaly's optimizer step is not taken, so no parameter ever holds what it would have applied.
The step is then executed again on the same batch (one more forward and backward: the parameters are still
those before it):

- clean the second time: the fault was transient, a suspected silent data corruption (a GPU or a link that
  computed a wrong value once). The rank whose own contribution differed between the two passes is named where
  the figures tell it; training goes on with the clean result.
- the anomaly again: it is the data or the model's divergence. Training rolls back and skips a window of
  samples (PaLM, section 5.1): trainer.job.numeric_recovery.

Spikes are measured with a robust z-score, (value - median) / (1.4826 x median absolute deviation) over the
last ``resilience.spike_window`` accepted steps, upwards only, from ``resilience.spike_after_steps`` on.

The drills (faults.schedule) are here too, because they act inside the step: ``nan@STEP[:rank=R]`` and
``spike@STEP[:rank=R]`` poison the loss of the batch step STEP trains in a run without skips, each time that
batch is trained (as bad data does, until it is skipped); ``sdc@STEP:rank=R`` flips the top exponent bit of
one element of rank R's gradient shard once.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config.drills import NUMERIC_FAULTS, Fault
from trainer.model.parallelize import local_shard
from trainer.run.tail import read_last_records

log = logging.getLogger(__name__)

MAD_TO_SIGMA = 1.4826  # the median absolute deviation of a normal distribution is 0.6745 sigma
SPIKE_FACTOR = 8.0  # the spike drill: the batch's loss (and so its gradient) this many times as large
# Two passes over the same batch on the same rank agree bit for bit on CPU and nearly so on GPU (atomics in a
# few kernels): a rank whose figures moved more than this between them computed something else once.
RERUN_TOLERANCE = 1e-3


@dataclass
class Anomaly:
    """What a step computed that its optimizer step must not apply."""

    step: int  # the step it happened in (1-based: the step that would have completed)
    first_sample: int  # the global index of its batch's first sample
    kind: str  # nonfinite_loss, nonfinite_grad_norm, loss_spike, grad_norm_spike
    loss: float
    grad_norm: float
    median: float | None = None  # of the spiking figure over the window
    zscore: float | None = None
    rerun: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if key != "rerun"}


def robust_zscore(value: float, window: list[float]) -> tuple[float, float]:
    """(z, median): how many robust standard deviations `value` lies above the window's median. A window with
    no spread measures against a hundredth of its median, so the same value again is not a spike."""
    median = statistics.median(window)
    spread = MAD_TO_SIGMA * statistics.median(abs(x - median) for x in window)
    spread = spread or max(abs(median) * 0.01, 1e-12)
    return (value - median) / spread, median


class SpikeWindow:
    """The accepted steps' losses and gradient norms, and what is a spike against them."""

    def __init__(self, size: int, zscore: float, after_steps: int):
        self.zscore, self.after_steps = zscore, after_steps
        self.losses: deque[float] = deque(maxlen=size)
        self.grad_norms: deque[float] = deque(maxlen=size)

    def judge(self, step: int, loss: float, grad_norm: float) -> tuple[str, float, float] | None:
        """(kind, median, z) of the first figure that is not finite or spikes; None when both are fine."""
        if not math.isfinite(loss):
            return "nonfinite_loss", math.nan, math.nan
        if not math.isfinite(grad_norm):
            return "nonfinite_grad_norm", math.nan, math.nan
        if not self.zscore or step < self.after_steps or len(self.losses) < self.losses.maxlen:
            return None
        for kind, value, window in (("loss_spike", loss, self.losses), ("grad_norm_spike", grad_norm, self.grad_norms)):
            z, median = robust_zscore(value, list(window))
            if z > self.zscore:
                return kind, median, z
        return None

    def accept(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def restore(self, metrics_path: Path, step: int) -> None:
        """Refill the window from metrics.jsonl's steps up to `step` (a resume): a restart does not blind the
        check for a window's worth of steps, and a resumed run judges as an uninterrupted one does. The newest
        record of a step wins (a replay after a fault wrote it again)."""
        size = self.losses.maxlen
        records = read_last_records(metrics_path, lambda r: int(r.get("step", 0)) <= step and "grad_norm" in r,
                                    2 * size)
        newest = {int(r["step"]): r for r in records}
        self.losses.clear()
        self.grad_norms.clear()
        for record in (newest[s] for s in sorted(newest)[-size:]):
            if math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]):
                self.accept(record["loss"], record["grad_norm"])


class NumericDrills:
    """This rank's nan, spike and sdc drills (trainer.config.drills), fired inside the step."""

    def __init__(self, faults: list[Fault], rank: int, events, fired_keys: set[str]):
        mine = [f for f in faults if f.type in NUMERIC_FAULTS and f.rank == rank]
        self.poisons = [f for f in mine if f.type in ("nan", "spike")]
        self.flips = [f for f in mine if f.type == "sdc" and f.key not in fired_keys]
        self.bitflips = [f for f in mine if f.type == "bitflip" and f.key not in fired_keys]
        self.rank, self.events, self.fired_keys = rank, events, fired_keys
        self._fired_now: list[str] = []  # fired since take_fired: what the step's resolution answers

    def poison(self, loss: torch.Tensor, first_sample: int, global_batch: int) -> torch.Tensor:
        """The loss of a micro-batch of a poisoned batch: non-finite (nan) or SPIKE_FACTOR times larger (spike)."""
        for fault in self.poisons:
            if first_sample <= (fault.step - 1) * global_batch < first_sample + global_batch:
                self._fired(fault, first_sample)
                return loss * (math.nan if fault.type == "nan" else SPIKE_FACTOR)
        return loss

    def flip(self, model: torch.nn.Module, step: int) -> None:
        """After the backward of `step`: an sdc drill due flips the top exponent bit of the largest gradient
        element of this rank's shard, once (a wrong value that no error reports: 2^128 times the value in fp32)."""
        for fault in [f for f in self.flips if step >= f.step]:
            self.flips.remove(fault)
            with torch.no_grad():
                # the first shard that holds a gradient at all (a byte vocabulary's upper rows get none)
                local = next(g for p in model.parameters() if p.grad is not None
                             and bool((g := _local_view(p.grad)).abs().max() > 0))
                largest = int(local.abs().argmax())
                bits = local[largest:largest + 1].view(torch.int32 if local.element_size() == 4 else torch.int16)
                bits ^= 1 << (30 if local.element_size() == 4 else 14)
            self._fired(fault, None, step=step)

    def flip_parameter(self, model: torch.nn.Module, step: int) -> None:
        """After the optimizer step of `step`: a bitflip drill due flips the lowest mantissa bit of this rank's
        largest parameter value, once: this replica group's shard no longer equals the others' (a wrong value in
        memory that nothing reports, and that training alone would never notice)."""
        for fault in [f for f in self.bitflips if step >= f.step]:
            self.bitflips.remove(fault)
            with torch.no_grad():
                local = next(_local_view(p.data) for p in model.parameters() if p.numel())
                largest = int(local.abs().argmax())
                bits = local[largest:largest + 1].view(torch.int32 if local.element_size() == 4 else torch.int16)
                bits ^= 1
            self._fired(fault, None, step=step)
            self.take_fired()  # answered by the fingerprints' finding, not by this step's resolution

    def take_fired(self) -> list[str]:
        fired, self._fired_now = self._fired_now, []
        return fired

    def _fired(self, fault: Fault, first_sample: int | None, step: int | None = None) -> None:
        if fault.key in self.fired_keys:  # a poisoned batch trained again: the same fault, not a new one
            return
        self.fired_keys.add(fault.key)
        self._fired_now.append(fault.key)
        self.events.write("fault", fault_type=fault.type, key=fault.key, step=step if step is not None else fault.step,
                          first_sample=first_sample)
        log.warning("injecting fault %s on rank %d", fault.key, self.rank)


class NumericGuard:
    """The step's check, the rerun's verdict and their records; `enabled` False: nothing is checked."""

    def __init__(self, resilience_cfg, *, rank: int, world_size: int, events, device: torch.device,
                 drills: NumericDrills):
        self.enabled = resilience_cfg.numeric_checks
        self.window = SpikeWindow(resilience_cfg.spike_window, resilience_cfg.spike_zscore,
                                  resilience_cfg.spike_after_steps)
        self.rank, self.world_size, self.events, self.device, self.drills = rank, world_size, events, device, drills

    def check(self, step: int, first_sample: int, loss: float, grad_norm: float) -> Anomaly | None:
        """Before step's optimizer step (the same figures on every rank of the group): the anomaly, if any."""
        if not self.enabled:
            return None
        found = self.window.judge(step, loss, grad_norm)
        if found is None:
            return None
        kind, median, z = found
        anomaly = Anomaly(step, first_sample, kind, loss, grad_norm, None if math.isnan(median) else median,
                          None if math.isnan(z) else z)
        if self.rank == 0:
            self.events.write("numeric_anomaly", **anomaly.record())
        log.warning("numeric anomaly at step %d: %s (loss %s, gradient norm %s%s); its optimizer step is skipped "
                    "and the step executed again on the same batch", step, kind, loss, grad_norm,
                    f", median {median:.4g}, robust z {z:.1f}" if anomaly.zscore is not None else "")
        return anomaly

    def after_rerun(self, anomaly: Anomaly, loss: float, grad_norm: float, first_pass: torch.Tensor,
                    second_pass: torch.Tensor, seconds: float = 0.0) -> str:
        """Collective. The verdict on the rerun's figures: "transient" (clean: a suspected SDC, recorded with
        the ranks whose own figures moved) or "reproducible" (the anomaly again). first_pass, second_pass:
        this rank's own figures (local_figures) of each pass; seconds: the rerun's (wasted progress)."""
        again = self.window.judge(anomaly.step, loss, grad_norm)
        moved = self._ranks_that_moved(first_pass, second_pass)
        verdict = "reproducible" if again is not None else "transient"
        anomaly.rerun = {"verdict": verdict, "loss": loss, "grad_norm": grad_norm, "ranks_that_differed": moved,
                         "seconds": seconds, **({"kind": again[0]} if again else {})}
        if self.rank == 0:
            self.events.write("numeric_rerun", step=anomaly.step, anomaly=anomaly.kind, **anomaly.rerun)
            if verdict == "transient":
                self.events.write("sdc_suspected", step=anomaly.step, anomaly=anomaly.kind, ranks=moved,
                                  how="rerun", first_loss=anomaly.loss, first_grad_norm=anomaly.grad_norm,
                                  loss=loss, grad_norm=grad_norm)
        if verdict == "transient":
            log.error("suspected silent data corruption at step %d: %s the first time, clean on the same batch "
                      "again%s; training goes on with the clean result", anomaly.step, anomaly.kind,
                      f" (rank(s) {moved} computed something else the first time)" if moved else "")
        else:
            log.error("numeric anomaly at step %d again on the same batch (%s): the data or divergence, not the "
                      "hardware", anomaly.step, again[0])
        return verdict

    def _ranks_that_moved(self, first_pass: torch.Tensor, second_pass: torch.Tensor) -> list[int]:
        """The ranks whose own loss or gradient shard norm differed between the passes (an all-gather, on this
        rare path only)."""
        mine = torch.stack([first_pass, second_pass]).to(self.device, torch.float64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        moved = []
        for rank, figures in enumerate(gathered):
            if any(_differ(a, b) for a, b in zip(figures[0].tolist(), figures[1].tolist())):
                moved.append(rank)
        return moved

    def accept(self, loss: float, grad_norm: float) -> None:
        """A step whose result was applied: part of the window the next ones are measured against."""
        self.window.accept(loss, grad_norm)

    def resumed(self, metrics_path: Path, step: int) -> None:
        if self.enabled:
            self.window.restore(metrics_path, step)


def _local_view(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's local shard (FSDP2: a DTensor), flat, sharing its storage."""
    return local_shard(grad).view(-1)


def _differ(first: float, second: float) -> bool:
    if math.isfinite(first) and math.isfinite(second):
        return abs(first - second) > RERUN_TOLERANCE * max(abs(second), 1e-12)
    return not (first == second or (math.isnan(first) and math.isnan(second)))


def local_figures(loss: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """This rank's own loss and the norm of its own gradient shard, before the clipping (what the all-reduces
    combined): read only when a step is anomalous."""
    shards = [_local_view(p.grad) for p in model.parameters() if p.grad is not None]
    own_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(shards))) if shards else loss.new_zeros(())
    return torch.stack([loss.detach().double().reshape(()), own_norm.detach().double().reshape(())])
