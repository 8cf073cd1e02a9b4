"""Checkpoint benchmark: no checkpointing, our sync and async saves, and a plain DCP async_save, in one run.

    .venv/bin/python bench/checkpoint.py                 # ≥ 100 M params (preset small), 2 CPU ranks, ~20 min
    .venv/bin/python bench/checkpoint.py --preset tiny --samples 1   # a quick check of the harness
    .venv/bin/python bench/checkpoint.py --load-only     # only the load figures (one training run, ~3 min),
                                                         # merged into the existing results file
    .venv/bin/python bench/checkpoint.py --commit-only   # only the commit figures (no training, ~1 min), merged

Everything is measured side by side in one invocation (the machine is shared and noisy) and reported as
ratios. Configurations, run in turn `--samples` times (none, sync, async, peer, async_process, none, ...), each the
real trainer under torchrun (FSDP2, gloo) on the same data and seed, the FSx tier alone (node memory off):
- none: no checkpointing; sync: `checkpoint.mode=sync`; async: `checkpoint.mode=async` (ours, the default
  thread executor); async_process: ours with `checkpoint.async_executor=process` (DCP's writer process);
- peer: what a team would write from the PyTorch docs (bench/plain_dcp.py): `dcp.async_save` with its
  thread executor on a gloo group of its own, waiting for the previous save's future first.

Definitions:
- loop wait per save: everything the loop waits for in a save (the previous save, the barrier, staging
  and hand-off; sync: the whole write), worst rank; the hand-off alone is reported beside it;
- throughput: steps/s over the same window of steps for every configuration (after the second save: the
  first async save also starts DCP's writer, a one-time cost reported on its own), divided by the same
  sample's no-checkpoint run; median and spread (min–max) over the samples;
- loads (bench/checkpoint_probe.py, every rank at once, the slowest rank, best of 3): a raw sequential read
  of each rank's shard file against loading the checkpoint into the trainer's state with DCP's own reader
  and with the project's (trainer/checkpoint/fast_reader.py, verifying as it reads; and without verifying),
  page cache warm and cold. `load_over_raw_read` = raw read seconds / the project's load seconds (1.0 = as
  fast as a plain read; goal ≥ 0.7), `dcp_load_over_raw_read` the same for DCP's reader. The raw read
  reuses one 16 MB buffer (it stays in the CPU cache); `raw_read_whole` reads into one buffer of the file's
  size, writing every byte to memory as a load must: `load_over_raw_read_whole` compares with that.
- commits (no trainer: a DCP save of a state of each size by the trainer's writer, 2 files): rank 0's commit
  (trainer.checkpoint.format.write_manifest) from the writers' digests, against the same commit re-reading
  every file to hash it (what it did before the writers hashed; page cache warm, so a lower bound of FSx's
  cost), at two sizes. `commit_reread_bytes_over_checkpoint` is what the commit read / the checkpoint's
  bytes (goal 0); `commit_seconds_large_over_small` is the commit's growth with the checkpoint (goal: flat,
  ~1, where re-reading grows with the bytes).
Writes bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

from components.train.local import run_local_training  # noqa: E402
from components.train.report import read_metrics  # noqa: E402
from trainer.checkpoint import reads  # noqa: E402
from trainer.checkpoint.commit import STALL_FIGURES  # noqa: E402
from trainer.checkpoint.format import MANIFEST, WRITTEN_DIGESTS, write_manifest  # noqa: E402
from trainer.checkpoint.hashing_writer import HashingFileSystemWriter  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.observe import logs  # noqa: E402
from trainer.planning.measured import MeasuredRun  # noqa: E402
from trainer.run.events import read_events  # noqa: E402
from trainer.run.run_dir import RunDir  # noqa: E402

log = logging.getLogger("bench.checkpoint")


def _config(work: Path, run_id: str, args, *extra: str):
    return load_config("local", [
        f"--run.work_dir={work}", f"--run.run_id={run_id}", f"--model.preset={args.preset}",
        f"--training.num_steps={args.steps}", f"--training.batch_size={args.batch_size}",
        f"--training.seq_len={args.seq_len}", "--training.warmup_steps=1", "--training.log_every=1",
        f"--checkpoint.interval_steps={args.interval}", "--checkpoint.keep_last=1",
        "--checkpoint.memory_interval_steps=0", "--faults.schedule=",
        # the final evaluation is not what is measured (2 of a run's 3 minutes at the default's 20 batches,
        # tasks and generations): the least of it
        "--eval.max_batches=1", "--eval.tasks=", "--eval.max_new_tokens=1", *extra])


def _throughput(metrics_path: Path, first_step: int) -> tuple[float, int]:
    """Steps per second between the records of first_step and the last step (saves in between count)."""
    records = {r["step"]: r for r in read_metrics(metrics_path)}
    last = max(records)
    return (last - first_step) / (records[last]["time"] - records[first_step]["time"]), last - first_step


def _ours(cfg, data: Path) -> tuple[Path, list[dict]]:
    """One run of our trainer: its metrics file and its saves (loop wait, hand-off, background; worst rank)."""
    run_local_training(cfg, data)
    measured = MeasuredRun.read(cfg.run_dir)  # one checkpoint_stall record per save: the worst rank's
    background = {e["step"]: e["background_seconds"] for e in measured.commits}
    saves = [{"step": stall["step"], **{key: stall.get(key, 0.0) for key in STALL_FIGURES},
              "background_seconds": background.get(stall["step"])}
             for stall in sorted(measured.stalls, key=lambda s: s["step"])]
    return RunDir(cfg.run_dir).metrics, saves


def _plain(cfg, data: Path, scratch: Path) -> tuple[Path, list[dict]]:
    """One run of bench/plain_dcp.py under torchrun with the same config."""
    out = scratch / cfg.run.run_id
    out.mkdir(parents=True)
    config_path = out / "config.yaml"
    config_path.write_text(cfg.to_yaml())
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.training.nproc_per_node}", str(ROOT / "bench" / "plain_dcp.py"),
                    str(config_path), str(data), str(out)], check=True, cwd=ROOT)
    ranks = [json.loads(path.read_text()) for path in sorted(out.glob("saves-*.json"))]
    saves = []
    for per_rank in zip(*(r["saves"] for r in ranks)):
        saves.append({key: max(save.get(key) or 0.0 for save in per_rank) for key in per_rank[0] if key != "step"}
                     | {"step": per_rank[0]["step"]})
    shutil.rmtree(out / f"step-{saves[-1]['step']}", ignore_errors=True)
    return out / "metrics.jsonl", saves


def _probe(scratch: Path, args, data: Path, cfg, checkpoint: str) -> list[dict]:
    """bench/checkpoint_probe.py under torchrun on `checkpoint`: every rank's memcpy, raw read and load figures."""
    probe_out = scratch / "probe.json"
    probe_cfg = scratch / "probe.yaml"
    probe_cfg.write_text(_config(scratch, "probe", args, "--checkpoint.enabled=false").to_yaml())
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={cfg.training.nproc_per_node}", str(ROOT / "bench" / "checkpoint_probe.py"),
                    str(probe_cfg), str(data), checkpoint, str(probe_out)], check=True, cwd=ROOT)
    return json.loads(probe_out.read_text())


def _load_figures(probe: list[dict]) -> dict:
    """The slowest rank's seconds for each way of loading, and the ratios to a raw read of the same files."""
    figures = {}
    for cache in ("warm", "cold"):
        seconds = {name: max(p[f"{name}_{cache}_seconds"] for p in probe)
                   for name in ("raw_read", "raw_read_whole", "dcp_load", "load", "load_unverified")}
        figures[f"loads_{cache}_seconds"] = seconds
        suffix = "" if cache == "warm" else "_cold"
        figures[f"load_over_raw_read{suffix}"] = seconds["raw_read"] / seconds["load"]
        figures[f"load_unverified_over_raw_read{suffix}"] = seconds["raw_read"] / seconds["load_unverified"]
        figures[f"dcp_load_over_raw_read{suffix}"] = seconds["raw_read"] / seconds["dcp_load"]
        figures[f"load_over_raw_read_whole{suffix}"] = seconds["raw_read_whole"] / seconds["load"]
    figures["load_bytes_per_rank"] = max(p["raw_read_bytes"] for p in probe)
    figures.update(_staging_figures(probe))
    # The names earlier results used: DCP's own load against the raw read, warm.
    figures["load_seconds"] = figures["loads_warm_seconds"]["dcp_load"]
    figures["raw_read_seconds"] = figures["loads_warm_seconds"]["raw_read"]
    figures["raw_read_over_load"] = figures["dcp_load_over_raw_read"]
    return figures


def _staging_figures(probe: list[dict]) -> dict:
    """The slowest rank's staging of a later async save, each stager, against its memcpy of the same state."""
    memcpy = max(p["memcpy_seconds"] for p in probe)
    figures = {f"stage_{name}_seconds": max(p[f"stage_{name}_seconds"] for p in probe)
               for name in ("default", "reusing", "check_then_reusing")}
    figures["stage_over_memcpy"] = figures["stage_reusing_seconds"] / memcpy
    figures["dcp_default_stage_over_memcpy"] = figures["stage_default_seconds"] / memcpy
    # what the loop waits for before the hand-off: the finite check, then the staging copy
    figures["check_then_stage_over_memcpy"] = figures["stage_check_then_reusing_seconds"] / memcpy
    figures["stage_dtensors_per_rank"] = max(p["dtensors"] for p in probe)
    return figures


def _load_only(args, scratch: Path, data: Path) -> int:
    """One training run that commits a checkpoint, the probe on it, its figures merged into args.output."""
    cfg = _config(scratch, "load-only", args, "--checkpoint.mode=async")
    run_local_training(cfg, data)
    committed = read_events(cfg.run_dir, "checkpoint_committed")
    figures = _load_figures(_probe(scratch, args, data, cfg, committed[-1]["path"]))
    previous = json.loads(args.output.read_text()) if args.output.is_file() else {}
    merged = {key: value for key, value in previous.items() if key not in ("command", "measured_at", "machine")}
    merged.update(figures, load_checkpoint_bytes=committed[-1]["bytes"])
    write_results(args.output, merged, "bench/checkpoint.py")
    print(json.dumps({k: v for k, v in figures.items()}, indent=1))
    return 0


def _commit_figures(scratch: Path, sizes_mb: tuple[int, int] = (64, 512), repeats: int = 3) -> dict:
    """Rank 0's commit of a checkpoint of each size, from the writers' digests and by re-reading (best of
    `repeats` each, alternating)."""
    figures: dict = {}
    for size_mb in sizes_mb:
        folder = scratch / f"commit-{size_mb}mb"
        tensors = size_mb * (1 << 20) // 4 // (1 << 20)
        state = {"model": {f"w{i}": torch.randn(1 << 20) for i in range(tensors)}}
        dcp.save(state, checkpoint_id=str(folder), no_dist=True,
                 storage_writer=HashingFileSystemWriter(str(folder), thread_count=2))
        written = (folder / WRITTEN_DIGESTS).read_text()
        seconds = {"digests": [], "reread": []}
        reread = {}
        for _ in range(repeats):
            for how in ("digests", "reread"):
                (folder / MANIFEST).unlink(missing_ok=True)
                if how == "digests":
                    (folder / WRITTEN_DIGESTS).write_text(written)
                before, started = reads.bytes_read(), time.perf_counter()
                manifest = write_manifest(folder, 1, {"world_size": 1})
                seconds[how].append(time.perf_counter() - started)
                reread[how] = reads.bytes_read() - before
        size = sum(f["bytes"] for f in manifest["files"].values())
        figures[f"commit_{size_mb}mb"] = {"checkpoint_bytes": size, "seconds": min(seconds["digests"]),
                                          "reread_seconds": min(seconds["reread"]),
                                          "reread_bytes_over_checkpoint": reread["digests"] / size,
                                          "reread_path_bytes_over_checkpoint": reread["reread"] / size}
        shutil.rmtree(folder)
    small, large = (figures[f"commit_{mb}mb"] for mb in sizes_mb)
    figures["commit_reread_bytes_over_checkpoint"] = max(small["reread_bytes_over_checkpoint"],
                                                         large["reread_bytes_over_checkpoint"])
    figures["commit_seconds_large_over_small"] = large["seconds"] / small["seconds"]
    figures["commit_reread_seconds_large_over_small"] = large["reread_seconds"] / small["reread_seconds"]
    figures["commit_large_reread_over_digests"] = large["reread_seconds"] / large["seconds"]
    return figures


def _commit_only(args, scratch: Path) -> int:
    figures = _commit_figures(scratch)
    previous = json.loads(args.output.read_text()) if args.output.is_file() else {}
    merged = {key: value for key, value in previous.items() if key not in ("command", "measured_at", "machine")}
    merged.update(figures)
    write_results(args.output, merged, "bench/checkpoint.py")
    print(json.dumps(figures, indent=1))
    return 0


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "samples": values}


def main() -> int:
    logs.configure()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model preset (small ≥ 100 M params)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=3, help="checkpoint every N steps")
    parser.add_argument("--samples", type=int, default=3, help="runs of each configuration, alternating")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "checkpoint.json")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--load-only", action="store_true",
                        help="measure the loads only and merge them into --output (one training run)")
    parser.add_argument("--commit-only", action="store_true",
                        help="measure the commits only and merge them into --output (no training)")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        if args.commit_only:
            return _commit_only(args, scratch)
        data = demo_token_dir(scratch)
        if args.load_only:
            return _load_only(args, scratch, data)
        options = {"none": ["--checkpoint.enabled=false"], "sync": ["--checkpoint.mode=sync"],
                   "async": ["--checkpoint.mode=async"], "peer": ["--checkpoint.enabled=false"],
                   "async_process": ["--checkpoint.mode=async", "--checkpoint.async_executor=process"]}
        # The same window for every configuration, after the second save: the second async save waits for
        # the first, which also starts DCP's writer (a one-time cost, reported on its own).
        window_start = 2 * args.interval + 1
        ratios: dict[str, list[float]] = {name: [] for name in options if name != "none"}
        steps_per_second: dict[str, list[float]] = {name: [] for name in options}
        saves: dict[str, list[dict]] = {name: [] for name in options if name != "none"}
        last_cfg = None
        for sample in range(args.samples):
            for name, extra in options.items():
                cfg = _config(scratch, f"{name.replace('_', '-')}-{sample}", args, *extra)
                started = time.perf_counter()
                metrics, found = _plain(cfg, data, scratch) if name == "peer" else _ours(cfg, data)
                rate, window = _throughput(metrics, window_start)
                steps_per_second[name].append(rate)
                if name != "none":
                    ratios[name].append(rate / steps_per_second["none"][-1])
                    saves[name].append(found)
                if name == "async":
                    last_cfg = cfg
                log.info("sample %d %s: %.3f steps/s over %d steps (run %.0f s)", sample, name, rate, window,
                         time.perf_counter() - started)

        def steady(name: str, key: str) -> float:
            """Median over the saves inside the throughput window, every sample."""
            return statistics.median(s[key] for run in saves[name] for s in run if s["step"] >= window_start)

        committed = read_events(last_cfg.run_dir, "checkpoint_committed")
        probe = _probe(scratch, args, data, last_cfg, committed[-1]["path"])
        memcpy = max(p["memcpy_seconds"] for p in probe)

        first_async = [run[0] for run in saves["async"]]
        figures = {
            "params": None,
            "state_bytes": sum(p["state_bytes"] for p in probe),
            "checkpoint_bytes": committed[-1]["bytes"],
            "interval_steps": args.interval,
            "window_steps": window,
            "samples": args.samples,
            "loop_wait_sync_seconds": steady("sync", "loop_wait_seconds"),
            "loop_wait_async_seconds": steady("async", "loop_wait_seconds"),
            "loop_wait_peer_seconds": steady("peer", "loop_wait_seconds"),
            "loop_wait_async_process_seconds": steady("async_process", "loop_wait_seconds"),
            "handoff_async_seconds": steady("async", "handoff_seconds"),
            "handoff_peer_seconds": steady("peer", "handoff_seconds"),
            "background_async_seconds": steady("async", "background_seconds"),
            "background_peer_seconds": steady("peer", "background_seconds"),
            "loop_wait_all_saves_seconds": {name: statistics.mean(s["loop_wait_seconds"] for run in runs for s in run)
                                            for name, runs in saves.items()},
            "first_save_async_background_seconds": statistics.median(s["background_seconds"] for s in first_async),
            "second_save_async_loop_wait_seconds": statistics.median(run[1]["loop_wait_seconds"] for run in saves["async"]),
            "first_save_async_process_background_seconds": statistics.median(
                run[0]["background_seconds"] for run in saves["async_process"]),
            "memcpy_seconds": memcpy,
            "throughput_steps_per_second": {name: _spread(v) for name, v in steps_per_second.items()},
            "throughput_ratio_sync": statistics.median(ratios["sync"]),
            "throughput_ratio_async": statistics.median(ratios["async"]),
            "throughput_ratio_peer": statistics.median(ratios["peer"]),
            "throughput_ratio_async_process": statistics.median(ratios["async_process"]),
            "throughput_ratios": {name: _spread(v) for name, v in ratios.items()},
            # Within a round the configurations ran back to back: ours over the plain one, round by round.
            "throughput_async_over_peer": _spread([a / p for a, p in zip(steps_per_second["async"],
                                                                         steps_per_second["peer"])]),
            **_load_figures(probe),
        }
        figures["loop_wait_async_over_peer"] = figures["loop_wait_async_seconds"] / figures["loop_wait_peer_seconds"]
        figures["loop_wait_async_over_sync"] = figures["loop_wait_async_seconds"] / figures["loop_wait_sync_seconds"]
        figures["loop_wait_async_over_memcpy"] = figures["loop_wait_async_seconds"] / memcpy
        figures["params"] = json.loads((RunDir(last_cfg.run_dir).result).read_text())["num_parameters"]
        figures.update(_commit_figures(scratch))
        write_results(args.output, figures, "bench/checkpoint.py")
        print(json.dumps({k: v for k, v in figures.items() if not isinstance(v, dict)}, indent=1))
        print(args.output)
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
