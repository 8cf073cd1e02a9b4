"""What the resilience costs per step: the full trainer (every resilience feature as the local config sets it:
async checkpoints, the node-memory copy every step and its peer replica, straggler detection, numeric checks,
the heartbeats) against a bare FSDP2 loop on the same model, data and ranks, in alternating rounds in one run
(this machine is shared and noisy: only ratios measured side by side are reported).

    python bench/overhead.py                      # tiny (40 steps, 3 rounds), small (20 steps, 1 round), 2 ranks
    python bench/overhead.py --presets tiny --rounds tiny=1 --steps tiny=25

Per preset and round: the bare loop, then the trainer as the local config sets it (the node-memory copy at the
planner's interval, checkpoint.memory_interval_steps=auto, for the demo's fleet whose nodes fail every 3 minutes),
the same for Llama 3's fleet (auto_node_mtbf_hours 6335), the copy every step, and never. The figure is the mean
wall time per step after the first 13 steps (the warm-up and the planner's probe of the copy's cost: each variant
in its steady state; a save's stall and a copy's wait count: they are the loop's time), so:
  throughput_over_bare     = bare step time / trainer step time (goal >= 0.97)
  node_memory_copy_share   = 1 - (step time with no copy / step time with the copy every step)
  memory_interval_steps    = the interval each auto variant's planner chose
Results: bench/results/overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, demo_token_dir, write_results

# Steps not timed: the first compile-free steps' warm-up, and the launch's node-memory probe (6 steps with a copy,
# 6 without, trainer.planning.auto), so every variant is timed in its steady state.
WARMUP = 13
# The trainer as the local config sets it (checkpoint.memory_interval_steps=auto, the demo's fleet: a node fails every
# 3 minutes), the same planner for Llama 3's fleet (the config's default MTBF), the copy every step, and none.
TRAINER_VARIANTS = {"trainer": ["--checkpoint.memory_interval_steps=auto"],
                    "trainer_fleet_mtbf": ["--checkpoint.memory_interval_steps=auto",
                                           "--checkpoint.auto_node_mtbf_hours=6335"],
                    "trainer_memory_every_step": ["--checkpoint.memory_interval_steps=1"],
                    "trainer_no_memory_copy": ["--checkpoint.memory_interval_steps=0"]}


def bare_loop(args: argparse.Namespace) -> None:
    """One rank of the bare loop (under torchrun): the trainer's model, sharding, optimizer and data, and
    nothing else; rank 0 writes its steps' wall times."""
    import numpy as np  # noqa: F401  (the batches are numpy arrays)
    import torch
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.data.batches import TokenBatches
    from trainer.data.shards import load_meta
    from trainer.data.tokenizer import load_tokenizer
    from trainer.job.step import clip, forward_backward
    from trainer.model.build import build_model, model_config_of
    from trainer.model.optimizer import build_optimizer
    from trainer.model.parallelize import device_mesh, parallelize
    from trainer.resilience.numerics import NumericDrills

    cfg = load_config("local", [f"--model.preset={args.preset}", *_shape(args)])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(cfg.training.num_threads)
    device = torch.device("cpu")
    meta = load_meta(args.data_dir)
    config = model_config_of(cfg.model, None, load_tokenizer(meta["tokenizer"]))
    model = parallelize(build_model(config, cfg.run.seed), cfg.training, device, device_mesh(cfg.training, world, device))
    optimizer = build_optimizer(model, cfg.training, cfg.optimizer, device)
    t = cfg.training
    batches = TokenBatches.open(args.data_dir, "train", t.seq_len, t.batch_size, cfg.run.seed)
    global_batch = t.batch_size * t.grad_accum_steps * world
    drills = NumericDrills([], rank, None, set())
    times = []
    for step in range(args.steps):
        first = step * global_batch
        micro = [batches.batch(first, m, rank, world) for m in range(t.grad_accum_steps)]
        loss, norm = forward_backward(model, micro, device=device, training_cfg=t, drills=drills, step=step + 1,
                                      first_sample=first, global_batch=global_batch)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        dist.all_reduce(loss)  # the loss a loop logs
        clip(model, norm, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.time())
    if rank == 0:
        Path(args.out).write_text(json.dumps(times))
    dist.destroy_process_group()


def _shape(args: argparse.Namespace) -> list[str]:
    return [f"--training.num_steps={args.steps}", "--training.seq_len=128", "--training.batch_size=8"]


def _mean_step(times: list[float]) -> float:
    later = times[WARMUP:]
    return (later[-1] - later[0]) / (len(later) - 1)


def run_bare(preset: str, args: argparse.Namespace, tokens: Path, scratch: Path) -> float:
    out = scratch / f"bare-{preset}-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    __file__, "--bare", "--preset", preset, "--steps", str(args.steps), "--data-dir", str(tokens),
                    "--out", str(out)], check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                   stdout=subprocess.DEVNULL)
    return _mean_step(json.loads(out.read_text()))


def run_trainer(preset: str, variant: list[str], args: argparse.Namespace, tokens: Path,
                scratch: Path) -> tuple[float, int | None]:
    """The trainer's mean step, and the node-memory interval its planner chose (None: not auto)."""
    from components.train.local import run_local_training
    from trainer.config import load_config
    from trainer.run.events import read_events
    from trainer.run.run_dir import read_jsonl

    run_id = f"overhead-{preset}-{time.monotonic_ns() % 10**9}"
    cfg = load_config("local", [f"--run.work_dir={scratch / run_id}", f"--run.run_id={run_id}",
                                f"--model.preset={preset}", *_shape(args), "--faults.schedule=",
                                # the final evaluation is not timed: the least of it (its generation is minutes here)
                                "--eval.every_steps=0", "--eval.max_batches=2", "--eval.max_new_tokens=1",
                                *variant, f"--checkpoint.memory_dir={scratch / run_id / 'node-memory'}"])
    run_local_training(cfg, tokens)
    chosen = read_events(cfg.run_dir, "memory_interval_chosen")
    return (_mean_step([r["time"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")]),
            chosen[0]["interval_steps"] if chosen else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--rounds", default="tiny=3,small=1", help="alternating rounds per preset")
    parser.add_argument("--steps", default="tiny=40,small=20", help="steps per preset (small: ~6-15 s a step here)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "overhead.json"))
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # a rank of the bare loop
    parser.add_argument("--preset", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        args.steps = int(args.steps)
        bare_loop(args)
        return 0
    steps_of = {preset: int(steps) for preset, steps in (item.split("=") for item in args.steps.split(","))}
    rounds_of = {preset: int(rounds) for preset, rounds in (item.split("=") for item in args.rounds.split(","))}
    figures: dict = {"steps": steps_of, "warmup_steps": WARMUP, "ranks": 2, "presets": {}}
    with tempfile.TemporaryDirectory(prefix="overhead-") as scratch_dir:
        scratch = Path(scratch_dir)
        tokens = demo_token_dir(scratch)
        for preset in args.presets.split(","):
            args.steps = steps_of[preset]
            rounds = []
            for round_index in range(rounds_of[preset]):
                seconds = {"bare": run_bare(preset, args, tokens, scratch)}
                intervals = {}
                for name, variant in TRAINER_VARIANTS.items():
                    seconds[name], intervals[name] = run_trainer(preset, variant, args, tokens, scratch)
                rounds.append({**seconds, "memory_interval_steps": {k: v for k, v in intervals.items() if v}})
                print(f"{preset} round {round_index + 1}: " + ", ".join(f"{k} {v * 1e3:.1f} ms/step"
                                                                      for k, v in seconds.items())
                      + f"; intervals chosen {rounds[-1]['memory_interval_steps']}", flush=True)
            over_bare = {name: statistics.median(r["bare"] / r[name] for r in rounds) for name in TRAINER_VARIANTS}
            figures["presets"][preset] = {
                "rounds": rounds, "throughput_over_bare": over_bare["trainer"],
                "throughput_over_bare_rounds": [r["bare"] / r["trainer"] for r in rounds],
                "fleet_mtbf_over_bare": over_bare["trainer_fleet_mtbf"],
                "memory_every_step_over_bare": over_bare["trainer_memory_every_step"],
                "trainer_no_memory_copy_over_bare": over_bare["trainer_no_memory_copy"],
                "node_memory_copy_share": statistics.median(
                    1 - r["trainer_no_memory_copy"] / r["trainer_memory_every_step"] for r in rounds)}
            presets = figures["presets"]  # written after each preset: a run cut short keeps what it measured
            figures["throughput_over_bare"] = min(p["throughput_over_bare"] for p in presets.values())
            figures["node_memory_copy_share"] = max(p["node_memory_copy_share"] for p in presets.values())
            write_results(Path(args.out), figures, "bench/overhead.py")
    print(json.dumps({k: figures[k] for k in ("throughput_over_bare", "node_memory_copy_share")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
