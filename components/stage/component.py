"""The stage steps as KFP components: the listing's fingerprint, the cached staging, and this run's record
of it (their logic: step.py)."""

from typing import NamedTuple

from kfp.dsl import Dataset, Input, Output


def fingerprint_data(config_json: str, overrides: list) -> NamedTuple("Outputs", [("fingerprint", str),
                                                                               ("stage_config", str)]):
    """The S3 prefix's listing hash (keys, sizes, ETags) and the staging-only config: together the stage
    step's cache key, free of per-run values. Never fails."""
    # Imports inside: KFP runs this function's source alone in the task.
    from collections import namedtuple

    from components.context import resolve_config
    from components.stage.staging import data_fingerprint
    from components.stage.step import staging_config_json
    from trainer import logs

    logs.configure()
    cfg = resolve_config(config_json, overrides, "fingerprint")
    return namedtuple("Outputs", ["fingerprint", "stage_config"])(data_fingerprint(cfg.data), staging_config_json(cfg))


def stage_data(stage_config: str, data_fingerprint: str, dataset: Output[Dataset]) -> str:
    """S3 → the FSx path, tokenized; returns the dataset folder. Cached: the same data is staged once."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_stage
    from trainer import logs

    logs.configure()
    result = run_stage(resolve_config(stage_config, [], "stage"), data_fingerprint)
    with open(dataset.path, "w") as handle:
        json.dump(result, handle, indent=2)
    dataset.metadata.update({k: result[k] for k in ("s3_uri", "mode", "objects", "bytes", "content_hash",
                                                    "manifest_hash")})
    return result["data_dir"]


def record_stage(config_json: str, overrides: list, kfp_job_id: str, dataset: Input[Dataset]) -> str:
    """Log the (possibly cached) staging to this run's MLflow run; returns the dataset folder."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_record_stage
    from trainer import logs

    logs.configure()
    with open(dataset.path) as handle:
        staged = json.load(handle)
    return run_record_stage(resolve_config(config_json, overrides, kfp_job_id), staged)["data_dir"]
