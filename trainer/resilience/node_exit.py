"""A worker takes its whole node down: the node_loss drill, and a straggler's replacement
(resilience.on_straggler=replace_node). Everything the node runs dies at once, as when the machine is lost;
the node's launcher (trainer.launch.launcher) marks each of its processes with the node's token."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path

import psutil

from trainer.env import (JOB_TOKEN_ENV, NODE_LAUNCHER_PID_ENV, NODE_RANK_ENV, NODE_STORE_ENV, NODE_TOKEN_ENV,
                         REPLICA_GROUP_ENV, WARM_START_ENV)

log = logging.getLogger(__name__)


def remove_fork_server_socket(socket_path: str) -> None:
    """A node's fork-server socket, and its temporary folder once empty: what goes with a lost machine's /tmp,
    and what a launcher removes when it ends. A SIGKILLed launcher or a lost node cannot (their folders piled up
    under /tmp on a machine that runs many launches)."""
    with contextlib.suppress(OSError):
        os.unlink(socket_path)
    with contextlib.suppress(OSError):
        os.rmdir(os.path.dirname(socket_path))


def kill_this_node(reason: str) -> None:
    """The node_loss drill on a node of a multi-node job: everything the node runs dies at once — its launcher
    first (so it restarts nothing), then every process started under it — and its node memory is wiped, as
    when the machine is lost. Does not return."""
    log.warning("node %s is lost (%s): its launcher, its workers and its node memory go", os.environ.get(
        NODE_RANK_ENV, "?"), reason)
    launcher = int(os.environ[NODE_LAUNCHER_PID_ENV])
    with _ignore_gone():
        os.kill(launcher, signal.SIGKILL)
    if os.environ.get(NODE_STORE_ENV):
        shutil.rmtree(Path(os.environ[NODE_STORE_ENV]), ignore_errors=True)
    if os.environ.get(WARM_START_ENV):
        remove_fork_server_socket(os.environ[WARM_START_ENV])
    token = os.environ[NODE_TOKEN_ENV]
    for proc in psutil.process_iter():
        with _ignore_gone():
            if proc.pid != os.getpid() and proc.environ().get(NODE_TOKEN_ENV) == token:
                proc.kill()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_this_group(reason: str, permanent: bool) -> None:
    """The group_loss drill: every node of this replica group is lost at once — each launcher first (so none
    restarts anything), then every process of the group, and the group's node memory. Does not return.
    permanent: the local runner starts no replacement (it reads the drill's key from the fired faults)."""
    group, token = os.environ.get(REPLICA_GROUP_ENV), os.environ.get(JOB_TOKEN_ENV)
    log.warning("replica group %s is lost%s (%s): every node of it goes", group,
                " for good" if permanent else "", reason)
    launchers, others, stores, sockets = [], [], set(), set()
    for proc in psutil.process_iter():
        with _ignore_gone():
            env = proc.environ()
            if proc.pid != os.getpid() and env.get(JOB_TOKEN_ENV) == token and env.get(REPLICA_GROUP_ENV) == group:
                # a node's launcher is the one process of it without its launcher's pid in the environment
                (others if NODE_LAUNCHER_PID_ENV in env else launchers).append(proc)
                stores.update([env[NODE_STORE_ENV]] if env.get(NODE_STORE_ENV) else [])
                sockets.update([env[WARM_START_ENV]] if env.get(WARM_START_ENV) else [])
    for proc in launchers + others:
        with _ignore_gone():
            proc.kill()
    for store in stores | ({os.environ[NODE_STORE_ENV]} if os.environ.get(NODE_STORE_ENV) else set()):
        shutil.rmtree(Path(store), ignore_errors=True)
    for socket_path in sockets | ({os.environ[WARM_START_ENV]} if os.environ.get(WARM_START_ENV) else set()):
        remove_fork_server_socket(socket_path)
    os.kill(os.getpid(), signal.SIGKILL)


def in_a_node_of_many() -> bool:
    """Whether this worker runs under a launcher of a multi-node job (a node of its own, not every rank)."""
    return bool(os.environ.get(NODE_LAUNCHER_PID_ENV)) and \
        int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0) < int(os.environ.get("WORLD_SIZE", 0) or 0)


class _ignore_gone:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, traceback):
        return kind is not None and issubclass(kind, (ProcessLookupError, psutil.NoSuchProcess, psutil.AccessDenied,
                                                      psutil.ZombieProcess))
