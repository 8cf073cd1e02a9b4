"""The network drills, enacted by the local runner from outside the nodes' namespaces (local.node_network=netns).

    partition@STEP:node=K[:seconds=S]   node K's link goes down once the run trained STEP; up again after S s, or never
    flap@STEP:node=K:times=N            node K's link goes down and up N times (FLAP_DOWN_SECONDS down, FLAP_UP_SECONDS up)
    partition_store@STEP:seconds=S      the rendezvous store (and the lighthouse) cut off from every node for S s

A rank cannot fire these: a node cut off cannot be the one to say so. The runner watches the run's progress (the
last line of metrics.jsonl, read from its end), cuts the link and records the fault itself — a ``fault`` event of
its own (rank null, the node), one per cut (a flap's cuts are ``KEY#1`` ... ``KEY#N``), which the recovery that
answers it names as for any drill. A cut that no restart answered (the link came back before any timeout fired)
gets a ``fault_absorbed`` record once the run trained ABSORBED_AFTER_STEPS steps past the step at which the link
came back, so every fault still leaves a record.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from trainer.config import Config
from trainer.config.drills import NETWORK_FAULTS, Fault, parse_schedule
from trainer.run.events import EventLog
from trainer.run.history import control_state
from trainer.run.run_dir import RunDir
from trainer.run.tail import read_last_record

log = logging.getLogger(__name__)

FLAP_DOWN_SECONDS = 1.5
FLAP_UP_SECONDS = 1.5
ABSORBED_AFTER_STEPS = 2
PROGRESS_POLL_SECONDS = 0.2


@dataclass
class _LinkChange:
    due: float  # time.monotonic()
    key: str
    up: bool
    node: int | None  # None: the services' link
    incarnation: int | None  # the node's namespace the cut acted on (a replacement has another)


class NetworkDrills:
    """Polled by the runner's loop (`poll`); `network` is the launch's NamespaceNetwork."""

    def __init__(self, cfg: Config, network, note=log.warning):
        self.run_dir = RunDir(cfg.run_dir)
        self.network = network
        self.note = note
        fired = control_state(self.run_dir.path).fired_fault_keys
        self.pending: list[Fault] = [f for f in parse_schedule(cfg.faults.schedule) if f.type in NETWORK_FAULTS
                                     and not any(k == f.key or k.startswith(f.key + "#") for k in fired)]
        self.changes: list[_LinkChange] = []
        self.absorbing: dict[str, int | None] = {}  # key -> the step trained when its link came back (None: not yet)
        self.cut_at: dict[str, float] = {}  # key -> time.time() of its cut
        self.events = EventLog(self.run_dir.path, rank=None)
        self._step, self._read_at = -1, 0.0

    @property
    def active(self) -> bool:
        return bool(self.pending or self.changes or self.absorbing)

    def last_step(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= PROGRESS_POLL_SECONDS:
            self._read_at = now
            record = read_last_record(self.run_dir.metrics)
            self._step = int(record["step"]) if record else -1
        return self._step

    def poll(self) -> None:
        if not self.active:
            return
        step = self.last_step()
        for fault in [f for f in self.pending if step >= f.step]:
            self.pending.remove(fault)
            self._enact(fault, step)
        now = time.monotonic()
        for change in sorted((c for c in self.changes if c.due <= now), key=lambda c: c.due):
            self.changes.remove(change)
            self._apply(change, step)
        self._absorb(step)

    def _enact(self, fault: Fault, step: int) -> None:
        now = time.monotonic()
        incarnation = self.network.incarnation(fault.node) if fault.node is not None else None
        if fault.type == "flap":
            period = FLAP_DOWN_SECONDS + FLAP_UP_SECONDS
            for cycle in range(fault.times):
                key = f"{fault.key}#{cycle + 1}"
                self.changes += [_LinkChange(now + cycle * period, key, False, fault.node, incarnation),
                                 _LinkChange(now + cycle * period + FLAP_DOWN_SECONDS, key, True, fault.node, incarnation)]
            return
        self.changes.append(_LinkChange(now, fault.key, False, fault.node, incarnation))
        if fault.down_seconds is not None:
            self.changes.append(_LinkChange(now + fault.down_seconds, fault.key, True, fault.node, incarnation))

    def _apply(self, change: _LinkChange, step: int) -> None:
        what = f"node {change.node}'s link" if change.node is not None else "the rendezvous store's link"
        if change.node is None:
            self.network.set_services_link(change.up)
        else:
            self.network.set_node_link(change.node, change.up, change.incarnation)
        if change.up:
            replaced = change.node is not None and self.network.incarnation(change.node) != change.incarnation
            self.note(f"drill {change.key}: {what} is up again after {time.time() - self.cut_at[change.key]:.1f} s"
                      + (" (that node was replaced meanwhile: its old namespace comes back)" if replaced else ""))
            self.events.write("link_restored", key=change.key, node=change.node, incarnation=change.incarnation,
                              replaced=replaced, step=step)
            self.absorbing[change.key] = step
            return
        self.cut_at[change.key] = time.time()
        fault_type = change.key.split("@")[0]
        self.note(f"drill {change.key}: {what} is cut after step {step}")
        # A fault of the runner's: no rank fired it, so the record names the node (or none: the store's).
        self.events.write("fault", fault_type=fault_type, key=change.key, step=step, node=change.node,
                          incarnation=change.incarnation)

    def _absorb(self, step: int) -> None:
        due = [key for key, back in self.absorbing.items() if back is not None and step >= back + ABSORBED_AFTER_STEPS]
        if not due:
            return
        unhandled = {f["key"] for f in control_state(self.run_dir.path).unhandled_faults}
        for key in due:
            del self.absorbing[key]
            if key in unhandled:  # no restart answered it: the link came back before any timeout fired
                self.events.write("fault_absorbed", fault_key=key, step=step,
                                  how="the link came back before any timeout fired: no restart")


def network_drills(cfg: Config, network, note) -> NetworkDrills | None:
    if not any(f.type in NETWORK_FAULTS for f in parse_schedule(cfg.faults.schedule)):
        return None
    return NetworkDrills(cfg, network, note)

