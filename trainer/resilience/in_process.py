"""Layer 1 of recovery: NVRx in-process restart around the training function.

No ``from __future__ import annotations`` here: NVRx finds the ``CallWrapper`` parameter by its annotation.
Each restart iteration builds a fresh process group (gloo or NCCL) on the application's TCPStore at
MASTER_PORT+1 under a per-iteration prefix (the Wrapper's own store is on MASTER_PORT+2), runs the training
function with an ``InProcessAttempt`` — iteration, progress ping, store port — and continues; the restarted
Trainer resumes from the node-memory tier, which outlives the iterations (trainer.checkpoint.memory). Process deaths
end the wrapped call's processes and are ft_launcher's business (layer 2); so is a fault that outlasts
``resilience.in_process_max_restarts`` in-process restarts in a row without progress (trainer.resilience.budget
decides, at the start of each iteration's Trainer, and ends the processes).
"""

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from trainer.config import Config
from trainer.resilience import nvrx_compat

log = logging.getLogger(__name__)


@dataclass
class InProcessAttempt:
    """What one restart iteration hands the Trainer."""

    iteration: int
    started_at: float
    ping: Callable[[], None]
    store_port: int


def run_with_in_process_restart(cfg: Config, train: Callable[[InProcessAttempt], None]) -> None:
    """Run train(attempt) under NVRx's in-process restart, a fresh attempt per restart iteration."""
    import torch  # heavy; only to tell CUDA from CPU here
    from nvidia_resiliency_ext import inprocess  # optional: only with resilience.in_process

    master_port = int(os.environ["MASTER_PORT"])
    wrapper = nvrx_compat.in_process_wrapper(
        store_port=master_port + 2, soft_timeout=cfg.resilience.soft_timeout,
        on_cuda=torch.cuda.is_available()
        and cfg.training.backend != "gloo")

    @wrapper
    def attempt(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:
        train(InProcessAttempt(iteration=call_wrapper.iteration, started_at=time.time(), ping=call_wrapper.ping,
                               store_port=master_port + 1))

    attempt()
