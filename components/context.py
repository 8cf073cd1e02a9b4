"""What every pipeline step shares: the run's Config rebuilt from KFP's parameters, the run's MLflow writer,
and the step context that records a step's MLflow run and its result or error in the run folder.

Each step resolves the configuration from the same three inputs (the config as JSON, the override list and
KFP's job id), does its work inside `step_context`, and writes its result to
``<run_dir>/steps/<step>.json`` (or ``<step>.error.json`` when it fails), where the exit handler picks
everything up for ``summary.json``.
"""

from __future__ import annotations

import contextlib
import subprocess
import traceback
from pathlib import Path
from typing import Any, Iterator

from components import tracking
from trainer.config import Config, config_from_yaml_text
from trainer.config.rules import InputError
from trainer.run.run_dir import RunDir, read_json, write_json


def resolve_config(config_json: str, overrides: list[str], kfp_job_id: str = "") -> Config:
    """The run's Config (config_json may also be YAML); run.run_id falls back to KFP's job id."""
    overrides = list(overrides or [])
    cfg = config_from_yaml_text(config_json, overrides)
    if not cfg.run.run_id:
        if not kfp_job_id:
            raise ValueError("run.run_id: empty and no KFP job id to fall back on; pass --run.run_id=NAME")
        cfg = config_from_yaml_text(config_json, [*overrides, f"run.run_id={kfp_job_id.lower()}"])
    return cfg


def tracker(cfg: Config) -> tracking.Tracker:
    """The run's MLflow writer (spooled in the run folder while the tracking server is unreachable)."""
    artifact_location = cfg.mlflow.artifact_location
    if not artifact_location and cfg.tracking_uri.startswith("sqlite:"):
        artifact_location = (cfg.work_dir / "mlartifacts").as_uri()
    return tracking.Tracker(cfg.tracking_uri, cfg.run.experiment, cfg.run.run_id, cfg.run_dir,
                            artifact_location=artifact_location)


def read_step_result(cfg: Config, step: str) -> dict[str, Any] | None:
    return read_json(RunDir(cfg.run_dir).step_result(step))


def write_step_result(cfg: Config, step: str, result: dict[str, Any]) -> None:
    write_json(RunDir(cfg.run_dir).step_result(step), result)


@contextlib.contextmanager
def step_context(cfg: Config, name: str, *, one_per_pipeline_run: bool = False
                 ) -> Iterator[tuple[tracking.Tracker, str]]:
    """Nested MLflow run + error record for one step: yields (tracker, the step run's spool key). A failed
    step's run ends FAILED with the reason as its `failure_reason` tag."""
    run_dir = RunDir(cfg.run_dir)
    run_dir.step_error(name).unlink(missing_ok=True)  # a retried step starts clean
    mlflow = tracker(cfg)
    run = mlflow.start_step(name, one_per_pipeline_run=one_per_pipeline_run)
    try:
        yield mlflow, run
    except BaseException as err:
        write_json(run_dir.step_error(name), {"step": name, "error_type": type(err).__name__, "message": str(err),
                                              "input_error": isinstance(err, InputError),
                                              "traceback": traceback.format_exc()})
        mlflow.set_tags(run, {"failure_reason": f"{type(err).__name__}: {err}"[:5000]})
        mlflow.end_run(run, "FAILED")
        raise
    mlflow.end_run(run, "FINISHED")


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
