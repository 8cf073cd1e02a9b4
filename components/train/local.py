"""The train step on one machine: ft_launcher (or torchrun) with ``nproc_per_node`` ranks, relaunched as a
whole job when the launcher gives up, and stopped as a whole job (every process, whatever its session) on a
timeout, a cancel or a relaunch. On EKS the same step is the TrainJob launcher (trainjob.py)."""

from __future__ import annotations

import contextlib
import itertools
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

import psutil

from components.train.report import training_report
from trainer.config import Config
from trainer.launch_args import initial_heartbeat_timeout, trainer_command
from trainer.lease import GENERATION_ENV, RunLease
from trainer.resilience.budget import (BUDGET_SINCE_ENV, CRASH_LOOP_EXIT_CODE, JOB_ATTEMPT_ENV, LAUNCHER_ENV,
                                       attempt_history, read_gave_up)
from trainer.run_dir import RunDir, read_json

log = logging.getLogger(__name__)

JOB_TOKEN_ENV = "RESILIENT_TRAIN_JOB_TOKEN"  # inherited by every process of one launch
RUN_DIR_ENV = "RESILIENT_TRAIN_RUN_DIR"  # and the run folder it trains into (ps e, debugging, tests)


# torch prefixes each rank's traceback lines with "[rankN]: ".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]+(?:Error|Exception|Interrupt|Fault): \S.*)$")
# ft_launcher logs its failed NVML probe on machines without NVIDIA drivers; expected on CPU, not a cause.
_EXPECTED_NOISE = ("libnvidia-ml.so",)


class TrainingError(RuntimeError):
    """Training exited with an error or ran out of time; the message holds the log's tail and its path."""


class CrashLoop(TrainingError):
    """The restart budget gave up: recoveries stopped making progress. Never relaunched; the message says where."""


class TrainingTimeout(TrainingError):
    """A launch ran past training.timeout_seconds: a deadline, so never relaunched (as activeDeadlineSeconds ends a
    TrainJob on EKS)."""


def launch_command(cfg: Config, config_path: Path, data_dir: Path) -> list[str]:
    """ft_launcher (in-job restarts, hang detection) or plain torchrun, on this machine, through
    trainer.launcher so that nothing it starts outlives it."""
    return trainer_command(cfg, config_path, data_dir)


def run_local_training(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """Launch training and relaunch the whole job when its launcher fails; output streams to
    <run dir>/train.log. Returns result.json plus wall time and goodput.

    Relaunches are bounded by progress, as every layer is (trainer.resilience.budget): the trainers give up
    on a crash loop with exit code 42, which is never relaunched; a launch that fails before any trainer
    started counts as a recovery without progress here. resilience.job_restarts >= 0 adds a plain cap.

    The run folder's lease is held throughout (a second launch on the same folder is refused with
    RunFolderBusy), and every attempt runs under a new lease generation, so trainers of an earlier attempt
    could never write again even if one escaped the stop.
    """
    run_dir = RunDir(cfg.run_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    started = time.time()
    r = cfg.resilience
    with RunLease(run_dir.path) as lease, cancel_on_sigterm():
        config_path = run_dir.write_config(cfg.to_yaml())
        empty_launches = 0  # launches in a row that started no training attempt at all
        for attempt in itertools.count():
            attempts_before = len(attempt_history(run_dir.path, started))
            try:
                _launch_once(cfg, config_path, data_dir, attempt, lease.new_generation(), budget_since=started)
                break
            except (CrashLoop, TrainingTimeout):
                raise
            except TrainingError as err:
                empty_launches = empty_launches + 1 if len(attempt_history(run_dir.path, started)) == attempts_before else 0
                if 0 <= r.job_restarts <= attempt:
                    raise
                if empty_launches >= r.max_restarts_without_progress:
                    raise CrashLoop(f"crash loop: {empty_launches} launches in a row failed before any trainer started "
                                    f"(resilience.max_restarts_without_progress={r.max_restarts_without_progress}); "
                                    f"the job relaunch layer gives up. Last failure: {err}") from err
                log.warning("training job failed (attempt %d), relaunching: %s", attempt + 1,
                            str(err).splitlines()[0])
    result = read_json(run_dir.result)
    if result is None:
        raise TrainingError(f"training finished but wrote no {run_dir.result}; log: {run_dir.train_log}")
    return {**result, **training_report(run_dir.path, started)}




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


def _launch_once(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int,
                 budget_since: float) -> None:
    log_path = RunDir(cfg.run_dir).train_log
    command = launch_command(cfg, config_path, data_dir)
    if cfg.resilience.launcher == "ft_launcher":
        log.info("initial heartbeat timeout %.0f s: %s", *initial_heartbeat_timeout(cfg, data_dir))
    log.info("launching (attempt %d, lease generation %d): %s", attempt + 1, generation, " ".join(command))
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: cfg.resilience.launcher, JOB_ATTEMPT_ENV: str(attempt),
           JOB_TOKEN_ENV: token, RUN_DIR_ENV: str(cfg.run_dir), GENERATION_ENV: str(generation),
           BUDGET_SINCE_ENV: repr(budget_since),
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
            raise TrainingTimeout(f"training exceeded training.timeout_seconds={cfg.training.timeout_seconds}; every "
                                  f"training process was stopped; log: {log_path}") from err
        finally:
            stop_job(proc, token)  # after an exit, a cancel or a timeout: nothing of this launch outlives it
            reader.join(timeout=10)
    gave_up = read_gave_up(cfg.run_dir)
    if returncode == CRASH_LOOP_EXIT_CODE and gave_up is not None and gave_up.get("generation") == generation:
        raise CrashLoop(f"{gave_up['message']} (log: {log_path})")
    if returncode != 0:
        causes = "\n".join(dict.fromkeys(errors)) or "".join(tail)
        raise TrainingError(f"training exited with code {returncode}; log: {log_path}\n{causes}")
