"""The validate step as a KFP component (its logic: step.run_validate)."""

from kfp.dsl import Metrics, Output


def validate_checkpoint(config_json: str, overrides: list, kfp_job_id: str, checkpoint: str,
                        report: Output[Metrics]) -> str:
    """Fail unless the checkpoint is complete, uncorrupted, reshardable and finite; returns it."""
    # Imports inside: KFP runs this function's source alone in the task.
    from components.context import resolve_config
    from components.validate.step import run_validate
    from trainer.observe import logs

    logs.configure()
    result = run_validate(resolve_config(config_json, overrides, kfp_job_id), checkpoint)
    for key in ("bytes", "files", "stream_seconds", "num_checks"):
        report.log_metric(key, float(result[key]))
    return result["checkpoint"]
