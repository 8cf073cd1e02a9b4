"""The JSON document of bench/gpu_check.sh, from its runs' folders: written after every run (a check cut off by
its time limit keeps what it measured) and printed at the end.

    python3 bench/gpu_check_report.py WORK RESULTS PRESET SEQ [final]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from trainer.config import load_config
from trainer.planning.model_size import gpu_memory_of, model_shape
from trainer.resilience.nvrx_compat import nvrx_version
from trainer.run.events import read_events
from trainer.run.run_dir import read_json

MEMORY_RUNS = ("mem-none", "mem-full", "mem-accum4")  # beside the perf runs: the estimate against each run's peak
WARMUP = 4  # steps left out of the medians: the first allocations, and the compile
PERF_FIELDS = ("tokens_per_second", "tflops_per_gpu", "mfu", "cuda_max_allocated_gib", "cuda_max_reserved_gib",
               "step_seconds")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def step_figures(metrics: list[dict]) -> dict:
    """Medians after the warm-up: the step's own figures, and its wall time (from one record to the next, so
    what the loop does between steps, such as a node-memory copy, counts)."""
    later = metrics[WARMUP:] or metrics
    figures = {f"median_{name}": _median([m[name] for m in later if name in m]) for name in PERF_FIELDS}
    walls = [b["time"] - a["time"] for a, b in zip(later, later[1:])]
    figures["median_wall_seconds_per_step"] = _median(walls)
    figures["cuda_alloc_retries"] = sum(m.get("cuda_alloc_retries", 0) for m in metrics)
    figures["steps"] = len(metrics)
    return figures


def memory_figures(args_file: Path, metrics: list[dict]) -> dict:
    """The run's peak allocated memory over every step against trainer.planning.model_size's estimate for its
    config (its command line's `--config NAME` and overrides, as gpu_check.sh wrote them; the goal: within 15 %)."""
    peaks = [m["cuda_max_allocated_gib"] for m in metrics if "cuda_max_allocated_gib" in m]
    if not peaks or not args_file.is_file():
        return {}
    args = args_file.read_text().splitlines()
    at = args.index("--config")
    cfg = load_config(args[at + 1], args[:at] + args[at + 2:])
    estimate = gpu_memory_of(model_shape(cfg), cfg)
    t = cfg.training
    return {"max_allocated_gib": max(peaks), "memory_estimate_gib": estimate["total"] / 2**30,
            "memory_estimate_parts_gib": {k: v / 2**30 for k, v in estimate.items() if k != "total"},
            "memory_estimate_over_max_allocated": estimate["total"] / 2**30 / max(peaks),
            "memory_setting": {"activation_checkpointing": t.activation_checkpointing, "compile": t.compile,
                               "grad_accum_steps": t.grad_accum_steps}}


def run_figures(run: Path, log: Path) -> dict:
    figures: dict = {"log_tail": log.read_text(errors="replace").splitlines()[-12:] if log.exists() else []}
    if (run / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        figures.update(step_figures(metrics))
        figures.update(memory_figures(log.with_suffix(".args"), metrics))
    if (run / "events").exists():
        figures["stalls"] = [{k: e.get(k) for k in ("step", "loop_wait_seconds", "handoff_seconds", "memory_seconds")}
                             for e in read_events(run, "checkpoint_stall")]
        figures["recoveries"] = [{k: e.get(k) for k in ("mechanism", "cause", "decision", "recovery_seconds",
                                                        "reload_source", "reloaded_step", "lost_steps",
                                                        "reload_seconds", "reinit_seconds")}
                                 for e in read_events(run, "recovery")]
        cache_fields = ("attempt", "step", "first_step_seconds", "fx_graph_hits", "fx_graph_misses",
                        "aot_autograd_hits", "aot_autograd_misses")
        figures["compile_cache"] = [{k: e.get(k) for k in cache_fields} for e in read_events(run, "compile_cache")]
        figures["numeric"] = [{k: v for k, v in e.items() if k not in ("rank", "attempt", "by_dataset", "time")}
                              for e in read_events(run) if e["event"] in ("numeric_anomaly", "numeric_rerun",
                                                                           "rollback", "data_skipped")]
    result = read_json(run / "result.json")
    if result:
        figures["result"] = {k: result.get(k) for k in ("steps", "final_loss", "wall_seconds", "num_parameters")}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path, help="the check's work folder (its runs under work/fsx/runs)")
    parser.add_argument("results", type=Path, help="where the logs are and gpu_check.json goes")
    parser.add_argument("preset")
    parser.add_argument("seq", type=int)
    parser.add_argument("final", nargs="?", default="", help="'final': also print the document")
    args = parser.parse_args()
    work, results, preset, seq, final = args.work, args.results, args.preset, args.seq, args.final == "final"
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "nvidia_resiliency_ext": nvrx_version(), "preset": preset, "seq_len": seq,
              "runs": {}}
    for name in ("perf-eager", "perf-compiled", "perf-compiled-full", "memcopy", "restart", "nan", *MEMORY_RUNS):
        run = work / "work" / "fsx" / "runs" / f"check-{name}"
        if run.exists() or (results / f"{name}.log").exists():
            report["runs"][name] = run_figures(run, results / f"{name}.log")
    runs = report["runs"]
    eager, compiled = runs.get("perf-eager", {}), runs.get("perf-compiled", {})
    full, copied = runs.get("perf-compiled-full", {}), runs.get("memcopy", {})
    report["summary"] = {
        "mfu": {name: runs.get(name, {}).get("median_mfu") for name in ("perf-eager", "perf-compiled",
                                                                      "perf-compiled-full")},
        "compile_speedup": _ratio(compiled.get("median_tokens_per_second"), eager.get("median_tokens_per_second")),
        "selective_over_full_tokens": _ratio(compiled.get("median_tokens_per_second"),
                                             full.get("median_tokens_per_second")),
        "selective_over_full_memory": _ratio(compiled.get("median_cuda_max_allocated_gib"),
                                             full.get("median_cuda_max_allocated_gib")),
        # the node-memory copy after every step: the step's wall time with it over without it (perf-eager)
        "node_memory_copy_every_step_wall_ratio": _ratio(copied.get("median_wall_seconds_per_step"),
                                                         eager.get("median_wall_seconds_per_step")),
        "memory_estimate_over_max_allocated": {name: run["memory_estimate_over_max_allocated"]
                                               for name, run in runs.items()
                                               if "memory_estimate_over_max_allocated" in run},
        # the first step of the cold start (compiling) and of the start after the SIGKILL (the run folder's cache)
        "restart_first_step_seconds": [c.get("first_step_seconds")
                                       for c in runs.get("restart", {}).get("compile_cache", [])],
        "restart_recovery_seconds": [r.get("recovery_seconds") for r in runs.get("restart", {}).get("recoveries", [])],
    }
    text = json.dumps(report, indent=1, default=str)
    (results / "gpu_check.json").write_text(text)
    if final:
        print(text)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


if __name__ == "__main__":
    main()
