"""Layer 1 of recovery: NVRx in-process restart around the training function.

No ``from __future__ import annotations`` here: NVRx finds the ``CallWrapper`` parameter by its annotation.
Each restart iteration builds a fresh process group (gloo or NCCL) on the application's TCPStore at
MASTER_PORT+1 under a per-iteration prefix (the Wrapper's own store is on MASTER_PORT+2), creates a new
Trainer that reloads the newest state — the in-memory copy kept across iterations (``MemorySnapshot``) when
it is at least as new as the newest valid checkpoint and the same step on every rank — and continues. Process deaths end the wrapped call's
processes and are ft_launcher's business (layer 2); so is a fault that outlasts
``resilience.in_process_max_restarts``.
"""

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from trainer.config import Config
from trainer.memory_snapshot import MemorySnapshot

log = logging.getLogger(__name__)


@dataclass
class InProcessAttempt:
    """What one restart iteration hands the Trainer."""

    iteration: int
    started_at: float
    ping: Callable[[], None]
    store_port: int
    snapshot: MemorySnapshot


def run_with_in_process_restart(cfg: Config, data_dir: Path) -> None:
    import torch
    from nvidia_resiliency_ext import inprocess

    from trainer import nvrx_compat
    from trainer.train import Trainer

    master_port = int(os.environ["MASTER_PORT"])
    snapshot = MemorySnapshot(cfg.resilience.memory_snapshot_interval_steps)  # outlives the iterations
    wrapper = nvrx_compat.in_process_wrapper(
        store_port=master_port + 2, soft_timeout=cfg.resilience.soft_timeout,
        max_restarts=cfg.resilience.in_process_max_restarts, on_cuda=torch.cuda.is_available()
        and cfg.training.backend != "gloo")

    @wrapper
    def attempt(call_wrapper: Optional[inprocess.CallWrapper] = None) -> None:
        started = time.time()
        trainer = Trainer(cfg, data_dir, in_process=InProcessAttempt(
            iteration=call_wrapper.iteration, started_at=started, ping=call_wrapper.ping,
            store_port=master_port + 1, snapshot=snapshot))
        clean = False
        try:
            trainer.train()
            clean = True
        finally:
            trainer.close(wait_for_checkpoint=clean)

    attempt()

