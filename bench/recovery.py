"""Downtime per fault, by recovery mechanism, measured side by side in one run (2 CPU ranks, 101 M params).

    .venv/bin/python bench/recovery.py                 # ~20 min
    .venv/bin/python bench/recovery.py --preset tiny   # harness check (~5 min)

Downtime per fault = wall time of a run with one fault − wall time of the same run (same seed, data and
steps) without it. It holds everything the fault costs: detection, tear-down, restart, reload and the steps
replayed. Each mechanism runs clean before and after its faulty runs; the mean of the two clean runs is the
reference, and their difference is reported as the noise (`clean_spread_seconds`).

Mechanisms (the same model and data; a synchronous FSx checkpoint every 4 steps — committed before the loop
goes on, so what a resume from FSx replays does not depend on how far an async write had got — and the fault
at step 6, so a resume from FSx replays 2 steps: half the interval, the expected loss of a fault that strikes
at a random step):
- full_relaunch: the launcher gives up at once and the whole job is started again (new launcher,
  rendezvous, interpreters, imports, model build, reload from FSx) — the baseline;
- ft_launcher: in-job restart of the workers, state from FSx only (no memory tier);
- ft_launcher_memory: in-job restart with the node-memory tier every step and the peer replica (each rank a
  node of its own here), state from node memory or the peer;
- ft_launcher_memory_replica_wait: as above, each step waiting for its replica (node loss only).
Faults: exception, hang (ft_launcher's heartbeat timeout detects it), sigkill (one rank), node_loss (one
rank SIGKILLed and its node memory wiped).

Node loss with real nodes (training.num_nodes=2, one rank each, a launcher per node, the node memory tier
every step with its replica waited; the node_loss drill kills node 1's launcher and workers and wipes its
memory; docs/node-loss.md):
- whole_job_restart: as the EKS runtime handled it before per-index replacement (local.node_loss=
  restart_job): every node is stopped and the job relaunched, state from FSx;
- node_replacement: only node 1 is replaced (local.node_replacement_delay_seconds=0: the cost of the
  platform, not of finding a machine), node 0 keeps running; state from node 0's memory and the replica.
``fsx_bytes_read`` is what the recoveries read from checkpoint folders (every rank's, the recovery record's).

Replica groups (issue 33; training.num_nodes=2 x nproc_per_node=2, the node-memory tier every step, the same
SIGKILL of rank 3 — node 1's second rank — in both):
- in_job_restart: one FSDP group of 4 ranks (training.replica_groups=1): ft_launcher restarts every worker;
- replica_group_heal: 2 replica groups of 2 ranks (HSDP, torchft): group 1 restarts and heals from group 0,
  which trains on alone meanwhile.
Keys: ``rank_seconds_lost`` (ranks x seconds not training: every rank's downtime for the in-job restart; the
failed group's ranks until their first step after the heal, plus the survivors' stall, for the heal),
``survivor_stall_seconds`` (the survivors' step-to-step gaps over a normal step, from the fault to the step
after the heal), ``heal_seconds`` and ``heal_bytes`` (the heal's transfer, slowest rank / every rank's).

    .venv/bin/python bench/recovery.py --mechanisms in_job_restart,replica_group_heal --num-steps 16 \
        --throughput-samples 0 --merge

    .venv/bin/python bench/recovery.py --mechanisms whole_job_restart,node_replacement --throughput-samples 0 --merge

Throughput of the memory tier: clean runs without FSx saves (only the final one), alternating memory tier
off / node memory only / node memory + peer replica, --throughput-samples times each; the ratio is the
median over samples of each run's median step-to-step time, off over on.
Writes bench/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from components.train.report import read_metrics  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.observe import logs  # noqa: E402
from trainer.run.events import read_events  # noqa: E402
from trainer.run.run_dir import RunDir, read_jsonl  # noqa: E402

log = logging.getLogger("bench.recovery")

FAULT_STEP = 6
FAULTS = {"exception": f"exception@{FAULT_STEP}:rank=1", "hang": f"hang@{FAULT_STEP}:rank=0",
          "sigkill": f"sigkill@{FAULT_STEP}:rank=1", "node_loss": f"node_loss@{FAULT_STEP}:rank=1"}
IN_JOB = ["--resilience.max_restarts=2", "--resilience.job_restarts=0"]
NO_MEMORY = ["--checkpoint.memory_interval_steps=0"]
MEMORY = ["--checkpoint.memory_interval_steps=1", "--checkpoint.peer_replica=true",
          "--checkpoint.memory_node_per_rank=true"]
MECHANISMS = {
    "full_relaunch": (["--resilience.max_restarts=0", "--resilience.job_restarts=1", *NO_MEMORY], list(FAULTS)),
    "ft_launcher": ([*IN_JOB, *NO_MEMORY], list(FAULTS)),
    "ft_launcher_memory": ([*IN_JOB, *MEMORY], list(FAULTS)),
    "ft_launcher_memory_replica_wait": ([*IN_JOB, *MEMORY, "--checkpoint.peer_replica_wait=true"], ["node_loss"]),
}
NODES = ["--training.num_nodes=2", "--training.nproc_per_node=1", "--checkpoint.memory_interval_steps=1",
         "--checkpoint.peer_replica=true", "--checkpoint.memory_node_per_rank=false",
         "--checkpoint.peer_replica_wait=true", "--local.node_replacement_delay_seconds=0"]
MECHANISMS.update({
    "whole_job_restart": (["--resilience.job_restarts=1", "--local.node_loss=restart_job", *NODES], ["node_loss"]),
    "node_replacement": ([*IN_JOB, "--local.node_loss=replace", *NODES], ["node_loss"]),
})
# 4 ranks of the small model on 2 cores take 8-16 s a step, more with a save: a heartbeat timeout of its own, so
# that only the drill restarts anything (the other mechanisms keep --heartbeat-timeout, their hang row's measure).
GROUP_SHAPE = ["--training.num_nodes=2", "--training.nproc_per_node=2", *MEMORY, "--resilience.heartbeat_timeout=60",
               "--resilience.quorum_timeout_seconds=15", "--resilience.replica_check_interval=0"]
MECHANISMS.update({
    "in_job_restart": ([*IN_JOB, *GROUP_SHAPE], ["sigkill"]),
    "replica_group_heal": ([*IN_JOB, *GROUP_SHAPE, "--training.replica_groups=2",
                            "--resilience.lighthouse_heartbeat_timeout_seconds=1"], ["sigkill"]),
})
GROUP_FAULTS = {"sigkill": f"sigkill@{FAULT_STEP}:rank=3"}  # group 1's second rank (node 1's)
# Results kept per mechanism: --merge replaces only the mechanisms measured now.
PER_MECHANISM = ("downtime_seconds", "in_run_downtime_seconds", "lost_steps", "reload_source", "clean_runs", "splits",
                 "fsx_bytes_read", "rank_seconds_lost", "survivor_stall_seconds", "heal_seconds", "heal_bytes")
THROUGHPUT = {"off": NO_MEMORY, "node_memory": [*MEMORY, "--checkpoint.peer_replica=false"],
              "node_memory_and_peer": MEMORY}
SPLIT = ("detect_and_teardown_seconds", "reinit_seconds", "reload_seconds", "first_step_seconds")


def _median_step_seconds(run_dir: Path) -> float:
    """The median time between consecutive steps after the first two (page faults of the first saves)."""
    times = sorted((r["step"], r["time"]) for r in read_metrics(RunDir(run_dir).metrics))
    gaps = [b[1] - a[1] for a, b in zip(times, times[1:]) if a[0] >= 2 and b[0] == a[0] + 1]
    return statistics.median(gaps)


def in_run_downtime(recoveries: list[dict], step_seconds: float) -> float:
    """Downtime from the run's own recovery events, free of run-to-run noise: for each recovery, fault → the
    first step after the resume completed, less that step's normal duration, plus the replayed steps."""
    return sum(r["recovery_seconds"] - step_seconds + (r["lost_steps"] or 0) * step_seconds for r in recoveries)


def survivor_stall(run_dir: Path, step_seconds: float) -> float:
    """The survivors' stall: their step-to-step gaps over a normal step, from the fault's step to the first
    step after it that both groups trained (the heal's), summed."""
    records = sorted(read_jsonl(RunDir(run_dir).metrics), key=lambda r: r["time"])
    kept = {}
    for record in records:  # the first record of each step (the groups write one line per step)
        kept.setdefault(int(record["step"]), record)
    steps = sorted(kept)
    back = next((s for s in steps if s > FAULT_STEP + 1 and kept[s]["participants"] == 2), steps[-1])
    gaps = [kept[s]["time"] - kept[s - 1]["time"] for s in steps if FAULT_STEP < s <= back and s - 1 in kept]
    return sum(max(0.0, gap - step_seconds) for gap in gaps)


def group_figures(mechanism: str, run_dir: Path, step_seconds: float, ranks: int) -> dict[str, float | None]:
    """Rank-seconds lost to one fault, and for a heal its survivors' stall and transfer."""
    recoveries = read_events(run_dir, "recovery")
    if mechanism == "in_job_restart":
        return {"rank_seconds_lost": ranks * in_run_downtime(recoveries, step_seconds)}
    heals = read_events(run_dir, "replica_group_heal")
    if not heals:  # the group came back after training ended: nothing to heal (a longer --num-steps)
        return {"rank_seconds_lost": None, "survivor_stall_seconds": None, "heal_seconds": None, "heal_bytes": None}
    stall = survivor_stall(run_dir, step_seconds)
    group_ranks = ranks // 2
    down = sum(r["recovery_seconds"] - step_seconds for r in recoveries)
    return {"rank_seconds_lost": group_ranks * down + group_ranks * stall, "survivor_stall_seconds": stall,
            "heal_seconds": max(h["seconds"] for h in heals), "heal_bytes": sum(h["bytes"] for h in heals)}


def goal_figures(downtime: dict[str, dict], heartbeat_timeout: float) -> dict[str, float]:
    """The issue's goals as ratios: memory tier over the full relaunch (SIGKILL ≤ 0.35, node loss ≤ 0.5) and a
    hang's downtime beyond the heartbeat timeout (≤ 3 s)."""
    full, goals = downtime.get("full_relaunch", {}), {}
    for mechanism, fault in (("ft_launcher_memory", "sigkill"), ("ft_launcher_memory", "node_loss"),
                             ("ft_launcher_memory_replica_wait", "node_loss")):
        if fault in downtime.get(mechanism, {}) and full.get(fault):
            goals[f"{mechanism}/{fault} over full_relaunch"] = downtime[mechanism][fault] / full[fault]
    replaced, restarted = downtime.get("node_replacement", {}), downtime.get("whole_job_restart", {})
    if restarted.get("node_loss") and "node_loss" in replaced:
        goals["node_replacement/node_loss over whole_job_restart"] = replaced["node_loss"] / restarted["node_loss"]
    if "hang" in downtime.get("ft_launcher_memory", {}):
        goals["ft_launcher_memory/hang minus heartbeat_timeout"] = downtime["ft_launcher_memory"]["hang"] - heartbeat_timeout
    return goals


def _fault_item(mechanism: str, fault: str | None) -> str:
    if fault is None:
        return ""
    return GROUP_FAULTS[fault] if mechanism in ("in_job_restart", "replica_group_heal") else FAULTS[fault]


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--heartbeat-timeout", type=float, default=20.0,
                        help="ft_launcher hang detection (s); above the slowest step incl. an FSx save")
    parser.add_argument("--mechanisms", default=",".join(MECHANISMS), help="comma-separated subset")
    parser.add_argument("--throughput-samples", type=int, default=3, help="clean runs per memory-tier setting")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "recovery.json")
    parser.add_argument("--merge", action="store_true",
                        help="keep the other mechanisms' figures already in --output (each measured side by side "
                             "with its own clean runs)")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    runs = 0

    def run(mechanism: str, flags: list[str], fault: str | None) -> tuple[float, Path]:
        nonlocal runs
        runs += 1
        cfg = load_config("local", [
            f"--run.work_dir={scratch}", f"--run.run_id=r{runs}", f"--model.preset={args.preset}",
            f"--training.num_steps={args.num_steps}", "--training.batch_size=1", "--training.seq_len=128",
            "--training.warmup_steps=1", "--training.log_every=1", "--checkpoint.interval_steps=4",
            "--checkpoint.mode=sync",
            "--checkpoint.keep_last=1", f"--checkpoint.memory_dir={scratch / 'node-memory'}",
            f"--resilience.heartbeat_timeout={args.heartbeat_timeout}", "--resilience.launcher=ft_launcher",
            f"--faults.schedule={_fault_item(mechanism, fault)}", *flags])
        started = time.perf_counter()
        run_local_training(cfg, data)
        wall = time.perf_counter() - started
        log.info("%s / %s: %.1f s", mechanism, fault or "clean", wall)
        return wall, cfg.run_dir

    try:
        data = demo_token_dir(scratch)
        downtime: dict[str, dict] = {}
        lost: dict[str, dict] = {}
        source: dict[str, dict] = {}
        splits: dict[str, dict] = {}
        clean: dict[str, dict] = {}
        in_run: dict[str, dict] = {}  # the same downtime, from each run's recovery events
        fsx_bytes_read: dict[str, dict] = {}
        grouped: dict[str, dict] = {key: {} for key in ("rank_seconds_lost", "survivor_stall_seconds", "heal_seconds",
                                                        "heal_bytes")}
        for mechanism in args.mechanisms.split(","):
            flags, faults = MECHANISMS[mechanism]
            before, before_dir = run(mechanism, flags, None)
            faulty = {fault: run(mechanism, flags, fault) for fault in faults}
            after, after_dir = run(mechanism, flags, None)
            reference = (before + after) / 2
            clean[mechanism] = {"wall_seconds": [before, after], "clean_spread_seconds": abs(before - after),
                                "median_step_seconds": [_median_step_seconds(before_dir),
                                                        _median_step_seconds(after_dir)]}
            downtime[mechanism], lost[mechanism], source[mechanism], splits[mechanism] = {}, {}, {}, {}
            in_run[mechanism], fsx_bytes_read[mechanism] = {}, {}
            for fault, (wall, run_dir) in faulty.items():
                recoveries = read_events(run_dir, "recovery")
                launches = read_events(run_dir, "launch")
                downtime[mechanism][fault] = wall - reference
                in_run[mechanism][fault] = in_run_downtime(
                    recoveries, statistics.mean(clean[mechanism]["median_step_seconds"]))
                lost[mechanism][fault] = sum(r["lost_steps"] or 0 for r in recoveries)
                fsx_bytes_read[mechanism][fault] = sum(r.get("fsx_bytes_read") or 0 for r in recoveries)
                source[mechanism][fault] = ",".join(r["reload_source"] for r in recoveries) or None
                splits[mechanism][fault] = [{"mechanism": r["mechanism"], **{k: r[k] for k in SPLIT},
                                             "recovery_seconds": r["recovery_seconds"]} for r in recoveries]
                if mechanism in ("in_job_restart", "replica_group_heal"):
                    found = group_figures(mechanism, run_dir, statistics.mean(clean[mechanism]["median_step_seconds"]),
                                          ranks=4)
                    for key, value in found.items():
                        grouped[key].setdefault(mechanism, {})[fault] = value
                restarted = [e for e in launches if e.get("init_seconds") and e is not launches[0]]
                if restarted:
                    splits[mechanism][fault].append({"restart_init_seconds": restarted[-1]["init_seconds"]})
            log.info("%s: downtime %s", mechanism, downtime[mechanism])

        figures: dict = {"downtime_seconds": downtime, "in_run_downtime_seconds": in_run, "lost_steps": lost,
                         "reload_source": source, "clean_runs": clean, "splits": splits,
                         "fsx_bytes_read": fsx_bytes_read, **grouped}
        if args.merge and args.output.is_file():
            earlier = json.loads(args.output.read_text())
            for key in PER_MECHANISM:
                figures[key] = {**earlier.get(key, {}), **figures[key]}
            downtime, in_run = figures["downtime_seconds"], figures["in_run_downtime_seconds"]
            lost, source = figures["lost_steps"], figures["reload_source"]
            kept = {k: v for k, v in earlier.items() if k not in (*PER_MECHANISM, "command", "measured_at", "machine")}
            figures = {**kept, **figures,
                       "earlier_commands": [*earlier.get("earlier_commands", []), earlier.get("command")]}
        # Each mechanism's run length (a --merge may measure some with another --num-steps than the rest).
        figures["num_steps_by_mechanism"] = {**(earlier.get("num_steps_by_mechanism", {}) if args.merge and
                                                args.output.is_file() else {}),
                                             **{m: args.num_steps for m in args.mechanisms.split(",")}}
        memory = splits.get("ft_launcher_memory", {}).get("sigkill")
        if memory:
            figures["reinit_seconds"] = memory[0]["reinit_seconds"]
        throughput: dict[str, list[float]] = {name: [] for name in THROUGHPUT}
        for _ in range(args.throughput_samples):
            for name, flags in THROUGHPUT.items():
                _, run_dir = run(f"throughput/{name}", [*IN_JOB, *flags, "--checkpoint.interval_steps=1000"], None)
                throughput[name].append(_median_step_seconds(run_dir))
        if args.throughput_samples:
            off = statistics.median(throughput["off"])
            figures["memory_tier_throughput_ratio"] = off / statistics.median(throughput["node_memory_and_peer"])
            figures["node_memory_only_throughput_ratio"] = off / statistics.median(throughput["node_memory"])
            figures["throughput_median_step_seconds"] = throughput
        goals = goal_figures(downtime, args.heartbeat_timeout)
        heal, restart = (figures["rank_seconds_lost"].get(m, {}).get("sigkill")
                         for m in ("replica_group_heal", "in_job_restart"))
        if heal is not None and restart:
            goals["replica_group_heal/sigkill rank_seconds_lost over in_job_restart"] = heal / restart
        stall = figures["survivor_stall_seconds"].get("replica_group_heal", {}).get("sigkill")
        if stall is not None:
            step = statistics.mean(figures["clean_runs"]["replica_group_heal"]["median_step_seconds"])
            goals["replica_group_heal/sigkill survivor_stall over 2 steps"] = stall / (2 * step)
        figures["in_run_goal_ratios"] = goal_figures(in_run, args.heartbeat_timeout)
        figures.update({"goal_ratios": goals, "params_preset": args.preset,
                        "num_steps": figures.get("num_steps", args.num_steps) if args.merge else args.num_steps,
                        "fault_step": FAULT_STEP, "fsx_interval_steps": 4,
                        "heartbeat_timeout": args.heartbeat_timeout})
        write_results(args.output, figures, "bench/recovery.py")

        def cell(value, unit=" s"):
            return "n/a" if value is None else (f"{value:.1f}{unit}" if isinstance(value, float) else str(value))

        print("\n| mechanism | " + " | ".join(FAULTS) + " |\n|---|" + "---|" * len(FAULTS))
        for mechanism in downtime:
            print(f"| {mechanism} | " + " | ".join(
                f"{cell(downtime[mechanism].get(f))}, lost {cell(lost[mechanism].get(f))}, "
                f"{cell(source[mechanism].get(f))}" if f in downtime[mechanism] else "—" for f in FAULTS) + " |")
        for key, value in figures.items():
            if key in ("reinit_seconds", "memory_tier_throughput_ratio", "node_memory_only_throughput_ratio",
                       "throughput_median_step_seconds", "goal_ratios", "in_run_goal_ratios"):
                print(f"{key}: {value}")
        print(args.output)
        return 0
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
