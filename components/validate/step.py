"""The validate step: nobody evaluates or ships a checkpoint that fails checks.check_checkpoint. A validated
checkpoint becomes an MLflow LoggedModel of the train run (``step-N``: its checkpoint, step and the evaluation's
metrics linked to it by the evaluate step), so the UI lists and compares a run's validated checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.context import step_context, write_step_result
from components.tracking import checkpoint_model_name, checkpoint_model_run
from components.validate.checks import check_checkpoint
from trainer.config import Config

def run_validate(cfg: Config, checkpoint: str) -> dict[str, Any]:
    with step_context(cfg, "validate") as (mlflow, run):
        report = check_checkpoint(Path(checkpoint), expected_run_id=cfg.run.run_id)
        mlflow.log_metrics(run, [{
            "step": report["step"], "checkpoint_bytes": report["bytes"], "checkpoint_files": report["files"],
            "validate_stream_seconds": report["stream_seconds"], "checks_passed": report["num_checks"]}])
        mlflow.logged_model(checkpoint_model_run(cfg.run_dir, run), checkpoint_model_name(report["step"]), report["step"],
                            model_type=report["model_type"],
                            params={"checkpoint": checkpoint, "step": str(report["step"]),
                                    "world_size": str(report["world_size"])},
                            tags={"validated": "true", "checks_passed": ",".join(report["checks_passed"])},
                            metrics={"checkpoint_bytes": report["bytes"]})
        write_step_result(cfg, "validate", report)
    return report
