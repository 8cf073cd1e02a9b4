"""The processes of one training launch, for both local launchers (components/train/local.py: every rank on
this machine; localcluster/nodes.py: a launcher per node): their environment, their output (train.log,
the ranks' exception lines), how they are stopped (every process carrying the launch's token, whatever its
session), and what a launcher's exit code means for the step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque

import psutil

from trainer.config import Config
from trainer.config.rules import InputError
from trainer.env import (BUDGET_SINCE_ENV, CRASH_LOOP_EXIT_CODE, GENERATION_ENV, JOB_ATTEMPT_ENV, JOB_TOKEN_ENV,
                         LAUNCHER_ENV, RUN_DIR_ENV)
from trainer.resilience.budget import read_gave_up
from trainer.run.run_dir import RunDir

log = logging.getLogger(__name__)



# torch prefixes each rank's traceback lines with "[rankN]: ".
_EXCEPTION_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([\w.]+(?:Error|Exception|Interrupt|Fault): \S.*)$")
# ft_launcher logs its failed NVML probe on machines without NVIDIA drivers; expected on CPU, not a cause.
_EXPECTED_NOISE = ("libnvidia-ml.so",)


class TrainingError(RuntimeError):
    """Training exited with an error or ran out of time; the message holds the log's tail and its path."""


class CrashLoop(TrainingError):
    """The restart budget gave up: recoveries stopped making progress. Never relaunched; the message says where."""


class TrainingInputError(CrashLoop, InputError):
    """The trainer stopped on an input it cannot use (a changed data mixture, a schedule a continuation cannot
    keep, a tokenizer that is not the base model's): cause input, exit 2, the message names the field."""


class TrainingTimeout(TrainingError):
    """A launch ran past training.timeout_seconds: a deadline, so never relaunched (as activeDeadlineSeconds ends a
    TrainJob on EKS)."""

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


def launch_env(cfg: Config, attempt: int, token: str, generation: int, budget_since: float) -> dict[str, str]:
    """The environment of every process of one launch (all its nodes)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHER_ENV: cfg.resilience.launcher, JOB_ATTEMPT_ENV: str(attempt),
            JOB_TOKEN_ENV: token, RUN_DIR_ENV: str(cfg.run_dir), GENERATION_ENV: str(generation),
            BUDGET_SINCE_ENV: repr(budget_since),
            # the launcher itself imports pynvml through torch.cuda; its deprecation notice is noise.
            "PYTHONWARNINGS": "ignore:The pynvml package is deprecated"}


class LaunchOutput:
    """Every launcher's output of one launch: into train.log and stdout (with a node prefix when there are
    several), the last lines kept for the error message, and the ranks' exception lines collected as causes."""

    def __init__(self, log_file):
        self.log_file = log_file
        self.tail: deque[str] = deque(maxlen=40)
        self.errors: list[str] = []  # "SomeError: message" lines from the ranks' tracebacks
        self._lock = threading.Lock()

    def pump(self, stream, prefix: str = "") -> None:
        for line in stream:
            if (match := _EXCEPTION_LINE.match(line.rstrip())) and not any(n in line for n in _EXPECTED_NOISE):
                self.errors.append(match.group(1))
            with self._lock:
                self.log_file.write(prefix + line)
                self.log_file.flush()
                self.tail.append(prefix + line)
                sys.stdout.write(prefix + line)

    def note(self, message: str, level: int = logging.INFO) -> None:
        """A line of the runner's own (node starts and losses), in train.log beside the nodes' output."""
        log.log(level, "%s", message)
        with self._lock:
            self.log_file.write(f"[nodes] {message}\n")
            self.log_file.flush()

    def follow(self, stream, prefix: str = "") -> threading.Thread:
        reader = threading.Thread(target=self.pump, args=(stream, prefix), daemon=True)
        reader.start()
        return reader

    def causes(self) -> str:
        return "\n".join(dict.fromkeys(self.errors)) or "".join(self.tail)

def raise_for_exit(cfg: Config, returncode: int, generation: int, output: LaunchOutput, what: str = "training") -> None:
    """CrashLoop when the restart budget of this launch gave up, TrainingError for any other failure."""
    log_path = RunDir(cfg.run_dir).train_log
    gave_up = read_gave_up(cfg.run_dir)
    if returncode == CRASH_LOOP_EXIT_CODE and gave_up is not None and gave_up.get("generation") == generation:
        kind = TrainingInputError if gave_up.get("cause") == "input" else CrashLoop
        raise kind(f"{gave_up['message']} (log: {log_path})")
    if returncode != 0:
        raise TrainingError(f"{what} exited with code {returncode}; log: {log_path}\n{output.causes()}")
