"""The run folder, ``<fsx_root>/runs/<run_id>/``: every file the layers share through it, named in one place.

The pipeline's steps, the launchers and the trainer (on EKS: different pods on the FSx mount) talk through
this folder. Each file name is spelled here and nowhere else, and JSON is always written atomically (a
temporary name, then a rename), so a reader never sees half a file:

    config.yaml        the resolved config (prepare; the launcher hands it to the trainer)
    result.json        the trainer's outcome (rank 0, at the end)
    metrics.jsonl      one line per optimizer step (rank 0)
    train.log          everything the launcher and the ranks printed
    events/rank-N.jsonl  checkpoints, faults, launches, resumes, recoveries (trainer.run.events)
    lease.lock, lease.json  the run folder's writer lease (trainer.run.lease)
    gave_up.json       why the restart budget ended the job (trainer.resilience.budget), when it did
    system/<node>.jsonl  each training node's system metrics (trainer.launcher)
    steps/<step>.json, steps/<step>.error.json, steps/trainjob.json  each pipeline step's result
    mlflow-spool/      MLflow writes not yet delivered; rejected.jsonl, those refused (components.tracking)
    logs/pipeline.log  everything the local runner printed (pipelines.console); logs/ also has the servers' logs
    checkpoints/       committed checkpoints (unless checkpoint.dir says otherwise)
    plots/, generations.json, logs/, summary.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
RESULT = "result.json"
METRICS = "metrics.jsonl"
TRAIN_LOG = "train.log"
SUMMARY = "summary.json"
GENERATIONS = "generations.json"
EVENTS_DIR = "events"
LEASE_LOCK = "lease.lock"
LEASE_FILE = "lease.json"
STEPS_DIR = "steps"
TRAINJOB = "trainjob.json"
SPOOL_DIR = "mlflow-spool"
CHECKPOINTS_DIR = "checkpoints"
PLOTS_DIR = "plots"
LOGS_DIR = "logs"
PIPELINE_LOG = "pipeline.log"
REJECTED = "rejected.jsonl"
GAVE_UP = "gave_up.json"
TRAINER_STATUS = "trainer_status.json"  # the TrainJob progress rank 0 reports (trainer.observe.progress)
SYSTEM_DIR = "system"


class RunDir:
    """Paths of one run folder; nothing here touches the disk except write_config."""

    def __init__(self, path: Path | str):
        self.path = Path(path)

    config = property(lambda self: self.path / CONFIG)
    result = property(lambda self: self.path / RESULT)
    metrics = property(lambda self: self.path / METRICS)
    train_log = property(lambda self: self.path / TRAIN_LOG)
    summary = property(lambda self: self.path / SUMMARY)
    generations = property(lambda self: self.path / GENERATIONS)
    events = property(lambda self: self.path / EVENTS_DIR)
    lease_lock = property(lambda self: self.path / LEASE_LOCK)
    lease = property(lambda self: self.path / LEASE_FILE)
    steps = property(lambda self: self.path / STEPS_DIR)
    trainjob = property(lambda self: self.path / STEPS_DIR / TRAINJOB)
    spool = property(lambda self: self.path / SPOOL_DIR)
    checkpoints = property(lambda self: self.path / CHECKPOINTS_DIR)
    plots = property(lambda self: self.path / PLOTS_DIR)
    logs = property(lambda self: self.path / LOGS_DIR)
    pipeline_log = property(lambda self: self.path / LOGS_DIR / PIPELINE_LOG)
    rejected = property(lambda self: self.path / SPOOL_DIR / REJECTED)
    gave_up = property(lambda self: self.path / GAVE_UP)
    system = property(lambda self: self.path / SYSTEM_DIR)
    trainer_status = property(lambda self: self.path / TRAINER_STATUS)

    def system_of(self, node: str) -> Path:
        return self.system / f"{node}.jsonl"

    def events_of(self, rank: int) -> Path:
        return self.events / f"rank-{rank}.jsonl"

    def step_result(self, step: str) -> Path:
        return self.steps / f"{step}.json"

    def step_error(self, step: str) -> Path:
        return self.steps / f"{step}.error.json"

    def step_errors(self) -> list[Path]:
        return sorted(self.steps.glob("*.error.json"))

    def write_config(self, yaml_text: str) -> Path:
        """The resolved config the trainer reads (written by prepare, and again by a launcher that runs alone)."""
        return write_atomic(self.config, yaml_text)


def write_atomic(path: Path, text: str, *, fsync: bool = False) -> Path:
    """A temporary name in the same folder, then a rename: a reader sees the old file or the new one, whole.
    With fsync the content is on disk before the rename (the caller fsyncs the folder if the name must be)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as handle:
        handle.write(text)
        if fsync:
            handle.flush()
            os.fsync(handle.fileno())
    tmp.replace(path)
    return path


def write_json(path: Path, payload: Any, *, fsync: bool = False, ensure_ascii: bool = True) -> Path:
    return write_atomic(path, json.dumps(payload, indent=2, default=str, ensure_ascii=ensure_ascii), fsync=fsync)


def read_json(path: Path) -> dict[str, Any] | None:
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a JSON-lines file; a line torn by a process killed mid-write is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
