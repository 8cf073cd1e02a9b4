"""The prepare step as a KFP component (its logic: step.run_prepare)."""


def prepare_run(config_json: str, overrides: list, kfp_job_id: str) -> str:
    """Validate the config, create the run folder and the MLflow parent run; returns the run folder."""
    # Imports inside: KFP runs this function's source alone in the task.
    from components.context import resolve_config
    from components.prepare.step import run_prepare
    from trainer.observe import logs

    logs.configure()
    return run_prepare(resolve_config(config_json, overrides, kfp_job_id))["run_dir"]
