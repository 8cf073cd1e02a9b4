"""The closed-form goodput model: how often to save to each tier and what each recovery configuration keeps.

    costs = Costs(nodes=8, node_mtbf_hours=5700, step_seconds=4.0, checkpoint_stall_seconds=0.5, ...)
    plan = make_plan(costs)              # intervals per tier, expected goodput per configuration
    plan.recommended.name, plan.interval_steps

Faults arrive at rate nodes / node MTBF. Each is of a class (``FAULT_CLASSES``) that a configuration routes
to a recovery mechanism and the tier it reloads from. A fault costs the mechanism's restart, the tier's
reload and the work done since that tier's newest *usable* copy: an asynchronous copy becomes usable only
when its background write ends, so a tier saved every τ seconds of work with a background write of b
seconds loses τ/2 + b on average. Saving costs the loop its stall δ per save, plus whatever of the previous
background write is still running at the next save (max(0, b − τ)): a write longer than the interval turns
into stall. First order in (fault rate × cost), like Young's and Daly's derivations: goodput =
1 / (1 + Σ stall/τ) × (1 − Σ rate × cost). For one class, one tier and no background write the model reduces
to Daly's, whose exact form (``daly_goodput``) the simulator is checked against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from trainer.planning.scale import restart_world_seconds

FAULT_CLASSES = ("exception", "process", "node", "rack")
"""exception: a Python error or hang inside a healthy process; process: the process dies (OOM, GPU Xid a
restart clears); node: the node must be replaced; rack: several neighbouring nodes at once (their peers too)."""

# Llama 3 (Dubey et al. 2024, table 5): of 419 unexpected interruptions, software bugs, NCCL watchdog and
# dependency failures ≈ 15 %; GPU and HBM faults ≈ 55 %, of which we take half as cleared by a process
# restart; network, host and the rest need the node; a small share takes a rack (switch, power).
DEFAULT_FAULT_MIX = {"exception": 0.15, "process": 0.40, "node": 0.40, "rack": 0.05}
HOUR = 3600.0


class PlanError(ValueError):
    """A cost or setting the planner cannot use; the message names the field (and the flag)."""


def _check(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise PlanError(f"{name}: {message}")


@dataclass(frozen=True)
class Costs:
    """What a run measured (or what is assumed), in seconds unless named otherwise."""

    nodes: int
    """Nodes in the job (a fault on any of them stops every rank)."""
    node_mtbf_hours: float
    """Mean time between failures of one node, hours."""
    step_seconds: float
    """One training step, without checkpointing."""
    checkpoint_stall_seconds: float
    """The loop's whole wait per asynchronous FSx save (previous save, barrier, hand-off)."""
    checkpoint_background_seconds: float = 0.0
    """How long an asynchronous FSx save runs after the loop goes on (write and commit)."""
    sync_stall_seconds: float = 0.0
    """The loop's wait per synchronous FSx save; 0 = stall + background (the same write, waited for)."""
    fsx_reload_seconds: float = 30.0
    """Reading the state back from FSx."""
    memory_stall_seconds: float = 0.0
    """The loop's wait per node-memory copy (and the peer replica's hand-off)."""
    memory_reload_seconds: float = 1.0
    """Restoring the state from node memory (or from the peer's replica)."""
    restart_seconds: float = 17.0
    """In-job restart by ft_launcher: detection, tear-down, re-initialisation (not the reload)."""
    in_process_restart_seconds: float = 10.0
    """In-process restart: detection, process-group rebuild (not the reload)."""
    job_restart_seconds: float = 270.0
    """A job-level relaunch: pods deleted, rescheduled and started again (≈ 270 s on EKS)."""
    replacement_seconds: float = 10.0
    """A lost node's replacement beyond the in-job restart, once its pod has a machine: the new launcher's start
    and rendezvous, the state sent from the peer (bench/recovery.py: node_replacement)."""
    spare_wait_seconds: float = 60.0
    """How long a lost node's replacement pod waits for a machine: a warm spare (manifests/components/
    warm-spares: preemption and container start, ~60 s) or, without one, a new instance (~600 s)."""
    gpus_per_node: int = 8
    """Ranks per node: a restart re-initialises the process group over nodes x this (trainer.planning.scale)."""
    replica_groups: int = 8
    """R of the replica-groups configuration (HSDP with torchft; at most one group per node)."""
    replica_detection_seconds: float = 2.0
    """How long the groups left wait for the lighthouse to drop a failed group (its heartbeat timeout)."""
    heal_seconds: float = 5.0
    """A restarted group's transfer of the live state from a peer group (bench/recovery.py: heal_seconds)."""
    quorum_seconds: float = 0.05
    """Replica groups: what each step waits for torchft's quorum and commit vote (the trainer's quorum_seconds
    metric; round trips to the lighthouse and within the group), paid on every step, fault or not."""
    scale_restarts: bool = True
    """Add the process-group initialisation of the restarted world to each restart (trainer.planning.scale);
    False: the restart costs as measured on a few nodes, whatever the job's size (comparisons only)."""
    startup_seconds: float = 0.0
    """One-time start of the job before the first step (counted once, not per fault)."""
    fault_mix: dict = field(default_factory=lambda: dict(DEFAULT_FAULT_MIX))
    """Share of faults per class (FAULT_CLASSES); the shares sum to 1."""

    def __post_init__(self) -> None:
        _check(isinstance(self.nodes, int) and self.nodes >= 1, "nodes (--nodes)", f"must be an integer >= 1, got {self.nodes!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("nodes", "fault_mix", "scale_restarts"):
                continue
            if f.name in ("gpus_per_node", "replica_groups"):
                _check(isinstance(value, int) and value >= 1, f"{f.name} (--{f.name.replace('_', '-')})",
                       f"must be an integer >= 1, got {value!r}")
                continue
            _check(isinstance(value, (int, float)) and math.isfinite(value), f"{f.name} (--{f.name.replace('_', '-')})",
                   f"must be a finite number, got {value!r}")
            positive = f.name in ("node_mtbf_hours", "step_seconds")
            _check(value > 0 if positive else value >= 0, f"{f.name} (--{f.name.replace('_', '-')})",
                   f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
        unknown = set(self.fault_mix) - set(FAULT_CLASSES)
        _check(not unknown, "fault_mix (--fault-mix)", f"unknown classes {sorted(unknown)}; use {list(FAULT_CLASSES)}")
        _check(all(isinstance(v, (int, float)) and v >= 0 for v in self.fault_mix.values()), "fault_mix (--fault-mix)",
               "shares must be numbers >= 0")
        _check(abs(sum(self.fault_mix.values()) - 1) < 1e-6, "fault_mix (--fault-mix)",
               f"shares must sum to 1, they sum to {sum(self.fault_mix.values()):.3f}")

    @property
    def job_mtbf_seconds(self) -> float:
        return self.node_mtbf_hours * HOUR / self.nodes

    def tier(self, name: str) -> "Tier":
        """Stall per save, background seconds and reload seconds of a tier."""
        if name == "fsx_sync":
            sync = self.sync_stall_seconds or self.checkpoint_stall_seconds + self.checkpoint_background_seconds
            return Tier(name, sync, 0.0, self.fsx_reload_seconds)
        if name == "fsx":
            return Tier(name, self.checkpoint_stall_seconds, self.checkpoint_background_seconds, self.fsx_reload_seconds)
        if name == "live":  # a live replica group's state: healed in the restart, nothing lost
            return Tier(name, 0.0, 0.0, 0.0)
        if name in ("memory", "peer"):
            # One copy per step serves both: the node's own and, sent beside the next step, its peer's.
            return Tier(name, self.memory_stall_seconds, 0.0, self.memory_reload_seconds)
        raise AssertionError(name)

    def restart(self, mechanism: str) -> float:
        """Seconds of the whole job's time a recovery costs. A restart re-initialises its world's process group
        (trainer.planning.scale); with replica groups that world is one group, and the others train on."""
        def world_of(nodes: int) -> float:
            return restart_world_seconds(nodes, self.gpus_per_node) if self.scale_restarts else 0.0

        world = world_of(self.nodes)
        if mechanism.startswith("replica_group"):
            groups = min(self.replica_groups, self.nodes)
            group = self.restart_seconds + world_of(self.nodes // groups) + self.heal_seconds
            if mechanism == "replica_group_replacement":
                group += self.replacement_seconds + self.spare_wait_seconds
            return group / groups + self.replica_detection_seconds + self.step_seconds
        return {"in_process": self.in_process_restart_seconds, "ft_launcher": self.restart_seconds + world,
                "replacement": self.restart_seconds + world + self.replacement_seconds + self.spare_wait_seconds,
                "job_relaunch": self.job_restart_seconds + world}[mechanism]


@dataclass(frozen=True)
class Tier:
    name: str
    stall: float
    background: float
    reload: float


@dataclass(frozen=True)
class Configuration:
    """Which mechanism recovers each fault class, and from which tier it reloads."""

    name: str
    description: str
    routes: dict  # fault class -> (mechanism, tier)

    @property
    def tiers(self) -> list[str]:
        """Tiers this configuration saves to; memory and peer are one copy, saved as 'memory'."""
        used = {tier if tier != "peer" else "memory" for _, tier in self.routes.values()}
        # A job that heals from live groups still saves to FSx: a copy when every group is lost, and the model.
        return [t for t in ("memory", "fsx", "fsx_sync") if t in used or (t == "fsx" and "live" in used)]


def _routes(exception, process, node, rack):
    return {"exception": exception, "process": process, "node": node, "rack": rack}


RELAUNCH_FSX = ("job_relaunch", "fsx")
REPLACE_FSX = ("replacement", "fsx")
# What the EKS deployment does (docs/node-loss.md): with in-job restarts on, a lost node's pod is replaced and the
# survivors keep running — every rank reloads from FSx unless the peer replica has the lost node's state; with
# them off (resilience.max_restarts=0) every pod is recreated: a relaunch.
CONFIGURATIONS = [
    Configuration("sync+relaunch", "synchronous FSx saves; every fault recreates every pod (no in-job restart)",
                  _routes(*[("job_relaunch", "fsx_sync")] * 4)),
    Configuration("async+relaunch", "asynchronous FSx saves; every fault recreates every pod",
                  _routes(*[RELAUNCH_FSX] * 4)),
    Configuration("async+ft_launcher", "in-job restart for exceptions and process deaths (state from FSx); a lost "
                  "node is replaced, every rank reloads from FSx", _routes(("ft_launcher", "fsx"), ("ft_launcher", "fsx"),
                                                                          REPLACE_FSX, REPLACE_FSX)),
    Configuration("async+ft_launcher+memory", "the same, state from node memory", _routes(
        ("ft_launcher", "memory"), ("ft_launcher", "memory"), REPLACE_FSX, REPLACE_FSX)),
    Configuration("async+ft_launcher+memory+peer", "and a lost node's state from its peer's replica", _routes(
        ("ft_launcher", "memory"), ("ft_launcher", "memory"), ("replacement", "peer"), REPLACE_FSX)),
    Configuration("in_process+ft_launcher+memory+peer", "and exceptions recovered in-process", _routes(
        ("in_process", "memory"), ("ft_launcher", "memory"), ("replacement", "peer"), REPLACE_FSX)),
    Configuration("replica_groups", "HSDP in replica groups (torchft): a fault restarts its group only, which heals "
                  "from a live one while the others train on", _routes(
                      ("replica_group", "live"), ("replica_group", "live"), ("replica_group_replacement", "live"),
                      # several neighbouring nodes may span groups: counted as the job restarting from FSx
                      REPLACE_FSX)),
]
CONFIGURATION_NAMES = [c.name for c in CONFIGURATIONS]


def young_interval(stall: float, mtbf: float) -> float:
    """Young (1974): the work between saves that minimises first-order waste."""
    return math.sqrt(2 * stall * mtbf)


def daly_interval(stall: float, mtbf: float) -> float:
    """Daly (2006), higher order: sqrt(2δM)·[1 + ⅓·sqrt(δ/2M) + δ/18M] − δ for δ < 2M, else M."""
    if stall >= 2 * mtbf:
        return mtbf
    return math.sqrt(2 * stall * mtbf) * (1 + math.sqrt(stall / (2 * mtbf)) / 3 + stall / (18 * mtbf)) - stall


def daly_goodput(interval: float, stall: float, restart: float, mtbf: float) -> float:
    """Daly's exact expected goodput for exponential failures: work τ per segment, a save of δ after it, a
    restart (and reload) of R after each failure, failures striking at any time, restarts included."""
    return interval / (mtbf * math.exp(restart / mtbf) * math.expm1((interval + stall) / mtbf))


def effective_stall(tier: Tier, interval: float) -> float:
    """The stall per save once a background write longer than the interval is waited for."""
    return tier.stall + max(0.0, tier.background - interval)


def write_survives(cls: str, mechanism: str) -> bool:
    """Whether a save in flight still completes: after an exception the process is alive and finishes its write
    before it exits (trainer.job.cli closes with the save waited for); not after a process or node dies, and not
    under an in-process restart (the peers may be gone, so it is dropped)."""
    return cls == "exception" and mechanism != "in_process"


def expected_loss(tier: Tier, interval: float, survives: bool = False) -> float:
    """Work lost on average when recovering from this tier: half an interval, plus — unless the write in flight
    survives the fault — the background write during which the newest save is not yet usable."""
    return interval / 2 + (0.0 if survives else min(tier.background, interval))


def tier_rates(costs: Costs, config: Configuration) -> dict[str, float]:
    """Faults per second that reload from each saved tier (peer copies count for the memory tier's cadence)."""
    rate = 1 / costs.job_mtbf_seconds
    rates = {t: 0.0 for t in config.tiers}
    for cls, (_, tier) in config.routes.items():
        if tier != "live":
            rates[tier if tier != "peer" else "memory"] += rate * costs.fault_mix.get(cls, 0.0)
    return rates


def best_interval(tier: Tier, rate: float, longest: float) -> dict:
    """The interval (seconds of work) for a tier whose copies serve faults arriving at `rate`, capped at
    `longest`: Daly's optimum, corrected for a background write that must end before the next save."""
    if rate <= 0:
        return {"mtbf_seconds": None, "young_seconds": None, "daly_seconds": None, "interval_seconds": longest}
    mtbf = 1 / rate
    waste = lambda tau: effective_stall(tier, tau) / tau + rate * expected_loss(tier, tau)  # noqa: E731
    daly = daly_interval(tier.stall, mtbf) if tier.stall > 0 else 0.0
    candidates = [max(daly, tier.background)]
    if tier.background > 0:
        # Saving before the previous write ends: the wait counts as stall, so Young's rule with δ + b applies.
        candidates.append(min(tier.background, young_interval(tier.stall + tier.background, mtbf)))
    candidates = [min(max(c, 1e-9), longest) for c in candidates]
    return {"mtbf_seconds": mtbf, "young_seconds": young_interval(tier.stall, mtbf), "daly_seconds": daly,
            "interval_seconds": min(candidates, key=waste)}


def expected_goodput(costs: Costs, config: Configuration, intervals: dict[str, float]) -> dict:
    """Goodput of a configuration at the given intervals (seconds of work per tier), with its badput split."""
    rate = 1 / costs.job_mtbf_seconds
    tiers = {t: costs.tier(t) for t in ("memory", "fsx", "fsx_sync", "live")}
    save_fraction = sum(effective_stall(tiers[t], intervals[t]) / intervals[t] for t in config.tiers)
    if any(tier == "live" for _, tier in config.routes.values()):
        save_fraction += costs.quorum_seconds / costs.step_seconds  # every step's quorum, in the same account
    restart = reload = lost = 0.0
    for cls, (mechanism, tier) in config.routes.items():
        share = rate * costs.fault_mix.get(cls, 0.0)
        source = tiers[tier if tier != "peer" else "memory"]
        restart += share * costs.restart(mechanism)
        reload += share * source.reload
        if tier != "live":
            lost += share * expected_loss(source, intervals[tier if tier != "peer" else "memory"],
                                          write_survives(cls, mechanism))
    compute = 1 / (1 + save_fraction)
    goodput = max(0.0, compute * (1 - restart - reload - lost))
    return {"goodput": goodput, "badput": {"checkpoint_save": 1 - compute, "infrastructure_recovery": restart * compute,
                                           "checkpoint_load": reload * compute, "wasted_progress": lost * compute}}


def _longest(costs: Costs) -> float:
    # Never less often than once a day of work: a tier no fault needs still keeps the run's progress safe.
    return max(24 * HOUR, costs.step_seconds)


def evaluate(costs: Costs, config: Configuration) -> dict:
    """A configuration at its best intervals: intervals per tier, expected goodput and its badput split."""
    rates = tier_rates(costs, config)
    chosen = {}
    for name in config.tiers:
        choice = best_interval(costs.tier(name), rates[name], _longest(costs))
        steps = max(1, round(choice["interval_seconds"] / costs.step_seconds))
        chosen[name] = {**choice, "interval_steps": steps, "interval_seconds": steps * costs.step_seconds}
    result = expected_goodput(costs, config, {t: c["interval_seconds"] for t, c in chosen.items()})
    return {"name": config.name, "description": config.description, "tiers": chosen, **result}


@dataclass(frozen=True)
class Plan:
    costs: Costs
    configurations: list  # evaluate() per configuration

    @property
    def recommended(self) -> dict:
        return max(self.configurations, key=lambda c: c["goodput"])

    @property
    def interval_seconds(self) -> float:
        """The FSx interval of the recommended configuration (what checkpoint.interval_steps sets)."""
        tiers = self.recommended["tiers"]
        return (tiers.get("fsx") or tiers["fsx_sync"])["interval_seconds"]

    @property
    def interval_steps(self) -> int:
        return max(1, round(self.interval_seconds / self.costs.step_seconds))

    def to_json(self) -> dict:
        costs = {f.name: getattr(self.costs, f.name) for f in fields(self.costs)}
        return {"interval_seconds": self.interval_seconds, "interval_steps": self.interval_steps,
                "recommended": self.recommended["name"], "job_mtbf_seconds": self.costs.job_mtbf_seconds,
                "costs": costs, "configurations": self.configurations}


def make_plan(costs: Costs, names: list[str] | None = None) -> Plan:
    """Every configuration (or those named) evaluated at its best intervals."""
    unknown = set(names or []) - set(CONFIGURATION_NAMES)
    _check(not unknown, "configurations (--configurations)", f"unknown {sorted(unknown)}; use {CONFIGURATION_NAMES}")
    chosen = [c for c in CONFIGURATIONS if names is None or c.name in names]
    return Plan(costs, [evaluate(costs, c) for c in chosen])
