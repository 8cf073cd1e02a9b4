"""Restart costs that grow with the job: what a measured restart on a few nodes leaves out at 1,024.

    extra = process_group_seconds(8192) - process_group_seconds(16)   # 85 s at 8,192 ranks

An in-job restart, a replacement or a relaunch re-initialises the process group over every rank of the world it
restarts: its TCPStore rendezvous and the communicators' set-up grow with the ranks. The figures are published
measurements of ProcessGroup initialisation over a TCPStore at scale (pytorch/gloo#408, Meta, 2025: 18 s at
2,048 ranks, 25 s at 4,096, 85 s at 8,192, with the batched store reads that landed in PyTorch; 82 s, 393 s and
~55 min before them). Below 64 ranks the cost is what bench/recovery.py measures on this machine, inside
Costs.restart_seconds; between the published points it is interpolated on log2(ranks), and beyond 8,192 it
grows linearly with the ranks (every rank's address goes through the store).

With replica groups (training.replica_groups = R), a restart re-initialises one group's world of N / R nodes,
and the groups left keep training: a fault costs the job the failed group's share (its restart and heal,
divided by R) plus the survivors' stall (the lighthouse's detection and the step they discard).
"""

from __future__ import annotations

import math

# (ranks, seconds) of process-group initialisation (pytorch/gloo#408, optimised store reads); 64: measured here
PROCESS_GROUP_SECONDS = ((64, 0.0), (2048, 18.0), (4096, 25.0), (8192, 85.0))


def process_group_seconds(ranks: int) -> float:
    """Process-group initialisation over `ranks` ranks beyond what a restart of up to 64 ranks measures."""
    if ranks <= PROCESS_GROUP_SECONDS[0][0]:
        return 0.0
    last_ranks, last_seconds = PROCESS_GROUP_SECONDS[-1]
    if ranks >= last_ranks:
        return last_seconds * ranks / last_ranks
    for (low, low_s), (high, high_s) in zip(PROCESS_GROUP_SECONDS, PROCESS_GROUP_SECONDS[1:]):
        if low <= ranks <= high:
            share = (math.log2(ranks) - math.log2(low)) / (math.log2(high) - math.log2(low))
            return low_s + share * (high_s - low_s)
    raise AssertionError(ranks)


def restart_world_seconds(nodes: int, gpus_per_node: int) -> float:
    """What re-initialising a world of `nodes` nodes adds to a restart measured on a small one."""
    return process_group_seconds(nodes * gpus_per_node)
