"""Staging for ``dcp.async_save`` that keeps the staged state between saves and copies only the tensors' data.

DCP's ``DefaultStager`` caches its CPU buffers, but every save it still deep-copies the whole state dict:
for a DTensor that is a new wrapper built through DTensor's dispatch, its spec and its mesh, about half a
millisecond each on this host (torch 2.13, ``_state_dict_stager.py``'s ``_offload_tensor``). An FSDP2 state
holds a DTensor per parameter and per optimizer moment: 900 of them cost 0.4-0.6 s of the loop's wait per
save, several times the memcpy of the data itself. The state's layout is the same every save, so the
staged tree the first save built is kept: later saves copy each tensor's local data into its staged
buffer and rebuild only the small non-tensor leaves (steps, learning rates). A save whose layout differs
(a tensor's shape, dtype, placement or sharing changed, a key came or went) is staged afresh.

The staged buffers are the ones the previous save's write read from: the caller must not stage again
until that write is finished (the checkpoint pipeline keeps at most one save in flight).

``stage_checked`` also tells which floating-point tensors hold a NaN or an infinity (the save's finite check,
trainer.checkpoint.commit) from the same pass: each CPU tensor is copied in chunks that stay in the CPU's
cache, and each chunk's least and greatest values are read from the copy just made. A separate check reads
the whole state from memory once more, about as long as the copy itself.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

CHECK_CHUNK_ELEMENTS = 1 << 18  # 1 MiB of fp32: copied, then read again while still in the CPU's cache


def nonfinite(tensor: torch.Tensor) -> torch.Tensor:
    """A bool scalar on the tensor's device: it holds a NaN or an infinity. Its least and greatest values are
    both finite exactly when all of them are (NaN propagates through min and max), which reads the tensor
    once and allocates nothing of its size, where isfinite(...).any() allocates two masks as big."""
    low, high = torch.aminmax(tensor.detach())
    return torch.logical_not(torch.isfinite(low) & torch.isfinite(high))


def checked(tensor: Any) -> bool:
    """Whether the finite check covers this leaf: a non-empty floating-point tensor."""
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.numel() > 0


@dataclass
class StagedState:
    """A state staged for the write, and its finite check: the dotted paths of its checked tensors (in the
    state's order) and a bool per path, on the CPU: that tensor holds a NaN or an infinity."""

    tree: dict[str, Any]
    paths: list[str]
    nonfinite: torch.Tensor


class _LayoutChanged(Exception):
    """The state no longer has the layout of the kept staged tree (internal: the save is staged afresh)."""


class ReusingStager(AsyncStager):
    """An ``AsyncStager`` for ``dcp.async_save``: DCP's ``DefaultStager`` for the first save (and any save of
    another layout), a copy of the local tensors into the kept staged tree for the others."""

    _synchronize_after_execute = False  # staging is synchronous: nothing to wait for after the hand-off

    def __init__(self, options: StagingOptions):
        self._full = DefaultStager(options)
        self._staged: Any = None
        self.full_stagings = 0  # how many saves were staged by DCP's deep copy (the first, and layout changes)

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self._stage(state_dict, None)

    def stage_checked(self, state_dict: dict[str, Any]) -> StagedState:
        """The staged state and its finite check, in one pass over the state where the layout is the kept one."""
        flags: list[tuple[str, torch.Tensor]] = []
        tree = self._stage(state_dict, flags)
        paths = [path for path, _ in flags]
        return StagedState(tree, paths, torch.stack([flag.cpu() for _, flag in flags]) if flags
                           else torch.zeros(0, dtype=torch.bool))

    def _stage(self, state_dict: dict[str, Any], flags: list | None) -> dict[str, Any]:
        if self._staged is not None:
            try:
                return _refill(state_dict, self._staged, {}, flags, ())
            except _LayoutChanged as why:
                log.info("the checkpoint state's layout changed (%s): staging it afresh", why)
                if flags is not None:
                    flags.clear()
        self._staged = self._full.stage(state_dict)
        self.full_stagings += 1
        tree = _containers_copied(self._staged)  # what the write is handed never aliases the kept tree
        if flags is not None:  # DCP's deep copy made this one: checked on its own
            flags.extend((path, nonfinite(leaf)) for path, leaf in _checked_leaves(tree, ()))
        return tree

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        self._staged = None
        self._full.close()


@torch.no_grad()
def _refill(source: Any, staged: Any, filled_from: dict[int, int], flags: list | None, path: tuple) -> Any:
    """`source`'s values in `staged`'s buffers: the staged tensors themselves (their data overwritten), new
    containers, and copies of the other leaves. `filled_from` maps each staged tensor filled so far to the
    source tensor it came from: a buffer two source tensors would share is a changed layout. With `flags`, each
    checked tensor's (dotted path, non-finite flag) is appended, from the copy."""
    if isinstance(source, torch.Tensor):
        if type(source) is not type(staged):
            raise _LayoutChanged(f"a {type(source).__name__} where a {type(staged).__name__} was staged")
        if filled_from.setdefault(id(staged), id(source)) != id(source):
            raise _LayoutChanged("two tensors now staged into one buffer")
        if isinstance(source, DTensor):
            if source.placements != staged.placements or source.shape != staged.shape:
                raise _LayoutChanged(f"a DTensor's placement or global shape: {source.placements} {source.shape}")
            source_local, buffer = source._local_tensor, staged._local_tensor
        else:
            source_local, buffer = source, staged
        if source_local.shape != buffer.shape or source_local.dtype != buffer.dtype:
            raise _LayoutChanged(f"a tensor's shape or dtype: {tuple(source_local.shape)} {source_local.dtype}")
        if flags is not None and checked(source_local):
            flags.append((".".join(map(str, path)), _copy_checked(source_local, buffer)))
        else:
            buffer.copy_(source_local)
        return staged
    if isinstance(source, dict):
        if not isinstance(staged, dict) or source.keys() != staged.keys():
            raise _LayoutChanged("a key came or went")
        return {key: _refill(value, staged[key], filled_from, flags, (*path, key)) for key, value in source.items()}
    if isinstance(source, (list, tuple)):
        if type(source) is not type(staged) or len(source) != len(staged):
            raise _LayoutChanged("a sequence's length")
        return _same_sequence(source, [_refill(value, old, filled_from, flags, (*path, index))
                                       for index, (value, old) in enumerate(zip(source, staged))])
    return copy.deepcopy(source)


def _copy_checked(source: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """Copy `source` into `buffer`; whether it holds a NaN or an infinity. On an accelerator the source is
    checked where it lives (its memory is fast; the host's is what the copy costs)."""
    if source.device.type != "cpu":
        flag = nonfinite(source)
        buffer.copy_(source)
        return flag
    if not (source.is_contiguous() and buffer.is_contiguous()) or source.numel() <= CHECK_CHUNK_ELEMENTS:
        buffer.copy_(source)
        return nonfinite(buffer)
    flat_source, flat_buffer = source.view(-1), buffer.view(-1)
    flags = []
    for start in range(0, flat_source.numel(), CHECK_CHUNK_ELEMENTS):
        chunk = flat_buffer[start:start + CHECK_CHUNK_ELEMENTS]
        chunk.copy_(flat_source[start:start + CHECK_CHUNK_ELEMENTS])
        flags.append(nonfinite(chunk))
    return torch.stack(flags).any()


def _checked_leaves(tree: Any, path: tuple):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _checked_leaves(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _checked_leaves(value, (*path, index))
    elif isinstance(tree, torch.Tensor):
        local = tree._local_tensor if isinstance(tree, DTensor) else tree
        if checked(local):
            yield ".".join(map(str, path)), local


def _containers_copied(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _containers_copied(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return _same_sequence(tree, [_containers_copied(value) for value in tree])
    return tree


def _same_sequence(like: list | tuple, items: list) -> list | tuple:
    if isinstance(like, list):
        return items
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)  # a namedtuple takes fields
