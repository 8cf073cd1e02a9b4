"""The stage steps: stage the data (what the cached KFP stage task runs, for any run over the same data), tokenize
its file groups into shards and collect them (cached tasks too), and record a staging (fresh or from KFP's
cache) as this run's stage step in MLflow."""

from __future__ import annotations

import contextlib
import json
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from components import tracking
from components.context import step_context, write_step_result
from components.stage.s3_copy import StageError
from components.stage.shards import collect_shards, dataset_lock, tokenize_group
from components.stage.staging import STAGE_ERROR, STAGE_MANIFEST, stage_dataset
from trainer.config import Config
from trainer.run.run_dir import read_json, write_json


def staging_config_json(cfg: Config) -> str:
    """What the stage step depends on and nothing else (no run id, trigger or training settings): its KFP
    cache key is this plus the listing's fingerprint, so runs over unchanged data share one staging."""
    return json.dumps({"run": {"work_dir": str(cfg.work_dir)}, "data": cfg.to_dict()["data"]}, sort_keys=True,
                      separators=(",", ":"))


@contextlib.contextmanager
def recording_stage_error(cfg: Config) -> Iterator[None]:
    """A failure of a stage, tokenize or collect task is also written to <dataset_dir>/stage.error.json,
    where the exit handler finds it (a cached task cannot know the pipeline run it serves)."""
    error_path = cfg.dataset_dir / STAGE_ERROR
    try:
        yield
    except BaseException as err:
        write_json(error_path, {"step": "stage", "error_type": type(err).__name__, "message": str(err),
                                "traceback": traceback.format_exc(), "time": time.time()})
        raise


def run_stage(cfg: Config, data_fingerprint: str = "", *, tokenize: bool = True) -> dict[str, Any]:
    """Stage the data (no MLflow, nothing in the run folder). With tokenize=False the result's "token_groups"
    are left for run_tokenize_shard, and run_collect_shards completes the result."""
    (cfg.dataset_dir / STAGE_ERROR).unlink(missing_ok=True)
    with recording_stage_error(cfg):
        manifest = stage_dataset(cfg.data, cfg.dataset_dir, cfg.fsx_root, tokenize=tokenize)
    staged = {"data_dir": str(cfg.dataset_dir), "s3_uri": cfg.data.s3_uri, "mode": manifest["mode"],
              "objects": manifest["object_count"], "bytes": manifest["bytes"], "downloaded": manifest["downloaded"],
              "deleted": len(manifest["deleted"]), "skipped": manifest["skipped_count"],
              "manifest_hash": manifest["manifest_hash"], "dra": manifest["dra"], "data_fingerprint": data_fingerprint,
              "stage_seconds": manifest["stage_seconds"], "token_groups": manifest["token_groups"]}
    if not tokenize:
        return staged
    return _with_tokens({**staged, "tokenize_seconds": manifest["tokenize_seconds"]}, manifest["tokens"])


def _with_tokens(staged: dict[str, Any], tokens: dict[str, Any]) -> dict[str, Any]:
    splits = tokens["splits"]
    return {**staged, "content_hash": tokens["content_hash"], "token_shards": len(tokens["shards"]),
            "train_tokens": splits["train"]["tokens"], "val_tokens": splits["val"]["tokens"]}


def _tokenize_seconds(shards: list[dict[str, Any]]) -> float:
    return max(shard["seconds"] for shard in shards)  # the tasks run side by side: the slowest is the wall time


def run_tokenize_shard(cfg: Config, group: dict[str, Any]) -> dict[str, Any]:
    """One planned group into its token shard (sharing the dataset's lock with the other groups' tasks)."""
    with recording_stage_error(cfg), dataset_lock(cfg.dataset_dir, shared=True):
        return tokenize_group(group, cfg.dataset_dir, cfg.data.val_fraction, cfg.data.tokenizer)


def run_collect_shards(cfg: Config, shards: list[dict[str, Any]], staged: dict[str, Any]) -> dict[str, Any]:
    """The dataset's tokens.json from the tokenized shards, and the stage manifest completed with it."""
    started = time.perf_counter()
    with recording_stage_error(cfg), dataset_lock(cfg.dataset_dir):
        tokens = collect_shards(shards, cfg.dataset_dir, cfg.data.val_fraction, cfg.data.tokenizer)
        manifest_path = cfg.dataset_dir / STAGE_MANIFEST
        manifest = read_json(manifest_path)
        if manifest is None or manifest.get("manifest_hash") != staged["manifest_hash"]:
            raise StageError(f"{manifest_path} is not the one this run's stage task wrote (another run staged other "
                             "data into the same data.dataset_name meanwhile?): run the pipeline again")
        write_json(manifest_path, {**manifest, "tokens": tokens})
    return _with_tokens({**staged, "stage_seconds": staged["stage_seconds"] + time.perf_counter() - started,
                         "tokenize_seconds": _tokenize_seconds(shards)}, tokens)


def run_record_stage(cfg: Config, staged: dict[str, Any]) -> dict[str, Any]:
    with step_context(cfg, "stage") as (mlflow, run):
        mlflow.log_metrics(run, [{
            "step": 0, "objects": staged["objects"], "bytes": staged["bytes"],
            "downloaded_objects": staged["downloaded"], "stage_seconds": staged["stage_seconds"],
            "train_tokens": staged["train_tokens"], "val_tokens": staged["val_tokens"],
            "token_shards": staged["token_shards"], "tokenize_seconds": staged["tokenize_seconds"]}])
        hashes = {"dataset_content_hash": staged["content_hash"], "dataset_manifest_hash": staged["manifest_hash"]}
        mlflow.set_tags(run, {"stage_mode": staged["mode"], **hashes})
        mlflow.set_tags(tracking.PARENT, hashes)  # runs are compared by the data they trained on
        mlflow.log_artifact(run, Path(staged["data_dir"]) / STAGE_MANIFEST)
        write_step_result(cfg, "stage", staged)
    return staged
