"""The memory tiers of one rank: its state in node memory every few steps, and a replica on a peer node.

    tier = MemoryTier(cfg, run_id, rank, world_size, local_world_size)
    tier.save(step, state)                 # when tier.due(step): copy to node memory, replicate to the peer
    found = tier.restore_newest(state)     # collective: (step, "memory" | "peer"), or None: go to FSx

Which rank keeps whose replica: ranks form a ring over nodes (see trainer.checkpoint.peer). Locally
``checkpoint.memory_node_per_rank`` makes each rank a node of its own (``node-<rank>``), so one machine can
drill a node loss: a rank SIGKILLed with its node folder wiped comes back from its peer's replica.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.node_copy import BackgroundCopy
from trainer.checkpoint.node_store import RankStore, StoredCopy, node_store_folder
from trainer.checkpoint.peer import PeerReplicator, receive_replica, send_replica
from trainer.checkpoint.state_bytes import StateMismatch, check_fits, restore
from trainer.config import CheckpointConfig

log = logging.getLogger(__name__)


class MemoryTier:
    def __init__(self, cfg: CheckpointConfig, run_id: str, rank: int, world_size: int, local_world_size: int,
                 device: torch.device = torch.device("cpu")):
        # auto: every step until the planner chooses (trainer.planning.auto)
        self.interval_steps = 1 if cfg.memory_interval_steps == "auto" else cfg.memory_interval_steps
        self.rank, self.world_size = rank, world_size
        self.folder = node_store_folder(cfg.memory_dir, run_id)
        # memory_node_per_rank stands in for nodes when one launcher runs every rank; with a launcher per node the
        # nodes are real.
        self.ranks_per_node = 1 if cfg.memory_node_per_rank and local_world_size == world_size else local_world_size
        self.nodes = nodes = world_size // self.ranks_per_node
        node = rank // self.ranks_per_node
        with_peer = cfg.peer_replica and nodes > 1
        # The ring over nodes: rank r keeps the replica of r - ranks_per_node and sends its own to r + ranks_per_node.
        self.replica_of = (rank - self.ranks_per_node) % world_size if with_peer else None
        self.holder = (rank + self.ranks_per_node) % world_size if with_peer else None
        self.store = RankStore(self.folder, node, rank, world_size, self.replica_of)
        self.wait_for_replica = cfg.peer_replica_wait
        self.replicator = (PeerReplicator(self.store.replica, self.holder, self.replica_of, sends_first=node % 2 == 0,
                                          nice=cfg.background_nice) if with_peer else None)
        if cfg.peer_replica and not with_peer and rank == 0:
            log.info("checkpoint.peer_replica: one node only, so no peer replica (node memory and FSx only)")
        self.last_save_seconds = 0.0
        self.last_saved_step: int | None = None
        # checkpoint.memory_copy: off the step's critical path, or in it (trainer.checkpoint.node_copy)
        copy_async = cfg.memory_copy == "async" or (cfg.memory_copy == "auto" and device.type == "cuda")
        self.copier = BackgroundCopy(self.store, device, cfg.background_nice,
                                     after_commit=self.replicator.replicate if self.replicator else lambda copy: None
                                     ) if copy_async else None

    def due(self, step: int, last: bool = False) -> bool:
        """Every interval_steps, once per step (the loop's last save asks again for the same step), and not while
        an async copy is still being written (it would be skipped: the state is not even gathered for it)."""
        if not (self.interval_steps > 0 and step % self.interval_steps == 0 and step != self.last_saved_step):
            return False
        if self.copier is not None and self.copier.busy and not last and not self.wait_for_replica:
            self.copier.skip(step)
            return False
        return True

    def save(self, step: int, state: dict[str, Any], wait_if_busy: bool = True) -> bool:
        """Copy this step's state (and replicate it); False when an async copy skipped it: the last one was still
        being written (trainer.checkpoint.node_copy), and the node keeps the step before."""
        started = time.perf_counter()
        if self.copier is not None:
            if not self.copier.start(step, state, wait_if_busy=wait_if_busy or self.wait_for_replica):
                return False
            self.last_saved_step = step
            if self.wait_for_replica:
                self.copier.wait()
                if self.replicator is not None:
                    self.replicator.wait()
            self.last_save_seconds = time.perf_counter() - started
            return True
        self.last_saved_step = step
        if self.replicator is not None:
            self.replicator.wait()  # the slot the last round sends is never the one overwritten now
        copy = self.store.save(step, state)
        if self.replicator is not None:
            self.replicator.replicate(copy)
            if self.wait_for_replica:
                self.replicator.wait()
        self.last_save_seconds = time.perf_counter() - started
        return True

    def before_state_changes(self) -> None:
        """Before the optimizer step or a load writes the state a copy in flight reads."""
        if self.copier is not None:
            self.copier.before_state_changes()

    def settle(self) -> None:
        """The copy in flight committed (or failed: logged, the node holds the step before)."""
        if self.copier is not None:
            try:
                self.copier.wait()
            except Exception as err:  # noqa: BLE001 - the older copy, or FSx, is what recovers then
                log.warning("node memory: the copy in flight failed: %s", err)

    # -- recovery ------------------------------------------------------------------------------------

    def restore_newest(self, state: dict[str, Any], newer_than: int = -1,
                       at_most: int | None = None) -> tuple[int, str] | None:
        """Collective: fill `state` from the newest step after `newer_than` (and not after `at_most`) that every
        rank can restore, from
        its own node memory or from the peer holding its replica, and say which ("memory", or "peer" when
        some rank needed its peer). None when there is none (state untouched: the caller goes to FSx).

        Candidates come from the slots' meta.json alone; only the copies a restore reads are verified, so a
        restart hashes one copy per rank, not four. A copy that fails its checksum drops that step (with a
        log line) and the next older candidate is tried."""
        self.settle()
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, (self.store.own_steps(), self.store.replica_steps()))
        holder_of = {r: (r + self.ranks_per_node) % self.world_size for r in range(self.world_size)}
        candidates = set().union(*(set(own) | set(held) for own, held in gathered))
        for step in sorted((s for s in candidates if s > newer_than and (at_most is None or s <= at_most)),
                           reverse=True):
            if all(step in gathered[r][0] or (self.holder is not None and step in gathered[holder_of[r]][1])
                   for r in range(self.world_size)):
                source = self.restore(step, state)
                if source is not None:
                    return step, source
                if self.rank == 0:
                    log.warning("node memory: step %d could not be restored on every rank; trying older", step)
        if any(own for own, _ in gathered) and self.rank == 0:
            log.warning("node memory: no step after %d restorable on every rank (own copies %s, replicas %s)",
                        newer_than, [own for own, _ in gathered], [held for _, held in gathered])
        return None

    def restore(self, step: int, state: dict[str, Any]) -> str | None:
        """Collective: fill `state` with this rank's copy of `step`, from node memory or, when this node lost
        it, from the peer's replica over the process group. Returns "memory", "peer" (some rank needed its
        peer), or None when any rank could not restore (the caller then falls back to FSx)."""
        own = self.store.own_copy(step)
        needs: list = [None] * self.world_size
        dist.all_gather_object(needs, own is None)
        if any(needs) and self.holder is None:
            return None
        # Ring order again: even nodes first send what their peer lacks, then receive; odd nodes the reverse.
        order = ("send", "receive") if (self.rank // self.ranks_per_node) % 2 == 0 else ("receive", "send")
        for action in order:
            if action == "send":
                self._send_if_needed(step, needs)
            else:
                own = self._receive_if_needed(needs, own)
        ok = own is not None
        if ok:
            try:
                check_fits(state, own.meta["layout"])
            except StateMismatch as err:
                log.warning("node memory: the copy of step %d does not fit this run (%s)", step, err)
                ok = False
        everyone: list = [None] * self.world_size
        dist.all_gather_object(everyone, ok)
        if not all(everyone):
            return None  # nothing was changed: the caller falls back to FSx
        restore(state, own.meta["layout"], own.data)
        return "peer" if any(needs) else "memory"

    def _send_if_needed(self, step: int, needs: list) -> None:
        if self.replica_of is not None and needs[self.replica_of]:
            send_replica(self.store.replica_copy(step), self.replica_of)

    def _receive_if_needed(self, needs: list, own: StoredCopy | None) -> StoredCopy | None:
        if needs[self.rank]:
            received = receive_replica(self.store.own, self.holder)
            log.warning("node memory of rank %d was gone: state of step %s received from rank %d's replica",
                        self.rank, received.step if received else None, self.holder)
            return received
        return own

    def drop_after(self, step: int) -> None:
        """This rank's copies and the replica it holds, of every step after `step`, are gone."""
        self.settle()
        if self.replicator is not None:
            self.replicator.wait()  # no round still sends a copy of the abandoned branch
        self.store.drop_after(step)
        self.last_saved_step = None

    def close(self, wait: bool = True) -> None:
        """wait=False after a fault: a replica round in flight is dropped (the peer may be gone)."""
        if self.copier is not None:
            self.copier.close(wait=wait)
        if self.replicator is not None:
            self.replicator.close(wait=wait)
