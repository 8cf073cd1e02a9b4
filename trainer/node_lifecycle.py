"""What happens to a node whose launcher ended: one table for every launcher of the job.

A multi-node job survives the loss of a node without restarting the others: only that node is replaced (with
the same node index), the survivors' launchers and node memory live on, their workers restart in-job and wait
in the rendezvous for the newcomer, which restores its shards from the peer replica held by its neighbour
(docs/node-loss.md). The launcher's exit code says which way a node's end goes:

====================  =============  =====================================================================
exit code             verdict        locally (components/train/nodes.py)  /  on EKS (podFailurePolicy)
====================  =============  =====================================================================
0                     finished       the node is done                     /  the index succeeds
42 (crash loop)       fail the job   CrashLoop, never relaunched           /  FailJob -> JobSet FailJobSet
43 (no replacement)   restart job    every node stopped, job relaunched    /  FailJob -> JobSet RestartJobSet
anything else         replace node   a new node after the delay            /  the index's pod is recreated
====================  =============  =====================================================================

Exit code 43 comes from a survivor whose rendezvous waited ``resilience.replacement_timeout_seconds`` for
a replacement that never came (trainer.launcher). A pod evicted or preempted (a DisruptionTarget condition: a
node drained, a Spot reclaim) is a node loss that is not the training's fault: replaced, never counted.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
from pathlib import Path

import psutil

from trainer.checkpoint.node_folders import NODE_STORE_ENV
from trainer.resilience.budget import CRASH_LOOP_EXIT_CODE

log = logging.getLogger(__name__)

REPLACEMENT_TIMEOUT_EXIT_CODE = 43
# Set by trainer.launcher for every process of its node: which node it is, the launcher's pid, a token shared by
# every process it starts (workers in sessions of their own, rank monitors, the fork server).
NODE_RANK_ENV = "PET_NODE_RANK"
NODE_LAUNCHER_PID_ENV = "RESILIENT_TRAIN_NODE_LAUNCHER_PID"
NODE_TOKEN_ENV = "RESILIENT_TRAIN_NODE_TOKEN"
CONTAINER_NAME = "node"  # the TrainJob's trainer container (Kubeflow Trainer's torch runtime)


class Verdict(enum.Enum):
    FINISHED = "finished"
    FAIL_JOB = "fail the job"
    RESTART_JOB = "restart the whole job"
    REPLACE_NODE = "replace the node"


def verdict(returncode: int) -> Verdict:
    """What the job does when a node's launcher exits with this code (negative: killed by that signal)."""
    if returncode == 0:
        return Verdict.FINISHED
    if returncode == CRASH_LOOP_EXIT_CODE:
        return Verdict.FAIL_JOB
    if returncode == REPLACEMENT_TIMEOUT_EXIT_CODE:
        return Verdict.RESTART_JOB
    return Verdict.REPLACE_NODE


def pod_failure_policy() -> dict:
    """The node Job's podFailurePolicy that gives every verdict above its meaning on EKS (rules in order, the
    first match acts): 42 and 43 fail the Job (the JobSet's rules then fail or restart the whole job), a
    disruption is replaced without counting; any other failure counts against the index's backoff and the
    pod is recreated with the same index."""
    def exit_code(code: int) -> dict:
        return {"action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In", "values": [code]}}

    return {"rules": [exit_code(CRASH_LOOP_EXIT_CODE), exit_code(REPLACEMENT_TIMEOUT_EXIT_CODE),
                      {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}]}


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
    token = os.environ[NODE_TOKEN_ENV]
    for proc in psutil.process_iter():
        with _ignore_gone():
            if proc.pid != os.getpid() and proc.environ().get(NODE_TOKEN_ENV) == token:
                proc.kill()
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
