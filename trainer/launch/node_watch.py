"""A node's own view of whether it is still part of the job: reached by the job's network, and not replaced.

A node cut off from the job's network (an EFA link down, a node NotReady, a NetworkPolicy change) keeps
running, and still reaches the run folder: FSx is served over another network. Its workers block in a collective
until ft_launcher's heartbeat timeout restarts them; its launcher would then wait in a rendezvous it cannot
reach, and come back as a second copy of the node once the link does. Two checks end that, once a second, in the
node's launcher (trainer.launch.launcher):

- **cut off**: the rendezvous store (a process, a pod, outside every node) was reached once and then not for
  ``resilience.store_timeout_seconds``: the node stops its workers and exits 46, and is replaced;
- **fenced**: a newer launcher claimed this node index (trainer.run.lease.claim_node; a replacement started
  while this one was cut off): the node stops its workers and exits 47. Its workers write nothing in between:
  every write checks the same claim (trainer.run.lease.Fence).

Either stops the launch the way a SIGTERM does (ft_launcher stops its workers). A cut-off launcher's main thread
is often inside the rendezvous store's C++ client, waiting on a socket that never answers (seen: 300 s), where a
signal's Python handler cannot run: if the launcher has not returned STOP_GRACE_SECONDS after the signal, the
watch kills every process of the node (they carry its token) and ends the launcher with the code itself. So a
cut-off or fenced node is silent within 1 s of the check plus STOP_GRACE_SECONDS; its workers write nothing
in between anyway once fenced (trainer.run.lease.Fence).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import psutil

from trainer.env import NODE_CUT_OFF_EXIT_CODE, NODE_FENCED_EXIT_CODE, NODE_TOKEN_ENV
from trainer.run.lease import read_node_generation

PROBE_TIMEOUT_SECONDS = 1.0
STOP_GRACE_SECONDS = 2.0


def store_reachable(endpoint: str, timeout_seconds: float = PROBE_TIMEOUT_SECONDS) -> bool:
    """Whether a TCP connection to the store opens: the path the rendezvous's own requests take."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_seconds):
            return True
    except OSError:
        return False


class NodeWatch:
    """Watches the node's reach of the store (store_endpoint None or store_timeout_seconds 0: not watched) and its
    claim on its node index (run_dir None: not watched). `fired` is (exit code, message) once one fired."""

    def __init__(self, *, run_dir: Path | None, node_index: int, node_generation: int | None,
                 store_endpoint: str | None, store_timeout_seconds: float, interval_seconds: float = 1.0,
                 grace_seconds: float = STOP_GRACE_SECONDS):
        self.run_dir = run_dir
        self.node_index = node_index
        self.node_generation = node_generation
        self.store_endpoint = store_endpoint if store_timeout_seconds > 0 else None
        self.store_timeout_seconds = store_timeout_seconds
        self.interval_seconds = interval_seconds
        self.grace_seconds = grace_seconds
        self.last_reached: float | None = None  # the store is not yet up when a gang starts: count from a contact
        self.fired: tuple[int, str] | None = None
        self.done = threading.Event()

    @property
    def active(self) -> bool:
        return self.store_endpoint is not None or (self.run_dir is not None and self.node_generation is not None)

    def check(self, now: float) -> tuple[int, str] | None:
        """One round of both checks: what fires now, if anything."""
        if self.run_dir is not None and self.node_generation is not None:
            newest = read_node_generation(self.run_dir, self.node_index)
            if newest != self.node_generation:
                return NODE_FENCED_EXIT_CODE, (
                    f"node {self.node_index} was replaced while this launcher ran (node generation {newest}, this "
                    f"launcher's {self.node_generation}): it stops its workers and exits {NODE_FENCED_EXIT_CODE}; the "
                    "replacement trains as this node")
        if self.store_endpoint is not None:
            if store_reachable(self.store_endpoint):
                self.last_reached = now
            elif self.last_reached is not None and now - self.last_reached >= self.store_timeout_seconds:
                return NODE_CUT_OFF_EXIT_CODE, (
                    f"node {self.node_index} could not reach the rendezvous store at {self.store_endpoint} for "
                    f"{now - self.last_reached:.0f} s (resilience.store_timeout_seconds={self.store_timeout_seconds:g}): "
                    f"cut off from the job's network; it stops its workers and exits {NODE_CUT_OFF_EXIT_CODE} to be "
                    "replaced")
        return None

    def start(self) -> "NodeWatch":
        if self.active:
            threading.Thread(target=self._run, name="node-watch", daemon=True).start()
        return self

    def stop(self) -> None:
        """The launcher returned (main thread): no more signals, and none still in flight may interrupt the exit."""
        self.done.set()
        if self.fired is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _run(self) -> None:
        while self.fired is None and not self.done.wait(self.interval_seconds):
            fired = self.check(time.monotonic())
            if fired is not None:
                self.fired = fired
                print(f"trainer.launcher: {fired[1]}", file=sys.stderr, flush=True)
        if self.fired is None:
            return
        os.kill(os.getpid(), signal.SIGTERM)
        if not self.done.wait(self.grace_seconds):
            print(f"trainer.launcher: still running {self.grace_seconds:g} s after SIGTERM (blocked where no signal "
                  "reaches it): every process of this node is killed", file=sys.stderr, flush=True)
            kill_this_nodes_processes()
            os._exit(self.fired[0])


def kill_this_nodes_processes() -> None:
    """SIGKILL every other process that carries this node's token (workers, rank monitors, the fork server)."""
    token = os.environ.get(NODE_TOKEN_ENV)
    if not token:
        return
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(NODE_TOKEN_ENV) == token:
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
