"""The control plane's readers of the release before the event store (commit 14fb929: events/rank-N.jsonl), measured
as that code ran them: the "before" of bench/results/control_plane_before.json. It imports that release, so it runs
only in a checkout of it:

    git worktree add /tmp/before/src 14fb929
    cd /tmp/before/src && python /path/to/bench/legacy/control_plane_before.py --ranks 1024 --days 30

Each reader in a fresh process, as bench/control_plane.py does (peak RSS here is ru_maxrss; for the forwarder pass
and the console poll it includes their set-up pass in the same process, which read the whole history).
"""
import argparse, io, json, os, resource, subprocess, sys, time, random
from pathlib import Path
sys.path.insert(0, "/tmp/before/src"); sys.path.insert(0, "/tmp/before/src/bench")

STEP_SECONDS = 4.0
NODE_MTBF_HOURS = round(2048 * 54 * 24 / 419)
READERS = ["rank_start", "rank0_start", "recovery_record", "budget_check", "forwarder_pass", "forwarder_restart",
           "console_poll", "end_report", "finalize"]

def plan(ranks):
    from report import SEED_COSTS
    from trainer.planning.goodput import Costs, make_plan
    nodes = max(1, ranks // 8)
    interval = make_plan(Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)).interval_seconds
    fault_mtbf = Costs(nodes=1024, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS).job_mtbf_seconds
    return interval, fault_mtbf

def build(run_dir: Path, ranks: int, days: float):
    interval, fault_mtbf = plan(ranks)
    run_dir.mkdir(parents=True)
    (run_dir / "events").mkdir(); (run_dir / "system").mkdir()
    t0 = 1_790_000_000.0; end = t0 + days * 86400
    rnd = random.Random(0)
    files = [open(run_dir / "events" / f"rank-{r}.jsonl", "w") for r in range(ranks)]
    def w(rank, event, t, **f):
        files[rank].write(json.dumps({"event": event, "rank": rank, "time": t, "attempt": "1/0/0/0", **f}) + "\n")
    saves = faults = records = 0
    faults_at = []; t = t0
    while True:
        t += rnd.expovariate(1 / fault_mtbf)
        if t >= end: break
        faults_at.append(t)
    w(0, "attempt", t0, layer="first_start", pid=1, generation=1, scope="step:1")
    w(0, "launch", t0 + 60, launcher="ft_launcher", restart_iteration=0, job_attempt=0, in_process_iteration=0,
      process_started_at=t0 + 1, init_seconds={})
    w(0, "resume", t0 + 61, step=0, source="none", path=None)
    w(0, "checkpoint_interval_chosen", t0 + 100, step=30, interval_steps=int(interval / STEP_SECONDS),
      interval_seconds=interval, reason="planned")
    metrics = open(run_dir / "metrics.jsonl", "w")
    step = 0; ts = t0 + 62; next_save = ts + interval; fi = 0; last_report = 0; restarts = 0
    while ts < end:
        step += 1; ts += STEP_SECONDS
        metrics.write(json.dumps({"step": step, "loss": 2.0, "lr": 1e-4, "grad_norm": 1.0, "step_seconds": STEP_SECONDS,
                                  "data_seconds": 0.01, "tokens_per_second": 1e6, "time": ts}) + "\n")
        if step % 50 == 0:
            w(0, "straggler_report", ts, step=step, steps=50, threshold=0.75, ranks=ranks, lowest={"rank": 3, "score": 0.9,
              "section": "step"}, stragglers=[])
        if ts >= next_save:
            next_save += interval; saves += 1
            for r in range(ranks):
                w(r, "checkpoint_stall", ts, step=step, mode="async", handoff_seconds=0.1, barrier_seconds=0.01,
                  loop_wait_seconds=0.2, previous_save_seconds=0.0, memory_seconds=0.05, memory_copies=10)
                w(r, "checkpoint_written", ts + 300, step=step, mode="async", blocking_seconds=0.1, write_seconds=300.0)
            w(0, "checkpoint_committed", ts + 310, step=step, mode="async", path=f"/fsx/ckpt/step-{step:06d}",
              bytes=96_000_000_000, blocking_seconds=0.1, write_seconds=300.0, commit_seconds=10.0,
              background_seconds=309.9, mb_per_second=310.0)
        if fi < len(faults_at) and ts >= faults_at[fi]:
            fi += 1; restarts += 1; failed = rnd.randrange(ranks)
            for r in range(ranks):
                if r != failed:
                    w(r, "rank_failed", ts + 1, how="exception", error_type="DistBackendError",
                      message="Connection closed by peer", phase="train", step=step, secondary=True)
            ts += 30; reload = step - 5
            w(0, "attempt", ts, layer="ft_launcher", pid=2, generation=1, scope="step:1")
            w(0, "launch", ts + 10, launcher="ft_launcher", restart_iteration=restarts, job_attempt=0,
              in_process_iteration=0, process_started_at=ts, init_seconds={})
            w(0, "resume", ts + 11, step=reload, source="memory", path=None)
            w(0, "recovery", ts + 20, fault_key=None, fault_keys=[], fault_type="unknown", fault_rank=None, fault_step=None,
              fault_time=None, mechanism="ft_launcher", restart_iteration=restarts, reloaded_step=reload,
              reload_source="memory", fsx_bytes_read=0, lost_steps=5, detect_and_teardown_seconds=None,
              reinit_seconds=10.0, reload_seconds=1.0, first_step_seconds=4.0, recovery_seconds=None, first_step=reload + 1,
              cause=f"rank {failed} failed first: ended without a record", first_failed_rank=failed,
              first_failure="killed", secondary_errors=ranks - 1, silent_ranks=[failed], earlier_causes=[])
            ts += 20
    for f in files: f.close()
    metrics.close()
    for n in range(max(1, ranks // 8)):
        with open(run_dir / "system" / f"node-{n}.jsonl", "w") as h:
            h.write(json.dumps({"time": end, "sample": 1, "system/cpu_utilization_percentage": 50.0}) + "\n")
    (run_dir / "lease.json").write_text(json.dumps({"generation": 1}))
    (run_dir / "result.json").write_text(json.dumps({"finished_at": end + 100, "steps": step,
                                                      "final_checkpoint_wait_seconds": 1.0}))
    lines = sum(1 for p in (run_dir / "events").iterdir() for _ in open(p))
    return {"records": lines, "steps": step, "saves": saves, "faults": len(faults_at), "interval": interval}

class Counter:
    def __init__(self): self.on = False; self.opens = 0
    def hook(self, event, args):
        if self.on and event == "open": self.opens += 1

def rchar():
    for line in open("/proc/self/io"):
        if line.startswith("rchar"): return int(line.split()[1])

def measure(reader, run_dir, ranks):
    run_dir = Path(run_dir)
    os.environ["RESILIENT_TRAIN_BUDGET_SINCE"] = "1790000000.0"
    from trainer.run.events import read_events, run_started_at
    from trainer.run.lease import Fence
    from trainer.resilience.budget import read_gave_up, attempt_history, budget_since
    from trainer.resilience.failures import explain_restarts, handled_fault_keys
    from trainer.run.run_dir import read_jsonl, RunDir
    prep = None
    if reader in ("forwarder_pass", "forwarder_restart"):
        import fcntl
        from components.tracking import Tracker, DELIVERER_LOCK
        from components.forwarder import RunFolderForwarder
        tracker = Tracker("http://127.0.0.1:9", "x", "bench", run_dir)
        tracker.spool.mkdir(parents=True, exist_ok=True)
        lock = open(tracker.spool / DELIVERER_LOCK, "a"); fcntl.flock(lock, fcntl.LOCK_EX)  # journal only
        fwd = RunFolderForwarder(tracker, "train", run_dir); fwd.forward()
        if reader == "forwarder_pass":  # 10k new records: new steps and one save of every rank
            with open(run_dir / "metrics.jsonl", "a") as m:
                for i in range(10_000 - 2 * ranks - 1 if 10_000 > 2 * ranks + 1 else 0):
                    m.write(json.dumps({"step": 10**7 + i, "loss": 2.0, "step_seconds": 4.0, "time": 1.9e9}) + "\n")
            for r in range(ranks):
                with open(run_dir / "events" / f"rank-{r}.jsonl", "a") as h:
                    h.write(json.dumps({"event": "checkpoint_stall", "rank": r, "time": 1.9e9, "step": 10**7,
                                        "loop_wait_seconds": 0.2, "handoff_seconds": 0.1}) + "\n")
                    h.write(json.dumps({"event": "checkpoint_written", "rank": r, "time": 1.9e9, "step": 10**7}) + "\n")
        else:
            fwd = RunFolderForwarder(tracker, "train", run_dir)
    if reader == "console_poll":
        from pipelines.console import TrainingProgress
        progress = TrainingProgress(run_dir, 10**7, io.StringIO()); progress.poll()
    c = Counter(); sys.addaudithook(c.hook)
    before_bytes = rchar(); c.on = True; t = time.perf_counter()
    if reader == "rank_start":
        read_events(run_dir, "fault"); read_events(run_dir, "checkpoint_interval_chosen"); read_gave_up(run_dir)
        Fence(run_dir, 1).check()
    elif reader == "rank0_start":
        read_events(run_dir, "fault"); read_events(run_dir, "checkpoint_interval_chosen"); read_gave_up(run_dir)
        Fence(run_dir, 1).check(); attempt_history(run_dir, budget_since(run_dir), "step:1")
        read_events(run_dir, "recovery")
    elif reader == "recovery_record":
        events = read_events(run_dir); handled_fault_keys(events)
        explain_restarts(run_dir, 2e9, ranks); read_jsonl(RunDir(run_dir).metrics)
    elif reader == "budget_check":
        read_gave_up(run_dir); attempt_history(run_dir, budget_since(run_dir), "step:1")
    elif reader in ("forwarder_pass", "forwarder_restart"):
        fwd.forward()
    elif reader == "console_poll":
        progress.poll()
    elif reader == "end_report":
        from components.train.report import training_report, checkpoint_metric_records, read_metrics
        from trainer.planning.measured import measured_costs
        training_report(run_dir, 1790000000.0); checkpoint_metric_records(run_dir)
        read_events(run_dir, "fault"); measured_costs(run_dir); read_events(run_dir, "checkpoint_interval_chosen")
        read_metrics(RunDir(run_dir).metrics); checkpoint_metric_records(run_dir); read_events(run_dir, "fault")
        read_events(run_dir, "recovery")
    elif reader == "finalize":
        read_events(run_dir, "recovery"); read_events(run_dir, "straggler")
    seconds = time.perf_counter() - t; c.on = False
    out = {"seconds": seconds, "files_opened": c.opens, "bytes_read": rchar() - before_bytes,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    print(json.dumps(out))

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int); p.add_argument("--days", type=float); p.add_argument("--root", default="/tmp/before/runs")
    p.add_argument("--measure"); p.add_argument("--run-dir"); p.add_argument("--readers", default=",".join(READERS))
    a = p.parse_args()
    if a.measure:
        measure(a.measure, a.run_dir, a.ranks); sys.exit()
    run_dir = Path(a.root) / f"r{a.ranks}-d{a.days:g}"
    import shutil; shutil.rmtree(run_dir, ignore_errors=True)
    t = time.time(); info = build(run_dir, a.ranks, a.days); info["build_seconds"] = time.time() - t
    print(json.dumps(info), flush=True)
    readers = {}
    for reader in a.readers.split(","):
        proc = subprocess.run([sys.executable, __file__, "--measure", reader, "--run-dir", str(run_dir), "--ranks", str(a.ranks)],
                              capture_output=True, text=True)
        if proc.returncode:
            print(reader, proc.stderr[-2000:]); continue
        readers[reader] = json.loads(proc.stdout.strip().splitlines()[-1]); print(reader, readers[reader], flush=True)
    Path("/tmp/before/results").mkdir(exist_ok=True)
    Path(f"/tmp/before/results/r{a.ranks}-d{a.days:g}.json").write_text(json.dumps({"ranks": a.ranks, "days": a.days, **info, "readers": readers}, indent=1))
    shutil.rmtree(run_dir, ignore_errors=True)
