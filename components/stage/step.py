"""The stage steps: stage the data (what the cached KFP stage task runs, for any run over the same data) and
record a staging (fresh or from KFP's cache) as this run's stage step in MLflow."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path
from typing import Any

from components import tracking
from components.context import step_context, write_step_result
from components.stage.staging import STAGE_ERROR, STAGE_MANIFEST, stage_dataset
from trainer.config import Config
from trainer.run_dir import write_json


def staging_config_json(cfg: Config) -> str:
    """What the stage step depends on and nothing else (no run id, trigger or training settings): its KFP
    cache key is this plus the listing's fingerprint, so runs over unchanged data share one staging."""
    return json.dumps({"run": {"work_dir": str(cfg.work_dir)}, "data": cfg.to_dict()["data"]}, sort_keys=True,
                      separators=(",", ":"))


def run_stage(cfg: Config, data_fingerprint: str = "") -> dict[str, Any]:
    """Stage the data (no MLflow, nothing in the run folder). A failure is also written to
    <dataset_dir>/stage.error.json, where the exit handler finds it (a cached task cannot know the pipeline
    run it serves)."""
    error_path = cfg.dataset_dir / STAGE_ERROR
    error_path.unlink(missing_ok=True)
    try:
        manifest = stage_dataset(cfg.data, cfg.dataset_dir, cfg.fsx_root)
    except BaseException as err:
        write_json(error_path, {"step": "stage", "error_type": type(err).__name__, "message": str(err),
                                "traceback": traceback.format_exc(), "time": time.time()})
        raise
    splits = manifest["tokens"]["splits"]
    return {"data_dir": str(cfg.dataset_dir), "s3_uri": cfg.data.s3_uri, "mode": manifest["mode"],
            "objects": manifest["object_count"], "bytes": manifest["bytes"], "downloaded": manifest["downloaded"],
            "deleted": len(manifest["deleted"]), "skipped": manifest["skipped_count"],
            "content_hash": manifest["tokens"]["content_hash"],
            "manifest_hash": manifest["manifest_hash"], "dra": manifest["dra"], "data_fingerprint": data_fingerprint,
            "stage_seconds": manifest["stage_seconds"], "train_tokens": splits["train"]["tokens"],
            "val_tokens": splits["val"]["tokens"]}


def run_record_stage(cfg: Config, staged: dict[str, Any]) -> dict[str, Any]:
    with step_context(cfg, "stage") as (mlflow, run):
        mlflow.log_metrics(run, [{
            "step": 0, "objects": staged["objects"], "bytes": staged["bytes"],
            "downloaded_objects": staged["downloaded"], "stage_seconds": staged["stage_seconds"],
            "train_tokens": staged["train_tokens"], "val_tokens": staged["val_tokens"]}])
        hashes = {"dataset_content_hash": staged["content_hash"], "dataset_manifest_hash": staged["manifest_hash"]}
        mlflow.set_tags(run, {"stage_mode": staged["mode"], **hashes})
        mlflow.set_tags(tracking.PARENT, hashes)  # runs are compared by the data they trained on
        mlflow.log_artifact(run, Path(staged["data_dir"]) / STAGE_MANIFEST)
        write_step_result(cfg, "stage", staged)
    return staged
