"""A real job's inputs, end to end through the CLI as a user runs it: a base model and its tokenizer in S3 (a small
Llama-family model with GQA, tied embeddings and llama3 rope scaling, saved with save_pretrained over several
safetensors files; a BPE tokenizer trained here, with its BOS, EOS and a chat template), two corpora (.jsonl.gz with
the text in "content", .parquet) mixed 3:1, from S3 on loopback to the registered model. data.tokenizer is not set:
the base model's own tokenizer, beside its weights, is the one used."""

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import boto3
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.demo_data import generate_documents
from tests.base_model import CHAT_TEMPLATE, loss_of, make_base_model
from trainer.config.rules import staged_folder_name
from trainer.data.batches import TokenBatches
from trainer.data.tokenizer import load_tokenizer
from trainer.model.base import BASE_INDEX
from trainer.run.events import read_events
from trainer.run.run_dir import read_jsonl

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BASE = "s3://models/base-models/tiny-llama"
DATASETS = ('[{name: web, s3_uri: "s3://corpus/datasets/web", weight: 3, text_field: content},'
            ' {name: code, s3_uri: "s3://corpus/datasets/code", weight: 1}]')
SHAPE = ["--training.num_steps=4", "--checkpoint.interval_steps=2", "--training.batch_size=4",
         "--training.seq_len=32", "--training.warmup_steps=1", "--eval.max_batches=2", "--faults.schedule=",
         "--eval.max_new_tokens=4"]


def run_cli(command: str, work: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "pipelines", command, "--config", "local", f"--run.work_dir={work}",
            "--local.s3_server=false", "--local.upload_demo_data=false", *overrides]
    return subprocess.run(args, cwd=work, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _upload_folder(s3, folder: Path, bucket: str, prefix: str) -> None:
    for path in sorted(folder.iterdir()):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.name}")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The S3 server on loopback (boto3 and the CLI find it through AWS_ENDPOINT_URL_S3) with the base model, its
    tokenizer and the two corpora in it, as a user uploads them."""
    from pipelines.local_stack import S3Server

    scratch = tmp_path_factory.mktemp("inputs")
    texts = generate_documents(600, seed=3)
    base = scratch / "tiny-llama"
    tokenizer = make_base_model(base, texts)
    with S3Server(log_dir=scratch / "s3-logs"):
        s3 = boto3.client("s3")
        for bucket in ("models", "corpus"):
            s3.create_bucket(Bucket=bucket)
        _upload_folder(s3, base, "models", "base-models/tiny-llama")
        web = "".join(json.dumps({"content": text, "url": f"https://example.com/{i}"}) + "\n"
                      for i, text in enumerate(texts[:400]))
        s3.put_object(Bucket="corpus", Key="datasets/web/part-0.jsonl.gz", Body=gzip.compress(web.encode()))
        table = scratch / "code.parquet"
        pq.write_table(pa.table({"text": texts[400:], "lang": ["en"] * 200}), table)
        s3.upload_file(str(table), "corpus", "datasets/code/part-0.parquet")
        s3.put_object(Bucket="corpus", Key="datasets/code/_SUCCESS", Body=b"")  # what Spark leaves: no documents
        yield {"s3": s3, "base": base, "tokenizer": tokenizer, "texts": texts}


@pytest.fixture(scope="module")
def run(inputs, tmp_path_factory):
    work = tmp_path_factory.mktemp("cpt")
    proc = run_cli("run", work, "--run.run_id=cpt", f"--model.init_from={BASE}",  # data.tokenizer unset
                   f"--data.datasets={DATASETS}", "--data.dataset_name=mix", *SHAPE)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return {"work": work, "proc": proc, "run_dir": work / "fsx" / "runs" / "cpt"}


def test_the_first_step_trains_the_base_models_weights_on_the_mixtures_first_samples(run, inputs):
    """The loss of step 1 is the base model's own loss (plain transformers, its files from the test's folder) on
    the step's global samples [0, 8): 2 ranks x batch 4, read back through the sample order."""
    [first] = [r for r in read_jsonl(run["run_dir"] / "metrics.jsonl") if r["step"] == 1]
    batches = TokenBatches.open(run["work"] / "fsx" / "datasets" / "mix", "train", seq_len=32, batch_size=4, seed=1234)
    inputs_, labels = batches.samples(np.arange(8))
    expected = loss_of(inputs["base"], inputs_, labels)
    assert first["first_sample"] == 0 and first["samples"] == 8
    assert first["loss"] == pytest.approx(expected, rel=1e-4)
    random_init = float(np.log(len(inputs["tokenizer"])))  # what an untrained model of this vocabulary scores
    assert expected < random_init - 1.0
    [loaded] = read_events(run["run_dir"], "base_model_loaded")
    assert loaded["base_bytes_read"] <= 1.1 * loaded["base_weights_bytes"] and loaded["ranks"] == 2


def test_the_corpora_are_mixed_by_weight_and_the_unknown_file_is_counted(run):
    last = read_jsonl(run["run_dir"] / "metrics.jsonl")[-1]
    assert last["samples_seen"] == 32 and last["tokens_seen"] == 32 * 32
    assert (last["samples/web"], last["samples/code"]) == (24, 8)
    assert 0 < last["epoch/code"] and last["epoch"] == max(last["epoch/web"], last["epoch/code"])
    stage = json.loads((run["run_dir"] / "steps" / "stage.json").read_text())
    assert stage["unknown_files"] == 1 and {d["dataset"]: d["text_field"] for d in stage["datasets"]} == \
        {"web": "content", "code": "text"}
    assert "1 file(s) of no document format skipped (data.unknown_files)" in run["proc"].stdout  # on the console
    mixture = json.loads((run["work"] / "fsx" / "datasets" / "mix" / "tokens.json").read_text())
    assert [(m["name"], m["weight"]) for m in mixture["mixture"]] == [("web", 3.0), ("code", 1.0)]
    manifest = json.loads((run["work"] / "fsx" / "datasets" / "code" / "stage-manifest.json").read_text())
    assert manifest["unknown_files"] == ["_SUCCESS"] and manifest["unknown_files_count"] == 1


def test_the_staged_model_and_its_tokenizer_are_recorded_with_their_uri_and_content_hash(run):
    """The model's folder is named by its whole URI (tiny-llama-<hash>) and its manifest names the URI; its own
    tokenizer (data.tokenizer unset) is what the corpora were tokenized with, and its content hash is in the stage
    manifest, tokens.json, the checkpoint's manifest and MLflow beside the model's."""
    from mlflow.tracking import MlflowClient

    staged = run["work"] / "fsx" / "models" / staged_folder_name(BASE)
    assert staged.name.startswith("tiny-llama-") and not (run["work"] / "fsx" / "models" / "tiny-llama").exists()
    index = json.loads((staged / BASE_INDEX).read_text())
    assert len(index["files"]) == 4 and (staged / "hf" / "config.json").is_file()
    assert json.loads((staged / "stage-manifest.json").read_text())["s3_uri"] == BASE
    tokenizer_hash = load_tokenizer(str(staged / "hf")).content_hash()
    stage = json.loads((run["run_dir"] / "steps" / "stage.json").read_text())
    [model] = stage["models"]  # the tokenizer's prefix is the model's: staged once
    assert model["s3_uri"] == BASE and model["content_hash"] == index["content_hash"] and model["chat_template"]
    assert model["tokenizer_hash"] == tokenizer_hash
    assert stage["tokenizer"] == {"source": BASE, "dir": str(staged / "hf"), "content_hash": tokenizer_hash}
    data_manifest = json.loads((run["work"] / "fsx" / "datasets" / "mix" / "stage-manifest.json").read_text())
    assert data_manifest["models"][0]["content_hash"] == index["content_hash"]
    assert data_manifest["tokenizer"]["content_hash"] == tokenizer_hash
    tokens = json.loads((run["work"] / "fsx" / "datasets" / "mix" / "tokens.json").read_text())
    assert tokens["tokenizer"] == str(staged / "hf") and tokens["tokenizer_hash"] == tokenizer_hash
    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    parent = MlflowClient(summary["mlflow_tracking_uri"]).get_run(summary["mlflow_parent_run_id"])
    assert parent.data.tags["base_model_uri"] == BASE
    assert parent.data.tags["base_model_content_hash"] == index["content_hash"]
    assert parent.data.tags["tokenizer_uri"] == BASE and parent.data.tags["tokenizer_content_hash"] == tokenizer_hash
    manifest = json.loads(Path(summary["checkpoint"], "manifest.json").read_text())
    assert manifest["base_model"] == {"init_from": BASE, "content_hash": index["content_hash"]}
    assert manifest["tokenizer"] == str(staged / "hf") and manifest["tokenizer_hash"] == tokenizer_hash


def test_the_registered_model_loads_in_plain_transformers_with_the_tokenizers_chat_template(run, inputs, tmp_path):
    import mlflow
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = json.loads((run["run_dir"] / "summary.json").read_text())
    assert summary["status"] == "succeeded" and summary["promotion"]["promote"]
    client = MlflowClient(summary["mlflow_tracking_uri"])
    version = client.get_model_version_by_alias("resilient-train-llama", "champion")
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(tmp_path),
                                                      tracking_uri=summary["mlflow_tracking_uri"]))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    original = inputs["tokenizer"]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    messages = [{"role": "user", "content": "the cat sat"}]
    assert tokenizer.apply_chat_template(messages) == original.apply_chat_template(messages)
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    assert model.config.rope_parameters["rope_type"] == "llama3"
    assert (model.config.bos_token_id, model.config.eos_token_id) == (original.bos_token_id, original.eos_token_id)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    output = model.generate(**prompt, max_new_tokens=3, do_sample=False) if hasattr(prompt, "keys") else \
        model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert output.shape[-1] > 3


def _corrupt_copy(inputs, prefix: str) -> str:
    """The base model again under another prefix, one safetensors file cut short."""
    s3, base = inputs["s3"], inputs["base"]
    _upload_folder(s3, base, "models", prefix)
    victim = sorted(base.glob("*.safetensors"))[1]
    s3.put_object(Bucket="models", Key=f"{prefix}/{victim.name}", Body=victim.read_bytes()[:-64])
    return victim.name


def _small_vocabulary(inputs, prefix: str) -> str:
    folder = inputs["base"].parent / "small-vocab"
    make_base_model(folder, inputs["texts"][:100], steps=0, vocab_size=200)  # rows for 200 of its 384 ids
    _upload_folder(inputs["s3"], folder, "models", prefix)
    return ""


def _other_eos(inputs, prefix: str) -> str:
    """The base model again, its generation_config.json naming other EOS ids than its tokenizer's."""
    _upload_folder(inputs["s3"], inputs["base"], "models", prefix)
    generation = json.loads((inputs["base"] / "generation_config.json").read_text())
    inputs["s3"].put_object(Bucket="models", Key=f"{prefix}/generation_config.json",
                            Body=json.dumps({**generation, "eos_token_id": [7, 8]}).encode())
    return ""


def _no_tokenizer(inputs, prefix: str) -> str:
    """The base model's config and weights without its tokenizer files."""
    for path in sorted(inputs["base"].iterdir()):
        if path.name == "config.json" or path.suffix == ".safetensors" or path.name.endswith(".index.json"):
            inputs["s3"].upload_file(str(path), "models", f"{prefix}/{path.name}")
    return ""


def _no_text_field(inputs, prefix: str) -> str:
    inputs["s3"].put_object(Bucket="corpus", Key=f"{prefix}/a.jsonl", Body=b'{"content": "ok"}\n{"body": "x"}\n')
    return ""


def _corrupt_gzip(inputs, prefix: str) -> str:
    data = bytearray(gzip.compress("".join(json.dumps({"content": t}) + "\n" for t in inputs["texts"]).encode()))
    data[len(data) // 2:len(data) // 2 + 32] = bytes(32)
    inputs["s3"].put_object(Bucket="corpus", Key=f"{prefix}/a.jsonl.gz", Body=bytes(data))
    return ""


@pytest.mark.parametrize("case, prepare, overrides, message", [
    ("missing-weights", None, [f"--model.init_from={BASE}-missing"],
     r"no objects under s3://models/base-models/tiny-llama-missing \(model.init_from\)"),
    ("corrupt-weights", _corrupt_copy, ["--model.init_from=s3://models/base-models/corrupt"],
     r"{victim}: not a valid safetensors file"),
    ("tokenizer-mismatch", _small_vocabulary, ["--model.init_from=s3://models/base-models/small-vocab"],
     r"data.tokenizer \(.*\) has 384 ids, the base model \(model.init_from, .*\) a vocabulary of 200"),
    ("byte-with-base", None, ["--data.tokenizer=byte"],
     r"data.tokenizer: 'byte' with model.init_from=s3://models/base-models/tiny-llama: a base model is trained "
     r"further with the tokenizer it was trained with"),
    ("other-eos", _other_eos, ["--model.init_from=s3://models/base-models/other-eos"],
     r"data.tokenizer \(.*\): its eos_token '<\|end_of_text\|>' is id 1, but the base model \(model.init_from, "
     r".*\) names eos_token_id \[7, 8\] in generation_config.json"),
    ("no-tokenizer", _no_tokenizer, ["--model.init_from=s3://models/base-models/no-tokenizer"],
     r"data.tokenizer is unset, so the base model's own tokenizer is used, but "
     r"model.init_from=s3://models/base-models/no-tokenizer staged no tokenizer.json"),
    ("no-text-field", _no_text_field, ['--data.datasets=[{name: nofield, s3_uri: "s3://corpus/datasets/nofield", '
                                       'text_field: content}]'],
     r"a.jsonl:2: no 'content' field \(data.text_field\)"),
    ("corrupt-gzip", _corrupt_gzip, ['--data.datasets=[{name: badgz, s3_uri: "s3://corpus/datasets/badgz", '
                                     'text_field: content}]'],
     r"a.jsonl.gz: corrupt gzip stream at compressed bytes \d+-\d+"),
    ("zero-weight", None, ['--data.datasets=[{name: web, s3_uri: "s3://corpus/datasets/web", weight: 0}]'],
     r"data.datasets\[0\].weight: must be > 0, got 0.0"),
])
def test_a_bad_input_is_one_line_naming_it_and_exit_2_before_training(inputs, tmp_path, case, prepare, overrides,
                                                                     message):
    prefix = {"corrupt-weights": "base-models/corrupt", "tokenizer-mismatch": "base-models/small-vocab",
              "other-eos": "base-models/other-eos", "no-tokenizer": "base-models/no-tokenizer",
              "no-text-field": "datasets/nofield", "corrupt-gzip": "datasets/badgz"}.get(case)
    victim = prepare(inputs, prefix) if prepare else ""
    base = [] if any(o.startswith("--model.init_from") for o in overrides) else [f"--model.init_from={BASE}"]
    proc = run_cli("stage", tmp_path, f"--data.datasets={DATASETS}", "--data.dataset_name=mix", *base, *overrides)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert re.search(message.format(victim=re.escape(victim)), line), line
    assert not (tmp_path / "fsx" / "runs").exists()  # nothing trained


def test_the_pipeline_stops_at_the_stage_with_exit_2_when_the_weights_are_missing(inputs, tmp_path):
    proc = run_cli("run", tmp_path, "--run.run_id=missing", f"--model.init_from={BASE}-missing",
                   f"--data.datasets={DATASETS}", "--data.dataset_name=mix", *SHAPE)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "fsx" / "runs" / "missing" / "summary.json").read_text())
    [error] = summary["errors"]
    assert error["step"] == "stage" and error["input_error"] and "model.init_from" in error["message"]
    assert summary["steps"]["train"] is None
