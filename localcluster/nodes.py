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

With training.replica_groups = R >= 2 the nodes split into R groups of num_nodes / R (node i in group
i // (num_nodes / R)), each a job of its own: its own rendezvous store, node ranks from 0, in-job restarts and
node replacement inside the group; torchft's lighthouse (started here, and again if it dies) forms each step's
quorum across them. A group's 43 restarts that group only; a group that cannot come back (its restart budget
gave up, or a permanent group_loss drill) is dropped while resilience.min_replica_groups groups remain.
docs/replica-groups.md.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from localcluster.network import node_network
from localcluster.network_drills import network_drills
from localcluster.processes import (CrashLoop, LaunchOutput, TrainingError, TrainingTimeout, job_processes,
                                        launch_env, raise_for_exit)
from trainer.config import Config
from trainer.config.drills import parse_schedule
from trainer.env import (JOB_TOKEN_ENV, LIGHTHOUSE_ENV, NODE_CUT_OFF_EXIT_CODE, NODE_INDEX_ENV, NODE_RANK_ENV, NODE_REPLACEMENT_ENV,
                         NUM_NODES_ENV, REPLICA_GROUP_ENV)
from trainer.launch.command import nodes_per_group, trainer_command
from trainer.launch.lighthouse import lighthouse_command
from trainer.launch.node_lifecycle import Verdict, verdict
from trainer.launch.rendezvous_store import READY_LINE
from trainer.run.events import EventLog
from trainer.run.history import control_state
from trainer.run.run_dir import RunDir

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 10.0


@dataclass
class Node:
    index: int  # the node's index in the job (its group's nodes are numbered from 0 in the group)
    group: int
    proc: subprocess.Popen
    reader: threading.Thread
    started: float


class NodeReplacementTimeout(TrainingError):
    """A lost node's replacement did not join within resilience.replacement_timeout_seconds: the whole job
    restarts (from FSx, every node's memory being gone with its launcher)."""


def node_command(command: list[str], index: int, address: str) -> list[str]:
    """The node's own memory folder under the job's (a replacement finds its predecessor's gone), and an
    address of its own (localcluster.network: 127.0.0.<index + 1> on loopback, the host name rt-node-<index>
    with namespaces), as each pod has its host name: NVRx 0.4.1's rendezvous orders nodes by address whenever the
    node completing a round saw no earlier one (a replacement), so a stable address per node index is what keeps
    every survivor's rank — and with it the node memory its ranks wrote."""
    command = [f"{arg}/node-{index}" if arg.startswith("--node-store=") else arg for arg in command]
    at = next(i for i, arg in enumerate(command) if arg.startswith("--nproc-per-node="))
    return [*command[:at], f"--local-addr={address}", *command[at:]]


def start_rendezvous_store(env: dict[str, str], nodes: int, network) -> tuple[subprocess.Popen, int]:
    store = subprocess.Popen([*network.services_prefix(), sys.executable, "-m", "trainer.rendezvous_store", "--host",
                              network.services_address, "--port", "0", "--nodes", str(nodes), "--die-with-parent"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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


class Lighthouse:
    """torchft's lighthouse for the groups of one launch (trainer.launch.lighthouse), started again on the same
    port whenever it dies: it holds no state, and the managers retry their quorum requests meanwhile."""

    def __init__(self, cfg: Config, env: dict[str, str], network):
        with socket.socket() as sock:  # free here; in the services' own namespace any port is
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        host = network.services_address
        self.command = [*network.services_prefix(), *lighthouse_command(cfg, f"{host}:{self.port}")]
        self.env, self.restarts = env, 0
        self.address = f"http://{host}:{self.port}"
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        # Its log is a line per quorum (every step): not the run's log.
        return subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)

    def keep_alive(self, output: LaunchOutput) -> None:
        if self.proc.poll() is not None:
            self.restarts += 1
            output.note(f"the lighthouse exited ({_exit_text(self.proc.returncode)}): started again on port "
                        f"{self.port} (restart {self.restarts})", logging.WARNING)
            self.proc = self._start()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def permanently_lost_groups(cfg: Config, fired_keys: list[str]) -> set[int]:
    """The groups a permanent group_loss drill took for good (its key is among the fired faults)."""
    return {f.group for f in parse_schedule(cfg.faults.schedule)
            if f.type == "group_loss" and f.permanent and f.key in fired_keys}


def launch_nodes(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int,
                 budget_since: float) -> None:
    """Run the job's nodes until every one finished. Raises CrashLoop, TrainingTimeout, NodeReplacementTimeout
    (the caller relaunches the whole job) or TrainingError (a node failed again and again before any trainer
    started). Every process of the launch is stopped when this returns."""
    token = uuid.uuid4().hex
    env = launch_env(cfg, attempt, token, generation, budget_since)
    network = node_network(cfg.local.node_network, token)  # NetworkUnavailable says why, naming the setting
    try:
        _launch_on(cfg, config_path, data_dir, attempt, generation, budget_since, network, token, env)
    finally:
        network.close()


def _launch_on(cfg: Config, config_path: Path, data_dir: Path, attempt: int, generation: int, budget_since: float,
               network, token: str, env: dict[str, str]) -> None:
    run_dir = RunDir(cfg.run_dir)
    count, groups, per_group = cfg.training.num_nodes, cfg.training.replica_groups, nodes_per_group(cfg)
    min_groups = cfg.resilience.min_groups(groups)
    delay = cfg.local.node_replacement_delay_seconds
    lighthouse = Lighthouse(cfg, env, network) if groups > 1 else None
    if lighthouse is not None:
        env = {**env, LIGHTHOUSE_ENV: lighthouse.address}
    stores = [start_rendezvous_store(env, per_group, network) for _ in range(groups)]
    commands = [trainer_command(cfg, config_path, data_dir, rendezvous_endpoint=f"{network.services_address}:{port}")
                for _, port in stores]
    log.info("launching %d nodes x %d ranks%s (attempt %d, lease generation %d, %s network), rendezvous store(s) on "
             "port(s) %s: %s", count, cfg.training.nproc_per_node, f" in {groups} replica groups" if groups > 1 else "",
             attempt + 1, generation, cfg.local.node_network, ", ".join(str(port) for _, port in stores),
             " ".join(commands[0]))
    deadline = time.monotonic() + cfg.training.timeout_seconds
    running: dict[int, Node] = {}
    replacements: dict[int, float] = {}  # node index -> when its replacement starts
    finished: set[int] = set()
    gone: set[int] = set()  # nodes of groups dropped for good
    replaced: dict[int, int] = {}  # node index -> launchers started for it (the first is no replacement)
    failures_without_attempts, attempts_seen = 0, control_state(run_dir.path).attempts_total
    events = EventLog(run_dir.path, rank=None)
    with run_dir.train_log.open("a") as log_file:
        output = LaunchOutput(log_file)

        def start(index: int) -> Node:
            group = index // per_group
            node_env = {**env, NODE_RANK_ENV: str(index % per_group), NUM_NODES_ENV: str(per_group),
                        NODE_REPLACEMENT_ENV: str(replaced.get(index, 0))}
            replaced[index] = replaced.get(index, 0) + 1
            if groups > 1:  # torchft's Rust side logs each quorum and commit at info level unless told otherwise
                node_env.update({REPLICA_GROUP_ENV: str(group), NODE_INDEX_ENV: str(index),
                                 "RUST_LOG": env.get("RUST_LOG", "warn")})
            prefix, address = network.start_node(index)
            proc = subprocess.Popen([*prefix, *node_command(commands[group], index, address)], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=node_env, start_new_session=True)
            output.note(f"node {index} started{f' (replica group {group})' if groups > 1 else ''} "
                        f"(launcher pid {proc.pid})")
            return Node(index, group, proc, output.follow(proc.stdout, f"[node-{index}] "), time.monotonic())

        def drop_group(group: int, why: str, crash_loop: bool = False) -> None:
            """A group that cannot come back: the job goes on without it while enough groups are left. Too few
            left: a crash loop fails the job as with one group (CrashLoop: never relaunched); a group lost for
            good restarts it (the relaunch brings every group back from the tiers)."""
            members = set(range(group * per_group, (group + 1) * per_group))
            left = groups - len(gone) // per_group - 1
            if left < min_groups:
                message = (f"replica group {group} is lost ({why}) and {left} group(s) are left, fewer than "
                           f"resilience.min_replica_groups={min_groups}: the job stops")
                output.note(message, logging.ERROR)
                raise (CrashLoop if crash_loop else TrainingError)(f"{message}; log: {run_dir.train_log}")
            output.note(f"replica group {group} is lost for good ({why}): {left} group(s) train on",
                        logging.WARNING)
            gone.update(members)
            stop_nodes([running.pop(i) for i in members if i in running], token, group=group)
            for index in members:
                replacements.pop(index, None)

        def restart_group(group: int) -> None:
            members = range(group * per_group, (group + 1) * per_group)
            stop_nodes([running.pop(i) for i in members if i in running], token, group=group)
            for index in members:
                replacements[index] = time.monotonic()

        drills = network_drills(cfg, network, lambda text: output.note(text, logging.WARNING))
        try:
            running = {index: start(index) for index in range(count)}
            while len(finished | gone) < count:
                if lighthouse is not None:
                    lighthouse.keep_alive(output)
                if drills is not None:
                    drills.poll()
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
                    if index in gone:
                        continue
                    if outcome is Verdict.SUPERSEDED:  # a newer launcher of this index runs: nothing to replace
                        output.note(f"node {index}: a launcher replaced while cut off stopped ({_exit_text(returncode)})")
                        continue
                    if outcome is Verdict.FINISHED:
                        finished.add(index)
                        for pending in list(replacements):  # training is over: nothing left to replace
                            del replacements[pending]
                            finished.add(pending)
                    elif outcome is Verdict.FAIL_JOB and groups > 1:  # this group's restart budget gave up
                        drop_group(node.group, f"node {index} exited with {_exit_text(returncode)}: its restart "
                                   "budget gave up", crash_loop=True)
                    elif outcome is Verdict.FAIL_JOB:
                        raise_for_exit(cfg, returncode, generation, output, what=f"node {index}")
                    elif finished:  # training is over (another node finished it): nothing to replace
                        output.note(f"node {index} exited with {_exit_text(returncode)} after node(s) "
                                    f"{sorted(finished)} finished training", logging.WARNING)
                        finished.add(index)
                    elif outcome in (Verdict.RESTART_JOB, Verdict.RESTART_GROUP) and groups > 1:
                        output.note(f"node {index} waited resilience.replacement_timeout_seconds for a node of "
                                    f"replica group {node.group} in vain: that group restarts, the others train on",
                                    logging.WARNING)
                        restart_group(node.group)
                    elif node.group in permanently_lost_groups(cfg, control_state(run_dir.path).fired_fault_keys):
                        drop_group(node.group, "a permanent group_loss drill: no replacement comes")
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
                        cut_off = returncode == NODE_CUT_OFF_EXIT_CODE
                        output.note(f"node {index} lost (its launcher exited with {_exit_text(returncode)}"
                                    f"{': it could not reach the rendezvous store, cut off' if cut_off else ''} after "
                                    f"{time.monotonic() - node.started:.0f} s): the other nodes keep running; its "
                                    f"replacement starts in {delay:g} s", logging.WARNING)
                        events.write("node_lost", node=index, exit_code=returncode,
                                     detector="store_timeout" if cut_off else "launcher_exit")
                        replacements[index] = time.monotonic() + delay
                for index, due in list(replacements.items()):
                    if time.monotonic() >= due:
                        del replacements[index]
                        output.note(f"node {index}: its replacement starts (same node index, empty node memory)")
                        running[index] = start(index)
                time.sleep(POLL_SECONDS)
        finally:
            stop_nodes(list(running.values()), token)
            for store, _ in stores:
                store.kill()
                store.wait()
            if lighthouse is not None:
                lighthouse.stop()


def _exit_text(returncode: int) -> str:
    return f"signal {-returncode}" if returncode < 0 else f"code {returncode}"


def stop_nodes(nodes: list[Node], token: str, group: int | None = None) -> None:
    """SIGTERM to every launcher (each stops its workers), SIGKILL after the grace, then every process left
    with the launch's token (of that replica group only, given one)."""
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
    left = [p for p in job_processes(token, JOB_TOKEN_ENV) if group is None or _group_of(p) == str(group)]
    for survivor in left:
        try:
            survivor.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(left, timeout=STOP_GRACE_SECONDS)


def _group_of(proc: psutil.Process) -> str | None:
    try:
        return proc.environ().get(REPLICA_GROUP_ENV)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
