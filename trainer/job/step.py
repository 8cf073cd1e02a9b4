"""The compute of one step (its learning rate, forward, backward, the gradient's clipping, the progress line's
figures) and the metrics file the loop appends to.

Apart from the Trainer because a step is computed twice when its figures are anomalous
(trainer.job.numeric_recovery executes it again on the same batch).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from trainer.model.loss import IGNORE
from trainer.resilience.numerics import NumericDrills
from trainer.run.lease import Fence


def forward_backward(model: torch.nn.Module, micro_batches: list[tuple[np.ndarray, np.ndarray]], *, device,
                     training_cfg, drills: NumericDrills, step: int, first_sample: int, global_batch: int,
                     job_targets: Callable[[int], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss summed over its micro-batches, the gradient's total norm over every rank, as
    torch.nn.utils.get_total_norm gives it: a DTensor under FSDP2): the gradients are left in the parameters,
    not clipped yet — the step's figures are checked first (trainer.resilience.numerics), and a rank's own
    gradient is what tells it when they are anomalous.

    The step's loss is the mean over every target of the global batch that counts. Where every target counts (a
    pre-training window), each micro-batch's mean over its own targets is that, as the gradients are averaged over
    the micro-batches and ranks. Where some are IGNORE (masked), `job_targets(counted here)` (a collective: mean_
    targets) gives the mean count per micro-batch and rank of the job, and each micro-batch's loss is its sum over
    that: averaged over micro-batches and ranks alike, the job's sum over the job's count."""
    t = training_cfg
    loss_sum = torch.zeros((), device=device)
    per_micro = None if job_targets is None else job_targets(sum(int((batch[1] != IGNORE).sum())
                                                                for batch in micro_batches))
    # per_step: the micro-batches before the last accumulate unsharded gradients, and the last one's backward
    # reduce-scatters their sum once (training.reduce_gradients).
    once = t.reduce_gradients == "per_step" and len(micro_batches) > 1 and hasattr(model, "set_requires_gradient_sync")
    for index, (inputs, labels, *positions) in enumerate(micro_batches):
        if once:
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        inputs = torch.from_numpy(inputs).to(device)
        labels = torch.from_numpy(labels).to(device)
        # documents packed in a row: positions restart at each, and transformers masks attention to runs of
        # consecutive positions (its packed-sequence mask; flash attention's varlen path)
        extra = {"position_ids": torch.from_numpy(positions[0]).to(device)} if positions else {}
        loss = (model(input_ids=inputs, targets=labels, loss_chunk=t.loss_chunk, **extra) if per_micro is None else
                model(input_ids=inputs, targets=labels, loss_reduction="sum", loss_chunk=t.loss_chunk, **extra)
                / per_micro)
        loss = drills.poison(loss, first_sample, global_batch)
        (loss / t.grad_accum_steps).backward()
        loss_sum += loss.detach()
    drills.flip(model, step)
    return loss_sum, torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


def mean_targets(counted: int, *, device, ranks: int, micro_batches: int, across_groups=None) -> torch.Tensor:
    """Collective: the job's counted targets (over the group's ranks, then the replica groups taking part:
    `across_groups` averages a value over them) per micro-batch and rank; at least one's worth (an all-masked step
    trains nothing instead of dividing by 0)."""
    count = torch.tensor(float(counted), dtype=torch.float64, device=device)
    if ranks > 1:
        dist.all_reduce(count)
    if across_groups is not None:
        count = across_groups(count)
    return (count / (ranks * micro_batches)).clamp(min=1.0 / (ranks * micro_batches)).float()


def step_extras(metrics: dict[str, float]) -> str:
    """The progress line's MFU and CUDA memory, where the step measured them."""
    extras = f" mfu {metrics['mfu']:.1%}" if "mfu" in metrics else ""
    if "cuda_max_allocated_gib" in metrics:
        extras += (f" mem {metrics['cuda_max_allocated_gib']:.1f}/{metrics['cuda_max_reserved_gib']:.1f} GiB"
                   f" retries {metrics['cuda_alloc_retries']}")
    return extras


def total(norm: torch.Tensor) -> torch.Tensor:
    """The total norm on every rank (a DTensor's reduction: a collective)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip(model: torch.nn.Module, norm: torch.Tensor, grad_clip: float) -> None:
    """clip_grad_norm_'s second half, with the norm its first half gave (forward_backward)."""
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"), norm)


class MetricsWriter:
    """Appends one JSON line per step (rank 0 only); the file survives restarts and is appended to."""

    def __init__(self, path: Path | None, fence: Fence):
        self.path = path
        self.fence = fence
        self.handle = None

    def __enter__(self) -> "MetricsWriter":
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
