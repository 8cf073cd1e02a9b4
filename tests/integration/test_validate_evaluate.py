"""Validation (streamed, no model loaded) of a real 2-rank checkpoint, and the training ranks' final evaluation."""

import json
import math
import shutil

import pytest

from components.validate.checks import CheckpointValidationError, check_checkpoint
from trainer.checkpoint.format import MANIFEST, write_manifest

pytestmark = pytest.mark.integration


@pytest.fixture
def checkpoint_copy(trained_run, tmp_path):
    cfg, _ = trained_run
    target = tmp_path / "step-000008"
    shutil.copytree(cfg.checkpoint_dir / "step-000008", target)
    return target


def test_valid_checkpoint_passes_every_check(checkpoint_copy, trained_run):
    cfg, _ = trained_run
    report = check_checkpoint(checkpoint_copy, expected_run_id=cfg.run.run_id)
    assert report["checks_passed"] == ["manifest", "dcp_metadata", "streamed"]
    assert report["world_size"] == 2 and report["step"] == 8 and report["bytes"] > 0
    assert report["optimizer_tensors"] > 0


def test_truncated_shard_fails_naming_the_file(checkpoint_copy):
    shard = sorted(checkpoint_copy.glob("*.distcp"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointValidationError, match=rf"{shard.name}: \d+ bytes, manifest says \d+ \(truncated"):
        check_checkpoint(checkpoint_copy)


def test_missing_shard_fails_naming_the_file(checkpoint_copy):
    shard = sorted(checkpoint_copy.glob("*.distcp"))[0]
    shard.unlink()
    with pytest.raises(CheckpointValidationError, match=rf"{shard.name}: listed in the manifest but missing"):
        check_checkpoint(checkpoint_copy)


def test_a_checkpoint_of_another_run_fails(checkpoint_copy):
    with pytest.raises(CheckpointValidationError, match=r"written by run '.*', not 'some-other-run'"):
        check_checkpoint(checkpoint_copy, expected_run_id="some-other-run")


def test_a_manifest_copied_from_another_checkpoint_fails(checkpoint_copy, trained_run):
    cfg, _ = trained_run
    other = sorted(p for p in cfg.checkpoint_dir.glob("step-*") if p.name != checkpoint_copy.name)[0]
    shutil.copy(other / MANIFEST, checkpoint_copy / MANIFEST)
    with pytest.raises(CheckpointValidationError, match="differs from the manifest|manifest says|records step"):
        check_checkpoint(checkpoint_copy)


def test_flipped_byte_in_a_shard_fails_naming_the_file(checkpoint_copy):
    shard = sorted(checkpoint_copy.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointValidationError, match=rf"{shard.name}: content hash \(xxh3_128\) differs"):
        check_checkpoint(checkpoint_copy)


def test_missing_manifest_fails(checkpoint_copy):
    (checkpoint_copy / MANIFEST).unlink()
    with pytest.raises(CheckpointValidationError, match="manifest missing"):
        check_checkpoint(checkpoint_copy)


def test_nan_weights_fail_even_with_a_consistent_manifest(checkpoint_copy):
    import torch
    import torch.distributed.checkpoint as dcp

    from trainer.checkpoint.load import load_model_from_checkpoint

    model, manifest = load_model_from_checkpoint(checkpoint_copy)
    state = {"model": model.state_dict()}
    next(iter(state["model"].values())).fill_(float("nan"))
    state["trainer"] = {"step": torch.tensor(8)}
    poisoned = checkpoint_copy.parent / "poisoned"
    dcp.save(state, checkpoint_id=str(poisoned), no_dist=True)
    write_manifest(poisoned, 8, {**{k: v for k, v in manifest.items() if k not in ("files", "step", "libraries")},
                                 "world_size": 1})  # saved by one process
    with pytest.raises(CheckpointValidationError, match="parameter .* NaN or Inf"):
        check_checkpoint(poisoned)


def test_nan_optimizer_state_fails(checkpoint_copy):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = FileSystemReader(str(checkpoint_copy)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()
             if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, checkpoint_id=str(checkpoint_copy), no_dist=True)
    key = next(k for k in state if k.endswith("exp_avg_sq"))
    state[key].view(-1)[0] = float("inf")
    poisoned = checkpoint_copy.parent / "poisoned"
    dcp.save(state, checkpoint_id=str(poisoned), no_dist=True)
    manifest = json.loads((checkpoint_copy / MANIFEST).read_text())
    write_manifest(poisoned, 8, {**{k: v for k, v in manifest.items() if k not in ("files", "step", "libraries")},
                                 "world_size": 1})
    with pytest.raises(CheckpointValidationError, match=rf"optimizer state {key} holds NaN or Inf"):
        check_checkpoint(poisoned)


def test_a_tensor_whose_chunks_do_not_cover_it_fails(checkpoint_copy):
    """A shard's entry missing from the DCP metadata: DCP could not reassemble (or reshard) that tensor."""
    import pickle

    from trainer.checkpoint.format import hash_file

    metadata_path = checkpoint_copy / ".metadata"
    metadata = pickle.loads(metadata_path.read_bytes())
    key = next(k for k in metadata.state_dict_metadata if k.endswith("embed_tokens.weight"))
    metadata.state_dict_metadata[key].chunks.pop()
    metadata_path.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((checkpoint_copy / MANIFEST).read_text())
    manifest["files"][".metadata"] = {"bytes": metadata_path.stat().st_size, "hash": hash_file(metadata_path)}
    (checkpoint_copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointValidationError, match=rf"{key} cannot be reassembled: its chunks hold \d+ of"):
        check_checkpoint(checkpoint_copy)


def test_the_training_ranks_final_evaluation_is_the_full_logits_loss(trained_run, token_dir):
    """The record the 2 ranks wrote at the end of training (chunked loss, windows dealt out to the ranks) gives
    the loss a single process computes with full fp32 logits on the same windows."""
    import torch
    import torch.nn.functional as F

    from trainer.checkpoint.load import load_model_from_checkpoint
    from trainer.evaluate.heldout import heldout_windows
    from trainer.run.run_dir import RunDir

    cfg, result = trained_run
    record = json.loads(RunDir(cfg.run_dir).evaluation(8).read_text())
    assert result["evaluation"] == str(RunDir(cfg.run_dir).evaluation(8))
    candidate = record["candidate"]
    assert candidate["eval_tokens"] == 4 * cfg.eval.batch_size * 32  # eval.max_batches x batch x seq_len
    assert math.isclose(candidate["perplexity"], math.exp(candidate["heldout_loss"]))
    assert candidate["heldout_loss"] < math.log(258)  # better than uniform over the byte vocabulary
    accuracy = candidate["tasks"]["multiple_choice"]["metrics"]["accuracy"]
    assert 0.0 <= accuracy <= 1.0 and candidate["tasks"]["multiple_choice"]["metrics"]["questions"] == 16

    memory = record["memory"]  # each rank: what the evaluation and export added to the shard it held
    for before, peak, shard in zip(memory["rss_before_bytes"], memory["peak_rss_bytes"], memory["shard_bytes"]):
        assert 0 < shard and peak - before < shard + 192 * 2**20

    windows = heldout_windows(token_dir, 32, cfg.eval.batch_size, 4)
    assert windows.fingerprint == record["windows"]
    model, _ = load_model_from_checkpoint(cfg.checkpoint_dir / "step-000008")
    with torch.inference_mode():
        logits = model(input_ids=torch.from_numpy(windows.inputs)).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), torch.from_numpy(windows.targets).reshape(-1))
    assert candidate["heldout_loss"] == pytest.approx(float(loss), rel=1e-5)


MEASURE_VALIDATE = """
import json, sys
from pathlib import Path
from components.validate.checks import check_checkpoint
from trainer.model.families import causal_lm_class, config_from_dict
from trainer.observe.memory import peak_rss, reset_peak
# The family's modeling module is imported once per process (tens of MB, not the model's size): before the baseline.
causal_lm_class(config_from_dict(json.loads((Path(sys.argv[1]) / "manifest.json").read_text())["model_config"]))
held = reset_peak()
report = check_checkpoint(Path(sys.argv[1]))
print(json.dumps({"growth": peak_rss() - held, "largest_item": report["largest_item_bytes"]}))
"""


def test_validation_memory_is_a_few_tensors_not_the_model(tmp_path):
    """A 51 M-parameter checkpoint with its optimizer state (620 MB): the streamed validation's peak RSS grows by
    its threads' tensors and a constant, not by the model (the load into one process held all of it)."""
    import subprocess
    import sys

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=258, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=16)
    model = LlamaForCausalLM(config)
    state = {"model": model.state_dict(), "trainer": {"step": torch.tensor(3)},
             "optim": {"state": {name: {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                                 for name, p in model.named_parameters()}}}
    state_bytes = sum(t.nbytes for t in model.state_dict().values()) * 3
    del model
    folder = tmp_path / "step-000003"
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    del state
    write_manifest(folder, 3, {"world_size": 1, "run_id": "memory", "model_config": config.to_dict()})
    proc = subprocess.run([sys.executable, "-c", MEASURE_VALIDATE, str(folder)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout)
    assert state_bytes > 600e6
    assert measured["growth"] < 4 * measured["largest_item"] + 96 * 2**20, (measured, state_bytes)
