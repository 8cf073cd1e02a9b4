"""An in-memory copy of one rank's training state, kept across in-process restarts.

An in-process restart keeps the OS process, so the copy survives the rebuilt process group and Trainer and
is reloaded instead of the checkpoint when it is newer and every rank holds the same step. Only local
shards are kept (``DTensor.to_local()``): the restarted Trainer shards the model the same way (same world
size, same mesh), so restoring is a plain copy into the fresh state dict's tensors — no collective, no disk.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


class MemorySnapshot:
    def __init__(self, interval_steps: int):
        self.interval_steps = interval_steps
        self.step: int | None = None
        self._state: dict[str, Any] | None = None

    def due(self, step: int) -> bool:
        return self.interval_steps > 0 and step % self.interval_steps == 0

    def capture(self, step: int, state: dict[str, Any]) -> None:
        """Copy the state's tensors (local shards) to host memory, reusing the buffers of the last copy."""
        previous = self._state
        self.step = None  # a copy interrupted half-way must never be reloaded
        self._state = _copy_tree(state, previous)
        self.step = step

    def agreed_step(self) -> int | None:
        """Collective: the snapshot's step when all ranks hold one of the same step, else None."""
        steps: list[int | None] = [None] * dist.get_world_size()
        dist.all_gather_object(steps, self.step)
        if self.step is None or any(s != self.step for s in steps):
            if any(s is not None for s in steps):
                log.warning("in-memory copies differ across ranks (steps %s): reloading from disk", steps)
            return None
        return self.step

    def restore_into(self, state: dict[str, Any]) -> None:
        """Copy the snapshot into a freshly built state dict of the same structure, in place."""
        assert self._state is not None, "restore_into without a snapshot"
        _restore_tree(self._state, state, path="")


def _copy_tree(value: Any, previous: Any) -> Any:
    if isinstance(value, torch.Tensor):
        local = _local(value)
        if isinstance(previous, torch.Tensor) and previous.shape == local.shape and previous.dtype == local.dtype:
            return previous.copy_(local)
        return local.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        previous = previous if isinstance(previous, dict) else {}
        return {key: _copy_tree(item, previous.get(key)) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        previous = previous if isinstance(previous, (list, tuple)) and len(previous) == len(value) else [None] * len(value)
        return type(value)(_copy_tree(item, old) for item, old in zip(value, previous))
    return copy.deepcopy(value)


def _restore_tree(saved: Any, target: Any, path: str) -> Any:
    """Returns the value to store at this position (tensors are filled in place)."""
    if isinstance(target, torch.Tensor):
        local = _local(target)
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            raise RuntimeError(f"in-memory copy does not match the rebuilt state at {path or '<root>'}")
        local.copy_(saved)
        return target
    if isinstance(target, dict):
        if not isinstance(saved, dict) or saved.keys() != target.keys():
            raise RuntimeError(f"in-memory copy does not match the rebuilt state at {path or '<root>'}")
        for key in target:
            target[key] = _restore_tree(saved[key], target[key], f"{path}.{key}" if path else str(key))
        return target
    if isinstance(target, list) and isinstance(saved, list) and len(saved) == len(target):
        for index in range(len(target)):
            target[index] = _restore_tree(saved[index], target[index], f"{path}[{index}]")
        return target
    return copy.deepcopy(saved)
