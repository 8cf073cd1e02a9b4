"""The pipeline on this machine: the embedded stack (S3 on loopback, the demo corpus) and KFP's local runner.

``run_locally`` gives every step the same config the compiled pipeline would, runs them with
``kfp.local.SubprocessRunner`` inside a ``PipelineConsole`` (compact console, full logs in the run folder),
delivers the steps' MLflow records from this process (``SpoolDeliverer``) and returns the summary that the finalize step wrote (``summary.json``), with the pipeline's wall time added.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from pathlib import Path

import kfp.local

from components.context import tracker
from components.delivery import SpoolDeliverer
from components.stage.fsx import FsxError
from components.stage.s3_copy import StageError
from components.stage.staging import STAGE_MANIFEST
from components.stage.step import run_stage
from pipelines.console import PipelineConsole
from pipelines.demo_data import DemoUploadError, upload_demo_data
from pipelines.local_stack import LocalStackError, S3Server
from pipelines.pipeline import build_pipeline
from trainer.config import Config
from trainer.config.rules import InputError
from trainer.run.run_dir import RunDir, read_json, write_json


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-", time.gmtime()) + secrets.token_hex(2)


@contextlib.contextmanager
def embedded_stack(cfg: Config, log_dir: Path):
    """The local stand-ins the config asks for: the S3 server on loopback and the uploaded demo corpus."""
    with contextlib.ExitStack() as stack:
        if cfg.local.s3_server:
            stack.enter_context(S3Server(log_dir=log_dir))
        if cfg.local.upload_demo_data:
            upload_demo_data(cfg.data, cfg.local.demo_documents)
        yield


def run_locally(cfg: Config, *, verbose: bool = False) -> dict:
    """Run the pipeline with kfp.local on this machine; returns the summary (also written to summary.json)."""
    if not cfg.run.run_id:
        cfg.run.run_id = new_run_id()
    run_dir = RunDir(cfg.run_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    console = PipelineConsole(run_dir.path, cfg.training.num_steps, verbose=verbose)
    with console, contextlib.ExitStack() as stack:
        # MLflow imported and its store opened once, here, instead of in each step (components/delivery.py).
        stack.enter_context(SpoolDeliverer(tracker(cfg)))
        try:
            stack.enter_context(embedded_stack(cfg, run_dir.logs))
        except (DemoUploadError, LocalStackError) as err:  # before any step: the summary says why
            summary = failed_before_start(cfg, "local stack", err)
            write_json(run_dir.summary, summary)
            return summary
        kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=str(run_dir.path / "kfp"),
                       raise_on_error=False)
        build_pipeline(cfg)(config_json=cfg.to_json(), overrides=[])
    summary = read_json(run_dir.summary)
    if summary is None:  # the exit handler itself failed
        raise RuntimeError(f"the pipeline wrote no {run_dir.summary}; see {console.log_path}")
    summary["pipeline_wall_seconds"] = time.perf_counter() - started
    summary["step_seconds"] = console.step_seconds
    job = (summary.get("steps", {}).get("train") or {}).get("job_wall_seconds")
    if job is not None:  # what the pipeline cost beyond the training job itself (bench/pipeline_steps.py splits it)
        summary["outside_job_seconds"] = summary["pipeline_wall_seconds"] - job
    write_json(run_dir.summary, summary)
    return summary


def failed_before_start(cfg: Config, step: str, err: Exception) -> dict:
    """A summary for a run that failed before its first pipeline step (same keys as finalize's)."""
    return {"status": "failed", "pipeline_run_id": cfg.run.run_id, "mlflow_tracking_uri": cfg.tracking_uri,
            "mlflow_experiment": cfg.run.experiment, "mlflow_parent_run_id": None, "mlflow_pending_records": 0,
            "mlflow_rejected_records": 0, "run_dir": str(cfg.run_dir), "checkpoint_dir": str(cfg.checkpoint_dir),
            "checkpoint": None, "steps_trained": None, "final_train_loss": None, "heldout_loss": None,
            "heldout_perplexity": None, "promotion": None, "recovery_events": [], "straggler_events": [],
            "goodput": None,
            "errors": [{"step": step, "error_type": type(err).__name__, "message": str(err)}], "steps": {},
            "finished_at": time.time()}


def stage_locally(cfg: Config) -> tuple[dict, Path]:
    """The stage step alone (pre-warming FSx, or trying a dataset): what was staged and its manifest's path.
    Raises StageError, FsxError, InputError (a bad base model, tokenizer or corpus), DemoUploadError or
    LocalStackError."""
    with embedded_stack(cfg, cfg.work_dir / "logs"):
        staged = run_stage(cfg)
    return staged, Path(staged["data_dir"]) / STAGE_MANIFEST


STAGE_ERRORS = (StageError, FsxError, InputError, DemoUploadError, LocalStackError)
