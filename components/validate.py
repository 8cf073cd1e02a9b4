"""validate_checkpoint: nobody loads, evaluates or ships a checkpoint that is incomplete or corrupt.

Checks, in order (each needs the previous): the manifest and every file it lists (size, sha256); DCP
metadata consistent with the manifest's model config; a load into one process (a different world size
than training used, proving the checkpoint reshards); finite parameters.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trainer.checkpoint import CheckpointError, verify_checkpoint

log = logging.getLogger(__name__)


class CheckpointValidationError(RuntimeError):
    """The checkpoint failed a check; the message names the folder, the file and the reason."""


def _expected_shapes(model_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(model_config))
    return {f"model.{name}": tuple(t.shape) for name, t in model.state_dict().items()}


def validate_checkpoint(folder: Path) -> dict[str, Any]:
    """Return a report of the checks passed, or raise CheckpointValidationError naming what failed."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from trainer.checkpoint import load_model_from_checkpoint

    folder = Path(folder)
    checks: list[str] = []

    def fail(reason: str) -> None:
        raise CheckpointValidationError(f"checkpoint {folder} failed validation: {reason} "
                                        f"(checks passed: {', '.join(checks) or 'none'})")

    verified = verify_checkpoint(folder)
    if not verified.ok:
        fail("; ".join(verified.problems))
    checks.append("manifest")
    manifest = verified.manifest

    try:
        metadata = FileSystemReader(str(folder)).read_metadata()
    except Exception as err:  # DCP raises assorted errors for unreadable metadata
        fail(f"{folder / '.metadata'}: unreadable DCP metadata ({err})")
    stored = {key: tuple(meta.size) for key, meta in metadata.state_dict_metadata.items() if hasattr(meta, "size")}
    for key, shape in _expected_shapes(manifest["model_config"]).items():
        if stored.get(key) != shape:
            fail(f"{folder / '.metadata'}: {key} has shape {stored.get(key)}, the manifest's model config "
                 f"expects {shape}")
    if "trainer.step" in stored or "trainer.step" in metadata.state_dict_metadata:
        checks.append("dcp_metadata")
    else:
        fail(f"{folder / '.metadata'}: no trainer.step entry")

    started = time.perf_counter()
    try:
        model, _ = load_model_from_checkpoint(folder, verified)
    except (CheckpointError, RuntimeError, ValueError) as err:
        fail(f"load into a single process failed: {err}")
    load_seconds = time.perf_counter() - started
    checks.append("reshard_load")

    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor).all():
            fail(f"parameter {name} holds NaN or Inf values")
    checks.append("finite")

    files = manifest["files"]
    report = {"checkpoint": str(folder), "step": manifest["step"], "world_size": manifest["world_size"],
              "run_id": manifest.get("run_id"), "files": len(files),
              "bytes": sum(f["bytes"] for f in files.values()), "load_seconds": load_seconds,
              "checks_passed": checks, "num_checks": len(checks)}
    log.info("checkpoint %s valid: %s", folder, ", ".join(checks))
    return report
