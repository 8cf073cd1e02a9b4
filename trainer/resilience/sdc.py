"""Silent data corruption across replica groups: a free detector. HSDP keeps every group's parameters bit-identical
after every step the groups share, so rank r of every group holds the same shard, bit for bit. Every
``resilience.sdc_check_every`` steps each rank fingerprints its shard and the groups compare:

- the fingerprint: the int64 sums of the shard's raw words and of their squares (wrapping), one pass over the
  parameters on the device, two numbers a rank. A flipped bit changes the first sum by a power of two;
- the exchange: a row per group, summed across the groups through torchft (one all-reduce of R x 2 numbers),
  then gathered over the group's ranks (every rank learns the whole table);
- the verdict (``judge``): for each rank position, the groups whose fingerprint differs from the majority's.
  At R >= 3 the majority is known, and the minority group heals from it: it steps its torchft step back, so the
  next quorum makes it recover a live group's state. The other groups do not stop. At R = 2 no majority says
  which group is right, so both groups roll back to the last step whose fingerprints agreed
  (trainer.job.numeric_recovery).

A finding is an ``sdc_found`` event naming the group, the ranks and their nodes. A node named in
``resilience.sdc_strikes`` findings is replaced (its rank takes it out through the node-replacement path).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from trainer.model.parallelize import local_shard


def shard_fingerprint(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """This rank's parameter shard as two int64 numbers: the sums of its raw words and of their squares."""
    total = torch.zeros(2, dtype=torch.int64, device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            flat = local_shard(parameter).detach().reshape(-1)
            if not flat.numel():
                continue
            words = flat.view(torch.int32 if flat.element_size() == 4 else torch.int16).to(torch.int64)
            total[0] += words.sum()
            total[1] += (words * words).sum()
    return total


def fingerprint_table(manager, model: torch.nn.Module, device: torch.device, group: int, groups: int,
                      world_size: int) -> list[list[list[int]]] | None:
    """Collective over every rank of every group taking part: table[rank][group] = that rank's fingerprint in that
    group (zeros for a group not taking part); None when the exchange across groups failed."""
    rows = torch.zeros(groups, 2, dtype=torch.int64, device=device)
    rows[group] = shard_fingerprint(model, device)
    manager.allreduce(rows, reduce_op=dist.ReduceOp.SUM).wait()  # a row per group: the sum is the table
    if manager.errored() is not None:
        return None
    gathered = [torch.empty_like(rows) for _ in range(world_size)]
    if world_size > 1:
        dist.all_gather(gathered, rows)
    else:
        gathered = [rows]
    return [g.tolist() for g in gathered]


def judge(table: list[list[list[int]]], groups: list[int]) -> dict[str, Any] | None:
    """table[rank][group] = a fingerprint (its numbers); groups: the groups taking part. None when every group
    agrees at every rank; otherwise {"ranks": {rank: [the groups apart: the minority, or all without a majority]},
    "minority": [groups] (empty without a majority), "majority": whether a strict majority agreed at every rank
    that differs}."""
    ranks: dict[int, list[int]] = {}
    majority = True
    for rank, row in enumerate(table):
        seen = Counter(tuple(row[g]) for g in groups)
        if len(seen) == 1:
            continue
        (common, count), = seen.most_common(1)
        if count * 2 > len(groups):
            ranks[rank] = sorted(g for g in groups if tuple(row[g]) != common)
        else:  # no majority: every group there is apart
            majority, ranks[rank] = False, sorted(groups)
    if not ranks:
        return None
    return {"ranks": ranks, "minority": sorted({g for found in ranks.values() for g in found}) if majority else [],
            "majority": majority}
