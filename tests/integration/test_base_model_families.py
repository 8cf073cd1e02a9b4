"""A base model of each family the trainer builds besides Llama (Llama's: test_continued_pretraining,
test_base_model_start), trained by real processes (2 ranks, FSDP2, gloo): its first step's loss is plain transformers'
loss of the base model on the step's samples, and the run's own export loads in plain transformers as the family's
class and generates what the run generated; the validate step checks its checkpoint against the family's
tensors."""

import json
from pathlib import Path

import numpy as np
import pytest

from components.train.local import run_local_training
from components.validate.checks import check_checkpoint
from pipelines.demo_data import generate_documents
from tests.base_model import loss_of, make_base_model
from tests.hf_serving import generate_with_plain_transformers
from trainer.data.batches import TokenBatches
from trainer.data.shards import tokenize_files
from trainer.model.base import BASE_INDEX, index_base_weights, read_base_config
from trainer.run.run_dir import RunDir, read_json, read_jsonl, write_json

pytestmark = pytest.mark.integration

CLASSES = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
STEPS = 2


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_a_base_model_of_the_family_trains_from_its_own_loss_and_exports_as_its_class(family, tmp_path,
                                                                                     training_config):
    cfg = training_config(tmp_path, family, f"--model.init_from=s3://models/base-models/tiny-{family}",
                          f"--training.num_steps={STEPS}", f"--checkpoint.interval_steps={STEPS}",
                          "--faults.schedule=", "--resilience.straggler_interval=0")
    texts = generate_documents(200, seed=1)
    tokenizer = make_base_model(cfg.base_model_dir, texts, family=family, steps=20)
    write_json(cfg.base_model_dir.parent / BASE_INDEX,
               index_base_weights(cfg.base_model_dir, read_base_config(cfg.base_model_dir)))
    raw = cfg.fsx_root / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokens = cfg.fsx_root / "datasets" / "tokens"
    tokenize_files([raw], tokens, 0.1, tokenizer=cfg.tokenizer_spec)

    result = run_local_training(cfg, tokens)

    assert result["steps"] == STEPS
    [first] = [r for r in read_jsonl(cfg.run_dir / "metrics.jsonl") if r["step"] == 1]
    batches = TokenBatches.open(tokens, "train", seq_len=cfg.training.seq_len, batch_size=cfg.training.batch_size,
                                seed=cfg.run.seed)
    inputs, labels = batches.samples(np.arange(2 * cfg.training.batch_size))  # 2 ranks' batches of step 1
    expected = loss_of(cfg.base_model_dir, inputs, labels)
    print(f"{family}: first step's loss {first['loss']:.6f}, plain transformers' {expected:.6f}")
    assert first["loss"] == pytest.approx(expected, rel=1e-4)
    assert expected < float(np.log(len(tokenizer))) - 0.5  # the base model's weights, not a random start's

    report = check_checkpoint(cfg.checkpoint_dir / f"step-{STEPS:06d}", expected_run_id=family)
    assert report["model_type"] == family and "dcp_metadata" in report["checks_passed"]

    record = read_json(RunDir(cfg.run_dir).evaluation(STEPS))
    assert record["export"]["complete"], record["export"]
    export = Path(record["export"]["uri"])
    assert json.loads((export / "config.json").read_text())["architectures"] == [CLASSES[family]]
    assert json.loads((export / "config.json").read_text())["model_type"] == family
    generations = record["candidate"]["generations"]
    served = generate_with_plain_transformers(export, [g["prompt"] for g in generations],
                                              cfg.eval.max_new_tokens, tmp_path)
    assert [s["completion"] for s in served] == [g["completion"] for g in generations]
    assert any(g["completion"] for g in generations)
