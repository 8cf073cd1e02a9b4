"""Launch training for the pipeline's train step.

Locally the step runs torchrun with ``nproc_per_node`` CPU ranks on this machine; on EKS the same step
becomes the launcher of a Kubeflow Trainer TrainJob. Either way the trainer writes ``result.json`` and
``metrics.jsonl`` into the run's folder on the shared file system, which this module reads back.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from trainer.config import Config

log = logging.getLogger(__name__)


# torch prefixes each rank's traceback lines with "[rankN]: ".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]+(?:Error|Exception|Interrupt): \S.*)$")


class TrainingError(RuntimeError):
    """Training exited with an error or ran out of time; the message holds the log's tail and its path."""


def torchrun_command(cfg: Config, config_path: Path, data_dir: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={cfg.training.nproc_per_node}", "-m", "trainer",
            "--config", str(config_path), "--data-dir", str(data_dir)]


def run_local_training(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """Run torchrun to completion, streaming its output to <run dir>/train.log; returns result.json."""
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    log_path = run_dir / "train.log"
    command = torchrun_command(cfg, config_path, data_dir)
    log.info("launching: %s", " ".join(command))
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           # torchrun itself imports pynvml through torch.cuda; its deprecation notice is noise.
           "PYTHONWARNINGS": "ignore:The pynvml package is deprecated"}
    tail: deque[str] = deque(maxlen=40)
    errors: list[str] = []  # "SomeError: message" lines from the ranks' tracebacks
    with log_path.open("a") as log_file, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                         text=True, env=env) as proc:
        try:
            for line in proc.stdout:
                log_file.write(line)
                tail.append(line)
                if match := _EXCEPTION_LINE.match(line.rstrip()):
                    errors.append(match.group(1))
                sys.stdout.write(line)
            returncode = proc.wait(timeout=cfg.training.timeout_seconds)
        except subprocess.TimeoutExpired as err:
            proc.kill()
            raise TrainingError(f"training exceeded training.timeout_seconds={cfg.training.timeout_seconds}; "
                                f"log: {log_path}") from err
    if returncode != 0:
        causes = "\n".join(dict.fromkeys(errors)) or "".join(tail)
        raise TrainingError(f"training exited with code {returncode}; log: {log_path}\n{causes}")
    result_path = run_dir / "result.json"
    if not result_path.is_file():
        raise TrainingError(f"training finished but wrote no {result_path}; log: {log_path}")
    return json.loads(result_path.read_text())


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Per-step records from metrics.jsonl; the last record of a step wins (steps replayed after a restart)."""
    if not Path(path).is_file():
        return []
    by_step: dict[int, dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a process killed mid-write
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def checkpoint_metric_records(run_dir: Path) -> list[dict[str, float]]:
    """Per-checkpoint records for MLflow: the loop's stall (worst rank), background time, size, speed."""
    from trainer.events import read_events

    stall: dict[int, float] = {}
    for event in read_events(run_dir, "checkpoint_written"):
        stall[event["step"]] = max(stall.get(event["step"], 0.0), event["blocking_seconds"])
    records = []
    for event in read_events(run_dir, "checkpoint_committed"):
        records.append({"step": event["step"], "time": event["time"],
                        "checkpoint_blocking_seconds": stall.get(event["step"], event["blocking_seconds"]),
                        "checkpoint_background_seconds": event["background_seconds"],
                        "checkpoint_bytes": event["bytes"], "checkpoint_mb_per_second": event["mb_per_second"] or 0.0})
    return records
