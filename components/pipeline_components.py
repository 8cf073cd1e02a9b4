"""Thin KFP wrappers around components.steps: the logic lives there and is tested without KFP.

Every component takes the run's config (one line of JSON), the override list and KFP's job id, from which
components.steps.resolve_config rebuilds the same Config in every pod. Imports stay inside the function
bodies: KFP ships each body to its own process (or container on EKS).
"""

from kfp import dsl
from kfp.dsl import Dataset, Metrics, Output, PipelineTaskFinalStatus

# The project image on EKS (built from this repository); the local runner executes the same functions in
# this virtual environment. install_kfp_package=False: the image has kfp, and it saves ~0.6 s per step.
BASE_IMAGE = "public.ecr.aws/docker/library/python:3.11-slim"
COMPONENT = dict(base_image=BASE_IMAGE, install_kfp_package=False)


@dsl.component(**COMPONENT)
def prepare_run(config_json: str, overrides: list, kfp_job_id: str) -> str:
    """Validate the config, create the run folder and the MLflow parent run; returns the run folder."""
    import logging

    from components.steps import prepare_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return prepare_step(resolve_config(config_json, overrides, kfp_job_id))["run_dir"]


@dsl.component(**COMPONENT)
def stage_data(config_json: str, overrides: list, kfp_job_id: str, dataset: Output[Dataset]) -> str:
    """S3 → the FSx path, tokenized; returns the dataset folder the trainer reads."""
    import json
    import logging

    from components.steps import resolve_config, stage_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = stage_step(resolve_config(config_json, overrides, kfp_job_id))
    with open(dataset.path, "w") as handle:
        json.dump(result, handle, indent=2)
    dataset.metadata.update({k: result[k] for k in ("s3_uri", "mode", "objects", "bytes", "content_hash", "manifest_hash")})
    return result["data_dir"]


@dsl.component(**COMPONENT)
def train_model(config_json: str, overrides: list, kfp_job_id: str, data_dir: str, metrics: Output[Metrics]) -> str:
    """Run distributed training; returns the final committed checkpoint folder."""
    import logging

    from components.steps import resolve_config, train_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = train_step(resolve_config(config_json, overrides, kfp_job_id), data_dir)
    for key in ("steps", "final_loss", "wall_seconds"):
        metrics.log_metric(key, float(result[key]))
    return result["checkpoint"]


@dsl.component(**COMPONENT)
def validate_checkpoint(config_json: str, overrides: list, kfp_job_id: str, checkpoint: str,
                        report: Output[Metrics]) -> str:
    """Fail unless the checkpoint is complete, uncorrupted, reshardable and finite; returns it."""
    import logging

    from components.steps import resolve_config, validate_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = validate_step(resolve_config(config_json, overrides, kfp_job_id), checkpoint)
    for key in ("bytes", "files", "load_seconds", "num_checks"):
        report.log_metric(key, float(result[key]))
    return result["checkpoint"]


@dsl.component(**COMPONENT)
def evaluate_model(config_json: str, overrides: list, kfp_job_id: str, checkpoint: str, data_dir: str,
                   metrics: Output[Metrics]) -> float:
    """Held-out loss and perplexity; returns the held-out loss."""
    import logging

    from components.steps import evaluate_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = evaluate_step(resolve_config(config_json, overrides, kfp_job_id), checkpoint, data_dir)
    for key in ("heldout_loss", "perplexity", "eval_tokens_per_second"):
        metrics.log_metric(key, float(result[key]))
    return result["heldout_loss"]


@dsl.component(**COMPONENT)
def finalize_run(config_json: str, overrides: list, kfp_job_id: str, status: PipelineTaskFinalStatus):
    """Exit handler: writes summary.json and closes the MLflow parent run, whether the pipeline passed or not."""
    import logging

    from components.steps import finalize_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    finalize_step(resolve_config(config_json, overrides, kfp_job_id), status.state)
