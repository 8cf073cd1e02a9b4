"""The prepare step: create the run folder and the MLflow parent run (found again, not duplicated, on a retry)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from components import tracking
from components.context import git_commit, tracker, write_step_result
from components.stage.staging import not_writable_hint
from trainer.config import Config
from trainer.run.run_dir import RunDir

log = logging.getLogger(__name__)


class RunFolderError(RuntimeError):
    """The run folder cannot be created; the message says why and what to do."""


def run_prepare(cfg: Config) -> dict[str, Any]:
    try:
        RunDir(cfg.run_dir).write_config(cfg.to_yaml())
    except PermissionError as err:
        raise RunFolderError(f"cannot create {cfg.run_dir} as uid {os.getuid()}: {err.strerror}. "
                             f"{not_writable_hint(cfg.kubernetes.namespace)}") from err
    mlflow = tracker(cfg)
    mlflow.start_parent(params=tracking.flatten(cfg.to_dict()),
                        tags={"trigger": cfg.run.trigger, "config_hash": cfg.config_hash(),
                              "git_commit": git_commit(), "run_dir": str(cfg.run_dir)})
    parent = mlflow.run_id()  # None while the tracking server is unreachable (the parent is spooled)
    result = {"mlflow_tracking_uri": cfg.tracking_uri, "mlflow_parent_run_id": parent, "run_dir": str(cfg.run_dir),
              "started_at": time.time()}
    write_step_result(cfg, "prepare", result)
    log.info("run %s: folder %s, MLflow parent run %s", cfg.run.run_id, cfg.run_dir, parent)
    return result
