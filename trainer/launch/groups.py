"""A TrainJob's pod finds its replica group: the node's index in the job splits into a group and a rank in it.

    env, args = join_replica_group(os.environ, launcher_args, groups=2)   # before the launcher starts

Kubeflow Trainer's torch plugin gives every pod of the job PET_NNODES (the job's nodes) and PET_NODE_RANK (the
pod's index, JOB_COMPLETION_INDEX). With training.replica_groups = R each group is a world of its own: node i
is node i mod (N / R) of group i // (N / R), with its own rendezvous (``--rdzv-id=<job>-group-<g>`` on the
job's one rendezvous store: c10d keys every rendezvous by its id) and its own node count. The local runner
sets the same variables itself (localcluster/nodes.py), so this changes nothing there.
"""

from __future__ import annotations

from trainer.env import NODE_INDEX_ENV, NODE_RANK_ENV, NUM_NODES_ENV, REPLICA_GROUP_ENV

REPLICA_GROUPS_OPTION = "--replica-groups="


def join_replica_group(environ: dict[str, str], args: list[str], groups: int) -> tuple[dict[str, str], list[str]]:
    """The variables to set and the launcher's arguments for this node's group (nothing to change with one group,
    or when the runner already placed the node)."""
    if groups <= 1 or REPLICA_GROUP_ENV in environ or NODE_RANK_ENV not in environ:
        return {}, list(args)
    index, nodes = int(environ[NODE_RANK_ENV]), int(environ[NUM_NODES_ENV])
    if nodes % groups:
        raise ValueError(f"{NUM_NODES_ENV}={nodes} nodes do not split into {groups} replica groups "
                         "(training.replica_groups must divide training.num_nodes)")
    per_group = nodes // groups
    group = index // per_group
    env = {REPLICA_GROUP_ENV: str(group), NODE_INDEX_ENV: str(index), NODE_RANK_ENV: str(index % per_group),
           NUM_NODES_ENV: str(per_group)}
    return env, [f"{arg}-group-{group}" if arg.startswith("--rdzv-id=") else arg for arg in args]
