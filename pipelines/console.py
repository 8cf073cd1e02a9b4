"""What a person sees while the pipeline runs locally: one line per step, a training progress bar, recoveries.

KFP's local runner prints every task's executor input, outputs, streamed logs and its own warnings (about
700 lines for the demo). While a ``PipelineConsole`` is open, all of that — everything written to
``sys.stdout``/``sys.stderr`` and every log record — goes to ``<run_dir>/logs/pipeline.log``; the console
reads the runner's task lines out of that stream and shows only:

    prepare          done    3.6 s
    train            [progress bar: step, loss, tokens/s, ETA — from metrics.jsonl]
      ! sigkill on rank 1 at step 120: ft_launcher restart, reloaded step 100 from disk, 20 steps lost, 5.2 s
    train            done   80.0 s

``verbose=True`` (``python -m pipelines run -v``) streams the full output to the terminal as well; the log
file is written either way. The summary (pipelines/summary.py) is printed after the console is closed.
"""

from __future__ import annotations

import io
import logging
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from components.run_metrics import opens_a_streak, replica_group_line
from pipelines.pipeline import DISPLAY_NAMES
from trainer.observe.logs import LOG_FORMAT
from trainer.run.run_dir import RunDir
from trainer.run.tail import read_last_record, read_new_lines

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STARTED = re.compile(r"Executing task '([\w-]+)'")
_FINISHED = re.compile(r"Task '([\w-]+)' finished with status (\w+)")
_CACHED = re.compile(r"Task ([\w-]+) cache hit")
_SKIPPED = re.compile(r"Skipping task ([\w-]+): upstream")
_TRAIN_TASK = "train-model"
_POLL_SECONDS = 0.5
_PLAIN_PROGRESS_LINES = 4  # off a terminal: a progress line at each quarter of the run


def _title(task: str) -> str:
    return DISPLAY_NAMES.get(task, task)


class _Tap(io.TextIOBase):
    """A text stream that appends to the log file (and the terminal when verbose) and hands each complete
    line to the console."""

    def __init__(self, log_file: TextIO, on_line, echo: TextIO | None):
        self._log_file, self._on_line, self._echo = log_file, on_line, echo
        self._partial = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._log_file.write(text)
            if self._echo is not None:
                self._echo.write(text)
            lines = (self._partial + text).split("\n")
            self._partial = lines.pop()
        for line in lines:
            self._on_line(_ANSI.sub("", line))
        return len(text)

    def flush(self) -> None:
        self._log_file.flush()
        if self._echo is not None:
            self._echo.flush()


class TrainingProgress:
    """This launch's training progress from the run folder: a tqdm bar on a terminal, a few plain lines
    elsewhere, and a line for each injected fault and each recovery. It tails metrics.jsonl and
    events/control.jsonl from where they stood when it started (what this launch trains: a continuation of a
    run starts at the step the run had reached), so a poll costs what was appended since the last one."""

    def __init__(self, run_dir: Path, num_steps: int, out: TextIO):
        self._run_dir = RunDir(run_dir)
        self._num_steps = num_steps
        self._out = out
        self._offset = self._size(self._run_dir.metrics)
        self._events_offset = self._size(self._run_dir.control_log)
        self.first_step = int((read_last_record(self._run_dir.metrics) or {}).get("step", 0))  # trained before
        self._last: dict[str, Any] | None = None
        self._step_seconds: list[float] = []
        self._seen_events: set[tuple] = set()
        span = max(1, num_steps - self.first_step)
        self._plain_marks = sorted({self.first_step + max(1, span * k // _PLAIN_PROGRESS_LINES)
                                    for k in range(1, _PLAIN_PROGRESS_LINES + 1)})
        self._bar = (tqdm(total=num_steps, initial=self.first_step, file=out, unit="step", leave=False,
                          dynamic_ncols=True,
                          bar_format="  train  {bar} {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {desc}")
                     if out.isatty() else None)

    @staticmethod
    def _size(path: Path) -> int:
        return path.stat().st_size if path.is_file() else 0

    def poll(self) -> None:
        """Read what was appended to metrics.jsonl and the control records since the last call."""
        for record in self._new_metrics():
            self._show_step(record)
        events, self._events_offset = read_new_lines(self._run_dir.control_log, self._events_offset)
        for event in events:
            self._show_event(event)

    def close(self) -> None:
        self.poll()
        if self._bar is not None:
            self._bar.close()

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self._out)
        else:
            print(line, file=self._out, flush=True)

    def _new_metrics(self) -> list[dict[str, Any]]:
        records, self._offset = read_new_lines(self._run_dir.metrics, self._offset)
        return records

    def _show_step(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        self._step_seconds = (self._step_seconds + [float(record.get("step_seconds") or 0.0)])[-20:]
        previous = self._last["step"] if self._last else self.first_step
        self._last = record
        if self._bar is not None:
            self._bar.n = step  # after a restart the run goes back to the reloaded step
            self._bar.set_description_str(f"loss {record['loss']:.4f}, {record.get('tokens_per_second', 0):,.0f} tok/s"
                                          f"{_mfu(record, ', ')}", refresh=True)
            return
        if any(previous < mark <= step for mark in self._plain_marks):
            eta = sum(self._step_seconds) / len(self._step_seconds) * max(0, self._num_steps - step)
            self.write(f"  train  step {step}/{self._num_steps}  loss {record['loss']:.4f}  "
                       f"{record.get('tokens_per_second', 0):,.0f} tok/s{_mfu(record, '  ')}  ETA {eta:.0f} s")

    def _show_event(self, event: dict[str, Any]) -> None:
        if event["event"] == "fault":
            key = ("fault", event.get("key"), event.get("step"))
            line = f"  ! {event['fault_type']} injected on rank {event['rank']} at step {event['step']}"
        elif event["event"] == "recovery":
            key = ("recovery", event.get("fault_key"), event.get("restart_iteration"), event.get("first_step"))
            lost = event["lost_steps"] if event["lost_steps"] is not None else "?"
            seconds = f"{event['recovery_seconds']:.1f} s" if event["recovery_seconds"] is not None else "n/a"
            line = (f"  ! recovered by {event['mechanism']} restart: reloaded step {event['reloaded_step']} from "
                    f"{event['reload_source']}, {lost} steps lost, {seconds} to the next step"
                    + "".join(f"\n    cause: {cause}" for cause in [*event.get("earlier_causes", []), event.get("cause")]
                              if cause)
                    + (f"\n    decision: {event['decision']} ({event['decided_cause']}: {event['evidence']})"
                       if event.get("decision") else ""))
        elif opens_a_streak(event):
            key = ("straggler", event.get("step"), event.get("straggler_rank"))  # a streak's start, a replacement
            line = (f"  ! straggler at step {event['step']}: rank {event['straggler_rank']} on {event['node']}, "
                    f"its work at {event['score']:.2f} of the fastest rank's, slowest in {event['section']} "
                    f"({event['consecutive_reports']} "
                    f"report(s) in a row{', replacing its node' if event.get('action') == 'replace_node' else ''})")
        elif event["event"] == "checkpoint_failed":
            key = ("checkpoint_failed", event.get("step"))
            line = f"  ! checkpoint step {event['step']} failed, not committed (the next save commits): {event['error']}"
        elif event["event"] == "fault_absorbed":
            key = ("fault_absorbed", event.get("fault_key"))
            line = f"  ! {event['fault_key']}: {event['why']}"
        elif event["event"] == "gave_up":
            key = ("gave_up", event.get("generation"))
            line = f"  ! {event['message']}"
        elif event["event"] == "rollback":
            key = ("rollback", event.get("anomaly_step"), event.get("time"))
            line = (f"  ! {event['anomaly']} at step {event['anomaly_step']}, again on the same batch: rolled back to "
                    f"step {event['reloaded_step']} ({event['reload_source']}), {event['lost_steps']} steps lost, "
                    f"{event['samples']} samples skipped")
        elif event["event"] == "sdc_suspected":
            key = ("sdc_suspected", event.get("step"))
            who = f" on rank(s) {', '.join(map(str, event['ranks']))}" if event.get("ranks") else ""
            line = (f"  ! suspected silent data corruption at step {event['step']}{who}: {event['anomaly']}, clean "
                    "when executed again; trained on")
        elif (found := replica_group_line(event)) is not None:
            key, line = found
        else:
            return
        if key not in self._seen_events:  # every rank records its recovery; one line is enough
            self._seen_events.add(key)
            self.write(line)


class PipelineConsole:
    """Context manager: while open, the runner's output goes to the log file and the console shows steps."""

    def __init__(self, run_dir: Path, num_steps: int, *, verbose: bool = False, out: TextIO | None = None):
        self.run_dir = Path(run_dir)
        self.log_path = RunDir(run_dir).pipeline_log
        self.verbose = verbose
        self._out = out if out is not None else sys.stdout
        self._num_steps = num_steps
        self._started: dict[str, list[float]] = {}  # a ParallelFor runs one task name several times at once
        self._first_started: dict[str, float] = {}
        # each task's wall time, as the console prints it (a ParallelFor's: its first start to its last finish)
        self.step_seconds: dict[str, float] = {}
        self._progress: TrainingProgress | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._saved: tuple | None = None

    def __enter__(self) -> PipelineConsole:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("a", buffering=1)
        tap = _Tap(self._log_file, self._on_line, self._out if self.verbose else None)
        root = logging.getLogger()
        self._saved = (sys.stdout, sys.stderr, root.handlers[:], root.level)
        handler = logging.StreamHandler(tap)
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.handlers[:] = [handler]
        root.setLevel(logging.INFO)
        sys.stdout = sys.stderr = tap
        if not self.verbose:
            self._say(f"logs: {self.log_path} (-v shows them here)")
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop_progress()
        stdout, stderr, handlers, level = self._saved
        sys.stdout, sys.stderr = stdout, stderr
        root = logging.getLogger()
        root.handlers[:] = handlers
        root.setLevel(level)
        self._log_file.close()

    def _say(self, line: str) -> None:
        if self.verbose:
            return  # the runner's own lines already say it
        if self._progress is not None:
            self._progress.write(line)
        else:
            print(line, file=self._out, flush=True)

    def _on_line(self, line: str) -> None:
        if match := _STARTED.search(line):
            task = match.group(1)
            if not self._started.get(task):
                self._first_started[task] = time.monotonic()
            self._started.setdefault(task, []).append(time.monotonic())
            if task == _TRAIN_TASK:
                self._start_progress()
            elif self._out.isatty() and not self.verbose:  # the finish line overwrites it
                self._out.write(f"  {_title(task):<14} running\r")
                self._out.flush()
            else:
                self._say(f"  {_title(task):<14} running")
        elif match := _FINISHED.search(line):
            task, status = match.groups()
            if task == _TRAIN_TASK:
                self._stop_progress()
            now = time.monotonic()
            running = self._started.get(task) or [now]
            seconds = now - running.pop(0)
            if not running:
                self.step_seconds[_title(task)] = round(now - self._first_started.pop(task, now - seconds), 3)
            outcome = "done" if status == "SUCCESS" else "FAILED"
            self._say(f"  {_title(task):<14} {outcome:<7}{seconds:6.1f} s"
                      + ("" if status == "SUCCESS" else f"  (see {self.log_path})"))
        elif match := _CACHED.search(line):
            self._say(f"  {_title(match.group(1)):<14} cached")
        elif match := _SKIPPED.search(line):
            self._say(f"  {_title(match.group(1)):<14} skipped (an earlier step failed)")

    def _start_progress(self) -> None:
        progress = TrainingProgress(self.run_dir, self._num_steps, self._out)
        trains = (f"steps {progress.first_step + 1}-{self._num_steps}: the run continues from step "
                  f"{progress.first_step}" if progress.first_step else f"{self._num_steps} steps")
        self._say(f"  {_title(_TRAIN_TASK):<14} running ({trains})")
        if self.verbose:
            return
        self._progress = progress
        self._stop.clear()
        self._poller = threading.Thread(target=self._poll, name="console-progress", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_SECONDS):
            self._progress.poll()

    def _stop_progress(self) -> None:
        if self._poller is None:
            return
        self._stop.set()
        self._poller.join()
        self._progress.close()
        self._poller = self._progress = None


def _mfu(record: dict[str, Any], separator: str) -> str:
    """A step's MFU where the trainer measured it (a GPU with a known peak: trainer.observe.flops)."""
    return f"{separator}MFU {record['mfu']:.1%}" if "mfu" in record else ""
