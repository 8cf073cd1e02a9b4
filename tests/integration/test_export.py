"""HF export of a sharded checkpoint, and starting a run from the exported weights."""

import pytest
import torch

from trainer.checkpoint import load_model_from_checkpoint
from trainer.config import load_config
from trainer.export import export_hf
from trainer.model import load_or_build_model

pytestmark = pytest.mark.integration


def test_export_round_trips_through_from_pretrained(trained_run, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg, _ = trained_run
    checkpoint = cfg.checkpoint_dir / "step-000008"
    out = export_hf(checkpoint, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}

    exported = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    original, _ = load_model_from_checkpoint(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tokenizer("The cat sat near the river.")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(exported(ids).logits, original(ids).logits)

    with pytest.raises(FileExistsError, match="already exists"):
        export_hf(checkpoint, out)


def test_init_from_an_export_loads_those_weights(trained_run, tmp_path):
    cfg, _ = trained_run
    out = export_hf(cfg.checkpoint_dir / "step-000008", tmp_path / "hf")
    model = load_or_build_model(load_config(None, [f"--model.init_from={out}"]).model, vocab_size=258, seed=1)
    original, _ = load_model_from_checkpoint(cfg.checkpoint_dir / "step-000008")
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert torch.equal(a, b), name


def test_init_from_a_folder_without_weights_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="model.init_from: .* must hold config.json and \\*.safetensors"):
        load_or_build_model(load_config(None, [f"--model.init_from={tmp_path}"]).model, vocab_size=258, seed=1)
