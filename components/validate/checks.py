"""check_checkpoint: nobody loads, evaluates or ships a checkpoint that is incomplete or corrupt.

Checks, in order (each needs the previous): the manifest and every file it lists (size here, xxh3-128 while
the load below reads it: one read of the checkpoint for both); the
checkpoint belongs to the expected run (when one is given); DCP metadata consistent with the manifest
(model config shapes, one shard file per training rank, the recorded step); a load into one process (a
different world size than training used, proving the checkpoint reshards); finite parameters and
optimizer state.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.checkpoint.fast_reader import FastReader
from trainer.checkpoint.format import MANIFEST, CheckpointError, verify_checkpoint
from trainer.checkpoint.load import load_checkpoint, load_model_from_checkpoint

log = logging.getLogger(__name__)


class CheckpointValidationError(RuntimeError):
    """The checkpoint failed a check; the message names the folder, the file and the reason."""


def _expected_shapes(model_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(model_config))
    return {f"model.{name}": tuple(t.shape) for name, t in model.state_dict().items()}


def check_checkpoint(folder: Path, expected_run_id: str | None = None) -> dict[str, Any]:
    """Return a report of the checks passed, or raise CheckpointValidationError naming what failed."""
    folder = Path(folder)
    checks: list[str] = []

    def fail(reason: str) -> None:
        raise CheckpointValidationError(f"checkpoint {folder} failed validation: {reason} "
                                        f"(checks passed: {', '.join(checks) or 'none'})")

    verified = verify_checkpoint(folder, hash_files=False)  # the content hashes: checked by the load's one read
    if not verified.ok:
        fail("; ".join(verified.problems))
    checks.append("manifest")
    manifest = verified.manifest
    if expected_run_id is not None and manifest.get("run_id") != expected_run_id:
        fail(f"{folder / MANIFEST}: written by run {manifest.get('run_id')!r}, not {expected_run_id!r} "
             "(a checkpoint or manifest copied from another run)")
    if folder.name.startswith("step-") and folder.name != f"step-{int(manifest['step']):06d}":
        fail(f"{folder / MANIFEST}: records step {manifest['step']}, the folder says {folder.name}")

    try:
        metadata = FastReader(folder).read_metadata()  # unpickled only once its hash matched the manifest
    except Exception as err:  # DCP raises assorted errors for unreadable metadata
        fail(f"{folder / '.metadata'}: unreadable DCP metadata ({err})")
    stored = {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}
    for key, shape in _expected_shapes(manifest["model_config"]).items():
        if stored.get(key) != shape:
            fail(f"{folder / '.metadata'}: {key} has shape {stored.get(key)}, the manifest's model config "
                 f"expects {shape}")
    if "trainer.step" not in metadata.state_dict_metadata:
        fail(f"{folder / '.metadata'}: no trainer.step entry")
    shard_files = {item.relative_path for item in (metadata.storage_data or {}).values()}
    if len(shard_files) != manifest["world_size"]:
        fail(f"{folder / '.metadata'}: {len(shard_files)} shard file(s) for a world size of {manifest['world_size']}")
    checks.append("dcp_metadata")

    started = time.perf_counter()
    try:
        model, _ = load_model_from_checkpoint(folder, verified)
    except CheckpointError as err:  # a file's content hash, found by the load's read
        fail(str(err))
    except (RuntimeError, ValueError) as err:
        fail(f"load into a single process failed: {err}")
    load_seconds = time.perf_counter() - started
    checks.append("reshard_load")

    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            fail(f"parameter {name} holds NaN or Inf values")
    stored_step, optimizer_tensors = _step_and_optimizer_check(folder, metadata, fail)
    if stored_step != manifest["step"]:
        fail(f"{folder / '.metadata'}: trainer.step is {stored_step}, the manifest says {manifest['step']}")
    checks.append("finite")

    files = manifest["files"]
    report = {"checkpoint": str(folder), "step": manifest["step"], "world_size": manifest["world_size"],
              "run_id": manifest.get("run_id"), "files": len(files),
              "bytes": sum(f["bytes"] for f in files.values()), "load_seconds": load_seconds,
              "optimizer_tensors": optimizer_tensors, "checks_passed": checks, "num_checks": len(checks)}
    log.info("checkpoint %s valid: %s", folder, ", ".join(checks))
    return report


def _step_and_optimizer_check(folder: Path, metadata, fail) -> tuple[int, int]:
    """Load trainer.step and every optimizer tensor (one at a time, full size) and check them for NaN/Inf."""
    entries = metadata.state_dict_metadata
    step_state = {"trainer": {"step": torch.tensor(0)}}
    checked = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # Verified by the model's load a moment ago, in this process: these reads come from the page cache.
        load_checkpoint(step_state, folder, no_dist=True, verify=False)
        optim_keys = [k for k, m in entries.items() if k.startswith("optim.") and isinstance(m, TensorStorageMetadata)]
        for start in range(0, len(optim_keys), 64):  # bounded memory: a few tensors per read
            batch = {}
            for key in optim_keys[start : start + 64]:
                meta = entries[key]
                batch[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            load_checkpoint(batch, folder, no_dist=True, verify=False)
            for key, tensor in batch.items():
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    fail(f"optimizer state {key} holds NaN or Inf values")
            checked += len(batch)
    return int(step_state["trainer"]["step"]), checked
