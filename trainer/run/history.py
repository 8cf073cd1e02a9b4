"""What the run's control records add up to, kept as the run goes: a start reads a bounded summary and what was
appended since, never the whole history.

    state = control_state(run_dir)                 # events/control-state.json + control.jsonl after its offset
    state = control_state(run_dir, save=True)      # ... and the summary written back (rank 0 at a start)

``ControlState`` is a fold of control records (trainer.run.events), a pure function of the log's prefix, so
any snapshot of it is valid and a reader that finds an older one only reads more. What it holds stays bounded
however long the run and however many faults:

- the drill faults fired (their keys: a fault fires once per run) and those no recovery answered yet;
- a straggler drill still in effect, per rank and node launcher;
- the checkpoint interval the planner chose;
- the recoveries as totals (count, seconds, lost steps, by mechanism); the last few records whole are read from
  the end of control.jsonl by whoever shows them (``recent_recoveries``), never by a start;
- where in failures.jsonl the next restart's explanation starts (trainer.resilience.failures);
- the restart budget's window (trainer.resilience.budget): the attempts of the newest launch scope, trimmed
  to those a no-progress streak can still reach, and its last fault — with replica groups, one such window per
  group (records carry their group; a group's budget counts its own attempts);
- the train step's launches (a continuation's wall time is theirs, not the gaps between them), the first process
  start, each straggling rank's summary;
- the run's data phases (trainer.data.phases: a few, one per change of its mixture) and the learning-rate schedule
  its newest start took up (trainer.job.schedule).
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainer.env import BUDGET_SINCE_ENV
from trainer.run.events import EventLog, read_events
from trainer.run.legacy import ensure_current_format
from trainer.run.run_dir import FAILURE_EVENTS, PERIODIC_EVENTS, RunDir, read_json, write_json
from trainer.run.tail import read_last_record, read_last_records, read_new_lines

# The newest rollbacks kept: a no-progress streak (trainer.resilience.budget.rollback_streak) never reaches back
# further than the restart budget's limit.
ROLLBACKS_KEPT = 32
RECENT_RECOVERIES = 5  # listed whole in summary.json and the CLI's summary; MLflow's table has them all


def handled_keys(record: dict[str, Any]) -> set[str]:
    """The drill faults this record accounts for: named by a recovery (its fault_keys), or absorbed without a
    restart (fault_absorbed: a slow rank; checkpoint_failed: a writer crash the next save covered)."""
    if record.get("event") == "recovery":
        keys = record.get("fault_keys") or [record.get("fault_key")]
    elif record.get("event") in ("fault_absorbed", "checkpoint_failed"):
        keys = [record.get("fault_key")]
    else:
        return set()
    return {key for key in keys if key is not None}


@dataclass
class ControlState:
    offset: int = 0  # bytes of control.jsonl folded in
    fired_fault_keys: list[str] = field(default_factory=list)
    unhandled_faults: list[dict[str, Any]] = field(default_factory=list)  # fired, not answered by a recovery yet
    straggling: list[list] = field(default_factory=list)  # [rank, its node launcher's pid] of straggler drills
    interval_chosen: dict[str, Any] | None = None
    first_process_started_at: float | None = None
    recoveries: dict[str, Any] = field(default_factory=lambda: {"count": 0, "seconds": 0.0, "timed": 0,
                                                                "lost_steps": 0, "by_mechanism": {}})
    failures_offset: int = 0  # failures.jsonl: where the next restart's explanation starts
    attempts_total: int = 0
    scope: str | None = None  # the restart budget's launch scope (trainer.resilience.budget.launch_scope)
    attempts: list[dict[str, Any]] = field(default_factory=list)  # the scope's window, oldest first
    last_fault: dict[str, Any] | None = None  # the newest drill fault of the scope
    # replica groups: group -> {"scope", "attempts", "last_fault"}, each group's window as the three fields above
    group_windows: dict[str, dict[str, Any]] = field(default_factory=dict)
    train_launches: list[dict[str, Any]] = field(default_factory=list)  # the train step's: started_at, finished_at
    stragglers: dict[str, dict[str, Any]] = field(default_factory=dict)  # rank -> first report, streaks, lowest
    # numeric anomalies rolled back (trainer.job.numeric_recovery): the sample windows never trained, and the
    # rollbacks (anomaly_step, reloaded_step, window) the budget by progress counts
    skip_windows: list[list[int]] = field(default_factory=list)
    sdc_strikes: dict[str, int] = field(default_factory=dict)  # node -> fingerprint findings naming it
    oom_kills: dict[str, int] = field(default_factory=dict)  # node -> its cgroup's OOM-kill count at its last start
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    data_phases: list[dict[str, Any]] = field(default_factory=list)  # data_phase records, oldest first
    lr_schedule: dict[str, Any] | None = None  # the newest start's schedule and the decision that gave it
    last_time: float = 0.0  # the newest record folded in

    # -- folding ---------------------------------------------------------------------------------------

    def fold(self, records: list[dict[str, Any]], *, whole: bool = False) -> "ControlState":
        """Fold control records in (in the log's order). whole: keep every attempt of every scope (the whole
        history, for tests and tools: trainer.resilience.budget.attempt_history)."""
        for record in records:
            self._apply(record, whole)
        return self

    def window(self, group: int | None = None) -> dict[str, Any]:
        """The restart budget's window ({"scope", "attempts", "last_fault"}): the job's, or a replica group's."""
        if group is None:
            return {"scope": self.scope, "attempts": self.attempts, "last_fault": self.last_fault}
        return self.group_windows.get(str(group), {"scope": None, "attempts": [], "last_fault": None})

    def _apply(self, record: dict[str, Any], whole: bool) -> None:
        kind, now = record.get("event"), record.get("time", 0.0)
        self.last_time = max(self.last_time, now)
        if kind in ("attempt", "resume", "escalated", "fault", "gave_up", "recovery"):
            window = self.window(record.get("group"))
            self._apply_to_window(window, record, whole)
            if record.get("group") is None:
                self.scope, self.attempts, self.last_fault = window["scope"], window["attempts"], window["last_fault"]
            else:
                self.group_windows[str(record["group"])] = window
        if kind == "attempt":
            self.attempts_total += 1
        elif kind == "fault":
            self._fault(record)
        elif kind in ("fault_absorbed", "checkpoint_failed"):
            self._handled(record)
        elif kind == "recovery":
            self._recovery(record)
        elif kind == "launch":
            started = record.get("process_started_at")
            if started is not None:
                self.first_process_started_at = min(started, self.first_process_started_at or started)
        elif kind == "checkpoint_interval_chosen":
            self.interval_chosen = record
        elif kind == "straggler":
            self._straggler(record)
        elif kind == "node_oom_kills":
            self.oom_kills[record["node"]] = record["oom_kill"]
        elif kind == "sdc_strike":
            self.sdc_strikes[record["node"]] = record["strikes"]
        elif kind == "data_phase":
            fields = ("phase", "start", "step", "order", "corpora", "drawn_before")
            self.data_phases = [*self.data_phases, {key: record.get(key) for key in fields}]
        elif kind == "lr_schedule":
            self.lr_schedule = {key: value for key, value in record.items() if key not in ("event", "rank")}
        elif kind == "data_skipped":
            self.skip_windows.append([record["start"], record["end"]])
        elif kind == "rollback":
            self.rollbacks = [*self.rollbacks, {key: record.get(key) for key in (
                "time", "anomaly_step", "anomaly", "reloaded_step", "window", "pinned_step",
                "episode_until")}][-ROLLBACKS_KEPT:]
        elif kind == "train_launch":
            self.train_launches.append({"started_at": record["started_at"], "finished_at": None})
        elif kind == "train_launch_ended":
            for launch in self.train_launches:
                if launch["started_at"] == record["started_at"]:
                    launch.update(finished_at=record["finished_at"], estimated=record.get("estimated", False))

    def _apply_to_window(self, window: dict[str, Any], record: dict[str, Any], whole: bool) -> None:
        """A record of the budget's (an attempt, its resume, an escalation, a fault, a give-up) in its window."""
        kind, now = record["event"], record.get("time", 0.0)
        if kind == "attempt":
            if record.get("scope") != window["scope"] and not whole:
                window["attempts"], window["last_fault"] = [], None
            window["scope"] = record.get("scope")
            window["attempts"] = [*window["attempts"], {"started": now, "layer": record["layer"],
                                                        "scope": window["scope"], "resumed_step": None, "fault": None,
                                                        "escalated": False,
                                                        **({"group": record["group"]} if "group" in record else {})}]
            self._trim(window, whole)  # the attempt before it has ended: it counts now
        elif kind == "resume":
            attempt = self._attempt_at(window, now)
            if attempt is not None and attempt["resumed_step"] is None:
                attempt["resumed_step"] = record["step"]
                self._trim(window, whole)
        elif kind == "escalated":
            attempt = self._attempt_at(window, now)
            if attempt is not None:
                attempt["escalated"] = True
                self._trim(window, whole)
        elif kind == "fault":
            attempt = self._attempt_at(window, record["time"])
            if attempt is not None:
                attempt["fault"] = record  # the last fault during it
            if window["last_fault"] is None or record["time"] >= window["last_fault"]["time"]:
                window["last_fault"] = record
        elif kind == "gave_up" and not whole:  # a new launch after a give-up starts with a full budget
            window["attempts"], window["last_fault"] = [], None
        elif kind == "recovery":  # written after the restart's first step: it trained
            attempt = self._attempt_at(window, now)
            if attempt is not None:
                attempt["trained"] = True

    @staticmethod
    def _attempt_at(window: dict[str, Any], when: float) -> dict[str, Any] | None:
        """The attempt a record of this time belongs to: the newest one started at or before it."""
        return next((a for a in reversed(window["attempts"]) if a["started"] <= when), None)

    def _fault(self, record: dict[str, Any]) -> None:
        if record["key"] not in self.fired_fault_keys:
            self.fired_fault_keys.append(record["key"])
        self.unhandled_faults.append(record)
        if record.get("fault_type") == "straggler":
            self.straggling.append([record["rank"], record.get("launcher_pid")])

    def _handled(self, record: dict[str, Any]) -> None:
        handled = handled_keys(record)
        self.unhandled_faults = [f for f in self.unhandled_faults if f["key"] not in handled]

    def _recovery(self, record: dict[str, Any]) -> None:
        self._handled(record)
        totals = self.recoveries
        totals["count"] += 1
        if record.get("recovery_seconds"):
            totals["seconds"] += record["recovery_seconds"]
            totals["timed"] += 1
        totals["lost_steps"] += record.get("lost_steps") or 0
        mechanism = record.get("mechanism", "unknown")
        totals["by_mechanism"][mechanism] = totals["by_mechanism"].get(mechanism, 0) + 1
        self.failures_offset = record.get("failures_offset", self.failures_offset)

    def _straggler(self, record: dict[str, Any]) -> None:
        known = self.stragglers.setdefault(str(record["straggler_rank"]), {
            "straggler_rank": record["straggler_rank"], "node": record.get("node"), "step": record["step"],
            "streaks": 0, "score": record["score"], "section": record.get("section")})
        # run folders before resilience.straggler_confirm_reports named a straggler in its first report
        known["streaks"] += record.get("first_of_streak", record.get("consecutive_reports", 1) == 1)
        known["replaced"] = known.get("replaced", False) or record.get("action") == "replace_node"
        if record["score"] < known["score"]:
            known.update(score=record["score"], section=record.get("section"))

    def _trim(self, window: dict[str, Any], whole: bool) -> None:
        """Drop the attempts a no-progress streak can no longer reach: the streak walks back from the newest ended
        attempt and stops at one whose nearest later known resume is past its own (trainer.resilience.budget.
        no_progress_streak), so everything before such an attempt is dead history. It stays as the new first
        entry, which the walk never counts."""
        if whole:
            return
        # The newest attempt is the one running (it may still escalate and drop out of the count): only the
        # ended ones decide, as in the budget's own walk (trainer.resilience.budget, `ended`).
        attempts = window["attempts"]
        counted = [a for a in attempts[:-1] if not a["escalated"]]
        grouped = any("group" in a for a in attempts)
        later = None
        for attempt in reversed(counted[1:]):
            # as the budget counts it: a replica group's restart progressed only if it trained (trainer.resilience.
            # budget, `steps`)
            step = attempt["resumed_step"] if not grouped or attempt.get("trained") else None
            if step is None:
                continue
            if later is not None and later > step:
                window["attempts"] = attempts[attempts.index(attempt):]
                return
            later = step

    # -- reading -------------------------------------------------------------------------------------------

    def launch_windows(self, launched_at: float | None, now: float) -> list[tuple[float, float]]:
        """The run's launches as (start, end), oldest first: each launch of the train step (a continuation adds
        one; one whose pod was killed ends at its last record), the one running from `launched_at` ending `now`.
        A run started by hand, with no train step: one window from its first process."""
        windows = [(launch["started_at"], launch["finished_at"] if launch["finished_at"] is not None else now)
                   for launch in self.train_launches if launched_at is None or launch["started_at"] < launched_at]
        if launched_at is not None:
            windows.append((launched_at, max(launched_at, now)))
        elif not windows and self.first_process_started_at is not None:
            windows.append((self.first_process_started_at, max(self.first_process_started_at, now)))
        return windows

    def run_wall_seconds(self, launched_at: float | None, now: float) -> float | None:
        """The run's wall time up to `now`: its launches' (launch_windows), not the gaps between them — the one
        definition the TrainJob's status and the training report both take. None before anything started."""
        windows = self.launch_windows(launched_at, now)
        return sum(end - start for start, end in windows) if windows else None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> "ControlState":
        if not data:
            return cls()
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**copy.deepcopy(known))


def launched_at_from_environment() -> float | None:
    """This launch's start as the train step set it for every process of the launch (None: started by hand)."""
    value = os.environ.get(BUDGET_SINCE_ENV)
    return float(value) if value else None


def control_state(run_dir: Path, *, save: bool = False) -> ControlState:
    """The control records folded: the last snapshot, plus what control.jsonl gained after its offset. save: write
    the snapshot back when that changed it (atomically; any snapshot is a valid prefix, so racing writers are
    harmless). An earlier release's run folder is migrated first."""
    run = RunDir(run_dir)
    if save:
        ensure_current_format(run.path)
    state = ControlState.from_json(read_json(run.control_state) if run.control_state.is_file() else None)
    records, offset = read_new_lines(run.control_log, state.offset)
    if offset != state.offset:
        state.fold(records)
        state.offset = offset
        if save:
            write_json(run.control_state, state.to_json())
    return state


def recent_recoveries(run_dir: Path, count: int = RECENT_RECOVERIES) -> list[dict[str, Any]]:
    """The run's last few recovery records, oldest first, read backwards from the end of control.jsonl: what they
    cost is the records after the count-th last recovery, not the history."""
    return read_last_records(RunDir(run_dir).control_log, lambda r: r.get("event") == "recovery", count)


def whole_history(run_dir: Path) -> ControlState:
    """Every control record folded with nothing trimmed (tests and tools; never a start)."""
    control = [r for r in read_events(run_dir) if r["event"] not in FAILURE_EVENTS + PERIODIC_EVENTS]
    return ControlState().fold(control, whole=True)  # (read_events: the streams, or an unmigrated folder's files)


def record_train_launch(run_dir: Path, started_at: float) -> None:
    """The train step starts a launch of the run (the first, or a continuation). A launch before it that left no
    end (its pod was killed) ends at its last record: the run's wall time counts what it ran, not the gap."""
    state = control_state(run_dir, save=True)
    if any(launch["started_at"] == started_at for launch in state.train_launches):
        return  # a retried train step that re-attached to its launch (a TrainJob submitted before)
    events = EventLog(run_dir, None)
    for launch in state.train_launches:
        if launch["finished_at"] is None and launch["started_at"] < started_at:
            events.write("train_launch_ended", started_at=launch["started_at"],
                         finished_at=max(launch["started_at"], last_activity(run_dir, state)), estimated=True)
    events.write("train_launch", started_at=started_at)


def record_train_launch_ended(run_dir: Path, started_at: float, outcome: str) -> None:
    EventLog(run_dir, None).write("train_launch_ended", started_at=started_at, finished_at=time.time(),
                                  outcome=outcome)


def last_activity(run_dir: Path, state: ControlState) -> float:
    """The latest time the run folder records: its last control record or its last step."""
    last_step = read_last_record(RunDir(run_dir).metrics)
    return max(state.last_time, (last_step or {}).get("time", 0.0))
