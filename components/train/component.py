"""The train step as a KFP component (its logic: step.run_train)."""

from kfp.dsl import Metrics, Output


def train_model(config_json: str, overrides: list, kfp_job_id: str, data_dir: str, metrics: Output[Metrics]) -> str:
    """Train (locally, or through a TrainJob when kubernetes.enabled); returns the final checkpoint folder.
    Exit code 1: training failed; 3: the cluster failed (API, permissions, timeout)."""
    # Imports inside: KFP runs this function's source alone in the task.
    import logging
    import sys

    from components.context import resolve_config
    from components.train.step import run_train
    from trainer.observe import logs

    logs.configure()
    try:
        result = run_train(resolve_config(config_json, overrides, kfp_job_id), data_dir)
    except Exception as err:  # noqa: BLE001 - the launcher's typed errors carry their exit code
        code = getattr(err, "exit_code", None)
        if code is None:
            raise
        logging.getLogger("train").error("%s: %s", type(err).__name__, err)
        sys.exit(code)
    for key in ("steps", "final_loss", "wall_seconds"):
        metrics.log_metric(key, float(result[key]))
    return result["checkpoint"]
