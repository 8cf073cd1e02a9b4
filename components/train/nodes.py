"""A multi-node job on one machine, as on EKS: one launcher per node, meeting in a rendezvous store outside
every node, and a lost node replaced — the others keep running.

    training.num_nodes=3, training.nproc_per_node=1  ->  rendezvous store + node 0, node 1, node 2

Each node is ``python -m trainer.launcher`` with a node memory folder of its own
(``<memory_dir>/<run_id>/node-<i>``) and ``PET_NODE_RANK=i``, as a TrainJob pod has. When a node's launcher
ends, trainer.launch.node_lifecycle says what follows: a lost node (the node_loss drill kills its launcher and
workers and wipes its memory) is replaced after ``local.node_replacement_delay_seconds`` by a new launcher
with the same index, while the survivors' workers restart in-job and wait in the rendezvous; exit code 43 (a
replacement did not come within resilience.replacement_timeout_seconds) restarts the whole job, 42 (the
restart budget gave up) fails it. docs/node-loss.md follows a loss pod by pod.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from components.train.processes import (LaunchOutput, TrainingError, TrainingTimeout, job_processes, launch_env,
                                        raise_for_exit)
from trainer.config import Config
from trainer.env import JOB_TOKEN_ENV, NODE_RANK_ENV, NUM_NODES_ENV
from trainer.launch.command import trainer_command
from trainer.launch.node_lifecycle import Verdict, verdict
from trainer.launch.rendezvous_store import READY_LINE
from trainer.run.history import control_state
from trainer.run.run_dir import RunDir

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0


@dataclass
class Node:
    index: int
    proc: subprocess.Popen
    reader: threading.Thread
    started: float


class NodeReplacementTimeout(TrainingError):
    """A lost node's replacement did not join within resilience.replacement_timeout_seconds: the whole job
    restarts (from FSx, every node's memory being gone with its launcher)."""


def node_command(command: list[str], index: int) -> list[str]:
    """The node's own memory folder under the job's (a replacement finds its predecessor's gone), and an
    address of its own on loopback (127.0.0.<index + 1>), as each pod has its host name: NVRx 0.4.1's
    rendezvous orders nodes by address whenever the node completing a round saw no earlier one (a
    replacement), so a stable address per node index is what keeps every survivor's rank — and with it the
    node memory its ranks wrote."""
    assert index < 254, "one loopback address per local node"
    command = [f"{arg}/node-{index}" if arg.startswith("--node-store=") else arg for arg in command]
    at = next(i for i, arg in enumerate(command) if arg.startswith("--nproc-per-node="))
    return [*command[:at], f"--local-addr=127.0.0.{index + 1}", *command[at:]]


def start_rendezvous_store(env: dict[str, str], nodes: int) -> tuple[subprocess.Popen, int]:
    store = subprocess.Popen([sys.executable, "-m", "trainer.rendezvous_store", "--host", "127.0.0.1", "--port", "0",
                              "--nodes", str(nodes), "--die-with-parent"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    for line in store.stdout:
        if line.startswith(READY_LINE):
            threading.Thread(target=lambda: [None for _ in store.stdout], daemon=True).start()  # drain it
            return store, int(line.split()[-1])
        if time.monotonic() > deadline:
            break
    store.kill()
    raise TrainingError(f"the rendezvous store did not start (exit code {store.wait()})")


def launch_nodes(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int,
                 budget_since: float) -> None:
    """Run the job's nodes until every one finished. Raises CrashLoop, TrainingTimeout, NodeReplacementTimeout
    (the caller relaunches the whole job) or TrainingError (a node failed again and again before any trainer
    started). Every process of the launch is stopped when this returns."""
    run_dir = RunDir(cfg.run_dir)
    token = uuid.uuid4().hex
    env = launch_env(cfg, attempt, token, generation, budget_since)
    count = cfg.training.num_nodes
    delay = cfg.local.node_replacement_delay_seconds
    store, port = start_rendezvous_store(env, count)
    command = trainer_command(cfg, config_path, data_dir, rendezvous_endpoint=f"127.0.0.1:{port}")
    log.info("launching %d nodes x %d ranks (attempt %d, lease generation %d), rendezvous store on port %d: %s",
             count, cfg.training.nproc_per_node, attempt + 1, generation, port, " ".join(command))
    deadline = time.monotonic() + cfg.training.timeout_seconds
    running: dict[int, Node] = {}
    replacements: dict[int, float] = {}  # node index -> when its replacement starts
    finished: set[int] = set()
    failures_without_attempts, attempts_seen = 0, control_state(run_dir.path).attempts_total
    with run_dir.train_log.open("a") as log_file:
        output = LaunchOutput(log_file)

        def start(index: int) -> Node:
            proc = subprocess.Popen(node_command(command, index), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, env={**env, NODE_RANK_ENV: str(index), NUM_NODES_ENV: str(count)},
                                    start_new_session=True)
            output.note(f"node {index} started (launcher pid {proc.pid})")
            return Node(index, proc, output.follow(proc.stdout, f"[node-{index}] "), time.monotonic())

        try:
            running = {index: start(index) for index in range(count)}
            while len(finished) < count:
                if time.monotonic() > deadline:
                    raise TrainingTimeout(f"training exceeded training.timeout_seconds={cfg.training.timeout_seconds}; "
                                          f"every training process was stopped; log: {run_dir.train_log}")
                for index, node in list(running.items()):
                    returncode = node.proc.poll()
                    if returncode is None:
                        continue
                    del running[index]
                    node.reader.join(timeout=5)
                    outcome = verdict(returncode)
                    if outcome is Verdict.FINISHED:
                        finished.add(index)
                    elif outcome is Verdict.FAIL_JOB:
                        raise_for_exit(cfg, returncode, generation, output, what=f"node {index}")
                    elif finished:  # training is over (another node finished it): nothing to replace
                        output.note(f"node {index} exited with {_exit_text(returncode)} after node(s) "
                                    f"{sorted(finished)} finished training", logging.WARNING)
                        finished.add(index)
                    elif outcome is Verdict.RESTART_JOB:
                        raise NodeReplacementTimeout(
                            f"node {index} waited resilience.replacement_timeout_seconds="
                            f"{cfg.resilience.replacement_timeout_seconds:g} for a lost node's replacement in vain: "
                            f"the whole job restarts; log: {run_dir.train_log}")
                    elif cfg.local.node_loss == "restart_job":
                        raise TrainingError(f"node {index} lost (its launcher exited with {_exit_text(returncode)}); "
                                            "local.node_loss=restart_job: the whole job restarts")
                    else:
                        attempts = control_state(run_dir.path).attempts_total
                        failures_without_attempts = failures_without_attempts + 1 if attempts == attempts_seen else 1
                        attempts_seen = attempts
                        if failures_without_attempts > cfg.resilience.max_restarts_without_progress:
                            raise_for_exit(cfg, returncode, generation, output, what=f"node {index} (again, before any "
                                           "trainer started)")
                        output.note(f"node {index} lost (its launcher exited with {_exit_text(returncode)} after "
                                    f"{time.monotonic() - node.started:.0f} s): the other nodes keep running; its "
                                    f"replacement starts in {delay:g} s", logging.WARNING)
                        replacements[index] = time.monotonic() + delay
                for index, due in list(replacements.items()):
                    if time.monotonic() >= due:
                        del replacements[index]
                        output.note(f"node {index}: its replacement starts (same node index, empty node memory)")
                        running[index] = start(index)
                time.sleep(POLL_SECONDS)
        finally:
            stop_nodes(list(running.values()), token)
            store.kill()
            store.wait()


def _exit_text(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


def stop_nodes(nodes: list[Node], token: str) -> None:
    """SIGTERM to every launcher (each stops its workers), SIGKILL after the grace, then every process left
    with the launch's token."""
    for node in nodes:
        if node.proc.poll() is None:
            node.proc.terminate()
    give_up_at = time.monotonic() + STOP_GRACE_SECONDS
    for node in nodes:
        try:
            node.proc.wait(timeout=max(0.1, give_up_at - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
        node.reader.join(timeout=5)
    left = job_processes(token, JOB_TOKEN_ENV)
    for survivor in left:
        try:
            survivor.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=STOP_GRACE_SECONDS)
