"""The prepare step: create the run folder and the MLflow parent run (found again, not duplicated, on a retry).

Running the pipeline again with the same run.run_id continues the run (more steps, after a give-up, after an
image upgrade): the run folder keeps its history and the parent run its params. A setting that changed is not
sent as a param — MLflow refuses to change a param's value — but recorded on the parent run as the tag
``continuation_<n>`` ("training.num_steps: 30 -> 60"), with ``continuations`` counting them; a param new to this
release is sent as usual."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import yaml

from components import tracking
from components.context import git_commit, tracker, write_step_result
from components.stage.staging import not_writable_hint
from trainer.config import Config
from trainer.run.run_dir import RunDir, read_json

log = logging.getLogger(__name__)


class RunFolderError(RuntimeError):
    """The run folder cannot be created; the message says why and what to do."""


def run_prepare(cfg: Config) -> dict[str, Any]:
    run_dir = RunDir(cfg.run_dir)
    earlier = _earlier_settings(run_dir)
    try:
        run_dir.write_config(cfg.to_yaml())
    except PermissionError as err:
        raise RunFolderError(f"cannot create {cfg.run_dir} as uid {os.getuid()}: {err.strerror}. "
                             f"{not_writable_hint(cfg.kubernetes.namespace)}") from err
    params = tracking.flatten(cfg.to_dict())
    changed = {key: (earlier[key], value) for key, value in params.items() if key in earlier and earlier[key] != value}
    continuations = (read_json(run_dir.step_result("prepare")) or {}).get("continuations", 0) + bool(changed)
    tags = {"trigger": cfg.run.trigger, "config_hash": cfg.config_hash(), "git_commit": git_commit(),
            "run_dir": str(cfg.run_dir)}
    if changed:
        tags.update({"continuations": str(continuations), f"continuation_{continuations}": "; ".join(
            f"{key}: {old} -> {new}" for key, (old, new) in sorted(changed.items()))[:5000]})
        log.info("run %s continues with changed settings (tag continuation_%d): %s", cfg.run.run_id, continuations,
                 ", ".join(sorted(changed)))
    mlflow = tracker(cfg)
    mlflow.start_parent(params={k: v for k, v in params.items() if k not in changed}, tags=tags)
    parent = mlflow.run_id()  # None while the tracking server is unreachable (the parent is spooled)
    result = {"mlflow_tracking_uri": cfg.tracking_uri, "mlflow_parent_run_id": parent, "run_dir": str(cfg.run_dir),
              "started_at": time.time(), "continuations": continuations, "first_params": earlier or params}
    write_step_result(cfg, "prepare", result)
    log.info("run %s: folder %s, MLflow parent run %s", cfg.run.run_id, cfg.run_dir, parent)
    return result


def _earlier_settings(run_dir: RunDir) -> dict[str, str]:
    """The settings the run had before this launch (its config.yaml), flattened as its params were; {} for a new
    run. Compared with the first launch's, not only the last: MLflow keeps a param's first value."""
    first = read_json(run_dir.step_result("prepare")) or {}
    if "first_params" in first:
        return first["first_params"]
    if not run_dir.config.is_file():
        return {}
    # An earlier release's run (its prepare kept no params): its resolved config, as written, not re-validated.
    return tracking.flatten(yaml.safe_load(run_dir.config.read_text()) or {})
