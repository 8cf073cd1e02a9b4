"""A seeded discrete-event simulation of one training job under failures, to check the closed form
(trainer.planning.goodput) where it holds and to go where it does not (heavy tails, racks, back-to-back faults).

    result = simulate(costs, CONFIGURATIONS[-1], intervals={"memory": 4.0, "fsx": 400.0}, work_seconds=7 * 86400,
                      seed=1, failures=FailureModel("weibull", weibull_shape=0.7))
    result["goodput"], result["faults"], result["badput"]

The job computes `work_seconds` of steps. Every tier saves when the work crosses a multiple of its interval
(as the trainer does: step % interval == 0); a save stalls the loop, and an asynchronous one becomes usable
only when its background write ends (the next save of that tier waits for it first). Each node fails on its
own clock (exponential, or Weibull with a shape < 1: a heavy tail of long-lived nodes and early failures); a
fault's class is drawn from the fault mix, and a rack fault takes every node of the failing node's rack. The
configuration routes the class to a mechanism (restart cost, spare-node wait) and a tier; a tier with no
usable copy falls back to FSx. Work since the copy is lost and replayed; a fault during a recovery starts
it again; a job relaunch empties node memory. A `trace` replays faults at given steps instead (each fires
once, when the run first finishes that step: how the benchmarks inject them).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass
from typing import Literal

from trainer.planning.goodput import FAULT_CLASSES, Configuration, Costs, PlanError, write_survives

_NONE = -1.0  # no usable copy


@dataclass(frozen=True)
class FailureModel:
    """How nodes fail in the simulation."""

    distribution: Literal["exponential", "weibull"] = "exponential"
    """Time between failures of one node: exponential (memoryless), or Weibull with `weibull_shape`."""
    weibull_shape: float = 0.7
    """Weibull shape k: < 1 is the heavy tail (a decreasing hazard) seen in field studies; 1 is exponential."""
    rack_size: int = 8
    """Nodes per rack: a rack fault takes all of them (and with them the peers' replicas)."""

    def __post_init__(self) -> None:
        if self.distribution not in ("exponential", "weibull"):
            raise PlanError(f"distribution (--distribution): {self.distribution!r} is not exponential or weibull")
        if not (isinstance(self.weibull_shape, (int, float)) and 0.1 <= self.weibull_shape <= 10):
            raise PlanError(f"weibull_shape (--weibull-shape): must be in [0.1, 10], got {self.weibull_shape!r}")
        if not (isinstance(self.rack_size, int) and self.rack_size >= 1):
            raise PlanError(f"rack_size (--rack-size): must be an integer >= 1, got {self.rack_size!r}")

    def draw(self, rng: random.Random, mean: float) -> float:
        if self.distribution == "exponential":
            return rng.expovariate(1 / mean)
        scale = mean / math.gamma(1 + 1 / self.weibull_shape)  # the same mean as the exponential
        return rng.weibullvariate(scale, self.weibull_shape)


class _Clocks:
    """Per-node failure times; the earliest first."""

    def __init__(self, costs: Costs, failures: FailureModel, rng: random.Random):
        self.costs, self.failures, self.rng = costs, failures, rng
        self.mean = costs.node_mtbf_hours * 3600.0
        self.heap = [(failures.draw(rng, self.mean), node) for node in range(costs.nodes)]
        heapq.heapify(self.heap)
        self.classes = [c for c in FAULT_CLASSES if costs.fault_mix.get(c, 0) > 0]
        self.weights = [costs.fault_mix[c] for c in self.classes]

    def next_time(self) -> float:
        return self.heap[0][0]

    def pop(self) -> tuple[float, str]:
        """The next fault: its time and class; the failed node(s) start a new clock from then."""
        when, node = heapq.heappop(self.heap)
        cls = self.rng.choices(self.classes, self.weights)[0]
        renewed = {node}
        if cls == "rack":
            rack = node // self.failures.rack_size
            renewed |= {n for n in range(rack * self.failures.rack_size, (rack + 1) * self.failures.rack_size)
                        if n < self.costs.nodes}
            self.heap = [(t, n) for t, n in self.heap if n not in renewed]
            heapq.heapify(self.heap)
        for n in renewed:
            heapq.heappush(self.heap, (when + self.failures.draw(self.rng, self.mean), n))
        return when, cls


class _Trace:
    """Faults at given steps, each fired once when the run first completes that step."""

    def __init__(self, trace: list[tuple[int, str]], step_seconds: float):
        unknown = {cls for _, cls in trace} - set(FAULT_CLASSES)
        if unknown:
            raise PlanError(f"trace: unknown fault classes {sorted(unknown)}; use {list(FAULT_CLASSES)}")
        self.pending = sorted((step * step_seconds, cls) for step, cls in trace)

    def next_work(self) -> float:
        return self.pending[0][0] if self.pending else math.inf


def simulate(costs: Costs, config: Configuration, intervals: dict[str, float], work_seconds: float, *, seed: int = 0,
             failures: FailureModel = FailureModel(), trace: list[tuple[int, str]] | None = None,
             final_save: bool = False) -> dict:
    """One job to completion. Returns goodput (work / wall), the wall time, faults by class, recoveries by
    mechanism and the badput split (fractions of the wall time)."""
    if not (isinstance(work_seconds, (int, float)) and work_seconds > 0 and math.isfinite(work_seconds)):
        raise PlanError(f"work_seconds: must be a finite number > 0, got {work_seconds!r}")
    for name in config.tiers:
        if not (intervals.get(name, 0) > 0 and math.isfinite(intervals[name])):
            raise PlanError(f"intervals[{name!r}]: every tier of {config.name} needs an interval > 0 "
                            f"(seconds of work), got {intervals.get(name)!r}")
    rng = random.Random(seed)
    tiers = {name: costs.tier(name) for name in config.tiers}
    clocks = None if trace is not None else _Clocks(costs, failures, rng)
    faults_at = _Trace(trace, costs.step_seconds) if trace is not None else None
    badput = dict.fromkeys(("startup", "checkpoint_save", "checkpoint_load", "infrastructure_recovery",
                            "wasted_progress"), 0.0)
    faults = dict.fromkeys(FAULT_CLASSES, 0)
    recoveries: dict[str, int] = {}
    copies = dict.fromkeys(tiers, _NONE)  # work at the newest usable copy per tier
    pending: dict[str, tuple[float, float]] = {}  # tier -> (work saved, wall time the write ends)
    t, w = costs.startup_seconds, 0.0
    badput["startup"] = t
    next_save = {name: intervals[name] for name in tiers}

    def next_failure() -> float:
        return clocks.next_time() if clocks is not None else math.inf

    def settle(now: float) -> None:
        for name, (saved, ready) in list(pending.items()):
            if ready <= now:
                copies[name] = max(copies[name], saved)
                del pending[name]

    def recover(now: float, cls: str) -> float:
        """Wall time when the job computes again after a fault of `cls` at `now` (faults during it included)."""
        nonlocal w
        while True:
            faults[cls] += 1
            mechanism, tier = config.routes[cls]
            if write_survives(cls, mechanism) and pending:
                # The failing process finishes its write before it exits: the copy counts, the wait is paid.
                finish = max(ready for _, ready in pending.values())
                badput["checkpoint_save"] += max(0.0, finish - now)
                now = max(now, finish)
            settle(now)
            pending.clear()  # a write in flight dies with its processes
            source = "memory" if tier == "peer" else tier
            if tier == "live":  # a replica group heals from a live one: no work lost (trainer.planning.scale)
                restart = costs.restart(mechanism)
                recoveries[mechanism] = recoveries.get(mechanism, 0) + 1
                done = now + restart
                if next_failure() >= done:
                    badput["infrastructure_recovery"] += restart
                    return done
                again, cls = clocks.pop()
                badput["infrastructure_recovery"] += again - now
                now = again
                continue
            if cls == "rack" or copies.get(source, _NONE) < 0:
                source = "fsx" if "fsx" in tiers else "fsx_sync"
            copy = max(copies.get(source, _NONE), 0.0)
            badput["wasted_progress"] += w - copy
            w = copy
            if mechanism == "job_relaunch" and "memory" in copies:
                copies["memory"] = _NONE  # new pods: node memory is empty
            elif "memory" in copies:
                copies["memory"] = max(copies["memory"], w) if source == "memory" else w
            restart, reload = costs.restart(mechanism), tiers[source].reload
            recoveries[mechanism] = recoveries.get(mechanism, 0) + 1
            for name, interval in intervals.items():
                if name in tiers:
                    next_save[name] = (math.floor(w / interval + 1e-9) + 1) * interval
            done = now + restart + reload
            if next_failure() >= done:
                badput["infrastructure_recovery"] += restart
                badput["checkpoint_load"] += reload
                return done
            # Struck again before the recovery ended: what it spent so far is lost too.
            again, cls = clocks.pop()
            spent = again - now
            badput["infrastructure_recovery"] += min(spent, restart)
            badput["checkpoint_load"] += max(0.0, spent - restart)
            now = again

    # Replica groups wait for torchft's quorum on every step: work advances 1 / pace per second of wall time.
    pace = 1 + (costs.quorum_seconds / costs.step_seconds
                if any(tier == "live" for _, tier in config.routes.values()) else 0.0)
    while w < work_seconds - 1e-9:
        target = min(min(next_save.values(), default=math.inf), work_seconds,
                     faults_at.next_work() if faults_at is not None else math.inf)
        failure = next_failure()
        if t + (target - w) * pace > failure:
            w += (failure - t) / pace
            badput["checkpoint_save"] += (failure - t) * (1 - 1 / pace)
            t, cls = clocks.pop()
            t = recover(t, cls)
            continue
        t += (target - w) * pace
        badput["checkpoint_save"] += (target - w) * (pace - 1)
        w = target
        struck = False
        for name in [n for n in tiers if next_save[n] <= w + 1e-9]:
            tier = tiers[name]
            settle(t)
            wait = max(0.0, pending[name][1] - t) if name in pending else 0.0
            if t + wait + tier.stall > next_failure():
                t, cls = clocks.pop()
                t = recover(t, cls)
                struck = True
                break
            t += wait + tier.stall
            badput["checkpoint_save"] += wait + tier.stall
            if tier.background > 0:
                settle(t)
                pending[name] = (w, t + tier.background)
            else:
                copies[name] = w
            next_save[name] = w + intervals[name]
        if not struck and faults_at is not None and faults_at.pending and faults_at.pending[0][0] <= w + 1e-9:
            _, cls = faults_at.pending.pop(0)
            t = recover(t, cls)
    if final_save:
        # The last save is always written and waited for (the job ends when it is committed).
        last = tiers.get("fsx") or tiers.get("fsx_sync")
        if last is not None:
            tail = last.stall + last.background + (max(0.0, pending["fsx"][1] - t) if "fsx" in pending else 0.0)
            t += tail
            badput["checkpoint_save"] += tail
    return {"goodput": work_seconds / t, "wall_seconds": t, "faults": faults, "recoveries": recoveries,
            "badput": {k: v / t for k, v in badput.items()}}


def simulate_many(costs: Costs, config: Configuration, intervals: dict[str, float], work_seconds: float, *,
                  seeds: int = 20, seed: int = 0, failures: FailureModel = FailureModel()) -> dict:
    """The mean goodput over `seeds` independent jobs (seed, seed+1, ...), with its standard error."""
    runs = [simulate(costs, config, intervals, work_seconds, seed=seed + i, failures=failures)["goodput"]
            for i in range(seeds)]
    mean = sum(runs) / len(runs)
    spread = math.sqrt(sum((g - mean) ** 2 for g in runs) / max(1, len(runs) - 1) / len(runs))
    return {"goodput": mean, "standard_error": spread, "runs": len(runs)}
