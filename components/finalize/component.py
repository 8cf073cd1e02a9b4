"""The exit handler as a KFP component (its logic: step.run_finalize)."""

from kfp.dsl import PipelineTaskFinalStatus


def finalize_run(config_json: str, overrides: list, kfp_job_id: str, status: PipelineTaskFinalStatus):
    """Exit handler: writes summary.json and closes the MLflow parent run, whether the pipeline passed or not."""
    # Imports inside: KFP runs this function's source alone in the task.
    from components.context import resolve_config
    from components.finalize.step import run_finalize
    from trainer.observe import logs

    logs.configure()
    run_finalize(resolve_config(config_json, overrides, kfp_job_id), status.state)
