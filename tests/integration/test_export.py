"""HF export of a sharded checkpoint, and starting a run from the exported weights."""

import pytest
import torch

from tests.hf_serving import generate_with_plain_transformers
from trainer.checkpoint.export import export_hf
from trainer.checkpoint.load import load_model_from_checkpoint
from trainer.model.base import BaseModelError, index_base_weights, load_base_weights, read_base_config
from trainer.model.build import build_model_on_meta, materialize_on

pytestmark = pytest.mark.integration


def test_export_round_trips_through_from_pretrained(trained_run, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    cfg, _ = trained_run
    checkpoint = cfg.checkpoint_dir / "step-000008"
    out = export_hf(checkpoint, tmp_path / "hf", dtype="float32", max_file_gb=0.004)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # shards of at most 4 MB

    exported = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    original, _ = load_model_from_checkpoint(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ids = torch.tensor([tokenizer("The cat sat near the river.")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(exported(ids).logits, original(ids).logits)

    with pytest.raises(FileExistsError, match="already exists"):
        export_hf(checkpoint, out)


def test_init_from_an_export_loads_those_weights(trained_run, tmp_path):
    """An export is a base model: its config and weights, read the way a first start reads them (a meta build,
    then the files through DCP's Hugging Face reader), give the checkpoint's weights in fp32."""
    cfg, _ = trained_run
    out = export_hf(cfg.checkpoint_dir / "step-000008", tmp_path / "hf", dtype="float32")
    config = read_base_config(out)
    model = build_model_on_meta(config)
    materialize_on(model, torch.device("cpu"))
    load_base_weights(model, out, index_base_weights(out, config, hash_files=False), no_dist=True)
    original, _ = load_model_from_checkpoint(cfg.checkpoint_dir / "step-000008")
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert a.dtype == torch.float32 and torch.equal(a, b), name


def test_a_bf16_export_is_bf16_on_disk_and_loads(trained_run, tmp_path):
    """The default export dtype: half the bytes, the config says so, transformers loads it as it is."""
    import json

    from transformers import LlamaForCausalLM

    cfg, _ = trained_run
    out = export_hf(cfg.checkpoint_dir / "step-000008", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = LlamaForCausalLM.from_pretrained(str(out), local_files_only=True, dtype="auto")
    original, _ = load_model_from_checkpoint(cfg.checkpoint_dir / "step-000008")
    for (name, a), (_, b) in zip(model.state_dict().items(), original.state_dict().items()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16)), name


def test_init_from_a_folder_without_weights_names_the_field(tmp_path):
    with pytest.raises(BaseModelError, match="model.init_from: .*config.json not found"):
        read_base_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 8}')
    with pytest.raises(BaseModelError, match=r"model.init_from: .* has no \*.safetensors files"):
        index_base_weights(tmp_path, read_base_config(tmp_path))


def test_the_export_reproduces_the_runs_generations_with_plain_transformers(trained_run, tmp_path):
    """What a model server (transformers, vLLM) does with the folder: AutoTokenizer adds the special tokens
    the model was trained with, config.json and generation_config.json agree with the tokenizer on them, and
    greedy decoding gives the run's own generations.json — loaded in a process that imports no project code."""
    import json

    from trainer.data.tokenizer import load_tokenizer
    from trainer.evaluate.heldout import generate

    cfg, _ = trained_run
    checkpoint = cfg.checkpoint_dir / "step-000008"
    prompts = ["The", "Once upon a time", "12 + 7 ="]
    model, manifest = load_model_from_checkpoint(checkpoint)
    expected = generate(model, load_tokenizer(manifest["tokenizer"]), prompts, max_new_tokens=24)  # the trainer's
    out = export_hf(checkpoint, tmp_path / "hf", dtype="float32")

    served = generate_with_plain_transformers(out, prompts, 24, tmp_path)
    training_tokenizer = load_tokenizer("byte")
    for mine, theirs in zip(expected, served):
        [trained_ids] = training_tokenizer.encode_documents([mine["prompt"]])
        assert theirs["ids"] == trained_ids[:-1]  # BOS first, as in training; a prompt has no EOS yet
        assert theirs["completion"] == mine["completion"], (theirs, mine)

    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    special = {"bos_token_id": training_tokenizer.bos_id, "eos_token_id": training_tokenizer.eos_id}
    assert {k: config[k] for k in special} == special
    assert {k: generation[k] for k in special} == special
