"""checkpoint.interval_steps=auto and checkpoint.memory_interval_steps=auto: the trainer measures its own costs in
its first saves and lets the planner (trainer.planning.goodput) choose the FSx interval (once per run) and the
node-memory copy's (once per launch).

Until the choice, the FSx tier saves every `checkpoint.auto_probe_steps`. At the third of those saves in a
launch, every rank has measured its step time (median so far), the second save's stall (the loop's wait less
any wait for the first save, which also started the writer) and that save's background time (write and
commit); the worst rank's figures go to the planner with this job's recovery layers and
`checkpoint.auto_node_mtbf_hours`. The choice is logged with its reasons and written as a
`checkpoint_interval_chosen` event, which a restarted launch reads instead of measuring again.

The node-memory copy's cost is measured in each launch's first 2 x MEMORY_PROBE_STEPS steps: the copy every step,
then none, each step's whole wall time (training, saves, and whatever the copy's background work - the peer
replica's transfer, an async copy's hash - takes from the step beside it) timed from one save to the next. A copy
costs the loop the difference of the two medians (the first two steps of each half not counted: they map the two
slots, and carry the other half's last save), and at least the loop's own wait for it. The worst rank's cost and step
time go to the same planner as the FSx interval, with the faults the copies serve: the nodes' (auto_node_mtbf_hours,
through this job's routes) and the drills' (faults.schedule, faults.mtbf_steps). The interval is logged with its
reasons and written as a `memory_interval_chosen` event. Measured per launch, not kept: a restart on other nodes,
or with another copy mode, costs what it costs there.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as dist

from trainer.config import Config
from trainer.config.drills import parse_schedule
from trainer.planning.goodput import Configuration, Costs, best_interval, tier_rates
from trainer.run.events import EventLog
from trainer.run.history import ControlState

log = logging.getLogger(__name__)

MEMORY_PROBE_STEPS = 6  # steps with a copy each, then as many without; the first two of each not counted
NO_COPY = 10 ** 9  # the memory tier's interval while the probe measures steps without a copy


def job_configuration(cfg: Config) -> Configuration:
    """This job's recovery layers as a planner configuration: which mechanism and tier serve each fault class."""
    ckpt, resilience = cfg.checkpoint, cfg.resilience
    fsx = "fsx" if ckpt.mode == "async" else "fsx_sync"
    memory = ckpt.memory_tier
    in_job = resilience.launcher == "ft_launcher" and resilience.max_restarts != 0  # -1: no count of its own
    process = ("ft_launcher", "memory" if memory else fsx) if in_job else ("job_relaunch", fsx)
    exception = ("in_process", "memory" if memory else fsx) if resilience.in_process else process
    # A lost node is replaced while the others restart in-job (docs/node-loss.md); without in-job restarts every
    # pod is recreated.
    lost = ("replacement", fsx) if in_job else ("job_relaunch", fsx)
    node = ("replacement", "peer") if memory and ckpt.peer_replica and in_job else lost
    return Configuration("this job", "from the config", {"exception": exception, "process": process, "node": node,
                                                         "rack": lost})


class AutoInterval:
    """The loop's one call: before_save(step, step_seconds) before each checkpointer.save."""

    def __init__(self, cfg: Config, checkpointer, events: EventLog, *, rank: int, nodes: int,
                 history: ControlState | None = None):
        """history: the control records as this start folded them (an earlier launch's choice)."""
        self.cfg, self.checkpointer, self.events, self.rank, self.nodes = cfg, checkpointer, events, rank, nodes
        self.enabled = cfg.checkpoint.enabled and cfg.checkpoint.interval_steps == "auto"
        self.step_seconds: list[float] = []
        chosen = history.interval_chosen if history is not None else None
        if self.enabled and chosen:  # an earlier launch of this run chose already
            checkpointer.interval_steps = chosen["interval_steps"]
            self.enabled = False
        self.memory_probe = (cfg.checkpoint.enabled and cfg.checkpoint.memory_interval_steps == "auto"
                             and checkpointer.memory_interval_steps is not None)
        self._probe_times: list[float] = []  # perf_counter at each before_save of this launch, while probing

    def before_save(self, step: int, step_seconds: float) -> None:
        if self.memory_probe:
            self._probe_memory(step)
        if not self.enabled:
            return
        self.step_seconds.append(step_seconds)
        if self.checkpointer.saves_started >= 2 and step % self.cfg.checkpoint.auto_probe_steps == 0:
            self._choose(step)

    def _probe_memory(self, step: int) -> None:
        """Every rank counts the same steps: the switch and the choice below happen at the same step on each."""
        self._probe_times.append(time.perf_counter())
        seen = len(self._probe_times)
        if seen == MEMORY_PROBE_STEPS + 1:  # the steps before copied; from this one on, none until the choice
            self.checkpointer.memory_interval_steps = NO_COPY
        elif seen == 2 * MEMORY_PROBE_STEPS + 1:
            self._choose_memory(step)

    def _choose_memory(self, step: int) -> None:
        self.memory_probe = False
        times, half = self._probe_times, MEMORY_PROBE_STEPS
        # times[i + 1] - times[i]: the save after step i's before_save, then the next step beside its background work
        with_copy = [b - a for a, b in zip(times[2:half], times[3:half + 1])]
        without = [b - a for a, b in zip(times[half + 2:2 * half], times[half + 3:2 * half + 1])]
        waits = self.checkpointer.costs.memory_copy_seconds[2:half]
        local = torch.tensor([statistics.median(without), statistics.median(with_copy) - statistics.median(without),
                              statistics.median(waits) if waits else 0.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        step_seconds, difference, wait = local.tolist()
        choice = memory_interval(self.cfg, self.nodes, step_seconds, max(difference, wait))
        choice.update(step_with_copy_seconds=step_seconds + difference, copy_wait_seconds=wait)
        self.checkpointer.memory_interval_steps = choice["interval_steps"]
        if self.rank == 0:
            log.info("checkpoint.memory_interval_steps=auto: every %d steps from step %d: %s", choice["interval_steps"],
                     step, choice["reason"])
            self.events.write("memory_interval_chosen", step=step, **choice)

    def _choose(self, step: int) -> None:
        self.enabled = False
        self.checkpointer.wait()  # the second save's background time, commit included
        measured = [self.checkpointer.save_costs[s] for s in sorted(self.checkpointer.save_costs)
                    if "stall" in self.checkpointer.save_costs[s] and "background" in self.checkpointer.save_costs[s]]
        last = measured[-1]
        local = torch.tensor([statistics.median(self.step_seconds), last["stall"],
                              last["background"] + last.get("commit", 0.0)], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(local, op=dist.ReduceOp.MAX)  # every rank then makes the same choice
        step_seconds, stall, background = local.tolist()
        ckpt = self.cfg.checkpoint
        sync = ckpt.mode == "sync"
        costs = Costs(nodes=self.nodes, node_mtbf_hours=ckpt.auto_node_mtbf_hours, step_seconds=step_seconds,
                      checkpoint_stall_seconds=stall, checkpoint_background_seconds=0.0 if sync else background,
                      sync_stall_seconds=stall if sync else 0.0)
        config = job_configuration(self.cfg)
        fsx = "fsx_sync" if sync else "fsx"
        longest = max(step_seconds, self.cfg.training.num_steps * step_seconds)  # the last step is saved anyway
        choice = best_interval(costs.tier(fsx), tier_rates(costs, config)[fsx], longest)
        steps = max(1, round(choice["interval_seconds"] / step_seconds))
        self.checkpointer.interval_steps = steps
        routes = {cls: f"{mechanism} from {tier}" for cls, (mechanism, tier) in config.routes.items()}
        fsx_mtbf = choice["mtbf_seconds"]
        reason = (f"step {step_seconds:.3f} s, FSx save stall {stall:.3f} s + background {background:.2f} s; "
                  f"{self.nodes} nodes x MTBF {ckpt.auto_node_mtbf_hours:g} h -> a fault reloading from FSx every "
                  + (f"{fsx_mtbf:.0f} s" if fsx_mtbf else "never (no fault class needs FSx)")
                  + f" ({', '.join(f'{c}: {r}' for c, r in routes.items())})")
        if self.rank == 0:
            log.info("checkpoint.interval_steps=auto: every %d steps (%.0f s of work, Daly %s s) at step %d: %s", steps,
                     steps * step_seconds, f"{choice['daly_seconds']:.0f}" if choice["daly_seconds"] else "-", step,
                     reason)
            self.events.write("checkpoint_interval_chosen", step=step, interval_steps=steps,
                              interval_seconds=steps * step_seconds, step_seconds=step_seconds, stall_seconds=stall,
                              background_seconds=background, nodes=self.nodes,
                              node_mtbf_hours=ckpt.auto_node_mtbf_hours, fsx_fault_mtbf_seconds=fsx_mtbf,
                              young_seconds=choice["young_seconds"], daly_seconds=choice["daly_seconds"],
                              routes=routes, reason=reason)


def drill_faults_per_step(cfg: Config) -> float:
    """The faults the drills schedule, per step: faults.schedule's over the run's steps, and faults.mtbf_steps'."""
    faults = cfg.faults
    scheduled = len(parse_schedule(faults.schedule)) / max(1, cfg.training.num_steps)
    return scheduled + (1 / faults.mtbf_steps if faults.mtbf_steps > 0 else 0.0)


def memory_interval(cfg: Config, nodes: int, step_seconds: float, copy_seconds: float) -> dict:
    """The node-memory copy's interval for a copy that costs the loop copy_seconds, by the planner's rule for a tier
    (Daly's optimum for the faults it serves: best_interval), and why."""
    ckpt = cfg.checkpoint
    costs = Costs(nodes=nodes, node_mtbf_hours=ckpt.auto_node_mtbf_hours, step_seconds=step_seconds,
                  checkpoint_stall_seconds=0.0, memory_stall_seconds=copy_seconds)
    config = job_configuration(cfg)
    fleet_rate = tier_rates(costs, config).get("memory", 0.0)
    drill_rate = drill_faults_per_step(cfg) / step_seconds
    longest = max(step_seconds, cfg.training.num_steps * step_seconds)
    if copy_seconds <= 0:
        seconds = step_seconds  # nothing measurable: every step
    else:
        seconds = best_interval(costs.tier("memory"), fleet_rate + drill_rate, longest)["interval_seconds"]
    steps = max(1, min(cfg.training.num_steps, round(seconds / step_seconds)))
    rate = fleet_rate + drill_rate
    reason = (f"a copy costs the loop {copy_seconds:.4f} s ({copy_seconds / step_seconds:.1%} of a "
              f"{step_seconds:.3f} s step); the faults it serves: one every "
              + (f"{1 / rate:.0f} s" if rate else "never")
              + f" ({nodes} nodes x MTBF {ckpt.auto_node_mtbf_hours:g} h"
              + (f", and the drills' {drill_faults_per_step(cfg):.3g} a step" if drill_rate else "") + ")"
              + f" -> the copy costs {copy_seconds / (steps * step_seconds):.2%} of the time, a fault replays "
              f"{(steps - 1) / 2:.1f} steps more on average than with a copy every step")
    return {"interval_steps": steps, "step_seconds": step_seconds, "copy_seconds": copy_seconds,
            "fault_rate_per_second": rate, "nodes": nodes, "node_mtbf_hours": ckpt.auto_node_mtbf_hours,
            "reason": reason}
