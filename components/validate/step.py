"""The validate step: nobody evaluates or ships a checkpoint that fails checks.check_checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from components.context import step_context, write_step_result
from components.validate.checks import check_checkpoint
from trainer.config import Config


def run_validate(cfg: Config, checkpoint: str) -> dict[str, Any]:
    with step_context(cfg, "validate") as (mlflow, run):
        report = check_checkpoint(Path(checkpoint), expected_run_id=cfg.run.run_id)
        mlflow.log_metrics(run, [{
            "step": report["step"], "checkpoint_bytes": report["bytes"], "checkpoint_files": report["files"],
            "load_seconds": report["load_seconds"], "checks_passed": report["num_checks"]}])
        write_step_result(cfg, "validate", report)
    return report
