"""A first start from a base model, with real processes: 2 nodes x 2 ranks read the staged model's weights once
between them (each rank its own rows), and a restart takes the state from node memory, never the base model again.
A base model that cannot be used stops the trainer with exit 2 naming the file."""

import json
import re
import subprocess
import sys

import pytest

from components.train.local import run_local_training
from pipelines.demo_data import generate_documents
from tests.base_model import make_base_model
from trainer.data.shards import tokenize_files
from trainer.model.base import BASE_INDEX, index_base_weights, read_base_config
from trainer.run.events import read_events
from trainer.run.run_dir import write_json

pytestmark = pytest.mark.integration

BASE = "s3://models/base-models/tiny-llama"  # staged: the trainer reads its index and files from FSx, not S3


def _stage(cfg, **shape):
    """What the stage step leaves for BASE (cfg.staged_model_dir: models/tiny-llama-<hash of the URI>): the files
    and the model's own tokenizer in hf/, the checked index beside them; and the corpus tokenized with that
    tokenizer. Returns (the index, the token folder)."""
    folder = cfg.base_model_dir
    texts = generate_documents(300, seed=1)
    make_base_model(folder, texts, **shape)
    index = index_base_weights(folder, read_base_config(folder))
    write_json(folder.parent / BASE_INDEX, index)
    raw = cfg.fsx_root / "raw.jsonl"
    raw.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    tokenize_files([raw], cfg.fsx_root / "datasets" / "tokens", 0.1, tokenizer=cfg.tokenizer_spec)
    return index, cfg.fsx_root / "datasets" / "tokens"


def test_2_nodes_x_2_ranks_read_the_weights_once_and_a_restart_reads_node_memory(tmp_path, training_config):
    cfg = training_config(tmp_path, "reads", f"--model.init_from={BASE}", "--training.num_nodes=2",
                          "--training.nproc_per_node=2", "--checkpoint.memory_node_per_rank=false",
                          "--training.num_steps=3", "--checkpoint.interval_steps=100",
                          "--faults.schedule=sigkill@2:rank=1", "--resilience.straggler_interval=0",
                          "--resilience.initial_heartbeat_timeout=120")
    assert cfg.tokenizer_spec == str(cfg.base_model_dir)  # data.tokenizer unset: the base model's own
    index, tokens = _stage(cfg, hidden=128, layers=4, steps=5, shard="400KB")
    result = run_local_training(cfg, tokens)

    assert result["steps"] == 3 and len(index["files"]) >= 3
    [loaded] = read_events(cfg.run_dir, "base_model_loaded")  # the first start only: the restart did not read it
    assert loaded["ranks"] == 4 and loaded["content_hash"] == index["content_hash"]
    assert loaded["base_weights_bytes"] == index["bytes"]
    assert loaded["base_bytes_read"] <= 1.1 * index["bytes"]  # every rank's bytes, the job's total
    assert loaded["base_max_rank_bytes_read"] <= 0.35 * index["bytes"]  # a rank reads its quarter of the rows
    [recovery] = read_events(cfg.run_dir, "recovery")
    assert recovery["reload_source"] in ("memory", "peer") and recovery["fsx_bytes_read"] == 0


@pytest.mark.parametrize("damage, message", [
    ("truncate", r"model-00002-of-0000\d.safetensors: not a valid safetensors file"),
    ("config", r"config.json: model_type 'gpt2' is not a family this trainer builds"),
    # the corpus was tokenized with the byte tokenizer, not the model's: its BOS 256 is not the model's
    ("tokenizer", r"data.tokenizer \(byte\): its bos_token '<\|bos\|>' is id 256, but the base model "
                  r"\(model.init_from, .*config.json\) names bos_token_id 0 in config.json"),
])
def test_a_base_model_that_cannot_be_used_exits_2_naming_the_file(tmp_path, token_dir, damage, message):
    folder = tmp_path / "base"
    make_base_model(folder, generate_documents(100, seed=2), steps=1, shard="64KB")
    if damage == "truncate":
        path = sorted(folder.glob("*.safetensors"))[1]
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "config":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    command = [sys.executable, "-m", "trainer", "--config", "local", "--data-dir", str(token_dir),
               f"--run.work_dir={tmp_path}", "--run.run_id=bad-base", f"--model.init_from={folder}",
               f"--checkpoint.memory_dir={tmp_path}/node-memory"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.search(message, proc.stderr), proc.stderr[-3000:]
