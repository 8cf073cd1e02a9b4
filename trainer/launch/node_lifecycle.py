"""What happens to a node whose launcher ended: one table for every launcher of the job.

A multi-node job survives the loss of a node without restarting the others: only that node is replaced (with
the same node index), the survivors' launchers and node memory live on, their workers restart in-job and wait
in the rendezvous for the newcomer, which restores its shards from the peer replica held by its neighbour
(docs/node-loss.md). The launcher's exit code says which way a node's end goes:

====================  =============  =====================================================================
exit code             verdict        locally (localcluster/nodes.py)  /  on EKS (podFailurePolicy)
====================  =============  =====================================================================
0                     finished       the node is done                     /  the index succeeds
42 (crash loop)       fail the job   CrashLoop, never relaunched           /  FailJob -> JobSet FailJobSet
43 (no replacement)   restart job    every node stopped, job relaunched    /  FailJob -> JobSet RestartJobSet
45 (no replacement,   restart group  the group's nodes stopped, restarted  /  the index's pod is recreated (no
    replica groups)                                                           rule matches; each survivor's)
46 (cut off: the       replace node   a new node after the delay            /  the index's pod is recreated
    store unreachable)
47 (fenced: a newer   superseded     nothing (its replacement runs)       /  never seen: the pod object is
    launcher claimed                                                          gone once its replacement exists
    the node index)                                                           (podReplacementPolicy: Failed)
anything else         replace node   a new node after the delay            /  the index's pod is recreated
====================  =============  =====================================================================

Exit code 43 comes from a survivor whose rendezvous waited ``resilience.replacement_timeout_seconds`` for
a replacement that never came (trainer.launcher). A pod evicted or preempted (a DisruptionTarget condition: a
node drained, a Spot reclaim) is a node loss that is not the training's fault: replaced, never counted.
"""

from __future__ import annotations

import enum

from trainer.env import CRASH_LOOP_EXIT_CODE, GROUP_RESTART_EXIT_CODE, NODE_FENCED_EXIT_CODE, REPLACEMENT_TIMEOUT_EXIT_CODE

CONTAINER_NAME = "node"  # the TrainJob's trainer container (Kubeflow Trainer's torch runtime)


class Verdict(enum.Enum):
    FINISHED = "finished"
    FAIL_JOB = "fail the job"
    RESTART_JOB = "restart the whole job"
    RESTART_GROUP = "restart the node's replica group"
    REPLACE_NODE = "replace the node"
    SUPERSEDED = "nothing: a newer launcher of the node index runs"


def verdict(returncode: int) -> Verdict:
    """What the job does when a node's launcher exits with this code (negative: killed by that signal)."""
    if returncode == 0:
        return Verdict.FINISHED
    if returncode == CRASH_LOOP_EXIT_CODE:
        return Verdict.FAIL_JOB
    if returncode == REPLACEMENT_TIMEOUT_EXIT_CODE:
        return Verdict.RESTART_JOB
    if returncode == GROUP_RESTART_EXIT_CODE:
        return Verdict.RESTART_GROUP
    if returncode == NODE_FENCED_EXIT_CODE:
        return Verdict.SUPERSEDED
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
