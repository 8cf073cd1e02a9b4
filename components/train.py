"""Launch training for the pipeline's train step.

Locally the step runs torchrun with ``nproc_per_node`` CPU ranks on this machine; on EKS the same step
becomes the launcher of a Kubeflow Trainer TrainJob. Either way the trainer writes ``result.json`` and
``metrics.jsonl`` into the run's folder on the shared file system, which this module reads back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

from trainer.config import Config
from trainer.launch_args import initial_heartbeat_timeout, trainer_command
from trainer.lease import GENERATION_ENV, RunLease

log = logging.getLogger(__name__)

JOB_TOKEN_ENV = "RESILIENT_TRAIN_JOB_TOKEN"  # inherited by every process of one launch
RUN_DIR_ENV = "RESILIENT_TRAIN_RUN_DIR"  # and the run folder it trains into (ps e, debugging, tests)


# torch prefixes each rank's traceback lines with "[rankN]: ".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]+(?:Error|Exception|Interrupt|Fault): \S.*)$")
# ft_launcher logs its failed NVML probe on machines without NVIDIA drivers; expected on CPU, not a cause.
_EXPECTED_NOISE = ("libnvidia-ml.so",)


class TrainingError(RuntimeError):
    """Training exited with an error or ran out of time; the message holds the log's tail and its path."""


def launch_command(cfg: Config, config_path: Path, data_dir: Path) -> list[str]:
    """ft_launcher (in-job restarts, hang detection) or plain torchrun, on this machine, through
    trainer.launcher so that nothing it starts outlives it."""
    return trainer_command(cfg, config_path, data_dir)


def run_local_training(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """Launch training and relaunch the whole job (up to resilience.job_restarts times) when the launcher
    gives up; output streams to <run dir>/train.log. Returns result.json plus wall time and goodput.

    The run folder's lease is held throughout (a second launch on the same folder is refused with
    RunFolderBusy), and every attempt runs under a new lease generation, so trainers of an earlier attempt
    could never write again even if one escaped the stop.
    """
    run_dir = cfg.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with RunLease(run_dir) as lease, cancel_on_sigterm():
        config_path = run_dir / "config.yaml"
        config_path.write_text(cfg.to_yaml())
        for attempt in range(cfg.resilience.job_restarts + 1):
            try:
                _launch_once(cfg, config_path, data_dir, attempt, lease.new_generation())
                break
            except TrainingError as err:
                if attempt == cfg.resilience.job_restarts:
                    raise
                log.warning("training job failed (attempt %d of %d), relaunching: %s", attempt + 1,
                            cfg.resilience.job_restarts + 1, str(err).splitlines()[0])
    result_path = run_dir / "result.json"
    if not result_path.is_file():
        raise TrainingError(f"training finished but wrote no {result_path}; log: {run_dir / 'train.log'}")
    return {**json.loads(result_path.read_text()), **training_report(run_dir, started)}


def training_report(run_dir: Path, started_at: float | None) -> dict[str, Any]:
    """Goodput and recovery totals from the run folder alone, so both launchers (this machine, a TrainJob)
    report the same thing: productive step seconds over the job's wall time, from started_at (the launch;
    else the first process start) to the result (else now)."""
    from trainer.events import read_events

    run_dir = Path(run_dir)
    if started_at is None:
        launches = read_events(run_dir, "launch")
        started_at = min((e["process_started_at"] for e in launches), default=None)
    result_path = run_dir / "result.json"
    finished_at = json.loads(result_path.read_text()).get("finished_at") if result_path.is_file() else None
    finished_at = finished_at or time.time()
    wall = finished_at - started_at if started_at is not None else None
    productive = sum(r["step_seconds"] for r in read_metrics(run_dir / "metrics.jsonl"))
    recoveries = read_events(run_dir, "recovery")
    totals = {"recoveries": len(recoveries), "lost_steps": sum(r["lost_steps"] or 0 for r in recoveries),
              "recovery_seconds_total": sum(r["recovery_seconds"] or 0.0 for r in recoveries)}
    for mechanism in sorted({r["mechanism"] for r in recoveries}):
        totals[f"recoveries_{mechanism}"] = sum(r["mechanism"] == mechanism for r in recoveries)
    return {"job_wall_seconds": wall, "productive_seconds": productive,
            "goodput": productive / wall if wall else None, "recovery_totals": totals}


class JobCancelled(RuntimeError):
    """The train step was asked to stop (SIGTERM: a KFP cancel, a pod deletion); every process was stopped."""


@contextlib.contextmanager
def cancel_on_sigterm():
    """SIGTERM becomes JobCancelled in the main thread, so the launch below stops its whole job first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def cancel(signum, frame):
        raise JobCancelled(f"training cancelled by signal {signum}: every training process was stopped")

    previous = signal.signal(signal.SIGTERM, cancel)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def job_processes(token: str, variable: str = JOB_TOKEN_ENV) -> list:
    """Every live process of one launch (or, with variable=RUN_DIR_ENV, of one run folder): they all inherit
    it, whoever their parent is now."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(variable) == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stop_job(proc: subprocess.Popen, token: str, grace_seconds: float = 10.0) -> None:
    """Stop the launcher (SIGTERM: it stops its workers; SIGKILL after the grace), then SIGKILL every process
    left with the launch's token — workers in sessions of their own, DCP writers, rank monitors."""
    import psutil

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    left = job_processes(token)
    for survivor in left:
        try:
            survivor.kill()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(left, timeout=grace_seconds)
    if left:
        log.warning("stopped %d process(es) the launcher left behind%s", len(left),
                    f"; {len(alive)} did not exit" if alive else "")


def _launch_once(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int) -> None:
    from trainer.resilience import JOB_ATTEMPT_ENV, LAUNCHER_ENV

    log_path = cfg.run_dir / "train.log"
    command = launch_command(cfg, config_path, data_dir)
    if cfg.resilience.launcher == "ft_launcher":
        log.info("initial heartbeat timeout %.0f s: %s", *initial_heartbeat_timeout(cfg, data_dir))
    log.info("launching (attempt %d, lease generation %d): %s", attempt + 1, generation, " ".join(command))
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: cfg.resilience.launcher, JOB_ATTEMPT_ENV: str(attempt),
           JOB_TOKEN_ENV: token, RUN_DIR_ENV: str(cfg.run_dir), GENERATION_ENV: str(generation),
           # the launcher itself imports pynvml through torch.cuda; its deprecation notice is noise.
           "PYTHONWARNINGS": "ignore:The pynvml package is deprecated"}
    tail: deque[str] = deque(maxlen=40)
    errors: list[str] = []  # "SomeError: message" lines from the ranks' tracebacks

    def pump(stream, log_file) -> None:
        for line in stream:
            log_file.write(line)
            log_file.flush()
            tail.append(line)
            if (match := _EXCEPTION_LINE.match(line.rstrip())) and not any(n in line for n in _EXPECTED_NOISE):
                errors.append(match.group(1))
            sys.stdout.write(line)

    # The launcher's own session keeps a Ctrl-C of the pipeline from reaching the ranks twice; the ranks sit
    # in sessions of their own anyway, which is why stopping goes by the launch's token, not a process group.
    with log_path.open("a") as log_file, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                         text=True, env=env, start_new_session=True) as proc:
        reader = threading.Thread(target=pump, args=(proc.stdout, log_file), daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=cfg.training.timeout_seconds)
        except subprocess.TimeoutExpired as err:
            stop_job(proc, token)
            raise TrainingError(f"training exceeded training.timeout_seconds={cfg.training.timeout_seconds}; every "
                                f"training process was stopped; log: {log_path}") from err
        finally:
            stop_job(proc, token)  # after an exit, a cancel or a timeout: nothing of this launch outlives it
            reader.join(timeout=10)
    if returncode != 0:
        causes = "\n".join(dict.fromkeys(errors)) or "".join(tail)
        raise TrainingError(f"training exited with code {returncode}; log: {log_path}\n{causes}")


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
