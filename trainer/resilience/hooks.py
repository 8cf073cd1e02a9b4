"""The resilience hooks of one training process: one call per step, and the record of a recovery.

The training loop touches this in one place, ``hooks.after_step(step)`` (ft_launcher heartbeat, in-process
progress ping, GPU health check, straggler report, fault injection), times its step's sections with
``hooks.section(name)`` (trainer.resilience.straggler) and reports its resume with ``hooks.note_resume(...)``.
Everything here is a no-op when not needed: no heartbeats unless the process runs under ft_launcher, no
faults unless a schedule is configured, no recovery record on a first launch.

A recovery record (event ``recovery``) is written by rank 0 after the first step of a restarted launch:
fault type, rank and step (from the fault event, or ``unknown`` for a real crash), mechanism, restart
iteration, reloaded step and source, lost steps, and the split of the recovery time — detect + tear down
(fault → this process started), re-init (start → checkpoint load begins), reload, first step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from trainer.config import Config
from trainer.config.drills import parse_schedule, random_schedule
from trainer.env import JOB_ATTEMPT_ENV, LAUNCHER_ENV, NODE_REPLACEMENT_ENV, RESTART_COUNT_ENV
from trainer.resilience import nvrx_compat
from trainer.resilience.budget import restart_layer
from trainer.resilience.failures import explain_restarts
from trainer.resilience.flight_recorder import StallDump
from trainer.resilience.faults import FaultInjector, straggling_here
from trainer.resilience.health import GpuHealth, efa_memlock_check
from trainer.resilience.numerics import NumericDrills, NumericGuard
from trainer.observe.memory import oom_kills
from trainer.resilience.straggler import StragglerDetector, node_name
from trainer.resilience.worker_clock import worker_started_at
from trainer.run.events import EventLog, current_attempt
from trainer.run.history import ControlState
from trainer.run.run_dir import RunDir
from trainer.run.tail import read_last_record, read_last_records

log = logging.getLogger(__name__)

WAITING_BEAT_SECONDS = 1.0  # an IPC round trip to the node's rank monitor: nothing, once a second


class Heartbeat:
    """ft_launcher's rank monitor client when the process runs under ft_launcher; otherwise nothing.

    It connects at the first beat, not before: NVRx 0.4.1's rank monitor aborts for good (and refuses every
    later heartbeat of the node's workers) when a restarted worker connects and dies before its first
    heartbeat (rank_monitor_state_machine: connection lost in HANDLING_START -> ABORTED). Start-up before the
    first step is watched by the phase watchdog (trainer.resilience.phases) instead.

    while_waiting(what, limit) beats from a thread while the loop waits on work done elsewhere (a checkpoint's
    background write): the loop is not hung, and at 8B a write outlasts the heartbeat timeout (96 GB at ~600 MB/s:
    160 s). Past the limit the beats stop, and ft_launcher takes the wait for the hang it then is."""

    def __init__(self, stall_dump: StallDump | None = None) -> None:
        self.client = nvrx_compat.rank_monitor_client() if nvrx_compat.under_ft_launcher() else None
        self._connected = False
        self.stall_dump = stall_dump  # the flight recorder's dump when the beats stop (a hang)
        self._lock = threading.Lock()  # the monitor client's socket: one sender at a time
        self._waiting: tuple[str, float, float] | None = None  # (what, started, until): monotonic seconds
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        with self._lock:
            self._send()

    def _send(self) -> None:
        if self.stall_dump is not None:
            self.stall_dump.beat()
        if self.client is not None:
            if not self._connected:
                self.client.init_workload_monitoring()
                self._connected = True
            self.client.send_heartbeat()

    @contextmanager
    def while_waiting(self, what: str, limit_seconds: float) -> Iterator[None]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._beat_while_waiting, name="heartbeat-while-waiting",
                                            daemon=True)
            self._thread.start()
        started = time.monotonic()
        self._waiting = (what, started, started + limit_seconds)
        try:
            yield
        finally:
            self._waiting = None

    def _beat_while_waiting(self) -> None:
        warned = None
        while not self._closed.wait(WAITING_BEAT_SECONDS):
            waiting = self._waiting
            if waiting is None:
                continue
            what, started, until = waiting
            if self.client is not None and not self._connected:
                continue  # before the loop's first beat: start-up's watchdog watches (see above)
            if time.monotonic() > until:
                if warned is not waiting:
                    warned = waiting
                    log.error("%s has been waited for %.0f s, longer than it can take: the heartbeats stop, so "
                              "ft_launcher restarts the workers as hung", what, time.monotonic() - started)
                continue
            with self._lock:
                if self._waiting is waiting and not self._closed.is_set():
                    self._send()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            if self.stall_dump is not None:
                self.stall_dump.close()
            if self.client is not None and self._connected:
                self.client.shutdown_workload_monitoring()
            self.client = None


class ResilienceHooks:
    def __init__(self, cfg: Config, rank: int, world_size: int, events: EventLog, device, in_process=None,
                 telemetry=None, node_memory=None, launched_at: float | None = None,
                 history: ControlState | None = None, global_rank: int | None = None):
        """launched_at: this launch's start (trainer.run.history.launched_at), the origin of t=SECONDS drills;
        history: the control records as this start folded them (the faults fired, the recovery's inputs)."""
        self.cfg = cfg
        self.history = history if history is not None else ControlState()
        self.rank, self.world_size = rank, world_size
        # drills name the job's ranks; with replica groups rank is this process's rank in its group
        self.global_rank = rank if global_rank is None else global_rank
        self.events = events
        self.in_process = in_process
        # For an in-process restart the "process" that restarts is the attempt, not the OS process.
        self.process_started_at = in_process.started_at if in_process else worker_started_at()
        self.in_process_iteration = in_process.iteration if in_process else 0
        self.ping = in_process.ping if in_process else (lambda: None)
        self.telemetry = telemetry
        self.restart_iteration = int(os.environ.get(RESTART_COUNT_ENV, "0"))
        self.job_attempt = int(os.environ.get(JOB_ATTEMPT_ENV, "0"))
        # a replacement of a lost node (its group had no survivor to restart in-job: the whole group was lost)
        self.node_replacement = int(os.environ.get(NODE_REPLACEMENT_ENV, "0") or 0)
        self.launcher = os.environ.get(LAUNCHER_ENV, "torchrun")
        self.heartbeat = Heartbeat(StallDump(cfg.run_dir, current_attempt(), self.global_rank,
                                             cfg.resilience.heartbeat_timeout / 2))
        self.gpu_health = GpuHealth(device, events, cfg.resilience.gpu_health_interval_steps)

        faults = parse_schedule(cfg.faults.schedule)
        if cfg.faults.mtbf_steps > 0:
            types = [t.strip() for t in cfg.faults.random_types.split(",") if t.strip()]
            faults += random_schedule(cfg.training.num_steps, cfg.faults.mtbf_steps, types,
                                      world_size * cfg.training.replica_groups, cfg.faults.seed)
        # a group's loss is fired by the group's first rank, a bit flip by its rank of the group
        faults = [dataclasses.replace(f, rank=f.group * world_size + (f.rank if f.type == "bitflip" else 0))
                  if f.group is not None else f for f in faults]
        late = [f.key for f in faults if f.step is not None and f.step > cfg.training.num_steps]
        if late and rank == 0:
            log.warning("faults scheduled after the last step (%d) will not fire: %s", cfg.training.num_steps,
                        ", ".join(late))
        self.injector = FaultInjector(faults, self.global_rank, events, set(self.history.fired_fault_keys),
                                      run_started_at=launched_at or self.process_started_at,
                                      slow_seconds=cfg.faults.slow_seconds,
                                      node_memory=node_memory, straggler_factor=cfg.faults.straggler_factor,
                                      straggling=straggling_here(self.history.straggling, self.global_rank))
        self.stragglers = StragglerDetector(cfg, rank=rank, world_size=world_size, device=device, events=events,
                                            telemetry=telemetry, slowdown=lambda: self.injector.slowdown)
        self.section = self.stragglers.section  # the loop's timed sections: with hooks.section("data"): ...
        # the step's own check (trainer.resilience.numerics): the loop asks it before each optimizer step
        self.numerics = NumericGuard(cfg.resilience, rank=rank, world_size=world_size, events=events, device=device,
                                     drills=NumericDrills(faults, self.global_rank, events, self.injector.fired_keys))
        self._resume: dict[str, Any] | None = None
        self._healed = False  # this start took a live replica group's state (trainer.resilience.replica_groups)
        self._first_step_done = False

    def start(self, init_seconds: dict[str, float] | None = None) -> None:
        """Called once the trainer is built: record this launch (rank 0) with where its start-up time went
        (init_seconds: imports, process group, model, ...), check what EFA needs."""
        if self.rank == 0:
            self.events.write("launch", launcher=self.launcher, restart_iteration=self.restart_iteration,
                              job_attempt=self.job_attempt, in_process_iteration=self.in_process_iteration,
                              process_started_at=self.process_started_at, init_seconds=init_seconds or {})
        self._note_oom_kills()
        memlock = efa_memlock_check(dict(os.environ))
        if memlock is not None and not memlock["ok"]:
            log.error("EFA: %s (memlock %s)", memlock["fix"], memlock["memlock_soft"])
            self.events.write("efa_memlock", **memlock)

    def _note_oom_kills(self) -> None:
        """A node's first rank records its cgroup's OOM-kill count when it changed since the node's last start: a
        rise is the OOM killer's evidence for the recovery that follows (a killed rank leaves no record)."""
        if int(os.environ.get("LOCAL_RANK", "0")) != 0 or (count := oom_kills()) is None:
            return
        node, before = node_name(), self.history.oom_kills.get(node_name())
        if count != before:
            self.events.write("node_oom_kills", node=node, oom_kill=count,
                              new=count - before if before is not None and count > before else 0)

    def note_resume(self, reloaded_step: int | None, load_started: float, load_seconds: float,
                    source: str = "disk", fsx_bytes_read: int = 0, **restore: float) -> None:
        """`restore`: the FSx restore's restore_seconds, restore_overlapped_seconds, restore_gb_per_second."""
        self._resume = {"reloaded_step": reloaded_step or 0, "load_started": load_started,
                        "load_seconds": load_seconds, "source": source, "fsx_bytes_read": fsx_bytes_read, **restore}
        self.injector.before_step((reloaded_step or 0) + 1)
        self.numerics.resumed(RunDir(self.cfg.run_dir).metrics, reloaded_step or 0)

    def note_heal(self, step: int, donor: int | None, seconds: float, received_bytes: int) -> None:
        """This group healed from a live one before its first step: the recovery reloaded that step from it."""
        self._healed = True
        resume = self._resume or {"load_started": time.time(), "load_seconds": 0.0}
        self._resume = {**resume, "reloaded_step": step, "source": f"replica_group_{donor}",
                        "load_seconds": resume["load_seconds"] + seconds, "heal_bytes": received_bytes,
                        "heal_seconds": seconds, "donor_group": donor}

    @property
    def is_restart(self) -> bool:
        return (self.in_process_iteration > 0 or self.restart_iteration > 0 or self.job_attempt > 0
                or self._healed or self.node_replacement > 0)

    @property
    def mechanism(self) -> tuple[str, int]:
        """The innermost layer that restarted this attempt, and its iteration."""
        if self._healed:
            return "replica_group_heal", self.restart_iteration
        if self.node_replacement and not (self.in_process_iteration or self.restart_iteration):
            return "node_replacement", self.node_replacement
        layer = restart_layer(self.in_process_iteration, self.restart_iteration, self.job_attempt, self.launcher)
        iteration = {"in_process": self.in_process_iteration, "job_restart": self.job_attempt}
        return ("job_restart" if layer == "first_start" else layer), iteration.get(layer, self.restart_iteration)

    def after_step(self, step: int) -> None:
        """The loop's one call per step, after the checkpoint manager's: heartbeat, GPU health, the recovery
        record after a restart, injected faults (last, so a fault at step N finds step N saved as usual)."""
        self.heartbeat.beat()
        self.ping()
        self.gpu_health.maybe_check(step)
        self.stragglers.after_step(step)
        if not self._first_step_done:
            self._first_step_done = True
            if self.rank == 0 and self.is_restart:
                self._record_recovery(step)
        self.injector.maybe_inject(step)
        self.injector.before_step(step + 1)

    def discarded_step(self, step: int) -> None:
        """The replica groups discarded the step after `step`: still alive (heartbeat), trained again at once."""
        self.heartbeat.beat()
        self.ping()

    def _lost_steps(self, reloaded_step: int) -> int | None:
        """Steps completed before the fault that must be trained again: the last step the failed attempt
        recorded (metrics.jsonl's last line before this process started, read from the file's end) minus the
        step reloaded. Not the fault's own step: a fault can surface later (a killed checkpoint writer fails
        the next save)."""
        last = read_last_record(RunDir(self.cfg.run_dir).metrics, before=self.process_started_at)
        return max(0, int(last["step"]) - reloaded_step) if last else None

    def _record_recovery(self, step: int) -> None:
        now = time.time()
        # The drill faults no recovery answered yet, as this start folded them (trainer.run.history).
        faults = [e for e in self.history.unhandled_faults if e["time"] < self.process_started_at]
        fault = faults[-1] if faults else None
        resume = self._resume or {"reloaded_step": 0, "load_started": now, "load_seconds": 0.0, "source": "none"}
        fault_time = fault["time"] if fault else None
        mechanism, iteration = self.mechanism
        record = {
            "fault_key": fault["key"] if fault else None,
            "fault_keys": [f["key"] for f in faults],  # every fault this recovery answers (one, unless they coincided)
            "fault_type": fault["fault_type"] if fault else "unknown",
            "fault_rank": fault["rank"] if fault else None,
            "fault_step": fault["step"] if fault else None,
            "fault_time": fault_time,
            "mechanism": mechanism,
            "restart_iteration": iteration,
            "reloaded_step": resume["reloaded_step"],
            "reload_source": resume["source"],
            "fsx_bytes_read": resume.get("fsx_bytes_read", 0),  # every rank's, from checkpoint folders
            **{key: resume[key] for key in ("heal_bytes", "heal_seconds", "donor_group") if key in resume},
            # Of a restore from FSx: the start-up's wait for it, its read hidden behind start-up, its rate.
            **{key: resume.get(key) for key in ("restore_seconds", "restore_overlapped_seconds",
                                                "restore_gb_per_second")},
            "lost_steps": self._lost_steps(resume["reloaded_step"]),
            "detect_and_teardown_seconds": (self.process_started_at - fault_time) if fault_time else None,
            "reinit_seconds": resume["load_started"] - self.process_started_at,
            "reload_seconds": resume["load_seconds"],
            "first_step_seconds": now - (resume["load_started"] + resume["load_seconds"]),
            "recovery_seconds": (now - fault_time) if fault_time else None,
            "first_step": step,
        }
        # Which rank failed first and how, from the ranks' own records (trainer.resilience.failures): the restart
        # this recovery comes from, and any restarts before it that failed in start-up.
        *earlier, last = explain_restarts(self.cfg.run_dir, self.process_started_at, self.world_size, self.history)
        record.update(last, earlier_causes=[found["cause"] for found in earlier])
        killed = self._oom_killed_since(fault_time or self.process_started_at)
        if killed and record["decided_cause"] == "transient":  # a rank killed without a word: here is why
            record["evidence"] = (f"the OOM killer ended {sum(k['new'] for k in killed)} process(es) on "
                                  f"{', '.join(sorted({k['node'] for k in killed}))} (cgroup memory.events)")
        if "donor_group" in resume:  # what brought this group back: a live group's state, not a tier
            record["cause"] = (f"{record['cause']}; replica group healed from group {resume['donor_group']} "
                               f"({resume['heal_bytes'] / 1e6:.0f} MB in {resume['heal_seconds']:.1f} s)")
        self.events.write("recovery", **record)
        if self.telemetry is not None:
            self.telemetry.observe_recovery(mechanism)
        log.warning("recovered by %s: reloaded step %d, lost %s steps, %.1f s — %s", mechanism,
                    record["reloaded_step"], record["lost_steps"], record["recovery_seconds"] or float("nan"),
                    record["cause"])

    def _oom_killed_since(self, since: float) -> list[dict[str, Any]]:
        """The nodes whose OOM-kill count rose at this start (their node_oom_kills records, read from the end)."""
        return read_last_records(RunDir(self.cfg.run_dir).control_log,
                                 lambda r: r.get("event") == "node_oom_kills" and r.get("new") and
                                 r.get("time", 0) >= since - 1, self.world_size)

    def close(self) -> None:
        self.heartbeat.close()
        self.stragglers.close()

