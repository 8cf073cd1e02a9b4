"""Thin KFP wrappers around components.steps: the logic lives there and is tested without KFP.

The functions below are plain Python; ``make_components(image)`` turns them into KFP components running
in the project's image (on EKS ``kubernetes.image``; the local runner executes them in this virtual
environment, where the image is not used). Imports stay inside the function bodies: KFP ships each body to
its own process (or container).

Every component takes the run's config (one line of JSON) and the override list, from which
components.steps.resolve_config rebuilds the same Config in every pod; all but the cached stage also take
KFP's job id (the run id when the config has none).
"""

from types import SimpleNamespace
from typing import NamedTuple

from kfp import dsl
from kfp.dsl import Dataset, Input, Metrics, Output, PipelineTaskFinalStatus


def prepare_run(config_json: str, overrides: list, kfp_job_id: str) -> str:
    """Validate the config, create the run folder and the MLflow parent run; returns the run folder."""
    import logging

    from components.steps import prepare_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return prepare_step(resolve_config(config_json, overrides, kfp_job_id))["run_dir"]


def fingerprint_data(config_json: str, overrides: list) -> NamedTuple("Outputs", [("fingerprint", str),
                                                                               ("stage_config", str)]):
    """The S3 prefix's listing hash (keys, sizes, ETags) and the staging-only config: together the stage
    step's cache key, free of per-run values. Never fails."""
    import logging
    from collections import namedtuple

    from components.stage import data_fingerprint
    from components.steps import resolve_config, staging_config_json

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = resolve_config(config_json, overrides, "fingerprint")
    return namedtuple("Outputs", ["fingerprint", "stage_config"])(data_fingerprint(cfg.data), staging_config_json(cfg))


def stage_data(stage_config: str, data_fingerprint: str, dataset: Output[Dataset]) -> str:
    """S3 → the FSx path, tokenized; returns the dataset folder. Cached: the same data is staged once."""
    import json
    import logging

    from components.steps import resolve_config, stage_only

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = stage_only(resolve_config(stage_config, [], "stage"), data_fingerprint)
    with open(dataset.path, "w") as handle:
        json.dump(result, handle, indent=2)
    dataset.metadata.update({k: result[k] for k in ("s3_uri", "mode", "objects", "bytes", "content_hash",
                                                    "manifest_hash")})
    return result["data_dir"]


def record_stage(config_json: str, overrides: list, kfp_job_id: str, dataset: Input[Dataset]) -> str:
    """Log the (possibly cached) staging to this run's MLflow run; returns the dataset folder."""
    import json
    import logging

    from components.steps import record_stage_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with open(dataset.path) as handle:
        staged = json.load(handle)
    return record_stage_step(resolve_config(config_json, overrides, kfp_job_id), staged)["data_dir"]


def train_model(config_json: str, overrides: list, kfp_job_id: str, data_dir: str, metrics: Output[Metrics]) -> str:
    """Train (locally, or through a TrainJob when kubernetes.enabled); returns the final checkpoint folder.
    Exit code 1: training failed; 3: the cluster failed (API, permissions, timeout)."""
    import logging
    import sys

    from components.steps import resolve_config, train_step

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = train_step(resolve_config(config_json, overrides, kfp_job_id), data_dir)
    except Exception as err:  # noqa: BLE001 - the launcher's typed errors carry their exit code
        code = getattr(err, "exit_code", None)
        if code is None:
            raise
        logging.getLogger("train").error("%s: %s", type(err).__name__, err)
        sys.exit(code)
    for key in ("steps", "final_loss", "wall_seconds"):
        metrics.log_metric(key, float(result[key]))
    return result["checkpoint"]


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


def evaluate_model(config_json: str, overrides: list, kfp_job_id: str, checkpoint: str, data_dir: str,
                   metrics: Output[Metrics]) -> float:
    """Held-out loss and perplexity, generations, and the promotion gate; returns the held-out loss."""
    import logging

    from components.steps import evaluate_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = evaluate_step(resolve_config(config_json, overrides, kfp_job_id), checkpoint, data_dir)
    for key in ("heldout_loss", "perplexity", "eval_tokens_per_second"):
        metrics.log_metric(key, float(result[key]))
    metrics.log_metric("promoted", float(bool((result.get("promotion") or {}).get("promote"))))
    return result["heldout_loss"]


def finalize_run(config_json: str, overrides: list, kfp_job_id: str, status: PipelineTaskFinalStatus):
    """Exit handler: writes summary.json and closes the MLflow parent run, whether the pipeline passed or not."""
    import logging

    from components.steps import finalize_step, resolve_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    finalize_step(resolve_config(config_json, overrides, kfp_job_id), status.state)


def make_components(image: str) -> SimpleNamespace:
    """The KFP components, running in `image` (the pipeline image). install_kfp_package=False: the image has
    kfp (and it saves ~0.6 s per step locally)."""
    functions = (prepare_run, fingerprint_data, stage_data, record_stage, train_model, validate_checkpoint,
                 evaluate_model, finalize_run)
    return SimpleNamespace(**{f.__name__: dsl.component(f, base_image=image, install_kfp_package=False)
                              for f in functions})
