"""checkpoint.interval_steps=auto: the trainer measures its own costs in its first saves and lets the planner
(trainer.planning.goodput) choose the FSx interval, once per run.

Until the choice, the FSx tier saves every `checkpoint.auto_probe_steps`. At the third of those saves in a
launch, every rank has measured its step time (median so far), the second save's stall (the loop's wait less
any wait for the first save, which also started the writer) and that save's background time (write and
commit); the worst rank's figures go to the planner with this job's recovery layers and
`checkpoint.auto_node_mtbf_hours`. The choice is logged with its reasons and written as a
`checkpoint_interval_chosen` event, which a restarted launch reads instead of measuring again.
"""

from __future__ import annotations

import logging
import statistics

import torch
import torch.distributed as dist

from trainer.config import Config
from trainer.planning.goodput import Configuration, Costs, best_interval, tier_rates
from trainer.run.events import EventLog
from trainer.run.history import ControlState

log = logging.getLogger(__name__)


def job_configuration(cfg: Config) -> Configuration:
    """This job's recovery layers as a planner configuration: which mechanism and tier serve each fault class."""
    ckpt, resilience = cfg.checkpoint, cfg.resilience
    fsx = "fsx" if ckpt.mode == "async" else "fsx_sync"
    memory = ckpt.memory_interval_steps > 0
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

    def before_save(self, step: int, step_seconds: float) -> None:
        if not self.enabled:
            return
        self.step_seconds.append(step_seconds)
        if self.checkpointer.saves_started >= 2 and step % self.cfg.checkpoint.auto_probe_steps == 0:
            self._choose(step)

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
