"""The run folder, ``<fsx_root>/runs/<run_id>/``: every file the layers share through it, named in one place.

The pipeline's steps, the launchers and the trainer (on EKS: different pods on the FSx mount) talk through
this folder. Each file name is spelled here and nowhere else, and JSON is always written atomically (a
temporary name, then a rename), so a reader never sees half a file:

    config.yaml        the resolved config (prepare; the launcher hands it to the trainer)
    result.json        the trainer's outcome (rank 0, at the end)
    metrics.jsonl      one line per optimizer step (rank 0)
    train.log          everything the launcher and the ranks printed
    events/control.jsonl   rare records every layer decides by: launches, attempts, resumes, faults,
                           recoveries, give-ups, interval choices (any rank; trainer.run.events)
    events/failures.jsonl  how each rank failed, written as it goes (any rank)
    events/periodic.jsonl  one record per save, upload and straggler report (rank 0)
    events/control-state.json  control.jsonl folded, with the byte offset it covers (trainer.run.history)
    events/format.json     the events' format; events/rank-N.jsonl: an earlier release's (trainer.run.legacy)
    lease.lock, lease.json  the run folder's writer lease (trainer.run.lease)
    fence/node-N.json      node N's fencing generation: its newest launcher's (trainer.run.lease)
    gave_up.json       why the restart budget ended the job (trainer.resilience.budget), when it did
    system/samples.jsonl  every training node's system metrics (each node's launcher appends)
    steps/<step>.json, steps/<step>.error.json, steps/trainjob.json  each pipeline step's result
    mlflow-spool/      MLflow writes not yet delivered; rejected.jsonl, those refused (components.tracking)
    logs/pipeline.log  everything the local runner printed (pipelines.console); logs/ also has the servers' logs
    checkpoints/       committed checkpoints (unless checkpoint.dir says otherwise)
    compile-cache/<key>/  inductor's compiled blocks, read again by every restart (trainer.model.compile_cache)
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
CONTROL_LOG = "control.jsonl"
FAILURES_LOG = "failures.jsonl"
PERIODIC_LOG = "periodic.jsonl"
CONTROL_STATE = "control-state.json"
EVENTS_FORMAT = "format.json"
MIGRATE_LOCK = "migrate.lock"
LEGACY_EVENTS = "rank-*.jsonl"  # one file per rank: the release before the shared streams
SYSTEM_SAMPLES = "samples.jsonl"
# Which events stream a record kind goes to (trainer.run.events); every other kind is a control record.
FAILURE_EVENTS = ("rank_failed", "hang")
PERIODIC_EVENTS = ("checkpoint_stall", "checkpoint_committed", "checkpoint_uploaded", "straggler_report")
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
EVAL_DIR = "eval"  # the training ranks' evaluations (step-N.json), the champion to compare with (champion.json)
EXPORT_STAGING_DIR = "export-staging"  # an export on its way to S3 (removed once uploaded)


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

    def node_fence(self, index: int) -> Path:
        return self.path / "fence" / f"node-{index}.json"
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
    control_log = property(lambda self: self.path / EVENTS_DIR / CONTROL_LOG)
    failures_log = property(lambda self: self.path / EVENTS_DIR / FAILURES_LOG)
    periodic_log = property(lambda self: self.path / EVENTS_DIR / PERIODIC_LOG)
    control_state = property(lambda self: self.path / EVENTS_DIR / CONTROL_STATE)
    events_format = property(lambda self: self.path / EVENTS_DIR / EVENTS_FORMAT)
    migrate_lock = property(lambda self: self.path / EVENTS_DIR / MIGRATE_LOCK)
    system_samples = property(lambda self: self.path / SYSTEM_DIR / SYSTEM_SAMPLES)

    evaluations = property(lambda self: self.path / EVAL_DIR)
    champion = property(lambda self: self.path / EVAL_DIR / "champion.json")
    export_staging = property(lambda self: self.path / EXPORT_STAGING_DIR)

    def evaluation(self, step: int) -> Path:
        return self.path / EVAL_DIR / f"step-{step:06d}.json"

    def stream_of(self, event: str) -> Path:
        """The events stream a record of this kind is appended to."""
        if event in FAILURE_EVENTS:
            return self.failures_log
        return self.periodic_log if event in PERIODIC_EVENTS else self.control_log

    def legacy_events(self) -> list[Path]:
        """An earlier release's events, one file per rank (trainer.run.legacy migrates them once)."""
        return sorted(self.events.glob(LEGACY_EVENTS))

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
