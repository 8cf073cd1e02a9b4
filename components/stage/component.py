"""The stage steps as KFP components: the listing's fingerprint, the cached staging, tokenizing and collecting
(one tokenize task per file group, under dsl.ParallelFor), and this run's record of it (their logic: step.py)."""

from typing import List, NamedTuple

from kfp.dsl import Dataset, Input, Output


def fingerprint_data(config_json: str, overrides: list) -> NamedTuple("Outputs", [("fingerprint", str),
                                                                               ("stage_config", str)]):
    """The staged S3 prefixes' listing hash (keys, sizes, ETags: each corpus, the base model, the tokenizer) and
    the staging-only config: together the stage step's cache key, free of per-run values. Never fails."""
    # Imports inside: KFP runs this function's source alone in the task.
    from collections import namedtuple

    from components.context import resolve_config
    from components.stage.staging import data_fingerprint
    from components.stage.step import staging_config_json
    from trainer.observe import logs

    logs.configure()
    cfg = resolve_config(config_json, overrides, "fingerprint")
    return namedtuple("Outputs", ["fingerprint", "stage_config"])(data_fingerprint(cfg), staging_config_json(cfg))


def stage_data(stage_config: str, data_fingerprint: str, staged: Output[Dataset]) -> List[str]:
    """S3 → the FSx path; returns the tokenize groups (JSON, one per tokenize task). Cached: the same data is
    staged once."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_stage
    from trainer.observe import logs

    logs.configure()
    result = run_stage(resolve_config(stage_config, [], "stage"), data_fingerprint, tokenize=False)
    with open(staged.path, "w") as handle:
        json.dump(result, handle, indent=2)
    staged.metadata.update({k: result[k] for k in ("s3_uri", "mode", "objects", "bytes", "manifest_hash")})
    # Each item carries the stage config and the fingerprint: the loop body reads nothing else (kfp 2.17's
    # local runner hands a ParallelFor body the loop item in place of every other task output it reads:
    # kfp/local/orchestrator/task_spec_utils.py, create_parameter_loop_iteration_task_spec). The fingerprint
    # also keys the tokenize task's cache.
    return [json.dumps({**group, "stage_config": stage_config, "data_fingerprint": data_fingerprint})
            for group in result["token_groups"]]


def tokenize_shard(group: str) -> str:
    """One group of staged files into its token shard (one ParallelFor iteration); returns the shard (JSON).
    Cached: the group names the data fingerprint."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_tokenize_shard
    from trainer.observe import logs

    logs.configure()
    item = json.loads(group)
    return json.dumps(run_tokenize_shard(resolve_config(item["stage_config"], [], "stage"), item))


def collect_shards(stage_config: str, data_fingerprint: str, shards: List[str], staged: Input[Dataset],
                   dataset: Output[Dataset]) -> str:
    """Every group's shard into the dataset's tokens.json and stage manifest; returns the dataset folder."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_collect_shards
    from trainer.observe import logs

    logs.configure()
    with open(staged.path) as handle:
        result = json.load(handle)
    result = run_collect_shards(resolve_config(stage_config, [], "stage"), [json.loads(s) for s in shards], result)
    with open(dataset.path, "w") as handle:
        json.dump(result, handle, indent=2)
    dataset.metadata.update({k: result[k] for k in ("s3_uri", "mode", "objects", "bytes", "content_hash",
                                                    "manifest_hash", "token_shards")})
    return result["data_dir"]


def record_stage(config_json: str, overrides: list, kfp_job_id: str, dataset: Input[Dataset]) -> str:
    """Log the (possibly cached) staging to this run's MLflow run; returns the dataset folder."""
    # Imports inside: KFP runs this function's source alone in the task.
    import json

    from components.context import resolve_config
    from components.stage.step import run_record_stage
    from trainer.observe import logs

    logs.configure()
    with open(dataset.path) as handle:
        staged = json.load(handle)
    return run_record_stage(resolve_config(config_json, overrides, kfp_job_id), staged)["data_dir"]
