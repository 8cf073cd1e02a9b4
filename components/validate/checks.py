"""check_checkpoint: nobody evaluates, exports or ships a checkpoint that is incomplete or corrupt — checked in
bounded memory, whatever the model's size.

Checks, in order (each needs the previous):
- manifest: every file it lists is there with its size; the checkpoint is the expected run's and step's;
- dcp_metadata: the DCP metadata (its hash checked against the manifest before it is unpickled) has every tensor
  the manifest's model config implies, with its shape, a trainer.step entry, one shard file per training rank, and
  each tensor's chunks cover it exactly (so DCP can load it at any world size: it reshards);
- streamed: each shard file read once, front to back, on a few threads: its bytes hashed (xxh3-128, against the
  manifest) and each stored tensor decoded where it lies in the file (trainer.checkpoint.tensor_decode) and checked
  for NaN/Inf — parameters and optimizer state — then dropped. A thread holds one tensor's bytes at a time, so
  the peak memory is a few of the largest tensors, not the model; no process loads the model.
"""

from __future__ import annotations

import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.checkpoint.fast_reader import FastReader
from trainer.checkpoint.format import MANIFEST, hasher, verify_checkpoint
from trainer.checkpoint.tensor_decode import Undecodable, decode_tensor
from trainer.config.model import DEFAULT_MODEL_TYPE
from trainer.model.families import causal_lm_class, config_from_dict

log = logging.getLogger(__name__)

READ_BYTES = 8 << 20  # the stretch between two tensors is hashed in reads of this size


class CheckpointValidationError(RuntimeError):
    """The checkpoint failed a check; the message names the folder, the file and the reason."""


def _expected_shapes(model_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        config = config_from_dict(model_config)
        model = causal_lm_class(config)._from_config(config)
    return {f"model.{name}": tuple(t.shape) for name, t in model.state_dict().items()}


def _uncovered(meta: TensorStorageMetadata) -> str | None:
    """Why the tensor's chunks do not tile it exactly (inside its bounds, no volume missing or counted twice)."""
    total = math.prod(meta.size)
    covered = 0
    for chunk in meta.chunks:
        if any(o < 0 or o + s > dim for o, s, dim in zip(chunk.offsets, chunk.sizes, meta.size)):
            return f"a chunk at {list(chunk.offsets)} of size {list(chunk.sizes)} lies outside {list(meta.size)}"
        covered += math.prod(chunk.sizes)
    return None if covered == total else f"its chunks hold {covered} of its {total} elements"


def _stream_file(path: Path, items: list[tuple[int, int, str]], algorithm: str, expected_hash: str) -> dict[str, Any]:
    """One shard file front to back: its hash, and each tensor item decoded and checked where it lies.
    items: (offset, length, key). Returns the problems found (a hash mismatch first: it explains the rest)."""
    digest, problems, values, largest = hasher(algorithm), [], {}, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        position = 0

        def hash_until(end: int) -> None:
            nonlocal position
            while position < end:
                chunk = os.pread(fd, min(READ_BYTES, end - position), position)
                if not chunk:
                    raise CheckpointValidationError(f"{path}: ends at byte {position}, an item needs {end}")
                digest.update(chunk)
                position += len(chunk)

        for offset, length, key in sorted(items):
            hash_until(offset)
            blob = os.pread(fd, length, offset)
            digest.update(blob)
            position = offset + len(blob)
            largest = max(largest, len(blob))
            if len(blob) != length:
                problems.append(f"{path}: {key} is cut short ({len(blob)} of {length} bytes)")
                continue
            try:
                tensor = decode_tensor(memoryview(blob))
            except Undecodable as err:
                problems.append(f"{path}: {key} does not decode as a tensor ({err})")
                continue
            if key == "trainer.step":
                values["trainer.step"] = int(tensor)
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                what = "optimizer state" if key.startswith("optim.") else "parameter"
                problems.append(f"{what} {key.removeprefix('model.')} holds NaN or Inf values ({path.name})")
        hash_until(os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if digest.hexdigest() != expected_hash:
        problems.insert(0, f"{path}: content hash ({algorithm}) differs from the manifest (corrupted)")
    return {"problems": problems, "values": values, "largest_item": largest}


def check_checkpoint(folder: Path, expected_run_id: str | None = None, threads: int = 4) -> dict[str, Any]:
    """Return a report of the checks passed, or raise CheckpointValidationError naming what failed."""
    folder = Path(folder)
    checks: list[str] = []

    def fail(reason: str) -> None:
        raise CheckpointValidationError(f"checkpoint {folder} failed validation: {reason} "
                                        f"(checks passed: {', '.join(checks) or 'none'})")

    verified = verify_checkpoint(folder, hash_files=False)  # sizes; the hashes come with the one streamed read
    if not verified.ok:
        fail("; ".join(verified.problems))
    manifest = verified.manifest
    if expected_run_id is not None and manifest.get("run_id") != expected_run_id:
        fail(f"{folder / MANIFEST}: written by run {manifest.get('run_id')!r}, not {expected_run_id!r} "
             "(a checkpoint or manifest copied from another run)")
    if folder.name.startswith("step-") and folder.name != f"step-{int(manifest['step']):06d}":
        fail(f"{folder / MANIFEST}: records step {manifest['step']}, the folder says {folder.name}")
    checks.append("manifest")

    try:
        metadata = FastReader(folder).read_metadata()  # unpickled only once its hash matched the manifest
    except Exception as err:  # DCP raises assorted errors for unreadable metadata
        fail(f"{folder / '.metadata'}: unreadable DCP metadata ({err})")
    entries = metadata.state_dict_metadata
    stored = {key: tuple(meta.size) for key, meta in entries.items() if hasattr(meta, "size")}
    for key, shape in _expected_shapes(manifest["model_config"]).items():
        if stored.get(key) != shape:
            fail(f"{folder / '.metadata'}: {key} has shape {stored.get(key)}, the manifest's model config "
                 f"expects {shape}")
    if "trainer.step" not in entries:
        fail(f"{folder / '.metadata'}: no trainer.step entry")
    for key, meta in entries.items():
        if isinstance(meta, TensorStorageMetadata) and (why := _uncovered(meta)):
            fail(f"{folder / '.metadata'}: {key} cannot be reassembled: {why}")
    storage = metadata.storage_data or {}
    shard_files = {info.relative_path for info in storage.values()}
    if len(shard_files) != manifest["world_size"]:
        fail(f"{folder / '.metadata'}: {len(shard_files)} shard file(s) for a world size of {manifest['world_size']}")
    checks.append("dcp_metadata")

    started = time.perf_counter()
    by_file: dict[str, list[tuple[int, int, str]]] = {name: [] for name in shard_files}
    for index, info in storage.items():
        if isinstance(entries[index.fqn], TensorStorageMetadata):  # others are pickled Python values (param groups)
            by_file[info.relative_path].append((info.offset, info.length, index.fqn))
    listed = manifest["files"]
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(by_file)))) as pool:
        results = dict(zip(by_file, pool.map(
            lambda name: _stream_file(folder / name, by_file[name], manifest["hash_algorithm"], listed[name]["hash"]),
            by_file)))
    problems = [problem for name in sorted(results) for problem in results[name]["problems"]]
    if problems:
        fail("; ".join(problems))
    steps = {r["values"]["trainer.step"] for r in results.values() if "trainer.step" in r["values"]}
    if steps != {manifest["step"]}:
        fail(f"{folder / '.metadata'}: trainer.step is {sorted(steps)}, the manifest says {manifest['step']}")
    checks.append("streamed")

    tensors = sum(1 for meta in entries.values() if isinstance(meta, TensorStorageMetadata))
    report = {"checkpoint": str(folder), "step": manifest["step"], "world_size": manifest["world_size"],
              "run_id": manifest.get("run_id"),
              "model_type": manifest["model_config"].get("model_type", DEFAULT_MODEL_TYPE),
              "files": len(listed), "bytes": sum(f["bytes"] for f in listed.values()),
              "stream_seconds": time.perf_counter() - started, "tensors": tensors,
              "optimizer_tensors": sum(1 for key in entries if key.startswith("optim.")),
              "largest_item_bytes": max((r["largest_item"] for r in results.values()), default=0),
              "checks_passed": checks, "num_checks": len(checks)}
    log.info("checkpoint %s valid: %s (%d tensors streamed in %.1f s)", folder, ", ".join(checks), tensors,
             report["stream_seconds"])
    return report
