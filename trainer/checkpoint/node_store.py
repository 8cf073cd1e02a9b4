"""The node-memory tier: each rank's training state in node-local shared memory that outlives the worker.

Layout, under the launch's store folder (``/dev/shm/...`` here; a ``medium: Memory`` emptyDir on EKS; see
``node_store_folder``)::

    node-<n>/rank-<r>/slot-0/ slot-1/           this rank's state, double buffered
    node-<n>/replica-of-rank-<p>/slot-0/ slot-1/ the state of rank p on another node (trainer.checkpoint.peer)

A slot is ``state.bin`` (every tensor's local shard, back to back) and ``meta.json`` (step, where each
tensor lies, the non-tensor values, an xxh3-128 checksum of ``state.bin``). A save goes to the slot that
does not hold the newest step, removes its ``meta.json`` first and writes it last, so a copy interrupted
half-way (the process killed mid-copy) leaves a slot nobody reads, and the other slot still holds the step
before. A slot whose data does not match its checksum is skipped with a log line.

Only local shards are kept (``DTensor.to_local()``): a restarted rank shards the model the same way (same
world size and rank), so restoring is a copy into the fresh state dict's tensors, no collective, no disk
(trainer.checkpoint.state_bytes: the bytes of a state dict and back).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

# The folders' names and lifetimes, light enough for the node's launcher (no torch).
from trainer.checkpoint.node_folders import META, owner_name, remove_dead_owners
from trainer.checkpoint.state_bytes import checksum, copy_and_checksum, flatten, layout_of
from trainer.env import NODE_STORE_ENV

log = logging.getLogger(__name__)

DATA = "state.bin"
SLOTS = ("slot-0", "slot-1")
_FORMAT_VERSION = 1


def node_store_folder(memory_dir: str, run_id: str) -> Path:
    """Where this process keeps its node-memory tier.

    Under trainer.launcher the launch's folder (``NODE_STORE_ENV``): it lives as long as the launcher, so
    restarted workers find it, and a later launch never reads an earlier one's. Without the launcher
    (``python -m trainer`` by hand) a folder of this process's own, removed when the process exits (an
    in-process restart keeps using it).
    """
    if not os.environ.get(NODE_STORE_ENV):
        root = Path(memory_dir) / run_id
        remove_dead_owners(root)  # a process killed (SIGKILL, OOM) never ran its atexit: its copies are RAM
        folder = root / owner_name("process", psutil.Process())
        os.environ[NODE_STORE_ENV] = str(folder)
        atexit.register(shutil.rmtree, folder, True)
    return Path(os.environ[NODE_STORE_ENV])


# -- slots ---------------------------------------------------------------------------------------------


@dataclass
class StoredCopy:
    """A verified copy: its step, metadata and data (a view of the slot's shared memory)."""

    step: int
    meta: dict[str, Any]
    data: torch.Tensor


class Slot:
    def __init__(self, folder: Path):
        self.folder = folder
        self._mapped: torch.Tensor | None = None
        self._verified: tuple | None = None

    @property
    def meta_path(self) -> Path:
        return self.folder / META

    @property
    def data_path(self) -> Path:
        return self.folder / DATA

    def read_meta(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.meta_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def buffer(self, nbytes: int) -> torch.Tensor:
        """The slot's data as a uint8 tensor over shared memory (MAP_SHARED), sized nbytes; mapped once."""
        if self._mapped is None or self._mapped.numel() != nbytes:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self.data_path.open("ab") as handle:
                handle.truncate(nbytes)
            self._mapped = torch.from_file(str(self.data_path), shared=True, size=nbytes, dtype=torch.uint8) \
                if nbytes else torch.empty(0, dtype=torch.uint8)
        return self._mapped

    def begin_write(self) -> None:
        self.meta_path.unlink(missing_ok=True)  # from here until commit, nobody takes this slot for a copy

    def commit(self, meta: dict[str, Any]) -> None:
        tmp = self.meta_path.with_name(META + ".tmp")
        tmp.write_text(json.dumps(meta))
        tmp.replace(self.meta_path)

    def load(self) -> StoredCopy | None:
        """The slot's copy when its data is whole and matches the checksum; None (with a log line) otherwise.
        Verified once per meta.json (a write removes it first, so new data always comes with a new one)."""
        try:
            stamp = self.meta_path.stat()
        except FileNotFoundError:
            return None
        key = (stamp.st_ino, stamp.st_mtime_ns)
        if self._verified is not None and self._verified[0] == key:
            return self._verified[1]
        copy = self._verify()
        self._verified = (key, copy)
        return copy

    def _verify(self) -> StoredCopy | None:
        meta = self.read_meta()
        if meta is None:
            return None
        size = self.data_path.stat().st_size if self.data_path.is_file() else -1
        if size != meta["nbytes"]:
            log.warning("node store: %s holds %d bytes, its meta.json says %d: skipped", self.folder, size,
                        meta["nbytes"])
            return None
        data = self.buffer(meta["nbytes"])
        if checksum(data) != meta["checksum"]:
            log.warning("node store: %s (step %d) does not match its checksum: skipped", self.folder, meta["step"])
            return None
        return StoredCopy(int(meta["step"]), meta, data)


class SlotPair:
    """Two slots holding the two newest steps of one rank's state (its own, or a replica of a peer's)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.slots = [Slot(folder / name) for name in SLOTS]

    def next_slot(self) -> Slot:
        """The slot not holding the newest committed step (the older one, or an empty one)."""
        steps = [(slot.read_meta() or {}).get("step", -1) for slot in self.slots]
        return self.slots[0] if steps[0] <= steps[1] else self.slots[1]

    def steps(self) -> dict[int, dict[str, Any]]:
        """The committed copies' meta.json, by step: cheap (nothing is read or verified)."""
        metas = [slot.read_meta() for slot in self.slots]
        return {int(meta["step"]): meta for meta in metas if meta is not None}

    def copy_of(self, step: int) -> StoredCopy | None:
        """The verified copy of `step`; None when no slot holds it or its data does not verify."""
        for slot in self.slots:
            if (slot.read_meta() or {}).get("step") == step:
                return slot.load()
        return None

    def copies(self) -> dict[int, StoredCopy]:
        """The verified copies, by step."""
        found = {}
        for slot in self.slots:
            copy = slot.load()
            if copy is not None:
                found[copy.step] = copy
        return found

    def write(self, meta: dict[str, Any], fill) -> StoredCopy:
        """Write one copy into the next slot: fill(buffer) copies the bytes and returns their checksum, then
        meta.json (with it) is committed."""
        slot = self.next_slot()
        slot.begin_write()
        buffer = slot.buffer(meta["nbytes"])
        meta = {**meta, "checksum": fill(buffer)}
        slot.commit(meta)
        return StoredCopy(int(meta["step"]), meta, buffer)

    def drop_after(self, step: int) -> None:
        """Empty the slots holding a step after `step` (an abandoned branch: trainer.job.numeric_recovery)."""
        for slot in self.slots:
            if (slot.read_meta() or {}).get("step", -1) > step:
                slot.begin_write()

    def corrupt_newest(self) -> None:
        """Flip a byte of the newest copy's data (the corrupt_memory drill): its checksum no longer matches."""
        newest = max(self.slots, key=lambda slot: (slot.read_meta() or {}).get("step", -1))
        with newest.data_path.open("r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 0xFF]) if first else b"\0")


class RankStore:
    """One rank's node-memory tier: its own slot pair, and the slot pair of the peer it keeps a replica for."""

    def __init__(self, folder: Path, node: int, rank: int, world_size: int, replica_of: int | None):
        self.node_folder = Path(folder) / f"node-{node}"
        self.rank, self.world_size, self.replica_of = rank, world_size, replica_of
        self.own = SlotPair(self.node_folder / f"rank-{rank}")
        self.replica = SlotPair(self.node_folder / f"replica-of-rank-{replica_of}") if replica_of is not None else None
        self._layout_key: tuple | None = None
        self._layout: tuple[list[dict[str, Any]], int] | None = None

    def save(self, step: int, state: dict[str, Any]) -> StoredCopy:
        """Copy the state's local shards into the next slot (committed when this returns)."""
        meta, layout, values = self.describe(step, state)
        return self.write(meta, layout, values)

    def write(self, meta: dict[str, Any], layout: list[dict[str, Any]], values: list[Any]) -> StoredCopy:
        """Copy `values` (host tensors, or device tensors copied as they are read) into the next slot and commit."""
        return self.own.write(meta, lambda buffer: copy_and_checksum(layout, values, buffer))

    def describe(self, step: int, state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], list[Any]]:
        """(meta.json less its checksum, the layout of this copy, the leaves to copy) of the state's local shards."""
        entries = list(flatten(state))
        key = tuple((path, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (path,)
                    for path, v in entries)
        if key != self._layout_key:
            self._layout_key, self._layout = key, layout_of(entries)
        cached, nbytes = self._layout
        values = [v for _, v in entries]
        # This step's non-tensor values, in a layout of this copy's own (a replica round may still read the last).
        layout = [{**entry, "value": value} if "value" in entry else entry for entry, value in zip(cached, values)]

        meta = {"format_version": _FORMAT_VERSION, "step": step, "rank": self.rank, "world_size": self.world_size,
                "nbytes": nbytes, "layout": layout}
        return meta, layout, values

    def _usable(self, meta: dict[str, Any], rank: int) -> bool:
        """Written by `rank` in a job of this world size (a store is never shared across layouts)."""
        return (meta.get("rank") == rank and meta.get("world_size") == self.world_size
                and meta.get("format_version") == _FORMAT_VERSION)

    def own_steps(self) -> list[int]:
        """The steps this rank's own slots claim to hold (unverified: see own_copy)."""
        return sorted(step for step, meta in self.own.steps().items() if self._usable(meta, self.rank))

    def replica_steps(self) -> list[int]:
        if self.replica is None:
            return []
        return sorted(step for step, meta in self.replica.steps().items() if self._usable(meta, self.replica_of))

    def own_copy(self, step: int) -> StoredCopy | None:
        """This rank's copy of `step`, verified against its checksum; None when it is absent or corrupt."""
        copy = self.own.copy_of(step)
        return copy if copy is not None and self._usable(copy.meta, self.rank) else None

    def replica_copy(self, step: int) -> StoredCopy | None:
        copy = self.replica.copy_of(step) if self.replica is not None else None
        return copy if copy is not None and self._usable(copy.meta, self.replica_of) else None

    def own_copies(self) -> dict[int, StoredCopy]:
        """Every verified copy of this rank's own (both slots hashed)."""
        return {step: copy for step in self.own_steps() if (copy := self.own_copy(step)) is not None}

    def drop_after(self, step: int) -> None:
        self.own.drop_after(step)
        if self.replica is not None:
            self.replica.drop_after(step)

    def wipe(self) -> None:
        """Everything this node holds (a node loss: drills and tests)."""
        shutil.rmtree(self.node_folder, ignore_errors=True)
