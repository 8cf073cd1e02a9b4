"""The checkpoint format: sharded DCP folders committed through a manifest, and loading one into a model.

Layout of one checkpoint directory::

    <dir>/step-000100.tmp/   while being written (never read)
    <dir>/step-000100/       committed: DCP shards + .metadata + manifest.json

Commit: every rank writes its shards into ``step-N.tmp``, hashing them as it writes; after a barrier rank 0
writes ``manifest.json`` (every file with size and content hash, from the writers' digests: nothing is read
again; the step, world size, model config, config hash, library versions) and renames the folder to
``step-N``. A checkpoint counts only when its manifest verifies, so a crash at any point leaves either the
previous checkpoints or a complete new one — never a half-written "latest".
DCP itself has no checksums and reads non-tensor items with pickle, which is why nothing is loaded from a
folder whose manifest did not verify.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from trainer.checkpoint import reads
from trainer.run import digest
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the folder and file."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


HASH_ALGORITHM = "xxh3_128"
# What the ranks' writers hashed as they wrote (trainer.checkpoint.hashing_writer), until the manifest takes it in.
WRITTEN_DIGESTS = "written-digests.json"


def hasher(algorithm: str):
    """A fresh hash object of a manifest's hash_algorithm."""
    if algorithm not in digest.ALGORITHMS:
        raise CheckpointError(f"unknown manifest hash algorithm {algorithm!r}")
    return digest.hasher(algorithm)


def hash_file(path: Path, algorithm: str = HASH_ALGORITHM) -> str:
    """A checkpoint file's content hash (trainer.run.digest), its bytes counted as checkpoint reads."""
    hasher(algorithm)  # an unknown algorithm is the manifest's fault: CheckpointError
    return digest.hash_file(path, algorithm, on_chunk=reads.count)


def library_versions() -> dict[str, str]:
    versions = {}
    for package in ("torch", "transformers", "nvidia-resiliency-ext", "resilient-train"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "absent"
    return versions


def read_written_digests(folder: Path) -> dict[str, dict[str, Any]]:
    """What the writers hashed as they wrote, by file name ({} when the folder's writer did not hash: plain DCP's)."""
    path = Path(folder) / WRITTEN_DIGESTS
    if not path.is_file():
        return {}
    recorded = json.loads(path.read_text())
    return recorded["files"] if recorded.get("hash_algorithm") == HASH_ALGORITHM else {}


def write_manifest(folder: Path, step: int, metadata: dict[str, Any]) -> dict[str, Any]:
    """Every file of the folder with its size and content hash. The hash is the one its writer computed while
    writing it (trainer.checkpoint.hashing_writer), so committing costs a stat per file; only a file no writer
    hashed (plain DCP's writer, a folder written by hand; NVRx's .metadata) is read to hash it, counted in reads."""
    written = read_written_digests(folder)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, WRITTEN_DIGESTS)):
        name, size = path.relative_to(folder).as_posix(), path.stat().st_size
        recorded = written.get(name)
        if recorded is not None and recorded["bytes"] != size:
            raise CheckpointError(f"{path}: {size} bytes on disk, its writer wrote {recorded['bytes']} "
                                  "(changed after it was written): not committed")
        files[name] = {"bytes": size, "hash": recorded["hash"] if recorded is not None else hash_file(path)}
    manifest = {"manifest_version": MANIFEST_VERSION, "step": step, "created_at": time.time(),
                "hash_algorithm": HASH_ALGORITHM,
                "libraries": library_versions(), **metadata, "files": files}
    write_json(folder / MANIFEST, manifest, fsync=True)
    (folder / WRITTEN_DIGESTS).unlink(missing_ok=True)  # in the manifest now
    # The folder's entries (shards, .metadata, the manifest's rename) reach the disk before the folder itself
    # is renamed into place: after a power loss a committed name never points at missing entries.
    fsync_dir(folder)
    return manifest


@dataclass
class Verification:
    """Outcome of checking one checkpoint folder against its manifest."""

    path: Path
    problems: list[str]
    manifest: dict[str, Any] | None
    hashed: bool = True  # the files' content hashes were checked (not only their sizes)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(folder: Path, hash_files: bool = True) -> Verification:
    """Check that every file the manifest lists exists with its size and (with `hash_files`) content hash.
    Without hashing it is a directory listing: for a caller whose load verifies as it reads (FastReader)."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        return Verification(folder, [f"{folder}: checkpoint folder does not exist"], None)
    if not manifest_path.is_file():
        return Verification(folder, [f"{manifest_path}: manifest missing (checkpoint never committed)"], None)
    try:
        manifest = json.loads(manifest_path.read_text())
        listed = manifest["files"]
        algorithm = manifest["hash_algorithm"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        return Verification(folder, [f"{manifest_path}: unreadable manifest ({err})"], None)
    problems = []
    if ".metadata" not in listed:
        problems.append(f"{manifest_path}: lists no DCP .metadata file")
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: listed in the manifest but missing")
            continue
        size = path.stat().st_size
        if size != expected["bytes"]:
            problems.append(f"{path}: {size} bytes, manifest says {expected['bytes']} (truncated or overwritten)")
        elif hash_files and hash_file(path, algorithm) != expected["hash"]:
            problems.append(f"{path}: content hash ({algorithm}) differs from the manifest (corrupted)")
    return Verification(folder, problems, manifest, hashed=hash_files)


STALE_SUFFIXES = (".tmp", ".deleting")  # a save that never committed; a deletion that never finished
_REPLACED = re.compile(r"^step-\d+\.replaced-\d+$")


def stale_folders(directory: Path) -> list[Path]:
    """Folders a crash left behind: never committed, or half deleted. None of them is ever read."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(child for child in directory.iterdir() if child.is_dir() and child.name.startswith("step-")
                  and (child.name.endswith(STALE_SUFFIXES) or _REPLACED.match(child.name)))


def committed_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed-looking folder, oldest first; not yet verified."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_valid_checkpoint(directory: Path, hash_files: bool = True, exclude=()) -> Verification | None:
    """The newest checkpoint (not in `exclude`) whose manifest verifies; broken newer ones are logged and
    skipped. Without `hash_files` only the sizes are checked (for a load that hashes as it reads)."""
    for step, folder in reversed(committed_checkpoints(directory)):
        if folder in exclude:
            continue
        result = verify_checkpoint(folder, hash_files)
        if result.ok:
            return result
        log.warning("skipping checkpoint %s (step %d): %s", folder, step, "; ".join(result.problems))
    return None


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
