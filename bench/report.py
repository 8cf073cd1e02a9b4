"""Writes bench/README.md, the one benchmark report, from bench/results/*.json and the planner.

    .venv/bin/python bench/report.py        # `make bench` runs every benchmark first, then this

Each section: how to run the benchmark, its definitions, its table against the goals (met / missed), and
what explains a miss. Then the planner (trainer.planning) for the seed's setting and at 128 and 1,024 nodes,
with its simulation, next to the published anchors.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from common import ROOT, machine  # noqa: E402  (bench/ is the script's folder)

from pipelines.plan import (PLOT_NODES, goodput_by_cluster_size, plot_goodput, replica_groups_pay_from,  # noqa: E402
                            restart_budget)
from report_control_plane import control_plane_section  # noqa: E402
from trainer.planning.goodput import CONFIGURATIONS, Costs, make_plan  # noqa: E402
from trainer.planning.scale import restart_world_seconds  # noqa: E402
from trainer.planning.simulate import FailureModel, simulate_many  # noqa: E402

RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "bench" / "README.md"

# The seed's setting: Llama-3.1-8B with FSDP2 on 2-8 x p5.48xlarge (8 x H100 each), FSx for Lustre SCRATCH_2.
# Until bench/gpu_check.sh runs on a GPU these are estimates, each with its reasoning:
SEED_COSTS = dict(
    # 8 nodes, seq 8192 x grad-accum 4 x 64 GPUs = 2.1 M tokens per step; 6 x 8 B x 2.1 M FLOPs at ~40 % of an
    # H100's 989 dense bf16 TFLOP/s per GPU.
    step_seconds=4.0,
    # State = fp32 weights (32 GB) + AdamW moments (64 GB) = 96 GB, 1.5 GB per GPU at 64 GPUs: a device-to-host
    # copy of ~0.1 s at ~20 GB/s pinned, plus DCP's planning and hand-off.
    checkpoint_stall_seconds=0.5,
    # 96 GB to a 1.2 TiB SCRATCH_2 file system at its baseline 200 MB/s per TiB (240 MB/s; bursts go to
    # 1.3 GB/s per TiB while credits last): the background write, and the same read back.
    checkpoint_background_seconds=400.0,
    fsx_reload_seconds=400.0,
    # Node memory: the same 1.5 GB per GPU copied to host memory each time (plus its hash); restoring it, or
    # fetching a peer's replica over EFA, takes seconds.
    memory_stall_seconds=0.2,
    memory_reload_seconds=5.0,
    # NVRx's published recovery times: in-process ~10 s, in-job (ft_launcher) ~17 s, job-level ~270 s on EKS.
    in_process_restart_seconds=10.0, restart_seconds=17.0, job_restart_seconds=270.0,
    # A lost node's replacement once its pod has a machine (bench/recovery.py, node_replacement: the new launcher,
    # rendezvous and the peer's transfer on CPU; a GPU node adds NCCL set-up), and the wait for that machine: a
    # warm spare's preemption and start (manifests/components/warm-spares).
    replacement_seconds=10.0, spare_wait_seconds=60.0,
)
NODE_MTBF_HOURS = round(2048 * 54 * 24 / 419)  # Llama 3: 419 unexpected interruptions, 54 days, 2,048 nodes
ANCHORS = [
    ("NVRx blog: async checkpointing keeps", "99.2–99.8 % of the step throughput (sync: 57–61 %)"),
    ("NVRx blog: recovery", "≈ 10 s in-process, ≈ 17 s in-job (ft_launcher), ≈ 270 s job-level"),
    ("SageMaker HyperPod", "95 % goodput on clusters of thousands of GPUs"),
    ("ByteRobust (ByteDance)", "97 % effective training time ratio at 9,600 GPUs"),
]


def load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def goal(value: float, target: float, at_least: bool = True) -> str:
    return "met" if (value >= target if at_least else value <= target) else "**missed**"


def when(results: dict) -> str:
    return f"{results['measured_at']}; " if results.get("measured_at") else ""


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows), ""]


def spread(d: dict) -> str:
    return f"{d['median']:.1%} ({d['min']:.1%}–{d['max']:.1%})"


def checkpoint_section(c: dict) -> list[str]:
    ratios = c["throughput_ratios"]
    none = c["throughput_steps_per_second"]["none"]["samples"]
    # Rounds whose no-checkpoint runs differ by > 10 % were disturbed: judge the goal on the least disturbed one.
    calm = max(range(len(none)), key=none.__getitem__)
    noisy = (max(none) - min(none)) / statistics.median(none) > 0.10
    async_ratio = ratios["async"]["samples"][calm] if noisy else c["throughput_ratio_async"]
    async_goal = (f"≥ 97 % — {goal(async_ratio, 0.97)}" + (f" (judged on the least disturbed round: {async_ratio:.1%})"
                                                             if noisy else ""))
    ours_ok = (c["loop_wait_async_seconds"] <= c["loop_wait_peer_seconds"]
               and c["throughput_async_over_peer"]["min"] >= 1.0)
    lines = [
        "## Checkpointing — `bench/checkpoint.py`", "",
        "```bash", ".venv/bin/python bench/checkpoint.py     # 101 M params, 2 CPU ranks (gloo), ~25 min", "```", "",
        f"The real trainer under torchrun, saving to the FSx tier every {c['interval_steps']} steps (node memory off), "
        f"in {c['samples']} alternating rounds of: no checkpointing, `checkpoint.mode=sync`, `checkpoint.mode=async` "
        "(ours: reused staging buffers, a writer thread on its own gloo group, manifest + fsync + rename commit), "
        "**peer** — what a team writes from the PyTorch docs (`bench/plain_dcp.py`: `dcp.async_save` with its thread "
        "executor on a gloo group of its own, waiting for the previous save's future first; no manifest, no fsync, "
        "no nice) — and ours with `checkpoint.async_executor=process` (DCP's writer process, state staged in shared "
        "memory; the default until this comparison).", "",
        "Definitions:",
        "- **loop wait per save**: everything the loop waits for in a save — the previous save still running, the "
        "barrier, staging and hand-off (sync: the whole write) — worst rank, median over the saves inside the "
        "throughput window. The hand-off alone is beside it (it was all we counted before).",
        "- **throughput ratio**: steps/s over the same window (after the second save) over the same round's "
        "no-checkpoint run; median and (min–max) over the rounds.",
        "- **loads** (`bench/checkpoint.py --load-only` measures them alone, ~3 min): every rank at once, the slowest "
        "rank, best of 3 — a raw sequential read of each rank's shard file (16 MB reads into one reused buffer, which "
        "stays in the CPU's cache; and into one buffer of the file's size, writing every byte to memory as a load "
        "must) against loading the checkpoint into the trainer's state: DCP's `FileSystemReader` and ours "
        "(`trainer/checkpoint/fast_reader.py`: the file mapped, items in offset order, one copy into each target, "
        "xxh3 of the same bytes on a thread — verification and load in one pass; and without verification), page "
        "cache warm and cold (files evicted with `posix_fadvise(DONTNEED)`). `load_over_raw_read` = raw read / "
        "load (1.0 = as fast as a plain read).", "",
        f"Result ({when(c)}`{c['command']}`):", "",
    ]
    lines += table(["measure", "value", "goal"], [
        ["params / state (params + AdamW, all ranks)", f"{c['params'] / 1e6:.1f} M / {c['state_bytes'] / 1e9:.2f} GB", ""],
        ["loop wait per save: sync", f"{c['loop_wait_sync_seconds']:.3f} s", ""],
        ["loop wait per save: async (ours) / hand-off alone", f"{c['loop_wait_async_seconds']:.3f} s / "
         f"{c['handoff_async_seconds']:.3f} s", ""],
        ["loop wait per save: async, process executor", f"{c['loop_wait_async_process_seconds']:.3f} s", ""],
        ["loop wait per save: peer (plain DCP async_save)", f"{c['loop_wait_peer_seconds']:.3f} s / "
         f"{c['handoff_peer_seconds']:.3f} s", ""],
        ["background write: async / peer", f"{c['background_async_seconds']:.2f} s / {c['background_peer_seconds']:.2f} s", ""],
        ["first async save in the background: thread / process executor (starts DCP's writer process)",
         f"{c['first_save_async_background_seconds']:.1f} s / {c['first_save_async_process_background_seconds']:.1f} s",
         "one-time"],
        ["warm memcpy of the state", f"{c['memcpy_seconds']:.3f} s", ""],
        ["async loop wait / memcpy", f"{c['loop_wait_async_over_memcpy']:.1f}×",
         f"≤ 1.5× — {goal(c['loop_wait_async_over_memcpy'], 1.5, False)}"],
        *([[f"staging a later save / memcpy: ours — DCP's DefaultStager ({c['stage_dtensors_per_rank']} DTensors "
            "a rank)", f"{c['stage_over_memcpy']:.2f}× — {c['dcp_default_stage_over_memcpy']:.2f}×", ""],
           ["the finite check, then staging / memcpy (what precedes the hand-off)",
            f"{c['check_then_stage_over_memcpy']:.2f}×", ""]]
          if "check_then_stage_over_memcpy" in c else []),
        ["async loop wait / sync loop wait", f"{c['loop_wait_async_over_sync']:.3f}",
         f"≤ 0.10 — {goal(c['loop_wait_async_over_sync'], 0.10, False)}"],
        ["throughput: sync", spread(ratios["sync"]), ""],
        ["throughput: async (ours)", spread(ratios["async"]), async_goal],
        ["throughput: async, process executor", spread(ratios["async_process"]), ""],
        ["throughput: peer", spread(ratios["peer"]), ""],
        ["throughput: ours / peer, round by round", spread(c["throughput_async_over_peer"]), ""],
        ["ours vs peer (loop wait, and throughput in every round)", "at least as good" if ours_ok else "worse",
         f"ours ≥ peer — {'met' if ours_ok else '**missed**'}"],
    ])
    lines += [
        "Figures as JSON: `bench/results/checkpoint.json`.", "",
        "What the figures say:",
        f"- **Noise.** The no-checkpoint runs took {', '.join(f'{v:.3f}' for v in none)} steps/s in the three rounds: "
        "while the first rounds ran, other work shared the machine, so ratios over them can exceed 100 %. Within a "
        "round the configurations ran back to back, so the round-by-round comparison (ours / peer) is the evidence "
        "for the ranking; the medians' absolute level is not.",
        f"- **Ours against the plain configuration.** Until this comparison ours wrote from DCP's background "
        f"process; measured side by side it kept *less* throughput than the plain thread-based `dcp.async_save` "
        f"(94.4 % vs 95.1 % median in the first comparison, `bench/results/checkpoint-process-default.json`) although its steady loop wait was lower (0.28 s vs "
        f"0.60 s). The cause: the process executor starts a new interpreter that imports torch at the first save "
        f"(its first save's background {c['first_save_async_process_background_seconds']:.1f} s, on the cores the "
        "ranks train on) and stages every save through shared memory that the writer process then reads. Writing "
        "from a thread instead (now the default) removes both; the plain configuration's remaining extra wait is "
        "its fresh CPU copy of the state at every save (ours reuses staging buffers) and no plan caching. Ours "
        "also commits (manifest with xxh3 hashes, fsync, rename), which the plain one does not.",
        f"- **Throughput below 97 %.** Writing {c['state_bytes'] / 1e9:.1f} GB into the page cache costs this "
        "virtual machine about 2.3 s of kernel CPU per 629 MB (it pays for every newly faulted page), wherever the "
        "write runs; the two ranks already keep both cores busy, so an asynchronous write can only move that work, "
        f"not remove it — at a save every {c['interval_steps']} steps ({c['interval_steps'] / c['throughput_steps_per_second']['none']['median']:.0f} s) "
        "it is a large share. On a GPU node the host CPUs are mostly idle during training, which is where async "
        "checkpointing earns NVRx's published 99 %; `bench/gpu_check.sh` measures it on a lent H200.",
        "- **Loop wait over memcpy** is the staging copy into the reused buffers plus DCP's hand-off (plan "
        "lookup, the writer's queue) and the save's barrier (the finite check's all-gather). DCP's "
        "`DefaultStager` reuses its buffers but deep-copies every DTensor's wrapper each save (about 0.5 ms each, "
        "through DTensor's dispatch); ours (`trainer/checkpoint/stager.py`) keeps the staged tree and copies only "
        "the local tensors (the probe times both on the same state, alternating). The finite check reads each "
        "tensor's min and max; checking each chunk of the copy while in the CPU's cache instead measured no "
        "faster here (0.38 s against 0.37 s, both ranks at once). **DCP load over a raw read** is DCP's per-item deserialisation in "
        "`FileSystemReader` (and its planning collectives); the project's own reader is measured below.", "",
    ]
    if "loads_warm_seconds" in c:
        warm, cold = c["loads_warm_seconds"], c["loads_cold_seconds"]
        lines += [f"Loads of one checkpoint ({c['load_bytes_per_rank'] / 1e6:.0f} MB per rank), seconds:", ""]
        lines += table(["", "raw read (16 MB buffer)", "raw read (whole-file buffer)", "DCP's reader", "ours, verified",
                        "ours, unverified"],
                       [[cache, *(f"{seconds[k]:.3f}" for k in ("raw_read", "raw_read_whole", "dcp_load", "load",
                                                                 "load_unverified"))]
                        for cache, seconds in (("warm", warm), ("cold", cold))])
        lines += table(["measure", "value", "goal"], [
            ["raw read / load, cold: ours (verified) — DCP's", f"{c['load_over_raw_read_cold']:.2f} — "
             f"{c['dcp_load_over_raw_read_cold']:.2f}", f"≥ 0.7 — {goal(c['load_over_raw_read_cold'], 0.7)}"],
            ["raw read / load, warm: ours (verified) — DCP's", f"{c['load_over_raw_read']:.2f} — "
             f"{c['dcp_load_over_raw_read']:.2f}", f"≥ 0.7 — {goal(c['load_over_raw_read'], 0.7)}"],
            ["whole-file raw read / load, warm: ours", f"{c['load_over_raw_read_whole']:.2f}", ""],
        ])
        lines += [
            "- **Cold** (what a restart on a new node meets) the load runs at the storage's speed: the reads are "
            "the cost, and ours issues them in file order with readahead and hashes the bytes it copies. **Warm**, "
            "the 16 MB raw read never leaves the CPU's cache; a load must write every byte of the state to memory "
            "(the whole-file raw read does too), and on top keeps DCP's planning (local plans, their exchange: "
            "~0.1 s per rank here, the price of resharding) and decodes ~600 items per rank. Profiled (one rank): "
            "the copies 0.16–0.19 s, planning and collectives ~0.1 s, decoding 0.05 s, hashing on its thread "
            "competes with the other rank for the second core. A Python garbage collection in the trainer's large "
            "heap used to cost 0.25 s of a load; loads now run with the collector paused.", ""]
    return lines


def node_loss_goals(r: dict) -> list[list[str]]:
    """Node loss with real nodes (2 launchers): replacing the lost node against restarting every node."""
    g, gi = r["goal_ratios"], r["in_run_goal_ratios"]
    key = "node_replacement/node_loss over whole_job_restart"
    if key not in g:
        return []
    lost = r["lost_steps"]["node_replacement"]["node_loss"]
    read = r["fsx_bytes_read"]["node_replacement"]["node_loss"]
    restart_read = r["fsx_bytes_read"]["whole_job_restart"]["node_loss"]
    return [["2 nodes, node lost: replacing it ≤ 0.25 × restarting every node", f"{g[key]:.2f}", f"{gi[key]:.2f}"],
            ["... with 0 lost steps (replica waited)", f"{lost} lost", ""],
            ["... reading 0 bytes from FSx", f"{read} B (the whole-job restart: {restart_read / 1e6:.0f} MB)", ""]]


def recovery_section(r: dict) -> list[str]:
    kinds = ["exception", "hang", "sigkill", "node_loss"]
    rows = []
    for mechanism, by_fault in r["downtime_seconds"].items():
        cells = []
        for fault in kinds:
            if fault not in by_fault:
                cells.append("")
                continue
            cells.append(f"{by_fault[fault]:.1f} / {r['in_run_downtime_seconds'][mechanism][fault]:.1f} s, "
                         f"{r['lost_steps'][mechanism][fault]} lost, {r['reload_source'][mechanism][fault]}")
        rows.append([mechanism, *cells])
    g, gi = r["goal_ratios"], r["in_run_goal_ratios"]
    return [
        "## Recovery — `bench/recovery.py`", "",
        "```bash", ".venv/bin/python bench/recovery.py     # 101 M params, 2 CPU ranks, ~30 min", "```", "",
        "**Downtime per fault** = wall time of a run with one fault − wall time of the same run without it, side by side "
        f"({r['num_steps']} steps, fault at step {r['fault_step']}, a synchronous FSx save every {r['fsx_interval_steps']} "
        f"steps, heartbeat timeout {r['heartbeat_timeout']:.0f} s); **in-run downtime** from the faulty run's own "
        "recovery events (fault → first step after the resume, less a normal step, plus the replayed steps), which "
        "the machine's noise does not blur (clean runs of one configuration differ by up to "
        f"{max(c['clean_spread_seconds'] for c in r['clean_runs'].values()):.1f} s).", "",
        f"Result ({when(r)}`{r['command']}`"
        + "".join(f"; earlier mechanisms: `{c}`" for c in r.get("earlier_commands", []) if c)
        + ") — wall difference / in-run, lost steps, reload source:", "",
        *table(["mechanism", *kinds], rows),
        *table(["goal", "wall difference", "in-run"], [
            ["SIGKILL, memory tier ≤ 0.35 × full relaunch", f"{g['ft_launcher_memory/sigkill over full_relaunch']:.2f}",
             f"{gi['ft_launcher_memory/sigkill over full_relaunch']:.2f}"],
            ["node loss via the peer ≤ 0.5 × full relaunch", f"{g['ft_launcher_memory/node_loss over full_relaunch']:.2f}",
             f"{gi['ft_launcher_memory/node_loss over full_relaunch']:.2f}"],
            ["hang ≤ heartbeat timeout + 3 s", f"+{g['ft_launcher_memory/hang minus heartbeat_timeout']:.1f} s",
             f"+{gi['ft_launcher_memory/hang minus heartbeat_timeout']:.1f} s"],
            ["re-init of an in-job restart ≤ 3 s", f"{r['reinit_seconds']:.2f} s", ""],
            ["memory tier every step ≥ 98 % of the throughput", f"{r['memory_tier_throughput_ratio']:.1%} (node memory + "
             f"peer), {r['node_memory_only_throughput_ratio']:.1%} (node memory only)", ""],
            *node_loss_goals(r),
        ]),
        "Where wall-difference figures miss while in-run ones meet: the clean runs' spread (above), and the restarted "
        "workers starting DCP's writer process again at their next FSx save. The memory tier's throughput on 2 shared "
        "cores: the copy, its hash and the replica's loopback transfer take CPU from the two ranks' compute; on a GPU "
        "node the copy is a device-to-host DMA and the transfer goes over EFA. Figures as JSON: "
        "`bench/results/recovery.json`.", "",
        *node_loss_notes(r),
        *replica_groups_notes(r),
    ]


def replica_groups_notes(r: dict) -> list[str]:
    """Issue 33's comparison: the same SIGKILL with one FSDP group of 4 ranks and with 2 replica groups of 2."""
    lost = r.get("rank_seconds_lost", {})
    heal, restart = lost.get("replica_group_heal", {}).get("sigkill"), lost.get("in_job_restart", {}).get("sigkill")
    if heal is None or restart is None:
        return []
    stall = r["survivor_stall_seconds"]["replica_group_heal"]["sigkill"]
    step = sum(r["clean_runs"]["replica_group_heal"]["median_step_seconds"]) / 2
    steps = r.get("num_steps_by_mechanism", {}).get("replica_group_heal", r["num_steps"])
    return [
        f"**Replica groups** (`in_job_restart`, `replica_group_heal`; {steps} steps): 2 nodes × 2 ranks, node memory "
        "every step, the same SIGKILL of rank 3 after step 6. One FSDP group of 4: ft_launcher restarts every worker. "
        "Two replica groups of 2 (HSDP with torchft): group 1 restarts and heals from group 0, which trains on "
        "alone meanwhile. *Rank-seconds lost* = ranks × seconds not training: all 4 ranks' in-run downtime for the "
        "restart; group 1's 2 ranks from the fault to their first step after the heal, plus group 0's 2 ranks' stall, "
        "for the heal.", "",
        *table(["figure", "in-job restart (R = 1)", "replica-group heal (R = 2)", "goal"], [
            ["rank-seconds lost per fault", f"{restart:.1f}", f"{heal:.1f}",
             f"heal ≤ 0.5 × restart: {heal / restart:.2f} ({'met' if heal <= 0.5 * restart else 'missed'})"],
            ["survivors' stall", "—", f"{stall:.1f} s (a step: {step:.1f} s)",
             f"≤ 2 steps: {stall / (2 * step):.2f} × 2 steps ({'met' if stall <= 2 * step else 'missed'})"],
            ["heal", "—", f"{r['heal_seconds']['replica_group_heal']['sigkill']:.2f} s, "
                          f"{r['heal_bytes']['replica_group_heal']['sigkill'] / 1e6:.0f} MB (every rank's)", ""],
        ]),
        "Why the heal misses 0.5 here: with half the ranks restarting its best is 0.5 plus the survivors' stall, and "
        f"group 1's own downtime ({r['in_run_downtime_seconds']['replica_group_heal']['sigkill']:.1f} s in-run) is "
        f"longer than the in-job restart's ({r['in_run_downtime_seconds']['in_job_restart']['sigkill']:.1f} s): it "
        "restarts on 2 cores that group 0 keeps busy training (its process-group phase took "
        f"{_init(r, 'replica_group_heal', 'process_group'):.2f} s against {_init(r, 'in_job_restart', 'process_group'):.2f} s),"
        " it reads its node memory and then the live state (the heal, over torchft's HTTP transport on loopback), "
        "and it joins at the survivors' next step boundary. On a cluster the groups run on their own nodes, and the "
        "in-job restart re-initialises every rank's world while the group's covers N / R nodes (the planner's "
        "trainer/planning/scale.py, below).", "",
    ]


def _init(r: dict, mechanism: str, phase: str) -> float:
    """A restarted attempt's start-up phase, as the bench recorded it (its launch record's init_seconds)."""
    return next((s["restart_init_seconds"][phase] for s in r["splits"][mechanism]["sigkill"]
                 if "restart_init_seconds" in s), float("nan"))


def node_loss_notes(r: dict) -> list[str]:
    splits = r.get("splits", {})
    if "node_replacement" not in splits or "whole_job_restart" not in splits:
        return []
    replaced, restarted = splits["node_replacement"]["node_loss"][0], splits["whole_job_restart"]["node_loss"][0]

    def phases(s: dict) -> str:
        return (f"fault → new workers {s['detect_and_teardown_seconds']:.1f} s, their start {s['reinit_seconds']:.1f} s, "
                f"reload {s['reload_seconds']:.1f} s, first step {s['first_step_seconds']:.1f} s")

    return [
        "**Node loss with real nodes** (`whole_job_restart`, `node_replacement`): 2 nodes of one rank each, a launcher "
        "per node, node memory every step with its replica waited; the drill kills node 1's launcher and workers and "
        "wipes its memory (docs/node-loss.md). Replacing the node: "
        f"{phases(replaced)}; the survivor kept its launcher and memory, the newcomer received its state from the "
        "replica, nothing was read from FSx. Restarting every node: "
        f"{phases(restarted)}, then the 2 steps since the last FSx save again. Most of a replacement here is the new "
        "launcher's Python start on 2 shared cores (torch imports in the launcher and its fork server); its dead "
        "predecessor no longer holds up the rendezvous for NVRx's 15 s keep-alive (nvrx_compat."
        "evict_predecessors_from_rendezvous: ~14 s of 15 s before). On EKS the whole-job restart also waits for the "
        "gang to be rescheduled (the planner's job_restart_seconds, 270 s) and both wait for a machine for the lost "
        "node (spare_wait_seconds).", "",
    ]


def goodput_section(g: dict) -> list[str]:
    names = [n for n in g if isinstance(g[n], dict) and "goodput" in g[n]]
    rows = [[n, f"**{g[n]['goodput']:.1%}**", f"{g[n]['predicted']['goodput']:.1%}", f"{g[n]['window_goodput']:.1%}",
             str(g[n]["lost_steps"]), str(g[n]["faults"]), ", ".join(f"{k} {v}" for k, v in g[n]["recoveries_by_mechanism"].items())]
            for n in names]
    categories = list(g[names[0]]["badput"])
    badput = [[n, *(f"{g[n]['badput'][c]:.1%}" for c in categories)] for n in names]
    lines = [
        "## Goodput — `bench/goodput.py`", "",
        "```bash", ".venv/bin/python bench/goodput.py      # tiny model, 2 CPU ranks, ~15 min", "```", "",
        f"One seeded fault schedule (exceptions and SIGKILLs), given to every configuration: {g['schedule']}. "
        f"{g['steps']} steps, FSx save every {g['interval_steps']} steps. The configurations carry the planner's names.", "",
        "**Goodput (the headline)** = productive seconds / the job's whole wall time, launch to the end of the last "
        "save; productive = the kept steps' compute less their data wait (a replayed step counts once). *Window* "
        "goodput divides by the steps' window only (first step's start to last step's end). *Predicted*: the "
        "simulator (`trainer.planning.simulate`, trace mode) fed with the costs each run measured "
        "(`trainer.planning.measured`) and the same faults at the same steps.", "",
        f"Result ({when(g)}`{g['command']}`):", "",
        *table(["configuration", "goodput", "predicted", "window goodput", "lost steps", "faults", "recoveries"], rows),
        f"**Calibration gap** (largest |predicted − measured|): **{g['calibration_gap_points']:.1f} points** — goal ≤ 5: "
        f"{goal(g['calibration_gap_points'], 5.0, False)}. Same final loss in every configuration: {g['same_final_loss']}.", "",
        "Badput by category (fraction of the job's wall time; Google's ml-goodput-measurement taxonomy):", "",
        *table(["configuration", *categories], badput),
        "Every restart, with the fault that caused it:", "",
    ]
    for n in names:
        lines += [f"- {n}: " + "; ".join(g[n]["recoveries"])]
    costs = {n: g[n]["predicted"]["costs"] for n in names}
    in_process = next((c["in_process_restart_seconds"] for c in costs.values() if "in_process_restart_seconds" in c), None)
    in_job = [c["restart_seconds"] for c in costs.values() if "restart_seconds" in c]
    lines += ["", "What the figures say:",
              "- Every restart is explained by its fault (the recovery record names the fault's key; a restart without "
              "one would be listed as such). The earlier run's 7 recoveries for 6 faults (async, in-process, with "
              "DCP's writer *process*, one more ft_launcher restart than SIGKILLs) did not recur with the thread "
              "writer now the default; that run's logs are gone, so its cause is not established.",
              "- The node-memory tier removes the wasted progress (0 steps replayed): each restart resumes from the step "
              "the fault struck, where FSx alone replays up to an interval."]
    if in_process is not None and in_job:
        lines += [f"- In-process restart is *slower* here than an in-job restart ({in_process:.1f} s vs "
                  f"{min(in_job):.1f}–{max(in_job):.1f} s of detection and re-initialisation): on gloo only the "
                  "collective timeout (`resilience.collective_timeout`, 3 s here) tells the healthy rank that its peer "
                  "failed, while ft_launcher sees a process exit at once and its warm fork server restarts workers in "
                  "about a second. NVRx's in-process path pays off on NCCL, where a failed peer is detected and aborted "
                  "faster than processes restart; on this machine the planner, fed these costs, ranks it accordingly."]
    lines += ["- The first calibration run missed by 4.6 points on async+ft_launcher: the simulator dropped a save "
              "in flight at every fault, but after an exception the trainer finishes its write before the process "
              "exits (`trainer/job/cli.py`), so the run lost nothing where the simulation lost 10 steps. Modelled in both "
              "planner and simulator (a unit test pins it), the gap fell to the figure above.",
              "", "Figures as JSON: `bench/results/goodput.json`.", ""]
    return lines


def staging_section(s: dict) -> list[str]:
    return [
        "## Staging — `bench/staging.py`", "",
        "```bash", ".venv/bin/python bench/staging.py      # 48 x 4 MiB + 2 x 48 MiB objects, ~4 min", "```", "",
        "Copy mode (parallel objects, ranged parts, size + checksum verification) against a sequential `download_file` "
        "per object from the S3 server on loopback, alternating, best of 3 — also through a proxy holding each request "
        "20 ms (S3's typical time to first byte). Re-stage: the whole stage step on unchanged data over the first.", "",
        *table(["measure", "value", "goal"], [
            ["objects / bytes", f"{s['objects']} / {s['bytes'] / 2**20:.0f} MiB", ""],
            ["copy vs sequential, +20 ms per request", f"{s['speedup_vs_sequential']:.2f}×",
             f"≥ 2× — {goal(s['speedup_vs_sequential'], 2.0)}"],
            ["copy vs sequential, loopback", f"{s['loopback_speedup_vs_sequential']:.2f}×", ""],
            ["unchanged re-stage / full stage", f"{s['restage_fraction']:.1%}", f"≤ 5 % — {goal(s['restage_fraction'], 0.05, False)}"],
        ]),
    ]


def data_section(d: dict) -> list[str]:
    runs, cores = d["runs"], d["cores"]
    small, large = d["corpus_megabytes"]
    rows = [[name.replace("_", " "), f"{r['mb_per_second']:.1f}", f"{r['mb_per_second_per_core']:.1f}",
             f"{r['peak_rss_tree_mb']:.0f}"] for name, r in runs.items()]
    return [
        "## Tokenization — `bench/data.py`", "",
        "```bash", ".venv/bin/python bench/data.py      # 40 MB and 160 MB JSONL corpora, byte and BPE, ~3 min", "```", "",
        "`trainer/data/shards.py::tokenize_files` on demo-document JSONL corpora of "
        f"{small:.0f} MB and {large:.0f} MB (1× and 4×), each measurement in a fresh process: the implementation "
        "before streaming (every document in memory, the HF byte tokenizer) as the baseline, the streaming one "
        "with 1 worker and one per core, a BPE tokenizer.json (8,192 tokens, trained here) against the tokenizers "
        "library's own `encode_batch` over the same documents already in memory. MB/s counts the corpus on disk; "
        "peak RSS includes the worker pool.", "",
        *table(["run", "MB/s", "MB/s per core", "peak RSS MB"], rows),
        *table(["measure", "value", "goal"], [
            ["byte tokenizer, MB/s per core (1 worker, 4× corpus)", f"{d['byte_mb_per_second_per_core']:.1f}",
             f"≥ 50 — {goal(d['byte_mb_per_second_per_core'], 50)}"],
            ["over the previous implementation", f"{d['byte_speedup_over_previous']:.1f}×", ""],
            [f"{cores} workers over 1", f"{d['byte_parallel_speedup']:.2f}×", ""],
            ["peak RSS, 4× corpus / 1×: streaming — previous", f"{d['byte_peak_rss_4x_over_1x']:.2f} — "
             f"{d['previous_peak_rss_4x_over_1x']:.2f}", f"independent of the corpus — "
             f"{goal(1.25, d['byte_peak_rss_4x_over_1x'])}"],
            ["BPE: ours / the library's batch", f"{d['bpe_over_library_batch']:.2f}", f"≥ 0.95 — "
             f"{goal(d['bpe_over_library_batch'], 0.95)}"],
            ["shards byte-identical to the previous implementation's", str(d["shards_identical_to_previous"]), "True"],
        ]),
        f"On {cores} cores shared with the parent (which appends the workers' outputs in order) a second worker "
        "adds little; the fan-out across pods is KFP's business (`dsl.ParallelFor`, not built yet: see the issue's "
        "closing note).", "",
    ]


def startup_section(s: dict) -> list[str]:
    rows = []
    for world, r in s["world_sizes"].items():
        first = r["seconds_to_first_step"]
        rows.append([world, *(f"{r['read_over_model_size'][p]:.2f}" for p in ("today", "new")),
                     *(f"{r['peak_rss_over_shard'][p]:.2f}" for p in ("today", "new")),
                     *(f"{first[p]:.1f}" if p in first else "n/a" for p in ("today", "new"))])
    worst_read = max(r["read_over_model_size"]["new"] for r in s["world_sizes"].values())
    return [
        "## Start-up from a base model — `bench/startup.py`", "",
        "```bash", ".venv/bin/python bench/startup.py      # 101 M parameters at 1, 2 and 4 ranks, ~10 min", "```", "",
        f"{when(s)}A base model of the `{s['preset']}` preset's shape ({s['weights_bytes'] / 1e6:.0f} MB of bf16 "
        "safetensors) loaded at a start: today's path (commit 836d549: every rank `from_pretrained` in fp32, then "
        "FSDP2 keeps its shard) against the new one (`trainer/model/base.py`: a meta build, sharded, each rank reading "
        "its rows through DCP's Hugging Face reader). *Read / model*: what the storage served every rank "
        "(`/proc/<pid>/io` read_bytes), each rank reading in turn from a cold page cache as one rank per node would, "
        "summed, over the files' size. *Peak RSS / shard*: the largest rank's peak RSS over what it held before the "
        "load, over its shard's fp32 bytes. *First step*: the trainer under torchrun, launch to the first step's "
        "metrics line (imports included).", "",
        *table(["ranks", "read / model: today", "new", "peak RSS / shard: today", "new", "first step s: today", "new"],
               rows),
        *table(["goal", "value", ""], [
            ["bytes read at a start ≤ 1.1 × the model (new, any world size)", f"{worst_read:.2f}",
             goal(worst_read, 1.1, at_least=False)]]),
        "The trainer runs read from this machine's warm page cache, so their seconds are each path's CPU cost (here "
        "about equal: a 101 M model on 2 cores), not the file system's. The reads are what a cluster pays: for "
        "Llama-3.1-8B on 16 nodes at the prod config's 240 MB/s, today's path reads the 16 GB of weights once per "
        "node (257 GB, ~1,070 s, past the first heartbeat) and the new one once for the job (16 GB, ~67 s).", "",
    ]


def evaluate_section(e: dict) -> list[str]:
    rows = []
    for world, r in e["world_sizes"].items():
        v, ev, ex = r["validate"], r["evaluate"], r["export"]
        rows.append([world, f"{r['model_bytes_fp32'] / 1e6:.0f}",
                     f"{v['today']['peak_rss_over_model']:.2f}", f"{v['new']['peak_rss_over_model']:.2f}",
                     f"{ev['today']['peak_rss_over_model']:.2f}", f"{ev['new']['peak_rss_over_model']:.2f}",
                     f"{max(ev['new']['rank_peak_rss_over_shard']):.2f}", f"{ev['new']['gate_peak_rss_over_model']:.2f}",
                     f"{ex['today']['peak_rss_over_model']:.2f}",
                     f"{ex['today']['bytes_through_tracking_server'] / 1e6:.0f} MB",
                     f"{ex['new']['bytes_through_tracking_server']} B"])
    seconds = []
    for world, r in e["world_sizes"].items():
        v, ev, ex = r["validate"], r["evaluate"], r["export"]
        seconds.append([world, f"{v['today']['seconds']:.1f}", f"{v['new']['seconds']:.1f}",
                        f"{ev['today']['seconds']:.1f}", f"{ev['new']['seconds_final_evaluation']:.1f}",
                        f"{ev['new']['seconds_candidate_heldout_and_tasks']:.1f}", f"{ev['new']['gate_seconds']:.1f}",
                        f"{ex['today']['seconds']:.1f}", f"{ex['new']['seconds']:.1f}"])
    worst_gate = max(r["evaluate"]["new"]["gate_peak_rss_over_model"] for r in e["world_sizes"].values())
    worst_validate = max(r["validate"]["new"]["peak_rss_over_model"] for r in e["world_sizes"].values())
    through = max(r["export"]["new"]["bytes_through_tracking_server"] for r in e["world_sizes"].values())
    over_shard = max(growth - growth / ratio for r in e["world_sizes"].values()  # a rank's growth beyond its shard
                     for growth, ratio in zip(r["evaluate"]["new"]["rank_peak_rss_growth_bytes"],
                                              r["evaluate"]["new"]["rank_peak_rss_over_shard"]))
    return [
        "## Validation, evaluation and export — `bench/evaluate.py`", "",
        "```bash", ".venv/bin/python bench/evaluate.py      # 101 M parameters at 1 and 2 ranks, ~10 min", "```", "",
        f"{when(e)}A model of the `{e['preset']}` preset's shape trained one step by the trainer, twice per world size "
        "(the second run's champion: the first's export), against a real MLflow tracking server on loopback. Today's "
        "path (commit f605da9): validate and evaluate load the model into one process (fp32, full logits), the champion "
        "downloaded through the tracking server; the export written by one process and uploaded through the tracking "
        "server. The new one: validate streams the checkpoint; the training's ranks evaluate, export (each rank its "
        "part, to S3) and read the champion from its export; the gate registers the export's URI. *Peak RSS / model*: "
        "a process's peak RSS over what it held after its imports, over the model's fp32 bytes (the ranks: the "
        "largest rank's growth during the final evaluation; *rank / shard*: over its own shard).", "",
        *table(["ranks", "model MB", "validate: today", "new", "evaluate: today", "new ranks", "new rank / shard",
                "gate", "export: today", "through MLflow: today", "new"], rows),
        *table(["ranks", "validate s: today", "new", "evaluate s: today (candidate + champion)",
                "new: whole final evaluation", "new: held-out + tasks", "gate", "export s: today", "new"], seconds),
        *table(["goal", "value", ""], [
            ["the gate's peak RSS independent of the model (< 0.5 x a 101 M model)", f"{worst_gate:.2f}",
             goal(worst_gate, 0.5, at_least=False)],
            ["validation's peak RSS < 0.5 x the model", f"{worst_validate:.2f}",
             goal(worst_validate, 0.5, at_least=False)],
            ["model bytes through the tracking server", f"{through} B", goal(through, 0, at_least=False)],
            ["a rank's peak RSS growth in the final evaluation ≤ its shard + 128 MB", f"shard + {over_shard / 1e6:.0f} MB",
             goal(over_shard, 128e6, at_least=False)]]),
        "The new final evaluation's seconds include the champion's load and evaluation, the generations and the "
        "export; today's evaluate seconds the candidate's and the champion's loads and evaluations (no export). On 2 "
        "CPU cores every forward of the sharded model is a round of gloo all-gathers, so the final evaluation's "
        "many small forwards (tasks, token-by-token generation) cost more here than one process's would; on GPUs "
        "they are NCCL all-gathers of bf16 layers. A rank's growth beyond its shard at 2 ranks (one layer gathered, "
        "a batch's activations, a logits chunk, the allocator's slack) is not yet explained to the last 100 MB.", "",
    ]


def pipeline_steps_section(p: dict) -> list[str]:
    lines = [
        "## Pipeline steps — `bench/pipeline_steps.py`", "",
        "```bash", ".venv/bin/python bench/pipeline_steps.py --summary work/fsx/runs/<run>/summary.json   # ~1 min",
        "```", "",
        "Where the local pipeline's time outside the training job goes (`summary.json`: `outside_job_seconds` = "
        "`pipeline_wall_seconds` − the job's wall time; `step_seconds` as the console prints them). Each part is "
        "measured in fresh processes: KFP's local runner per task (a chain of trivial components), importing each "
        "step's module, MLflow's client and its sqlite store (every step that writes to MLflow pays both), an "
        "interpreter's teardown.", "",
        *table(["part", "seconds"], [
            ["KFP local runner, per task", f"{p['kfp_task_seconds']:.2f}"],
            ["MLflow client import / sqlite store open", f"{p['mlflow_import_seconds']:.2f} / "
             f"{p['mlflow_sqlite_store_seconds']:.2f}"],
            ["interpreter teardown (torch, transformers, MLflow loaded)", f"{p['exit_seconds']:.2f}"],
            *[[f"import: {step}", f"{seconds:.2f}"] for step, seconds in p["import_seconds"].items()],
        ]),
    ]
    if "steps" in p:
        split = p["outside_job_split"]
        lines += [f"The run `{p['summary']}`: {p['outside_job_seconds']:.1f} s outside the training job "
                  f"(goal ≤ 15 s — {goal(15, p['outside_job_seconds'])}), of which KFP's runner "
                  f"{split['kfp_runner']:.1f} s ({p['kfp_runner_share_of_outside_job']:.0%}), imports "
                  f"{split['imports']:.1f} s, MLflow client and store {split['mlflow']:.1f} s, the rest (the steps' "
                  f"work, teardown) {split['rest']:.1f} s.", ""]
        lines += table(["step", "wall", "KFP runner", "imports", "MLflow", "rest"],
                       [[step, *(f"{v.get(k, 0.0):.1f}" for k in ("wall", "kfp_runner", "imports", "mlflow", "rest"))]
                        for step, v in p["steps"].items()])
    return lines


def straggler_section(s: dict) -> list[str]:
    drills = s["drills"]
    return [
        "## Straggler detection — `bench/straggler.py`", "",
        "```bash", ".venv/bin/python bench/straggler.py   # ~8 min", "```", "",
        f"Per round on 2 CPU ranks ({s['steps']} steps, a report every {s['interval_steps']} steps): a clean run "
        "without detection, the same with it (its reports: a straggler named there is a false positive), and a "
        f"`straggler@STEP:rank=1` drill ({s['factor']:g}x slower), STEP moving through the interval from round to "
        "round. Latency: from the fault's step to the first report naming rank 1.", "",
        *table(["measure", "value", "goal"], [
            ["false positives (clean reports)", f"{s['false_positives']} ({s['clean_reports']})",
             goal(0, s["false_positives"])],
            ["lowest relative step score in a clean run", f"{s['lowest_clean_step_score']:.2f}"
             if s["lowest_clean_step_score"] is not None else "n/a", "≥ 0.75"],
            ["drills detected", f"{s['detected']} / {len(drills)}", goal(s["detected"], len(drills))],
            ["latency, at most (intervals)", f"{s['max_latency_intervals']:.1f}"
             if s["max_latency_intervals"] is not None else "n/a",
             goal(2, s["max_latency_intervals"]) if s["max_latency_intervals"] is not None else "n/a"],
            ["step time with detection / without", f"{s['step_time_ratio_on_over_off']:.3f}", ""],
        ]),
        *table(["fault at step", "first named at", "latency (steps)", "score"],
               [[str(d["fault_step"]), str(d["first_named_at"]), str(d["latency_steps"]),
                 f"{d['score']:.2f}" if d["score"] is not None else "n/a"] for d in drills]),
    ]


def numeric_faults_section(n: dict) -> list[str]:
    drills = n["drills"]
    fingerprints = n["step_time_fingerprints_every_100_over_none"]
    return [
        "## Numeric faults — `bench/numeric_faults.py`", "",
        "```bash", ".venv/bin/python bench/numeric_faults.py   # ~11 min", "```", "",
        f"The demo's tiny model on 2 CPU ranks ({n['steps']} steps, each drill at step {n['fault_step']}; bitflip with "
        "R = 2 replica groups of one node of 2 ranks each, fingerprints every 10 steps), against a clean run of the "
        "same shape. Detection: the numeric_anomaly or sdc_found event's step minus the drill's. Steps lost: applied "
        "steps rolled back (node memory holds the step before a NaN or a spike, whose own step is never applied; "
        "a flipped parameter goes back to the last step whose fingerprints agreed). The "
        "cost: runs with the checks on and off, alternating, "
        f"{n['rounds']} rounds; the fingerprints' cost at the default cadence (every 100 steps) is the extra "
        "measured at every 10 steps, scaled by 10 / 100. docs/numeric-faults.md describes the mechanism.", "",
        *table(["drill", "detected after (steps)", "steps lost", "samples skipped", "held-out loss / clean"],
               [[name, str(d["detected_after_steps"]), str(d["steps_lost"]), str(d["samples_skipped"]),
                 f"{d['heldout_loss_over_clean']:.3f}"] for name, d in drills.items()]),
        *table(["cost", "value", "goal"], [
            ["step time, numeric checks on / off (R = 1)", f"{n['step_time_checks_on_over_off']:.3f} "
             f"(rounds {', '.join(f'{r:.3f}' for r in n['step_time_checks_on_over_off_rounds'])})",
             goal(n["step_time_checks_on_over_off"], 1.01, at_least=False)],
            ["step time, fingerprints every 100 steps / none (R = 2)", f"{fingerprints:.4f}",
             goal(fingerprints, 1.01, at_least=False)],
        ]),
        "Figures as JSON: `bench/results/numeric_faults.json`.", "",
    ]


def gpu_check_section(g: dict | None) -> list[str]:
    lines = ["## GPU check — `bench/gpu_check.sh`", "",
             "For a lent H200 (at most 8 minutes, one JSON document): MFU and memory of the llama3-1b preset at "
             "sequence length 8,192 with compile off and on and selective against full checkpointing; the node-memory "
             "copy after every step; a SIGKILL restart under ft_launcher on NCCL; a NaN drill.", ""]
    if g is None:
        return lines + ["Not yet run.", ""]
    runs, summary = g["runs"], g["summary"]
    perf = [[name, f"{run['median_tokens_per_second']:,.0f}", f"{run['median_tflops_per_gpu']:.0f}",
             f"{run['median_mfu']:.1%}", f"{run['median_cuda_max_allocated_gib']:.1f}",
             f"{run['median_cuda_max_reserved_gib']:.1f}", str(run["cuda_alloc_retries"])]
            for name, run in runs.items() if name.startswith("perf") or name == "memcopy"]
    lines += [f"{when(g)}{g['device']}, torch {g['torch']}, NVRx {g['nvidia_resiliency_ext']}; {g['preset']}, sequence "
              f"length {g['seq_len']}, batch 2, 1 GPU, medians after 4 steps. {g['how']}", "",
              *table(["run", "tokens/s", "TFLOP/s per GPU", "MFU", "max allocated (GiB)", "max reserved (GiB)",
                      "allocator retries"], perf),
              f"- compile: {summary['compile_speedup']:.2f} x the eager tokens/s; selective (op) checkpointing "
              f"{summary['selective_over_full_tokens']:.2f} x full's tokens/s at "
              f"{summary['selective_over_full_memory']:.2f} x its peak allocation.",
              f"- Compare: torchtitan reports 33-39 % MFU for Llama 3.1 8B with 1-D FSDP on 8 and 128 H100s "
              "(docs/performance.md: 5,762 tokens/s per GPU, 6,667 compiled, local batch 2, selective checkpointing). "
              "This is one GPU with no communication, a smaller model and 141 GB: an upper bound for our step, not a "
              "like-for-like figure; the CPU figures (`bench/overhead.py`) measure the resilience's own cost.",
              f"- Node-memory copy after every step (memcopy, the whole 12 GB state of 1B on one GPU every 0.38 s "
              f"step): the step's wall time is {summary['node_memory_copy_every_step_wall_ratio']:.1f} x eager's: the "
              "host writes and hashes ~5 GB/s, so a copy of 12 GB cannot keep up with the step (the 3 % goal is not "
              "met at this shape). The copy now skips a step rather than wait while the last one is being written "
              "(measured on the CPU, not yet on a GPU); at the job we are judged by (8B over 128 GPUs: 0.75 GB per "
              "rank every ~4 s step) the host has ~40 x the time it needs.", ""]
    for recovery in runs.get("restart", {}).get("recoveries", []):
        lines += [f"SIGKILL under ft_launcher on NCCL: {recovery['cause']}; reloaded step {recovery['reloaded_step']} "
                  f"from {recovery['reload_source']}, {recovery['lost_steps']} step(s) lost (the copy of the killed step "
                  f"was in flight), recovered in {recovery['recovery_seconds']:.1f} s (re-init "
                  f"{recovery['reinit_seconds']:.1f} s, reload {recovery['reload_seconds']:.2f} s).", ""]
    numeric = runs.get("nan", {}).get("numeric", [])
    if numeric:
        lines += ["NaN drill on NCCL: " + ", then ".join(f"{e['event']}" + (f" at step {e['step']}" if e.get("step") else "")
                                                    for e in numeric) + ".", ""]
    return lines + ["Figures as JSON: `bench/results/gpu_check.json` (the earlier smoke run of issue 43: "
                    "`bench/results/gpu_smoke.json`).", ""]


def overhead_section(o: dict) -> list[str]:
    def chosen(p: dict, variant: str) -> str:
        return "/".join(str(r["memory_interval_steps"].get(variant, "-")) for r in p["rounds"])

    rows = [[preset, f"{p['throughput_over_bare']:.3f}", " / ".join(f"{r:.3f}" for r in p["throughput_over_bare_rounds"]),
             chosen(p, "trainer"), f"{p['fleet_mtbf_over_bare']:.3f}", chosen(p, "trainer_fleet_mtbf"),
             f"{p['memory_every_step_over_bare']:.3f}", f"{p['trainer_no_memory_copy_over_bare']:.3f}",
             f"{p['node_memory_copy_share']:.1%}"] for preset, p in o["presets"].items()]
    return ["## Overhead — `bench/overhead.py`", "",
            "```bash", ".venv/bin/python bench/overhead.py   # ~20 min", "```", "",
            f"{when(o)}The full trainer (the local config's resilience: async checkpoints, the node-memory copy at the "
            "planner's interval (`checkpoint.memory_interval_steps=auto`) and its peer replica, straggler detection, "
            "numeric checks, heartbeats) against a bare FSDP2 loop on the same model and data, 2 ranks, "
            + ", ".join(f"{preset} {steps} steps ({len(o['presets'][preset]['rounds'])} round(s))"
                        for preset, steps in o["steps"].items() if preset in o["presets"])
            + f": the mean wall time per step after {o['warmup_steps']} (the warm-up and the planner's probe), "
            "alternating rounds. The local config's fleet fails a node every 3 minutes (the demo's "
            "`auto_node_mtbf_hours: 0.05`); Llama 3's fleet is the config's default (6,335 h).", "",
            *table(["preset", "trainer / bare (goal >= 0.97)", "rounds", "interval chosen",
                    "Llama 3's fleet / bare", "interval chosen", "copy every step / bare", "no copy / bare",
                    "copy's share (every step)"], rows),
            f"Goal {goal(o['throughput_over_bare'], 0.97)} at the demo's fault rate"
            + "".join(f" ({preset}'s rounds spread {max(r) - min(r):.2f}: this machine's noise that day, more than "
                      "the 3 % the goal is about, so the figure cannot settle it)"
                      for preset, p in o["presets"].items()
                      for r in [p["throughput_over_bare_rounds"]] if max(r) - min(r) > 0.06)
            + ". The planner copies as often as "
            "the faults the copies serve make worth their cost (its probe measures the cost in each launch: "
            "`memory_interval_chosen` events); on this 2-core machine both ranks keep both cores busy, so every byte "
            "the node-memory tier moves (the copy, its hash, the peer's replica) is taken from training. On a GPU node "
            "that work runs on idle host cores beside the GPU's step (`bench/gpu_check.sh`).", "",
            "Figures as JSON: `bench/results/overhead.json`.", ""]


def planner_section() -> list[str]:
    lines = [
        "## Planner — `python -m pipelines plan`", "",
        "The seed's setting: Llama-3.1-8B, FSDP2 on p5.48xlarge nodes, FSx for Lustre SCRATCH_2. Until a GPU run "
        "measures them (`bench/gpu_check.sh`, then `python -m pipelines plan --run-id ...`), the costs are estimates "
        "(their reasoning is in `bench/report.py`): " + ", ".join(f"{k} {v:g}" for k, v in SEED_COSTS.items())
        + f"; node MTBF {NODE_MTBF_HOURS} h (Llama 3's fleet: 419 unexpected interruptions in 54 days on 2,048 "
        "nodes); fault mix exception 15 %, process 40 %, node 40 %, rack 5 %. Expected goodput is the closed form "
        "(first order, Young/Daly intervals corrected for the background write); *simulated* is the mean of 10 "
        "seeded 30-day jobs at those intervals (exponential failures), and *Weibull* the same with a heavy tail "
        "(shape 0.7, same mean: early failures of new nodes).", "",
    ]
    for nodes in (2, 8, 128, 1024):
        costs = Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)
        plan = make_plan(costs)
        rows = []
        by_name = {c.name: c for c in CONFIGURATIONS}
        for config in plan.configurations:
            intervals = {t: c["interval_seconds"] for t, c in config["tiers"].items()}
            sim = simulate_many(costs, by_name[config["name"]], intervals, 30 * 86400, seeds=10)
            heavy = simulate_many(costs, by_name[config["name"]], intervals, 30 * 86400, seeds=10,
                                  failures=FailureModel("weibull", 0.7))
            fsx = config["tiers"].get("fsx") or config["tiers"]["fsx_sync"]
            memory = config["tiers"].get("memory")
            rows.append([config["name"], f"{config['goodput']:.2%}", f"{sim['goodput']:.2%}", f"{heavy['goodput']:.2%}",
                         f"{fsx['interval_steps']} ({fsx['interval_seconds'] / 60:.0f} min)",
                         f"{memory['interval_steps']}" if memory else "—"])
        lines += [f"**{nodes} nodes** (a fault every {costs.job_mtbf_seconds / 3600:.1f} h) — recommended: "
                  f"**{plan.recommended['name']}**, FSx every {plan.interval_steps} steps:", "",
                  *table(["configuration", "expected goodput", "simulated", "Weibull", "FSx interval, steps",
                          "memory interval, steps"], rows)]
    costs = Costs(nodes=8, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)
    plot_goodput(costs, RESULTS / "goodput-vs-nodes.png")
    curves = goodput_by_cluster_size(costs, PLOT_NODES)
    lines += ["Goodput against cluster size (intervals re-chosen at each size): `bench/results/goodput-vs-nodes.png`.", "",
              *table(["configuration", *(str(n) for n in PLOT_NODES)],
                     [[name, *(f"{v:.1%}" for v in values)] for name, values in curves.items()])]
    at_1024 = {c["name"]: c for c in make_plan(dataclasses.replace(costs, nodes=1024)).configurations}
    lines += ["Next to the published anchors:", "",
              *table(["published", "figure", "here"], [
                  [ANCHORS[0][0], ANCHORS[0][1], "checkpoint bench: see the throughput rows above (CPU); planner at "
                   f"1,024 nodes: save badput {at_1024['async+relaunch']['badput']['checkpoint_save']:.2%} async vs "
                   f"{at_1024['sync+relaunch']['badput']['checkpoint_save']:.2%} sync at their best intervals"],
                  [ANCHORS[1][0], ANCHORS[1][1], "the planner's restart costs (estimates above); CPU: recovery bench"],
                  [ANCHORS[2][0], ANCHORS[2][1], f"1,024 nodes: {at_1024['async+ft_launcher']['goodput']:.1%} with "
                   f"ft_launcher, {at_1024['in_process+ft_launcher+memory+peer']['goodput']:.1%} with every layer"],
                  [ANCHORS[3][0], ANCHORS[3][1], f"1,024 nodes, every layer: "
                   f"{at_1024['in_process+ft_launcher+memory+peer']['goodput']:.1%}"],
              ])]
    return lines + published_gap_section() + which_configuration_section() + restart_budget_section()


def published_gap_section() -> list[str]:
    """Issue 33: why the planner ranked every configuration at 98-99.6 % at 1,024 nodes with the 17 s restart
    measured on 2-8 nodes, against the published 90-97 %: which costs grow with the job."""
    rows = []
    for nodes in (8, 128, 1024, 2048):
        costs = Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)
        flat = dataclasses.replace(costs, scale_restarts=False)  # the 17 s restart at any size
        by_name = {c["name"]: c["goodput"] for c in make_plan(costs).configurations}
        flat_names = {c["name"]: c["goodput"] for c in make_plan(flat).configurations}
        rows.append([str(nodes), f"{restart_world_seconds(nodes, 8):.0f} s",
                     f"{flat_names['async+relaunch']:.1%} → {by_name['async+relaunch']:.1%}",
                     f"{flat_names['async+ft_launcher']:.1%} → {by_name['async+ft_launcher']:.1%}",
                     f"{flat_names['in_process+ft_launcher+memory+peer']:.1%} → "
                     f"{by_name['in_process+ft_launcher+memory+peer']:.1%}",
                     f"{by_name['replica_groups']:.1%}"])
    pays = replica_groups_pay_from(Costs(nodes=8, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS))
    return [
        "### Restarts that grow with the job, and replica groups", "",
        "A restart re-initialises the process group over every rank of the world it restarts (its TCPStore "
        "rendezvous, the communicators). The 17 s in-job restart was measured on 2-8 nodes; at scale the published "
        "figures for ProcessGroup initialisation over a TCPStore are 18 s at 2,048 ranks, 25 s at 4,096 and 85 s at "
        "8,192 (pytorch/gloo#408, with the batched store reads that landed in PyTorch; 82 s, 393 s and ~55 min "
        "before them), which trainer/planning/scale.py interpolates on log2(ranks) and extends linearly beyond. The "
        "planner now adds that to every restart of the whole world (in-job, replacement, relaunch); with replica "
        "groups only the failed group's world restarts, and the others stall for the lighthouse's detection and one "
        f"step (`replica_detection_seconds`, {Costs.replica_detection_seconds:g} s) while every step pays the quorum "
        f"(`quorum_seconds`, {Costs.quorum_seconds:g} s: round trips to the lighthouse and within the group; the "
        "trainer records it per step).", "",
        *table(["nodes", "process-group init added", "async+relaunch (flat → scaled)", "async+ft_launcher",
                "every layer", "replica_groups (R = 8)"], rows),
        f"Replica groups keep the most goodput from **{pays} nodes** on with these costs (`python -m pipelines plan` "
        "prints the size for any costs): below it the per-step quorum costs more than what a group-scoped restart "
        "saves.", "",
        "What explains the published figures (Llama 3: 90 % effective training time on 16 k GPUs; ByteRobust: 97 % "
        "at 9,600): Llama 3 restarted the whole job at each of its ~8 interruptions a day, from storage — the "
        "planner's *async+relaunch* at 2,048 nodes (the table above), where the gang's rescheduling (270 s), the "
        "world's initialisation (over 100 s at 16 k ranks) and the work since the last checkpoint dominate; "
        "ByteRobust recovers in place and still re-initialises the full world at each fault — the planner's "
        "*async+ft_launcher* band at 1,024 nodes. What the planner still leaves out: the time to diagnose faults "
        "that need a person, silent data corruption found late, and slow nodes before they fail (bench straggler).",
        "",
    ]


NO_SPARE_WAIT_SECONDS = 600.0  # a new p5 instance from the node group: launch, boot, join, image pull


def which_configuration_section() -> list[str]:
    """What a 2-, 8-, 128- and 1,024-node EKS job should run: the planner's choice among what the deployment
    implements, with and without a warm spare, and whether one spare pays for itself (its node-hours against the
    node-hours of the whole job that the shorter wait saves)."""
    rows = []
    for nodes in (2, 8, 128, 1024):
        spare = Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)
        none = dataclasses.replace(spare, spare_wait_seconds=NO_SPARE_WAIT_SECONDS)
        with_spare, without = make_plan(spare), make_plan(none)
        gain = with_spare.recommended["goodput"] - without.recommended["goodput"]
        pays = gain * nodes > 1.0  # node-hours saved per hour of the job vs the spare's own hour
        rows.append([str(nodes), f"**{with_spare.recommended['name']}**, FSx every {with_spare.interval_steps} steps",
                     f"{with_spare.recommended['goodput']:.2%}", f"{without.recommended['goodput']:.2%}",
                     f"{gain * nodes:.2f}", "yes (1 spare)" if pays else "no"])
    return [
        "### Which configuration an EKS job should use", "",
        "Every configuration above is one the EKS deployment runs (docs/node-loss.md): with in-job restarts on, a lost "
        "node's pod is replaced with its index while the others keep running — from the peer replica with the memory "
        "tier and `checkpoint.peer_replica`, from FSx without; with them off (`resilience.max_restarts=0`), every "
        "pod is recreated (*relaunch*). A replacement costs the in-job restart, `replacement_seconds` (the new "
        f"launcher and the state from the peer: {SEED_COSTS['replacement_seconds']:g} s, bench/recovery.py's "
        "node_replacement) and the wait for a machine, `spare_wait_seconds`: "
        f"{SEED_COSTS['spare_wait_seconds']:g} s with a warm spare (manifests/components/warm-spares), "
        f"{NO_SPARE_WAIT_SECONDS:g} s for a new instance without one. A spare pays when the node-hours it saves the "
        "job (goodput gained × nodes) exceed its own hour.", "",
        *table(["nodes", "use", "goodput, warm spare", "goodput, no spare", "node-hours saved per hour by a spare",
                "warm spare?"], rows),
    ]


def _survival(value: float) -> str:
    if value >= 1.0:
        return "100 %"
    return f"{value:.2%}" if value < 0.9999 else f"1 − {1 - value:.1e}"


def restart_budget_section() -> list[str]:
    """Will a 30-day job survive its restart budget? A fixed count against the no-progress rule, closed form
    and simulated (trainer.planning.survival; docs/restart-budget.md)."""
    lines = ["## Restart budget — will a 30-day job survive it?", "",
             "Faults arrive at the job's rate; a **fixed count** of B restarts survives while N ≤ B (9 was this "
             "project's EKS budget: JobSet maxRestarts 2 × ft_launcher 3, plus 3); **by progress** "
             "(`resilience.max_restarts_without_progress` = L) a job dies only when L recoveries in a row each "
             "meet the next fault before they advanced the state (restart 17 s + node-memory reload 5 s + one 4 s "
             "step = 26 s here). Closed form, and the simulator's share of 2,000 seeded jobs beside it. The "
             "JobSet's maxRestarts covers the pod-level faults (node, rack) with 99.9 %.", ""]
    rows = []
    for nodes in (8, 1024):
        costs = Costs(nodes=nodes, node_mtbf_hours=NODE_MTBF_HOURS, **SEED_COSTS)
        budget = restart_budget(costs, days=30, simulate_jobs=2000, seed=0)
        for kind, label in (("fixed", "fixed count"), ("by_progress", "by progress, L =")):
            for key, value in budget[kind].items():
                rows.append([f"{nodes}", f"{budget['expected_faults']:.1f}", f"{label} {key}", _survival(value),
                             f"{budget['simulated'][kind][key]:.2%}", f"{budget['jobset_max_restarts']}"])
    return lines + table(["nodes", "faults in 30 days", "budget", "survival", "simulated", "JobSet maxRestarts"],
                         rows) + [""]


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    results = {name: load(f"{name}.json") for name in ("checkpoint", "recovery", "goodput", "staging", "data",
                                                         "startup", "evaluate", "pipeline_steps", "straggler",
                                                         "numeric_faults", "control_plane")}
    info = next((r["machine"] for r in results.values() if r and "machine" in r), None) or machine()
    lines = [
        "# Benchmarks", "",
        "<!-- Generated by bench/report.py (`make bench`); edit the generator, not this file. -->", "",
        "Each benchmark measures its configurations side by side in one run (this machine is shared and noisy) and "
        "reports ratios; none of them is a test. `make bench` runs them all (~100 min on 2 cores) and regenerates "
        "this report; `make bench-report` only regenerates it from `bench/results/*.json`.", "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, Python {info['python']}, torch "
        f"{info['torch']}, Linux {info['kernel']}; no GPU.", "",
    ]
    for name, section in (("checkpoint", checkpoint_section), ("recovery", recovery_section),
                          ("goodput", goodput_section), ("staging", staging_section), ("data", data_section),
                          ("startup", startup_section), ("evaluate", evaluate_section),
                          ("pipeline_steps", pipeline_steps_section), ("straggler", straggler_section),
                          ("numeric_faults", numeric_faults_section),
                          ("control_plane", lambda r: control_plane_section(r, load("control_plane_before.json")))):
        if results[name] is not None:
            lines += section(results[name])
        else:
            lines += [f"## {name}", "", f"No results yet: run `python bench/{name}.py`.", ""]
    lines += planner_section()
    overhead = load("overhead.json")
    lines += overhead_section(overhead) if overhead else ["## overhead", "", "No results yet: run `python bench/overhead.py`.", ""]
    lines += gpu_check_section(load("gpu_check.json"))
    OUT.write_text("\n".join(lines))
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
