"""The train step on one machine: ft_launcher (or torchrun) with ``nproc_per_node`` ranks, relaunched as a
whole job when the launcher gives up, and stopped as a whole job (every process, whatever its session) on a
timeout, a cancel or a relaunch. On EKS the same step is the TrainJob launcher (trainjob.py)."""

from __future__ import annotations

import itertools
import logging
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from localcluster.nodes import launch_nodes
from localcluster.processes import (CrashLoop, JobCancelled, LaunchOutput, TrainingError, TrainingTimeout,
                                        cancel_on_sigterm, job_processes, launch_env, raise_for_exit, stop_job)
from trainer.config import Config
from trainer.env import JOB_TOKEN_ENV, RUN_DIR_ENV
from trainer.launch.command import initial_heartbeat_timeout, trainer_command
from trainer.run.history import control_state, record_train_launch, record_train_launch_ended
from trainer.run.lease import RunLease
from trainer.run.run_dir import RunDir, read_json

log = logging.getLogger(__name__)

# What the rest of the project imports from here (the train step's launcher, tests, benchmarks).
__all__ = ["JOB_TOKEN_ENV", "RUN_DIR_ENV", "CrashLoop", "JobCancelled", "TrainingError", "TrainingTimeout",
           "cancel_on_sigterm", "job_processes", "launch_command", "run_local_training", "stop_job"]


def launch_command(cfg: Config, config_path: Path, data_dir: Path) -> list[str]:
    """ft_launcher (in-job restarts, hang detection) or plain torchrun, on this machine, through
    trainer.launcher so that nothing it starts outlives it."""
    return trainer_command(cfg, config_path, data_dir)


def run_local_training(cfg: Config, data_dir: Path) -> dict[str, Any]:
    """Launch training and relaunch the whole job when its launcher fails; output streams to
    <run dir>/train.log. Returns result.json and `launched_at`, this launch's start (the report's origin:
    components.train.report). The launch is recorded, start and end, with the run (trainer.run.history): a
    continuation's wall time is the sum of its launches'.

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
    with RunLease(run_dir.path) as lease, cancel_on_sigterm():
        config_path = run_dir.write_config(cfg.to_yaml())
        record_train_launch(run_dir.path, started)
        outcome = "failed"
        try:
            _launch_until_done(cfg, config_path, data_dir, lease, started)
            outcome = "finished"
        finally:
            record_train_launch_ended(run_dir.path, started, outcome)
    result = read_json(run_dir.result)
    if result is None:
        raise TrainingError(f"training finished but wrote no {run_dir.result}; log: {run_dir.train_log}")
    return {**result, "launched_at": started}


def _launch_until_done(cfg: Config, config_path: Path, data_dir: Path, lease: RunLease, started: float) -> None:
    r = cfg.resilience
    run_dir = RunDir(cfg.run_dir)
    empty_launches = 0  # launches in a row that started no training attempt at all
    for attempt in itertools.count():
        attempts_before = control_state(run_dir.path).attempts_total
        try:
            _launch_once(cfg, config_path, data_dir, attempt, lease.new_generation(), budget_since=started)
            return
        except (CrashLoop, TrainingTimeout):
            raise
        except TrainingError as err:
            empty_launches = empty_launches + 1 if control_state(run_dir.path).attempts_total == attempts_before else 0
            if 0 <= r.job_restarts <= attempt:
                raise
            if empty_launches >= r.max_restarts_without_progress:
                raise CrashLoop(f"crash loop: {empty_launches} launches in a row failed before any trainer started "
                                f"(resilience.max_restarts_without_progress={r.max_restarts_without_progress}); "
                                f"the job relaunch layer gives up. Last failure: {err}") from err
            log.warning("training job failed (attempt %d), relaunching: %s", attempt + 1, str(err).splitlines()[0])




def _launch_once(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int,
                 budget_since: float) -> None:
    if cfg.training.num_nodes > 1:  # one launcher per node, as on EKS
        launch_nodes(cfg, config_path, data_dir, attempt, generation, budget_since)
        return
    log_path = RunDir(cfg.run_dir).train_log
    command = launch_command(cfg, config_path, data_dir)
    if cfg.resilience.launcher == "ft_launcher":
        log.info("initial heartbeat timeout %.0f s: %s", *initial_heartbeat_timeout(cfg, data_dir))
    log.info("launching (attempt %d, lease generation %d): %s", attempt + 1, generation, " ".join(command))
    token = uuid.uuid4().hex
    env = launch_env(cfg, attempt, token, generation, budget_since)
    # The launcher's own session keeps a Ctrl-C of the pipeline from reaching the ranks twice; the ranks sit
    # in sessions of their own anyway, which is why stopping goes by the launch's token, not a process group.
    with log_path.open("a") as log_file, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                         text=True, env=env, start_new_session=True) as proc:
        output = LaunchOutput(log_file)
        reader = output.follow(proc.stdout)
        try:
            returncode = proc.wait(timeout=cfg.training.timeout_seconds)
        except subprocess.TimeoutExpired as err:
            stop_job(proc, token)
            raise TrainingTimeout(f"training exceeded training.timeout_seconds={cfg.training.timeout_seconds}; every "
                                  f"training process was stopped; log: {log_path}") from err
        finally:
            stop_job(proc, token)  # after an exit, a cancel or a timeout: nothing of this launch outlives it
            reader.join(timeout=10)
    raise_for_exit(cfg, returncode, generation, output)
