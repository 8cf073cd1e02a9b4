"""Validation and evaluation of a real 2-rank checkpoint, loaded into one process."""

import json
import math
import shutil

import pytest

from components.evaluate import evaluate_checkpoint
from components.validate import CheckpointValidationError, validate_checkpoint
from trainer.checkpoint import MANIFEST, write_manifest

pytestmark = pytest.mark.integration


@pytest.fixture
def checkpoint_copy(trained_run, tmp_path):
    cfg, _ = trained_run
    target = tmp_path / "step-000008"
    shutil.copytree(cfg.checkpoint_dir / "step-000008", target)
    return target


def test_valid_checkpoint_passes_every_check(checkpoint_copy):
    report = validate_checkpoint(checkpoint_copy)
    assert report["checks_passed"] == ["manifest", "dcp_metadata", "reshard_load", "finite"]
    assert report["world_size"] == 2 and report["step"] == 8 and report["bytes"] > 0


def test_flipped_byte_in_a_shard_fails_naming_the_file(checkpoint_copy):
    shard = sorted(checkpoint_copy.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointValidationError, match=rf"{shard.name}: content hash \(xxh3_128\) differs"):
        validate_checkpoint(checkpoint_copy)


def test_missing_manifest_fails(checkpoint_copy):
    (checkpoint_copy / MANIFEST).unlink()
    with pytest.raises(CheckpointValidationError, match="manifest missing"):
        validate_checkpoint(checkpoint_copy)


def test_nan_weights_fail_even_with_a_consistent_manifest(checkpoint_copy):
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint import load_model_from_checkpoint

    model, manifest = load_model_from_checkpoint(checkpoint_copy)
    state = {"model": model.state_dict()}
    next(iter(state["model"].values())).fill_(float("nan"))
    state["trainer"] = {"step": torch.tensor(8)}
    poisoned = checkpoint_copy.parent / "poisoned"
    dcp.save(state, checkpoint_id=str(poisoned), no_dist=True)
    write_manifest(poisoned, 8, {k: v for k, v in manifest.items() if k not in ("files", "step", "libraries")})
    with pytest.raises(CheckpointValidationError, match="NaN or Inf"):
        validate_checkpoint(poisoned)


def test_evaluation_reports_heldout_loss_and_perplexity(trained_run, token_dir):
    cfg, result = trained_run
    metrics = evaluate_checkpoint(cfg.checkpoint_dir / "step-000008", token_dir, seq_len=32, batch_size=4,
                                  max_batches=4)
    assert metrics["eval_tokens"] == 4 * 4 * 32
    assert math.isclose(metrics["perplexity"], math.exp(metrics["heldout_loss"]))
    assert metrics["heldout_loss"] < math.log(258)  # better than uniform over the byte vocabulary
