"""The stage steps: stage the inputs (what the cached KFP stage task runs, for any run over the same inputs: the
base model and the tokenizer from S3, checked; each corpus), tokenize the corpora's file groups into shards and
collect them (cached tasks too), and record a staging (fresh or from KFP's cache) as this run's stage step in
MLflow.

The trainer's data folder (``cfg.dataset_dir``) is the one corpus's, or with data.datasets the mixture's: a
tokens.json naming each corpus's folder and weight, and a stage manifest listing the corpora and the models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from components import tracking
from components.context import step_context, write_step_result
from components.stage.models import stage_models
from components.stage.s3_copy import StageError
from components.stage.shards import collect_shards, dataset_lock, tokenize_group, write_mixture
from components.stage.staging import STAGE_ERROR, STAGE_MANIFEST, make_folder, stage_dataset
from trainer.config import Config, DatasetConfig
from trainer.config.rules import InputError
from trainer.data.conversations import conversation_format
from trainer.data.tokenizer import load_tokenizer
from trainer.run.run_dir import read_json, write_json


def staging_config_json(cfg: Config) -> str:
    """What the stage step depends on and nothing else (no run id, trigger or training settings): its KFP
    cache key is this plus the listings' fingerprint, so runs over unchanged inputs share one staging."""
    return json.dumps({"run": {"work_dir": str(cfg.work_dir)}, "data": cfg.to_dict()["data"],
                       "model": {"init_from": cfg.model.init_from}}, sort_keys=True, separators=(",", ":"))


@contextlib.contextmanager
def recording_stage_error(cfg: Config) -> Iterator[None]:
    """A failure of a stage, tokenize or collect task is also written to <dataset_dir>/stage.error.json,
    where the exit handler finds it (a cached task cannot know the pipeline run it serves)."""
    error_path = cfg.dataset_dir / STAGE_ERROR
    try:
        yield
    except BaseException as err:
        make_folder(cfg.dataset_dir)
        write_json(error_path, {"step": "stage", "error_type": type(err).__name__, "message": str(err),
                                "input_error": isinstance(err, InputError), "traceback": traceback.format_exc(),
                                "time": time.time()})
        raise


def _field_of(cfg: Config, index: int) -> str:
    return f"data.datasets[{index}].s3_uri" if cfg.data.mixed else "data.s3_uri"


def run_stage(cfg: Config, data_fingerprint: str = "", *, tokenize: bool = True) -> dict[str, Any]:
    """Stage the inputs (no MLflow, nothing in the run folder). With tokenize=False the result's "token_groups"
    (every corpus's) are left for run_tokenize_shard, and run_collect_shards completes the result."""
    (cfg.dataset_dir / STAGE_ERROR).unlink(missing_ok=True)
    started = time.perf_counter()
    with recording_stage_error(cfg):
        models = stage_models(cfg)  # first: the tokenizer the corpora are tokenized with
        tokenizer = {"source": cfg.tokenizer_source, "dir": cfg.tokenizer_spec,
                     "content_hash": load_tokenizer(cfg.tokenizer_spec).content_hash()}
        manifests = [stage_dataset(cfg.data, cfg.dataset_dir_of(source.name), cfg.fsx_root, tokenize=tokenize,
                                   source=source, tokenizer=cfg.tokenizer_spec, field=_field_of(cfg, index),
                                   conversations=conversation_format(cfg.data, cfg.training.seq_len))
                     for index, source in enumerate(cfg.data.sources())]
        manifest_hash = (manifests[0]["manifest_hash"] if not cfg.data.mixed else hashlib.sha256(json.dumps(
            [[m["dataset"], m["weight"], m["manifest_hash"]] for m in manifests]).encode()).hexdigest())
        tokens = (_mixture(cfg, manifests) if cfg.data.mixed else manifests[0]["tokens"]) if tokenize else None
        _write_data_manifest(cfg, manifests, models, tokenizer, manifest_hash, tokens)
    staged = {"data_dir": str(cfg.dataset_dir), "s3_uri": ", ".join(m["s3_uri"] for m in manifests),
              "mode": cfg.data.stage_mode, "objects": sum(m["object_count"] for m in manifests),
              "bytes": sum(m["bytes"] for m in manifests), "downloaded": sum(m["downloaded"] for m in manifests),
              "deleted": sum(len(m["deleted"]) for m in manifests),
              "skipped": sum(m["skipped_count"] for m in manifests),
              "unknown_files": sum(m["unknown_files_count"] for m in manifests),
              "manifest_hash": manifest_hash, "dra": manifests[0]["dra"], "data_fingerprint": data_fingerprint,
              "datasets": [_dataset_summary(m) for m in manifests], "models": [_model_summary(m) for m in models],
              "tokenizer": tokenizer,
              "stage_seconds": time.perf_counter() - started,
              "token_groups": [group for m in manifests for group in m["token_groups"]]}
    if not tokenize:
        return staged
    return _with_tokens({**staged, "tokenize_seconds": sum(m["tokenize_seconds"] for m in manifests)}, tokens)


def _dataset_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: manifest[key] for key in ("dataset", "s3_uri", "weight", "text_field", "dataset_dir", "object_count",
                                           "bytes", "downloaded", "unknown_files_count", "manifest_hash", "tokens")}


def _model_summary(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: manifest[key] for key in ("kind", "field", "s3_uri", "dir", "object_count", "bytes", "downloaded",
                                           "content_hash", "parameters", "tokenizer_hash", "chat_template")
            if key in manifest}


def _write_data_manifest(cfg: Config, manifests: list[dict[str, Any]], models: list[dict[str, Any]],
                         tokenizer: dict[str, Any], manifest_hash: str, tokens: dict[str, Any] | None) -> None:
    """The data folder's stage manifest: the corpus's own (one corpus) or the mixture's, with the models staged and
    the tokenizer the tokens are of (where it came from, its content hash)."""
    path = cfg.dataset_dir / STAGE_MANIFEST
    if not cfg.data.mixed:
        write_json(path, {**manifests[0], "models": [_model_summary(m) for m in models], "tokenizer": tokenizer})
        return
    make_folder(cfg.dataset_dir)
    write_json(path, {"mode": cfg.data.stage_mode, "mixture": True, "manifest_hash": manifest_hash,
                      "datasets": [_dataset_summary(m) for m in manifests],
                      "models": [_model_summary(m) for m in models], "tokenizer": tokenizer, "tokens": tokens})


def _mixture(cfg: Config, manifests: list[dict[str, Any]]) -> dict[str, Any]:
    sources = {source.name: source for source in cfg.data.sources()}
    return write_mixture(cfg.dataset_dir, [(sources[m["dataset"]], Path(m["dataset_dir"]), m["tokens"])
                                           for m in manifests])


def _with_tokens(staged: dict[str, Any], tokens: dict[str, Any]) -> dict[str, Any]:
    splits = tokens["splits"]
    return {**staged, "content_hash": tokens["content_hash"], "token_shards": len(staged["token_groups"]),
            "train_tokens": splits["train"]["tokens"], "val_tokens": splits["val"]["tokens"]}


def _tokenize_seconds(shards: list[dict[str, Any]]) -> float:
    return max(shard["seconds"] for shard in shards)  # the tasks run side by side: the slowest is the wall time


def _source(cfg: Config, name: str) -> DatasetConfig:
    return next(source for source in cfg.data.sources() if source.name == name)


def run_tokenize_shard(cfg: Config, group: dict[str, Any]) -> dict[str, Any]:
    """One planned group into its token shard (sharing its corpus's lock with the other groups' tasks)."""
    source = _source(cfg, group["dataset"])
    dataset_dir = cfg.dataset_dir_of(source.name)
    with recording_stage_error(cfg), dataset_lock(dataset_dir, shared=True):
        return {**tokenize_group(group, dataset_dir, cfg.data.val_fraction, cfg.tokenizer_spec, source.text_field,
                                 conversation_format(cfg.data, cfg.training.seq_len)),
                "dataset": source.name}


def run_collect_shards(cfg: Config, shards: list[dict[str, Any]], staged: dict[str, Any]) -> dict[str, Any]:
    """Each corpus's tokens.json from its tokenized shards, its stage manifest completed with it; with several
    corpora, the mixture's tokens.json too."""
    started = time.perf_counter()
    with recording_stage_error(cfg):
        for summary in staged["datasets"]:
            source = _source(cfg, summary["dataset"])
            dataset_dir = cfg.dataset_dir_of(source.name)
            with dataset_lock(dataset_dir):
                mine = [shard for shard in shards if shard["dataset"] == source.name]
                summary["tokens"] = collect_shards(mine, dataset_dir, cfg.data.val_fraction, cfg.tokenizer_spec,
                                                   source.text_field,
                                                   conversation_format(cfg.data, cfg.training.seq_len))
                manifest_path = dataset_dir / STAGE_MANIFEST
                manifest = read_json(manifest_path)
                if manifest is None or manifest.get("manifest_hash") != summary["manifest_hash"]:
                    raise StageError(f"{manifest_path} is not the one this run's stage task wrote (another run staged "
                                     "other data into the same folder meanwhile?): run the pipeline again")
                write_json(manifest_path, {**manifest, "tokens": summary["tokens"]})
        tokens = (write_mixture(cfg.dataset_dir, [(_source(cfg, d["dataset"]), Path(d["dataset_dir"]), d["tokens"])
                                                  for d in staged["datasets"]])
                  if cfg.data.mixed else staged["datasets"][0]["tokens"])
        path = cfg.dataset_dir / STAGE_MANIFEST
        if cfg.data.mixed:
            write_json(path, {**(read_json(path) or {}), "tokens": tokens})
    return _with_tokens({**staged, "stage_seconds": staged["stage_seconds"] + time.perf_counter() - started,
                         "tokenize_seconds": _tokenize_seconds(shards)}, tokens)


def run_record_stage(cfg: Config, staged: dict[str, Any]) -> dict[str, Any]:
    with step_context(cfg, "stage") as (mlflow, run):
        mlflow.log_metrics(run, [{
            "step": 0, "objects": staged["objects"], "bytes": staged["bytes"],
            "downloaded_objects": staged["downloaded"], "stage_seconds": staged["stage_seconds"],
            "train_tokens": staged["train_tokens"], "val_tokens": staged["val_tokens"],
            "token_shards": staged["token_shards"], "tokenize_seconds": staged["tokenize_seconds"],
            "unknown_files_skipped": staged["unknown_files"],
            **{f"train_tokens/{d['dataset']}": d["tokens"]["splits"]["train"]["tokens"]
               for d in staged["datasets"] if cfg.data.mixed and d.get("tokens")}}])
        hashes = {"dataset_content_hash": staged["content_hash"], "dataset_manifest_hash": staged["manifest_hash"]}
        for model in staged["models"]:  # what a run started from: its URI and content hash
            prefix = "base_model" if model["kind"] == "model" else "tokenizer"
            hashes[f"{prefix}_uri"] = model["s3_uri"]
            hashes[f"{prefix}_content_hash"] = model.get("content_hash") or model.get("tokenizer_hash") or ""
        tokenizer = staged.get("tokenizer")  # (a staging cached by an earlier release has none)
        if tokenizer:  # the tokenizer's identity beside the model's, whichever it is (the base model's own, byte)
            hashes.update(tokenizer_uri=tokenizer["source"], tokenizer_content_hash=tokenizer["content_hash"])
        mlflow.set_tags(run, {"stage_mode": staged["mode"], **hashes})
        mlflow.set_tags(tracking.PARENT, hashes)  # runs are compared by the data and the base model they trained on
        mlflow.log_artifact(run, Path(staged["data_dir"]) / STAGE_MANIFEST)
        for model in staged["models"]:
            mlflow.log_artifact(run, Path(model["dir"]).parent / STAGE_MANIFEST,
                                artifact_path=f"models/{model['kind']}")
        write_step_result(cfg, "stage", staged)
    return staged
