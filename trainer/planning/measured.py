"""What a run measured, read from its run folder once: the costs the planner takes, and where the run's wall time
went (badput by category, after Google's ml-goodput-measurement taxonomy).

    run = MeasuredRun.read(run_dir, launched_at=..., finished_at=...)   # one pass over each file
    run.costs()      # {"step_seconds": ..., "checkpoint_stall_seconds": ..., ...}
    run.badput()     # {"wall_seconds", "productive_seconds", "goodput", "badput_seconds": {...}}

One pass each over metrics.jsonl (streamed: per-step arrays, not a record per line), the per-save records and the
control records, so the end of a month-long run reads its history once, in bounded memory.

A step's point is its **first** record: a step replayed after a fault is counted once, as it was first computed,
and its replay is wasted progress — the same point MLflow keeps (the forwarder sends a step once, live).

The wall time is the run's: every launch of the train step start to end (a continuation adds its launch; the gaps
between launches are nobody's time: trainer.run.history.ControlState.run_wall_seconds), and only the steps
trained within those launches count. Categories, in seconds of that wall time (they and the productive time add up
to it; `other` is the rest: logging, metrics, the processes' exit):
- productive: the kept steps' compute, less their data wait;
- data_loading: the kept steps' wait for their batches;
- checkpoint_save: everything the loop waited for in saves (previous save, barrier, hand-off, node-memory
  copies; the worst rank's) and the final save's wait;
- checkpoint_load: reloading the state after a fault or for a rollback;
- wasted_progress: steps computed again after a fault (their first computation was productive), a numeric
  anomaly's step that was rolled back (both its passes) and the rerun of one that proved transient (the rerun is
  inside its kept step's seconds, so it leaves productive). A rollback's steps computed again count as replays;
- infrastructure_recovery: detection, tear-down and re-initialisation after a fault;
- startup: from each launch's start to its first step;
- evaluation: periodic validation between steps (eval.every_steps) and the final evaluation and export.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from trainer.run.history import ControlState, control_state
from trainer.run.run_dir import RunDir, read_json, read_jsonl

BADPUT_CATEGORIES = ("checkpoint_save", "checkpoint_load", "wasted_progress", "infrastructure_recovery", "startup",
                     "data_loading", "evaluation", "other")
MECHANISM_COST = {"in_process": "in_process_restart_seconds", "ft_launcher": "restart_seconds",
                  "job_restart": "job_restart_seconds"}
STEP_FIELDS = ("loss", "step_seconds", "data_seconds", "tokens_per_second", "time", "samples", "samples_skipped",
               "val_seconds")


@dataclass
class StepLedger:
    """metrics.jsonl in one streamed pass: each step's first record as arrays indexed by step (bounded memory
    however long the run), what its replays cost, and each launch's first step."""

    values: dict[str, np.ndarray] = field(default_factory=dict)  # field -> array by step (NaN: never trained)
    replayed_seconds: float = 0.0  # steps computed again after a fault, within the counted launches
    records: int = 0
    windows_first_start: list[float | None] = field(default_factory=list)  # per launch: its first step's start

    @classmethod
    def read(cls, path: Path, windows: list[tuple[float, float]] = ()) -> "StepLedger":
        ledger = cls(values={name: np.full(1024, np.nan) for name in STEP_FIELDS},
                     windows_first_start=[None] * len(windows))
        counted_from = windows[0][0] if windows else float("-inf")
        try:
            handle = Path(path).open("rb")
        except FileNotFoundError:
            return ledger
        with handle:
            for line in handle:
                try:
                    record = orjson.loads(line)
                except orjson.JSONDecodeError:  # a blank separator, or a line torn by a killed writer
                    continue
                ledger._add(record, counted_from, windows)
        return ledger

    def _add(self, record: dict[str, Any], counted_from: float, windows: list[tuple[float, float]]) -> None:
        self.records += 1
        step, at = int(record["step"]), record.get("time", 0.0)
        started = at - record.get("step_seconds", 0.0)
        for index, (start, end) in enumerate(windows):
            if start <= started <= end and (self.windows_first_start[index] is None
                                            or started < self.windows_first_start[index]):
                self.windows_first_start[index] = started
        if step >= len(self.values["time"]):
            size = max(step + 1, 2 * len(self.values["time"]))
            self.values = {name: np.concatenate([array, np.full(size - len(array), np.nan)])
                           for name, array in self.values.items()}
        if not np.isnan(self.values["time"][step]):  # a replay: the first record stands
            if at >= counted_from:
                self.replayed_seconds += record.get("step_seconds", 0.0)
            return
        for name in STEP_FIELDS:
            self.values[name][step] = record.get(name, 0.0 if name != "loss" else np.nan)

    @property
    def steps(self) -> np.ndarray:
        return np.flatnonzero(~np.isnan(self.values["time"]))

    def kept(self, name: str, counted_from: float = float("-inf")) -> np.ndarray:
        """A field of the kept steps (within the counted launches when counted_from is given)."""
        steps = self.steps
        return self.values[name][steps][self.values["time"][steps] >= counted_from]

    def records_of(self) -> list[dict[str, float]]:
        """The kept steps as records (tests, small runs): {"step": ..., "loss": ..., ...}."""
        return [{"step": int(s), **{name: float(self.values[name][s]) for name in STEP_FIELDS}} for s in self.steps]


@dataclass
class MeasuredRun:
    ledger: StepLedger
    stalls: list[dict[str, Any]]  # one per save, the worst rank's (trainer.checkpoint.commit)
    commits: list[dict[str, Any]]
    recoveries: list[dict[str, Any]]
    faults: list[dict[str, Any]]  # drill faults
    numeric: list[dict[str, Any]]  # numeric_rerun and rollback records (trainer.job.numeric_recovery)
    state: ControlState
    windows: list[tuple[float, float]]  # the counted launches: (start, end)
    result: dict[str, Any]

    @classmethod
    def read(cls, run_dir: Path, launched_at: float | None = None, finished_at: float | None = None) -> "MeasuredRun":
        """launched_at: this launch's start (trainer.run.history.launched_at_from_environment); finished_at: its
        end (default: result.json's finished_at)."""
        run = RunDir(run_dir)
        state = control_state(run.path)
        result = read_json(run.result) or {}
        finished_at = finished_at or result.get("finished_at")
        windows = state.launch_windows(launched_at, finished_at) if finished_at else []
        periodic, control = read_jsonl(run.periodic_log), read_jsonl(run.control_log)
        return cls(ledger=StepLedger.read(run.metrics, windows),
                   stalls=[r for r in periodic if r["event"] == "checkpoint_stall"],
                   commits=[r for r in periodic if r["event"] == "checkpoint_committed"],
                   recoveries=[r for r in control if r.get("event") == "recovery"],
                   faults=[r for r in control if r.get("event") == "fault"],
                   numeric=[r for r in control if r.get("event") in ("numeric_rerun", "rollback")],
                   state=state, windows=windows, result=result)

    def costs(self) -> dict[str, float]:
        """The planner's inputs (trainer.planning.goodput.Costs field names) that this run measured; a cost the
        run did not exercise (no fault of that kind, no save) is left out."""
        costs: dict[str, float] = {}
        step_seconds = self.ledger.kept("step_seconds")
        if len(step_seconds):
            costs["step_seconds"] = float(np.median(step_seconds))
        later = sorted(self.stalls, key=lambda s: s["step"])[1:]  # the first save also starts the writer: one-time
        mode = self.commits[-1]["mode"] if self.commits else None
        if later:
            key = "sync_stall_seconds" if mode == "sync" else "checkpoint_stall_seconds"
            costs[key] = statistics.median(s["loop_wait_seconds"] - s.get("memory_seconds", 0.0) for s in later)
            memory = [s["memory_seconds"] / s["memory_copies"] for s in later if s.get("memory_copies")]
            if memory:
                costs["memory_stall_seconds"] = statistics.median(memory)
        if mode and mode != "sync" and len(self.commits) > 1:
            costs["checkpoint_background_seconds"] = statistics.median(e["background_seconds"] for e in self.commits[1:])
        for source, key in (("disk", "fsx_reload_seconds"), ("memory", "memory_reload_seconds"),
                            ("peer", "memory_reload_seconds")):
            found = [r["reload_seconds"] for r in self.recoveries if r.get("reload_source") == source]
            if found and key not in costs:
                costs[key] = statistics.median(found)
        for mechanism, key in MECHANISM_COST.items():
            found = [(r.get("detect_and_teardown_seconds") or 0.0) + r["reinit_seconds"] for r in self.recoveries
                     if r.get("mechanism") == mechanism and r.get("reinit_seconds") is not None]
            if found:
                costs[key] = statistics.median(found)
        # A start-up's own cost: the first process's start to the first step (not the run's start: a later
        # launch of the same run folder starts after that step).
        first_process, starts = self.state.first_process_started_at, self.ledger.kept("time") - self.ledger.kept(
            "step_seconds")
        if first_process is not None and len(starts):
            costs["startup_seconds"] = max(0.0, float(starts.min()) - first_process)
        return costs

    def badput(self) -> dict[str, Any]:
        """Where the run's wall time went: productive seconds, each badput category's, and the goodput."""
        if not self.windows or not len(self.ledger.steps):
            return {"wall_seconds": None, "productive_seconds": None, "goodput": None, "badput_seconds": {}}
        wall = sum(end - start for start, end in self.windows)
        counted_from = self.windows[0][0]
        data = float(self.ledger.kept("data_seconds", counted_from).sum())
        productive = float(self.ledger.kept("step_seconds", counted_from).sum()) - data
        counted = [r for r in self.recoveries if r["time"] >= counted_from]
        rollbacks = [r for r in self.numeric if r["event"] == "rollback" and r["time"] >= counted_from]
        transient_reruns = sum(r.get("seconds") or 0.0 for r in self.numeric if r["event"] == "numeric_rerun"
                               and r.get("verdict") == "transient" and r["time"] >= counted_from)
        productive -= transient_reruns
        seconds = {
            "checkpoint_save": sum(s["loop_wait_seconds"] for s in self.stalls if s["time"] >= counted_from)
            + (self.result.get("final_checkpoint_wait_seconds") or 0.0),
            "checkpoint_load": sum(r.get("reload_seconds") or 0.0 for r in counted + rollbacks),
            "wasted_progress": self.ledger.replayed_seconds + transient_reruns
            + sum(r.get("wasted_seconds") or 0.0 for r in rollbacks),
            "infrastructure_recovery": sum((r.get("detect_and_teardown_seconds") or 0.0)
                                           + (r.get("reinit_seconds") or 0.0) for r in counted),
            "startup": sum(max(0.0, first - start) for (start, _), first in zip(self.windows,
                                                                               self.ledger.windows_first_start)
                           if first is not None),
            "data_loading": data,
            # periodic validation between steps, and the final evaluation and export at the end (trainer.evaluate)
            "evaluation": float(self.ledger.kept("val_seconds", counted_from).sum())
            + (self.result.get("final_evaluation_seconds") or 0.0),
        }
        seconds["other"] = wall - productive - sum(seconds.values())
        return {"wall_seconds": wall, "productive_seconds": productive, "goodput": productive / wall if wall > 0 else None,
                "badput_seconds": seconds}


def measured_costs(run_dir: Path) -> dict[str, float]:
    """The planner's inputs a finished run measured (`python -m pipelines plan --run-id`)."""
    return MeasuredRun.read(run_dir).costs()


def badput_breakdown(run_dir: Path, started_at: float | None = None, finished_at: float | None = None) -> dict[str, Any]:
    """Where the run's wall time went; started_at: this launch's start, finished_at: its end (default: the
    result's)."""
    return MeasuredRun.read(run_dir, started_at, finished_at).badput()


def kept_metrics(path: Path) -> list[dict[str, float]]:
    """Per-step records of metrics.jsonl, each step's first (a step replayed after a fault counts once)."""
    return StepLedger.read(path).records_of()
