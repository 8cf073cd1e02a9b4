"""The compute of one step (its learning rate, forward, backward, the gradient's clipping, the progress line's
figures) and the metrics file the loop appends to.

Apart from the Trainer because a step is computed twice when its figures are anomalous
(trainer.job.numeric_recovery executes it again on the same batch).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import Config
from trainer.resilience.numerics import NumericDrills
from trainer.run.lease import Fence


def forward_backward(model: torch.nn.Module, micro_batches: list[tuple[np.ndarray, np.ndarray]], *, device,
                     training_cfg, drills: NumericDrills, step: int, first_sample: int,
                     global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's loss summed over its micro-batches, the gradient's total norm over every rank, as
    torch.nn.utils.get_total_norm gives it: a DTensor under FSDP2): the gradients are left in the parameters,
    not clipped yet — the step's figures are checked first (trainer.resilience.numerics), and a rank's own
    gradient is what tells it when they are anomalous."""
    t = training_cfg
    loss_sum = torch.zeros((), device=device)
    # per_step: the micro-batches before the last accumulate unsharded gradients, and the last one's backward
    # reduce-scatters their sum once (training.reduce_gradients).
    once = t.reduce_gradients == "per_step" and len(micro_batches) > 1 and hasattr(model, "set_requires_gradient_sync")
    for index, (inputs, labels) in enumerate(micro_batches):
        if once:
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        inputs = torch.from_numpy(inputs).to(device)
        labels = torch.from_numpy(labels).to(device)
        loss = drills.poison(model(input_ids=inputs, targets=labels, loss_chunk=t.loss_chunk), first_sample,
                             global_batch)
        (loss / t.grad_accum_steps).backward()
        loss_sum += loss.detach()
    drills.flip(model, step)
    return loss_sum, torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])


def lr_at(step: int, cfg: Config) -> float:
    """Linear warm-up to lr, then cosine decay to lr * min_lr_ratio at num_steps (step is 0-based)."""
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.num_steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


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


def local(value: Any) -> Any:
    """A DTensor's local shard (FSDP2's parameters and their optimizer state); anything else as it is."""
    return value.to_local() if hasattr(value, "to_local") else value


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
