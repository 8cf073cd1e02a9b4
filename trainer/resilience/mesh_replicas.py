"""Native HSDP's replicas (training.data_parallel_replicate_degree > 1): one job, no torchft, so a fault restarts
it as a whole (the R = 1 path), and HSDP's invariant is checked every resilience.replica_check_interval steps:
the ranks that hold the same shard in each replica hold the same bits (trainer.resilience.sdc's fingerprints,
all-gathered over the mesh's replicate dimension). A mismatch is an error line and a ``replica_divergence`` event.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.model.parallelize import REPLICATE
from trainer.resilience.replica_groups import Single
from trainer.resilience.sdc import shard_fingerprint
from trainer.run.events import EventLog

log = logging.getLogger(__name__)


class MeshReplicas(Single):
    def __init__(self, rank: int, world_size: int, mesh: DeviceMesh, check_interval: int, events: EventLog,
                 device: torch.device):
        super().__init__(rank, world_size)
        self.group_of_replicas = mesh.get_group(REPLICATE)
        self.replicas = mesh.size(mesh.mesh_dim_names.index(REPLICATE))
        self.check_interval, self.events, self.device = check_interval, events, device

    def replicas_equal(self, model: torch.nn.Module, step: int) -> bool | None:
        """Collective over every rank when due (None otherwise): whether this rank's replicas agree, bit for bit."""
        if not self.check_interval or step % self.check_interval:
            return None
        mine = shard_fingerprint(model, self.device)
        theirs = [torch.empty_like(mine) for _ in range(self.replicas)]
        dist.all_gather(theirs, mine, group=self.group_of_replicas)
        equal = all(torch.equal(mine, other) for other in theirs)
        if not equal:
            log.error("rank %d: the HSDP replicas of its shard differ after step %d (fingerprints %s)", self.rank,
                      step, [t.tolist() for t in theirs])
            self.events.write("replica_divergence", step=step, ranks={str(self.rank): [t.tolist() for t in theirs]})
        return equal
