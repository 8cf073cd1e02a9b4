"""One rule over the job's timeouts, so that a fault — a partition above all — is a fast replacement, not a hang.

Three rungs, each of which must end before the next one's clock runs out (docs/network-faults.md):

1. **Release.** A rank blocked on a peer that is gone is released by the wait it is in: gloo's collective
   timeout under in-process restart (``collective_timeout``, below ``soft_timeout``, which declares the rank
   hung); with replica groups torchft's waits (``quorum_timeout_seconds``, ``lighthouse_join_timeout_seconds``,
   ``lighthouse_heartbeat_timeout_seconds`` and twice ``replica_timeout_seconds``: the all-reduce, then the
   commit vote), below ``heartbeat_timeout``, after which ft_launcher restarts the rank's workers as hung.
2. **Detect.** A lost node is declared lost: a dead one by its peers' closed sockets at once; a hung or
   cut-off one by ``heartbeat_timeout`` on every node (ft_launcher), and by ``store_timeout_seconds`` on the
   cut-off node itself, which then exits to be replaced (trainer.launch.node_watch).
3. **Replace.** The survivors wait ``replacement_timeout_seconds`` in the rendezvous for the lost node's
   replacement: a cut-off node must have declared itself lost and its replacement have started within it, or
   every node restarts from FSx. (``local.node_replacement_delay_seconds`` is no timeout but the stand-in for
   finding a machine: set above it, it drills a replacement that never comes.)

The run folder's fence is checked on every write and watched once a second by each launcher: it has no clock
to order, only the bound it adds to a fenced node's stop.
"""

from __future__ import annotations

from typing import Any

from trainer.config.rules import require


def check_timeouts(cfg: Any) -> None:  # a trainer.config.tree.Config (which calls this from its __post_init__)
    """ConfigError naming the first timeout out of order (the in-process rung is checked by its own section)."""
    r = cfg.resilience
    if cfg.training.replica_groups > 1:
        for name in ("quorum_timeout_seconds", "lighthouse_join_timeout_seconds", "lighthouse_heartbeat_timeout_seconds"):
            require(getattr(r, name) < r.heartbeat_timeout, f"resilience.{name}",
                    f"must be below resilience.heartbeat_timeout={r.heartbeat_timeout:g}: a group waiting on "
                    "torchft longer than that is restarted as hung")
        require(2 * r.replica_timeout_seconds < r.heartbeat_timeout, "resilience.replica_timeout_seconds",
                f"twice it must be below resilience.heartbeat_timeout={r.heartbeat_timeout:g}: a step waiting on "
                "a failed group's all-reduce and then the commit vote would be restarted as hung")
    if cfg.training.num_nodes > 1 and r.store_timeout_seconds > 0:
        require(r.store_timeout_seconds < r.replacement_timeout_seconds, "resilience.store_timeout_seconds",
                f"must be below resilience.replacement_timeout_seconds={r.replacement_timeout_seconds:g}: the survivors "
                "would give up on a cut-off node before it has declared itself lost, and every node would restart "
                "from FSx; leave room for the replacement's start too (a warm spare's ~60 s on EKS)")


def timeout_ladder(cfg: Any) -> list[tuple[str, float]]:
    """The job's timeouts rung by rung, (name, seconds), for the docs and for checks of rendered manifests."""
    r = cfg.resilience
    rungs = [("resilience.collective_timeout", r.collective_timeout)] if r.in_process else []
    if cfg.training.replica_groups > 1:
        rungs += [("resilience.quorum_timeout_seconds", r.quorum_timeout_seconds),
                  ("2 x resilience.replica_timeout_seconds", 2 * r.replica_timeout_seconds)]
    rungs.append(("resilience.heartbeat_timeout", r.heartbeat_timeout))
    if cfg.training.num_nodes > 1 and r.store_timeout_seconds > 0:
        rungs.append(("resilience.store_timeout_seconds", r.store_timeout_seconds))
    if cfg.training.num_nodes > 1:
        rungs.append(("resilience.replacement_timeout_seconds", r.replacement_timeout_seconds))
    return rungs
