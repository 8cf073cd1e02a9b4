"""Restore overlapping start-up: a start that will resume from FSx reads (and verifies) its share of the newest
checkpoint on a thread while the process group and the model are being built.

A process starts this before anything collective, from what it can see alone: the newest committed folder
on FSx (a directory listing) and its manifest, its rank and world size from the launcher's environment. It
hashes the files it would verify in the load (``fast_reader.verifier_of``: its own shard at the same world
size), which also brings them into the page cache. The load that follows (``load.load_checkpoint``) then
skips hashing those files and copies from memory. When the load takes another folder (memory was newer,
the prefetched one failed, S3 held a newer copy) the prefetch only cost a read on a thread.

Not started when this node holds a node-memory copy (the start will most likely restore from it) or when
nothing is committed on FSx.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from trainer.checkpoint.fast_reader import verifier_of
from trainer.checkpoint.format import MANIFEST, committed_checkpoints, hasher
from trainer.checkpoint.node_folders import holds_a_copy
from trainer.env import NODE_STORE_ENV

log = logging.getLogger(__name__)

_CHUNK_BYTES = 16 << 20


class RestorePrefetch:
    """Public: start (classmethod; None when there is nothing to prefetch), verified_files, figures."""

    def __init__(self, folder: Path, files: list[str], algorithm: str, expected: dict[str, str]):
        self.folder = folder
        self._files, self._algorithm, self._expected = files, algorithm, expected
        self._verified: set[str] = set()
        self.bytes_read = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="ckpt-prefetch", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, checkpoint_dir: Path, rank: int, world_size: int, node_memory_holds_a_copy: bool
              ) -> RestorePrefetch | None:
        if node_memory_holds_a_copy:
            return None
        committed = committed_checkpoints(checkpoint_dir)
        if not committed:
            return None
        folder = committed[-1][1]
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            listed = manifest["files"]
            algorithm = manifest["hash_algorithm"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError):
            return None  # the load's own checks will say what is wrong with it
        data_files = [name for name in listed if name not in (".metadata", MANIFEST)]
        mine = [name for index, name in enumerate(data_files) if verifier_of(name, index, world_size) == rank]
        if not mine:
            return None
        return cls(folder, mine, algorithm, {name: listed[name]["hash"] for name in mine})

    def _run(self) -> None:
        started = time.perf_counter()
        buffer = bytearray(_CHUNK_BYTES)
        view = memoryview(buffer)
        for name in self._files:
            digest = hasher(self._algorithm)
            try:
                with (self.folder / name).open("rb", buffering=0) as handle:
                    while got := handle.readinto(view):
                        digest.update(view[:got])
                        self.bytes_read += got  # not in reads.count: it started before anyone took a reading
            except OSError as err:  # deleted by retention meanwhile, unreadable: the load decides
                log.info("restore prefetch: %s: %s", self.folder / name, err)
                continue
            if digest.hexdigest() == self._expected[name]:
                self._verified.add(name)
        self.seconds = time.perf_counter() - started

    def verified_files(self, folder: Path) -> set[str]:
        """The files of `folder` this prefetch read and found matching the manifest (waits for it to end):
        what the load need not hash again. Empty for any other folder."""
        self._thread.join()
        return set(self._verified) if Path(folder) == self.folder else set()

    def figures(self) -> dict[str, float]:
        self._thread.join()
        return {"prefetch_bytes": self.bytes_read, "prefetch_seconds": self.seconds}


def started_from_environment(checkpoint_dir: Path, ckpt) -> RestorePrefetch | None:
    """RestorePrefetch.start for this process (`ckpt`: its CheckpointConfig), from the rank and world size the
    launcher exported, before any process group. None where node memory or a peer's replica will most likely
    serve the start: this node holds a copy, or peers replicate (a replaced node gets its state from one)."""
    if not (ckpt.enabled and ckpt.resume) or "RANK" not in os.environ:
        return None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    several_nodes = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world or (ckpt.memory_node_per_rank and world > 1)
    if ckpt.memory_tier and (holds_a_copy(os.environ.get(NODE_STORE_ENV)) or
                                       (ckpt.peer_replica and several_nodes)):
        return None
    return RestorePrefetch.start(checkpoint_dir, int(os.environ["RANK"]), world, node_memory_holds_a_copy=False)
