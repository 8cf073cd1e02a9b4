"""The restart budget, by progress: a recovery that moved training forward costs nothing; a crash loop ends.

Every layer restarts as often as training makes progress between faults — in-process restarts, ft_launcher's
in-job restarts, the local job relaunch and the TrainJob's gang restart on EKS. What ends a job is
``resilience.max_restarts_without_progress`` consecutive recoveries that did not advance the state a
recovery reads: each resumed from the same step (or an earlier one) as the attempt before it, or died
before it could load anything. That is a crash loop (a bad batch, a broken node, a bug at step N), and
restarting it again only burns GPU hours.

The decision is the training's, made the same way at every layer from the run folder alone:

- each attempt (a start of the ranks: first launch, in-process iteration, in-job restart, relaunch) is an
  ``attempt`` event rank 0 writes before any heavy work, and its ``resume`` event says where it resumed;
- a recovery made progress when the next attempt resumed from a later step than it did; an attempt with no
  resume (it died in start-up) made none;
- at start and again right after the resume, rank 0 counts the trailing recoveries without progress and
  tells every rank — from the control records as this start folded them (trainer.run.history: the launch
  scope's attempts since the last give-up, trimmed to those a streak can reach), read nothing else; at the limit it writes ``gave_up.json`` (the message, the layer, the step, the fault)
  and every rank exits with ``CRASH_LOOP_EXIT_CODE``.

Above the ranks that exit code is the one signal to stop: trainer.launcher stops ft_launcher (whose own
restart count is kept out of the way) when it sees ``gave_up.json`` of its generation, the local train step
does not relaunch it, and on EKS the Job's podFailurePolicy turns it into a failed Job and the JobSet's
failure policy into a failed JobSet; every other exit restarts.

The history a decision reads is this launch's (``launch_scope``: the train step's launch, a TrainJob with its
gang restarts, one torchrun/ft_launcher invocation, or one process), since the last give-up: a new launch
after a fix starts with a full budget.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.run.lease import check_fence_of_this_process
from trainer.env import (BUDGET_SINCE_ENV, CRASH_LOOP_EXIT_CODE, JOB_ATTEMPT_ENV, LAUNCHER_ENV, REPLICA_GROUP_ENV,
                         RESTART_COUNT_ENV, TORCHELASTIC_RUN_ID_ENV)
from trainer.run.events import EventLog
from trainer.run.history import ControlState, whole_history
from trainer.run.run_dir import RunDir, read_json, write_json

log = logging.getLogger(__name__)

# The one exit code that means "do not restart me" — Kubernetes' own podFailurePolicy example uses 42 for a
# non-retriable failure; nothing else in the stack (Python, torch elastic, NVRx, the shell) exits with it.


class RestartBudgetExhausted(BaseException):
    """The no-progress rule gave up; the message says where, how and what to do.

    A BaseException: NVRx's in-process Wrapper restarts on any Exception, and so would any handler that
    catches Exception on the way out; this one must reach the process's exit code.
    """


class EscalateToLauncher(BaseException):
    """In-process restarts stopped making progress: end the processes so ft_launcher restarts them."""


@dataclass(frozen=True)
class Attempt:
    """One start of the ranks, as the run folder recorded it."""

    started: float
    layer: str  # first_start, in_process, ft_launcher, torchrun, job_restart
    resumed_step: int | None  # None: it died before it resumed
    fault: dict[str, Any] | None  # the last fault recorded during it
    escalated: bool = False  # it handed over to ft_launcher (in-process stopped progressing): not a try of its own
    trained: bool = False  # a restart that trained a step (its recovery record): what progress is for a group


def restart_layer(in_process_iteration: int, restart_iteration: int, job_attempt: int, launcher: str) -> str:
    """The innermost layer that restarted this attempt (first_start when none did)."""
    if in_process_iteration > 0:
        return "in_process"
    if restart_iteration > 0:
        return launcher
    if job_attempt > 0:
        return "job_restart"
    return "first_start"


def current_layer(in_process_iteration: int = 0) -> str:
    """This process's layer, from what the launchers put in its environment."""
    return restart_layer(in_process_iteration, int(os.environ.get(RESTART_COUNT_ENV, "0")),
                         int(os.environ.get(JOB_ATTEMPT_ENV, "0")), os.environ.get(LAUNCHER_ENV, "torchrun"))


def no_progress_streak(resumed_steps: list[int | None], current: int | None) -> int:
    """Consecutive recoveries, newest first, that did not advance the state: resumed_steps are the ended
    attempts' resume steps (oldest first; index 0 is the first start, not a recovery), current the resume of
    the attempt starting now (None before it has loaded).

    A recovery progressed when the nearest later known resume is past its own; one that never resumed made
    none; one with no later known resume cannot be judged yet, and ends the count.
    """
    later = current
    streak = 0
    for step in reversed(resumed_steps[1:]):
        if step is None:
            streak += 1
            continue
        if later is None or later > step:
            break
        streak += 1
        later = step
    return streak


def launch_scope() -> str:
    """The launch whose attempts share one budget: the pipeline's train step (every relaunch and, on EKS,
    every gang restart of its TrainJob carry BUDGET_SINCE_ENV), else one torchrun or ft_launcher invocation
    (TORCHELASTIC_RUN_ID: its restarts count, a new invocation starts afresh), else this process."""
    group = f"/group-{os.environ[REPLICA_GROUP_ENV]}" if os.environ.get(REPLICA_GROUP_ENV) else ""
    if os.environ.get(BUDGET_SINCE_ENV):
        return f"step:{os.environ[BUDGET_SINCE_ENV]}{group}"
    return (os.environ.get(TORCHELASTIC_RUN_ID_ENV) or f"process:{os.getpid()}") + group


def budget_group() -> int | None:
    """This process's replica group, whose own budget it spends (None: the job has one group)."""
    return int(os.environ[REPLICA_GROUP_ENV]) if os.environ.get(REPLICA_GROUP_ENV) else None


def attempts_of(history: ControlState, group: int | None = None) -> list[Attempt]:
    """The folded attempts (trainer.run.history) as Attempts, oldest first: the job's, or a replica group's."""
    return [Attempt(a["started"], a["layer"], a["resumed_step"], a["fault"], a["escalated"], a.get("trained", False))
            for a in history.window(group)["attempts"]]


def attempt_history(run_dir: Path, since: float, scope: str | None = None) -> list[Attempt]:
    """Every attempt recorded since `since` (of one launch_scope when given), each with its resume and its last
    fault — the whole history, folded as a start folds it: for tests and tools."""
    history = whole_history(run_dir)
    return [attempt for attempt, record in zip(attempts_of(history), history.attempts)
            if attempt.started >= since and (scope is None or record["scope"] == scope)]


def read_gave_up(run_dir: Path) -> dict[str, Any] | None:
    return read_json(RunDir(run_dir).gave_up)


def budget_since(run_dir: Path) -> float:
    """Where the counted history starts: after the last give-up (a new launch after a fix starts afresh)."""
    gave_up = read_gave_up(run_dir)
    return gave_up["time"] if gave_up else 0.0


def _fault_text(fault: dict[str, Any] | None) -> str:
    if fault is None:
        return "a crash with no injected fault recorded (the ranks' tracebacks are in train.log)"
    return f"{fault['fault_type']} ({fault['key']}) at step {fault['step']} on rank {fault['rank']}"


def give_up_message(attempts: list[Attempt], current_step: int | None, streak: int, limit: int, layer: str,
                    train_log: Path, last_fault: dict[str, Any] | None = None) -> str:
    """last_fault: the newest fault of the ended attempts (default: found among `attempts`)."""
    stuck = [a.resumed_step for a in attempts[-streak:] if a.resumed_step is not None]
    step = max(stuck) if stuck else current_step
    where = f"step {step}" if step is not None else "start-up (no attempt got as far as resuming)"
    last_fault = next((a.fault for a in reversed(attempts) if a.fault is not None), last_fault)
    return (f"crash loop: {streak} recoveries in a row made no progress (resilience.max_restarts_without_progress="
            f"{limit}): training is stuck at {where}; last fault: {_fault_text(last_fault)}; the {layer} layer "
            f"gives up instead of restarting again (exit code {CRASH_LOOP_EXIT_CODE}). Fix the cause (see "
            f"{train_log}), then run the step again: a new launch starts with a full budget.")


def rollback_streak(anomaly_steps: list[int]) -> int:
    """Rollbacks in a row without progress, newest last: each one's anomaly at a step no later than the one
    before it's (training never got past where it last went wrong); 1 for a rollback after progress."""
    streak = 1 if anomaly_steps else 0
    for newer, older in zip(reversed(anomaly_steps), list(reversed(anomaly_steps))[1:]):
        if newer > older:
            break
        streak += 1
    return streak


class RestartBudget:
    """The no-progress rule inside one training attempt; collective (every rank calls the same methods)."""

    def __init__(self, run_dir: Path, *, rank: int, events: EventLog, limit: int, in_process_limit: int,
                 layer: str, generation: int | None, process_started_at: float, broadcast,
                 history: ControlState | None = None, own_generation: bool = False):
        """broadcast(obj) -> obj: rank 0's object on every rank (torch.distributed in the trainer); history: the
        control records as this start folded them (rank 0; trainer.run.history), kept up to date with what this
        budget writes — its decisions read nothing else."""
        self.run_dir = RunDir(run_dir)
        self.history = history if history is not None else ControlState()
        # Started by hand, rank 0 takes a generation of its own at every start: then a give-up is this launch's
        # when it names this launch scope (one torchrun/ft_launcher invocation), not this generation.
        self.own_generation = own_generation
        self.rank = rank
        self.events = events
        self.limit = limit
        self.in_process_limit = in_process_limit
        self.layer = layer
        self.generation = generation
        self.process_started_at = process_started_at
        self.broadcast = broadcast

    def start(self) -> None:
        """Record this attempt, then stop before any heavy work if the history already says so."""
        gave_up = read_gave_up(self.run_dir.path)
        if gave_up is not None and gave_up.get("group") == budget_group() and (
                (self.generation is not None and gave_up.get("generation") == self.generation)
                or (self.own_generation and gave_up.get("scope") == launch_scope())):
            # This launch gave up already; ft_launcher restarted us before trainer.launcher stopped it.
            raise RestartBudgetExhausted(gave_up["message"])
        if self.rank == 0:
            self._record("attempt", layer=self.layer, pid=os.getpid(), generation=self.generation,
                         scope=launch_scope())
        self.check(None)

    def _record(self, event: str, **fields: Any) -> None:
        self.history.fold([self.events.write(event, **fields)])

    def check(self, resumed_step: int | None) -> None:
        """Give up (RestartBudgetExhausted on every rank) at the limit; escalate in-process restarts that stopped
        progressing (EscalateToLauncher). resumed_step: this attempt's resume, once known."""
        verdict = self._verdict(resumed_step) if self.rank == 0 else None
        verdict = self.broadcast(verdict)
        if verdict is None:
            return
        kind, message = verdict
        if self.rank == 0:  # one voice: every rank acts on it
            log.log(logging.WARNING if kind == "escalate" else logging.ERROR, "%s", message)
        if kind == "escalate":
            raise EscalateToLauncher(message)
        raise RestartBudgetExhausted(message)

    def give_up(self, message: str, **fields: Any) -> None:
        """End the launch now (a decision, not a count): gave_up.json, which the launcher watches for, and
        RestartBudgetExhausted on this rank."""
        record = {"time": time.time(), "generation": self.generation, "scope": launch_scope(),
                  "group": budget_group(), "layer": "decision", "streak": 0, "limit": self.limit, "step": None,
                  "message": message, "last_fault": None, **fields}
        check_fence_of_this_process(self.run_dir.path)
        write_json(self.run_dir.gave_up, record)
        self._record("gave_up", **{k: v for k, v in record.items() if k not in ("time", "traceback")})
        log.error("%s", message)
        raise RestartBudgetExhausted(message)

    def stop(self, failure: dict[str, Any]) -> None:
        """A failure whose cause's decision is stop (trainer.config.decisions): this rank writes gave_up.json,
        which ends the launch (trainer.launcher watches for it), and raises RestartBudgetExhausted."""
        frame = failure.get("frame") or {}
        where = f"{frame.get('file')}:{frame.get('line')} in {frame.get('function')}" if frame else "an unknown frame"
        at = f"step {failure['step']}" if failure.get("step") is not None else f"start-up phase {failure['phase']}"
        if failure["cause"] == "input":  # the message names the field and what to do; nothing else to say
            message = (f"stopped: {failure['message']} (rank {failure['rank']} at {at}: an input this run cannot use, "
                       "which a restart would meet again). Fix it, then run the step again.")
        else:
            message = (f"stopped by cause: {failure['error_type']} raised at {where} at {at} on rank "
                       f"{failure['rank']}: {failure['cause']} ({failure['evidence']}), so a restart would meet it "
                       f"again (resilience.decisions: {failure['cause']}=stop). {failure['message']}. Fix it (the "
                       f"traceback is in gave_up.json and {self.run_dir.train_log}), then run the step again: a new "
                       "launch starts afresh.")
        self.give_up(message, step=failure.get("step"), cause=failure["cause"], frame=frame,
                     traceback=failure.get("traceback"))

    def rolled_back(self, record: dict[str, Any]) -> None:
        """Collective. A numeric anomaly was rolled back (trainer.job.numeric_recovery): rank 0 records it, and
        every rank gives up (RestartBudgetExhausted) once resilience.max_restarts_without_progress rollbacks in a
        row made no progress."""
        verdict = None
        if self.rank == 0:
            self._record("rollback", **record)
            rollbacks = self.history.rollbacks
            streak = rollback_streak([r["anomaly_step"] for r in rollbacks])
            if streak >= self.limit:
                steps = ", ".join(f"step {r['anomaly_step']} ({r['anomaly']}, samples [{r['window'][0]}, "
                                  f"{r['window'][1]}) skipped)" for r in rollbacks[-streak:])
                message = (f"gave up: {streak} rollbacks in a row without progress (resilience."
                           f"max_restarts_without_progress={self.limit}): numeric anomalies at {steps}; each came "
                           "back before training got past the one before it. The data after the windows or the "
                           "model's settings (lr, warm-up, grad_clip) need a look: see the numeric_anomaly and "
                           f"rollback events and {self.run_dir.train_log}")
                gave_up = {"time": time.time(), "generation": self.generation, "scope": launch_scope(),
                           "group": budget_group(), "layer": "rollback", "streak": streak, "limit": self.limit,
                           "step": record["reloaded_step"], "message": message, "last_fault": None,
                           "rollbacks": rollbacks[-streak:]}
                check_fence_of_this_process(self.run_dir.path)
                write_json(self.run_dir.gave_up, gave_up)
                self._record("gave_up", **{k: v for k, v in gave_up.items() if k != "time"})
                verdict = message
        verdict = self.broadcast(verdict)
        if verdict is not None:
            if self.rank == 0:
                log.error("%s", verdict)
            raise RestartBudgetExhausted(verdict)

    def _verdict(self, resumed_step: int | None) -> tuple[str, str] | None:
        # The window of this launch scope since the last give-up, trimmed to what a streak can reach; its
        # newest attempt is this one.
        # With replica groups, this group's window: a crash loop in one group gives that group up, not the job.
        window = self.history.window(budget_group())
        attempts = attempts_of(self.history, budget_group()) if window["scope"] == launch_scope() else []
        ended = [a for a in attempts[:-1] if not a.escalated]
        # A replica group resumes from a newer copy at every restart (the live groups save and heal it): its
        # recovery progressed only when it trained a step; one that died before its first step made none.
        steps = [a.resumed_step if budget_group() is None or a.trained else None for a in ended]
        streak = no_progress_streak(steps, resumed_step)
        if streak >= self.limit:
            last_fault = next((a.fault for a in reversed(ended) if a.fault), window["last_fault"])
            message = give_up_message(ended, resumed_step, streak, self.limit, self.layer, self.run_dir.train_log,
                                      last_fault)
            record = {"time": time.time(), "generation": self.generation, "scope": launch_scope(),
                      "group": budget_group(), "layer": self.layer, "streak": streak,
                      "limit": self.limit, "step": resumed_step, "message": message, "last_fault": last_fault}
            check_fence_of_this_process(self.run_dir.path)
            write_json(self.run_dir.gave_up, record)
            self._record("gave_up", **{k: v for k, v in record.items() if k != "time"})
            return "give_up", message
        if self.layer == "in_process":
            mine = [a for a in ended if a.started >= self.process_started_at]
            in_process = no_progress_streak([a.resumed_step for a in mine], resumed_step)
            if in_process >= self.in_process_limit:
                self._record("escalated", streak=in_process, limit=self.in_process_limit, step=resumed_step)
                return "escalate", (f"{in_process} in-process restarts in a row made no progress "
                                    f"(resilience.in_process_max_restarts={self.in_process_limit}): ending the "
                                    "processes so that ft_launcher restarts them")
        return None
