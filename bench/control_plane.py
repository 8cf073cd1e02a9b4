"""The control plane at scale: every reader of the run folder's history, measured on a month of synthetic history.

    .venv/bin/python bench/control_plane.py                       # the default shapes (~10 min on 2 cores)
    .venv/bin/python bench/control_plane.py --ranks 1024 --days 7  # one shape

The history is written by the project's own writers (trainer.run.events.EventLog for the event streams, the
trainer's metrics writer, the start-up's fold of the control records, the recovery's explanation), on a
synthetic clock: a step every 4 s, FSx saves at the planner's interval for the shape's node count (8 ranks per
node), faults at the planner's 1,024-node rate (node MTBF 6,335 h: one every 6.2 h, ~116 in 30 days). A fault
leaves what a real one leaves: a failure record from every other rank, then a restart (an attempt, a launch, a
resume, a recovery record). The history ends at such a fault, so each reader is measured where it runs: the
restart that follows it.

Readers, each in a fresh process, the fastest of --repeats (seconds, files opened, bytes read — /proc/self/io rchar —, peak RSS — VmHWM):
- ``rank_start``: a rank other than 0 starting (the lease's fence, the budget's give-up record; the history is
  handed over by rank 0: trainer.job.startup);
- ``rank0_start``: rank 0 starting (the control records folded and written back, the fence, the budget's start);
- ``recovery_record``: rank 0 after the first step of the restart (the failures since the last recovery, the
  last step before the fault: what trainer.resilience.hooks reads for its record);
- ``budget_check``: the restart budget's check after the resume (trainer.resilience.budget);
- ``forwarder_pass``: one pass of the MLflow forwarder over 10 k new records (steps and nodes' system samples);
- ``forwarder_restart``: a forwarder started again (a retried train step) and its first pass;
- ``console_poll``: one poll of the local console's progress;
- ``end_report``: the train step's end-of-training report (figures, per-save records, plots);
- ``finalize``: what the exit handler reads for summary.json.

Default shapes: (8 ranks, 1 day), (1,024, 30), (8,192, 30), and (8,192, 1) for the 30-day / 1-day ratio. Writes
``--output`` (bench/results/control_plane.json); bench/report.py renders it into bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from common import ROOT, write_results  # noqa: E402  (bench/ is the script's folder)

READERS = ("rank_start", "rank0_start", "recovery_record", "budget_check", "forwarder_pass", "forwarder_restart",
           "console_poll", "end_report", "finalize")
DEFAULT_SHAPES = ((8, 1.0), (1024, 30.0), (8192, 30.0), (8192, 1.0))
STEP_SECONDS = 4.0
T0 = 1_790_000_000.0
NEW_RECORDS = 10_000  # what one forwarder pass reads
GOALS = {"rank_start": (0.2, 5), "rank0_start": (1.0, None), "recovery_record": (1.0, None),
         "budget_check": (1.0, None), "forwarder_pass": (1.0, None), "forwarder_restart": (10.0, None),
         "end_report": (60.0, None)}
END_REPORT_RSS_MB = 1024


class Clock:
    """The synthetic clock every writer reads (their modules' `time`, for the build only)."""

    def __init__(self, now: float):
        self.now = now

    def time(self) -> float:
        return self.now


def plan(ranks: int) -> tuple[float, float]:
    """The planner's FSx interval for the shape's nodes, and the mean time between faults at 1,024 nodes."""
    from report import NODE_MTBF_HOURS, SEED_COSTS
    from trainer.planning.goodput import Costs, make_plan

    nodes = max(1, ranks // 8)
    interval = make_plan(Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)).interval_seconds
    return interval, Costs(nodes=1024, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS).job_mtbf_seconds


def build(run_dir: Path, ranks: int, days: float) -> dict:
    """A run folder holding `days` of a `ranks`-rank job's history, written as the code writes it."""
    import trainer.job.trainer as job_trainer
    import trainer.run.events as events_module
    import trainer.run.history as history_module
    from trainer.resilience.failures import explain_restarts
    from trainer.run.events import EventLog
    from trainer.run.history import control_state, record_train_launch
    from trainer.run.run_dir import RunDir, write_json

    clock = Clock(T0)
    for module in (events_module, history_module, job_trainer):
        module.time = SimpleNamespace(time=clock.time, perf_counter=time.perf_counter)
    interval, fault_mtbf = plan(ranks)
    rnd = random.Random(0)
    run = RunDir(run_dir)
    run.path.mkdir(parents=True)
    write_json(run.lease, {"generation": 1})
    end = T0 + days * 86400
    scope = f"step:{T0!r}"
    record_train_launch(run.path, T0)
    ranks_log = [EventLog(run.path, rank) for rank in range(ranks)]
    rank0 = ranks_log[0]
    metrics = job_trainer._MetricsWriter(run.metrics, SimpleNamespace(check=lambda: None)).__enter__()
    step, next_save, saves, faults, previous_save = 0, T0 + 60 + interval, 0, 0, None
    next_fault = T0 + rnd.expovariate(1 / fault_mtbf)

    def start(layer: str, resumed: int) -> None:  # what rank 0 writes and folds as the ranks start
        clock.now += 30.0
        control_state(run.path, save=True)
        rank0.write("attempt", layer=layer, pid=1, generation=1, scope=scope)
        rank0.write("launch", launcher="ft_launcher", restart_iteration=faults, job_attempt=0, in_process_iteration=0,
                    process_started_at=clock.now - 20.0, init_seconds={})
        rank0.write("resume", step=resumed, source="memory" if resumed else "none", path=None)

    start("first_start", 0)
    while True:
        failing_now = clock.now >= next_fault or clock.now >= end  # the history ends at a fault
        if failing_now:
            faults += 1
            failed = rnd.randrange(ranks)  # killed outright: no record of its own
            for rank in range(ranks):
                if rank != failed:
                    ranks_log[rank].write("rank_failed", how="exception", error_type="DistBackendError",
                                          message="Connection closed by peer [10.0.0.1]:29500", phase="train",
                                          step=step, secondary=True)
            if clock.now >= end:
                break
            started = clock.now + 30.0
            start("ft_launcher", step)  # resumed from node memory: nothing lost
            history = control_state(run.path)
            [explained] = explain_restarts(run.path, started, ranks, history)
            rank0.write("recovery", fault_key=None, fault_keys=[], fault_type="unknown", fault_rank=None,
                        fault_step=None, fault_time=None, mechanism="ft_launcher", restart_iteration=faults,
                        reloaded_step=step, reload_source="memory", fsx_bytes_read=0, lost_steps=0,
                        detect_and_teardown_seconds=None, reinit_seconds=10.0, reload_seconds=1.0,
                        first_step_seconds=4.0, recovery_seconds=None, first_step=step + 1, earlier_causes=[],
                        **explained)
            next_fault = clock.now + rnd.expovariate(1 / fault_mtbf)
            continue
        step += 1
        clock.now += STEP_SECONDS
        metrics.write({"step": step, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "step_seconds": STEP_SECONDS,
                       "data_seconds": 0.01, "tokens_per_second": 1e6})
        if step == 30:
            rank0.write("checkpoint_interval_chosen", step=step, interval_steps=int(interval / STEP_SECONDS),
                        interval_seconds=interval, reason="the planner's")
        if step % 50 == 0:
            rank0.write("straggler_report", step=step, steps=50, threshold=0.75, ranks=ranks, stragglers=[],
                        lowest={"rank": 3, "score": 0.93, "section": "step"})
        if clock.now >= next_save:
            next_save += interval
            saves += 1
            if previous_save is not None:  # reduced at this save's barrier (trainer.checkpoint.commit)
                rank0.write("checkpoint_stall", step=previous_save, mode="async", ranks=ranks, loop_wait_seconds=0.2,
                            handoff_seconds=0.1, barrier_seconds=0.01, previous_save_seconds=0.0,
                            memory_seconds=0.05, memory_copies=int(interval / STEP_SECONDS), write_seconds=300.0)
            rank0.write("checkpoint_committed", step=step, mode="async", path=f"/fsx/ckpt/step-{step:06d}",
                        bytes=96_000_000_000, blocking_seconds=0.1, write_seconds=300.0, commit_seconds=10.0,
                        background_seconds=309.9, mb_per_second=310.0)
            previous_save = step
    metrics.__exit__(None, None, None)
    run.system.mkdir()
    for node in range(max(1, ranks // 8)):  # every node's newest sample (older ones are never read again)
        events_module.append_record(run.system_samples, {"time": clock.now, "node": f"node-{node}", "sample": 0,
                                                         "system/cpu_utilization_percentage": 50.0})
    write_json(run.result, {"steps": step, "finished_at": clock.now, "final_checkpoint_wait_seconds": 1.0})
    write_json(run.step_result("train"), {"steps": step, "goodput": 0.9})
    # The forwarder has tailed the run all along: its positions are at the end of every file.
    spool = run.spool
    spool.mkdir(parents=True)
    offsets = {str(p.relative_to(run.path)): p.stat().st_size for p in (run.metrics, run.control_log,
                                                                       run.periodic_log, run.system_samples)
               if p.exists()}
    write_json(spool / "forwarded.json", {"offsets": offsets, "counters": {
        "max_step": step, "recoveries": faults - 1, "system_points": 0, "tables": {}}})
    write_json(run.path / "bench.json", {"ranks": ranks, "end": clock.now, "step": step})
    records = sum(1 for path in (run.control_log, run.failures_log, run.periodic_log) for line in path.open("rb")
                  if line.strip())
    return {"records": records, "metrics_lines": step, "saves": saves, "faults": faults,
            "interval_seconds": interval, "bytes": sum(p.stat().st_size for p in run.path.rglob("*") if p.is_file())}


def _new_records(run_dir: Path, ranks: int, count: int) -> None:
    """What a forwarder pass finds: new steps and every node's system samples."""
    from trainer.run.events import append_record
    from trainer.run.run_dir import RunDir, read_json

    run, info = RunDir(run_dir), read_json(Path(run_dir) / "bench.json")
    nodes = max(1, ranks // 8)
    samples = count * 4 // 5
    with run.metrics.open("a") as handle:
        for i in range(count - samples):
            handle.write(json.dumps({"step": info["step"] + 1 + i, "loss": 1.9, "step_seconds": STEP_SECONDS,
                                     "data_seconds": 0.01, "tokens_per_second": 1e6,
                                     "time": info["end"] + STEP_SECONDS * (i + 1)}) + "\n")
    for i in range(samples):
        append_record(run.system_samples, {"time": info["end"] + i // nodes, "node": f"node-{i % nodes}", "sample": i,
                                           "system/cpu_utilization_percentage": 50.0 + i % 7,
                                           "system/system_memory_usage_megabytes": 1e6})


def measure(reader: str, run_dir: Path) -> dict:
    """One reader as the code runs it; the set-up before the clock starts is not counted."""
    import fcntl

    from trainer.run.run_dir import RunDir, read_json

    run = RunDir(run_dir)
    info = read_json(run.path / "bench.json")
    ranks, now = info["ranks"], info["end"] + 60.0
    os.environ["RESILIENT_TRAIN_BUDGET_SINCE"] = repr(T0)
    # Each reader's process imports what that reader's code imports, no more (its peak RSS is the process's).
    from trainer.resilience.budget import RestartBudget, read_gave_up
    from trainer.run.events import EventLog
    from trainer.run.history import control_state

    history = control_state(run.path)  # set-up for the readers that get it handed over
    if reader in ("forwarder_pass", "forwarder_restart"):
        from components.forwarder import RunFolderForwarder
        from components.tracking import DELIVERER_LOCK, Tracker

        tracker = Tracker("http://127.0.0.1:9", "bench", "bench", run.path)
        lock = (tracker.spool / DELIVERER_LOCK).open("a")
        fcntl.flock(lock, fcntl.LOCK_EX)  # a deliverer "holds" the spool: the pass journals, as on a local run
        if reader == "forwarder_pass":
            forwarder = RunFolderForwarder(tracker, "train", run.path)
            _new_records(run.path, ranks, NEW_RECORDS)
    elif reader == "console_poll":
        from pipelines.console import TrainingProgress

        progress = TrainingProgress(run.path, 10**9, open(os.devnull, "w"))
        _new_records(run.path, ranks, 10)
    elif reader == "recovery_record":
        from trainer.resilience.failures import explain_restarts
        from trainer.run.tail import read_last_record
    elif reader == "end_report":
        from components.train.report import TrainingReport
    elif reader == "rank_start" or reader == "rank0_start":
        from trainer.run.lease import Fence
    budget = RestartBudget(run.path, rank=0, events=EventLog(run.path, 0), limit=3, in_process_limit=2,
                           layer="ft_launcher", generation=1, process_started_at=now, broadcast=lambda v: v,
                           history=history)
    if reader == "budget_check":
        budget.start()

    opened, counting = [0], False
    sys.addaudithook(lambda event, args: opened.__setitem__(0, opened[0] + 1) if event == "open" and counting else None)
    read_before = _rchar()
    counting, started = True, time.perf_counter()
    if reader == "rank_start":
        Fence(run.path, 1).check()
        RestartBudget(run.path, rank=1, events=EventLog(run.path, 1), limit=3, in_process_limit=2, layer="ft_launcher",
                      generation=1, process_started_at=now, broadcast=lambda v: None, history=history).start()
    elif reader == "rank0_start":
        history = control_state(run.path, save=True)
        Fence(run.path, 1).check()
        RestartBudget(run.path, rank=0, events=EventLog(run.path, 0), limit=3, in_process_limit=2,
                      layer="ft_launcher", generation=1, process_started_at=now, broadcast=lambda v: v,
                      history=history).start()
    elif reader == "recovery_record":
        explain_restarts(run.path, now, ranks, history)
        read_last_record(run.metrics, before=now)
    elif reader == "budget_check":
        budget.check(info["step"])
    elif reader == "forwarder_pass":
        forwarder.forward()
    elif reader == "forwarder_restart":
        RunFolderForwarder(tracker, "train", run.path).forward()
    elif reader == "console_poll":
        progress.poll()
    elif reader == "end_report":
        report = TrainingReport.read(run.path, T0)
        report.figures()
        report.checkpoint_records()
        report.plots(Path(tempfile.mkdtemp()))
    elif reader == "finalize":
        control_state(run.path)
        read_gave_up(run.path)
        [read_json(path) for path in sorted(run.steps.glob("*.json"))]
    seconds = time.perf_counter() - started
    counting = False
    return {"seconds": seconds, "files_opened": opened[0], "bytes_read": _rchar() - read_before,
            "peak_rss_mb": _peak_rss_mb()}


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: its own address space's, reset at exec — unlike ru_maxrss,
    which keeps the peak of the process it was forked from)."""
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024


def _rchar() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/io") if line.startswith("rchar"))


def shape(ranks: int, days: float, scratch: Path, repeats: int) -> dict:
    run_dir = scratch / f"r{ranks}-d{days:g}"
    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.time()
    built = build(run_dir, ranks, days)
    built["build_seconds"] = round(time.time() - started, 1)
    print(f"{ranks} ranks x {days:g} days: {built}", flush=True)
    readers = {}
    for reader in READERS:
        runs = []
        for _ in range(repeats):  # each in a fresh process on the history as built (some readers append)
            copy = scratch / "measure"
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(run_dir, copy)
            proc = subprocess.run([sys.executable, __file__, "--measure", reader, "--run-dir", str(copy)],
                                  capture_output=True, text=True, cwd=ROOT)
            if proc.returncode:
                raise RuntimeError(f"{reader} failed on {ranks} x {days:g}: {proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        # Seconds: the fastest run (on a shared machine noise only adds); the rest are the same in every run.
        readers[reader] = {**min(runs, key=lambda r: r["seconds"]), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
        print(f"  {reader:<18} {readers[reader]}", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(scratch / "measure", ignore_errors=True)
    return {"ranks": ranks, "days": days, **built, "readers": readers}


def table(shapes: list[dict]) -> str:
    titles = [f"{s['ranks']} x {s['days']:g} d" for s in shapes]
    lines = [f"{'reader':<18}" + "".join(f"{title:>26}" for title in titles)]
    for reader in READERS:
        cells = [s["readers"][reader] for s in shapes]
        lines.append(f"{reader:<18}" + "".join(f"{c['seconds']:>8.3f} s {c['files_opened']:>4} f {c['peak_rss_mb']:>5.0f} MB"
                                                for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, help="one shape: this many ranks (with --days)")
    parser.add_argument("--days", type=float, help="one shape: this many days of history")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "control_plane.json")
    parser.add_argument("--repeats", type=int, default=5, help="measurements per reader (the fastest is kept)")
    parser.add_argument("--scratch", type=Path, default=None, help="where the histories are built (default: a temp dir)")
    parser.add_argument("--measure", choices=READERS, help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.run_dir)))
        return
    if (args.ranks is None) != (args.days is None):
        parser.error("--ranks and --days go together (or neither: the default shapes)")
    shapes = [(args.ranks, args.days)] if args.ranks else DEFAULT_SHAPES
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="control-plane-"))
    results = [shape(ranks, days, scratch, args.repeats) for ranks, days in shapes]
    print(table(results))
    write_results(args.output, {"shapes": results, "goals": {k: {"seconds": s, "files": f} for k, (s, f) in GOALS.items()},
                                "end_report_peak_rss_mb_goal": END_REPORT_RSS_MB,
                                "new_records_per_pass": NEW_RECORDS, "step_seconds": STEP_SECONDS,
                                "repeats": args.repeats},
                  "bench/control_plane.py")


if __name__ == "__main__":
    main()
