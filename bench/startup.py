"""A start from a base model (model.init_from), today's path against the new one, side by side at 1, 2 and 4 ranks:
what the file system serves, what each rank holds, how long until the first step.

    .venv/bin/python bench/startup.py              # ~8 min on 2 cores; writes bench/results/startup.json
    .venv/bin/python bench/startup.py --preset tiny --world-sizes 1,2   # harness check

The model: the `small` preset's shape (101 M parameters with the byte vocabulary), saved with save_pretrained in
bf16 over safetensors files of 100 MB, as a base model is. Two paths:
- today: every rank ``LlamaForCausalLM.from_pretrained`` in fp32, then FSDP2 keeps its shard (commit 836d549, the
  last before trainer.model.base);
- new: the model built on the meta device and sharded, each rank reading its rows through DCP's Hugging Face
  reader (trainer.model.base).
Per world size and path:
- ``read_over_model_size``: what the storage served every rank (/proc/<pid>/io read_bytes, each rank reading in
  turn from a cold page cache, as one rank per node would), summed, over the weights' files' size
  (bench/startup_probe.py);
- ``peak_rss_over_shard``: the largest rank's peak RSS (VmHWM) over what it held before the load, over its shard's
  fp32 bytes;
- ``seconds_to_first_step``: the trainer itself under torchrun (today's from a git worktree at that commit),
  checkpoints off: from the launch to the first step's metrics line, the slowest of --samples runs' median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

TODAY_COMMIT = "836d549"  # the trainer before it read base models shard by shard (trainer.model.base)
PATHS = ("today", "new")


def _make_model(folder: Path, preset: str) -> int:
    """A base model of the preset's shape in bf16 safetensors; returns its files' bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer.config import MODEL_PRESETS

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=258, **MODEL_PRESETS[preset], bos_token_id=256, eos_token_id=257)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100MB")
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def _probe(path: str, world: int, model: Path, scratch: Path) -> list[dict]:
    out = scratch / f"probe-{path}-{world}.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                    str(ROOT / "bench" / "startup_probe.py"), path, str(model), str(out)], check=True, cwd=ROOT,
                   capture_output=True)
    return json.loads(out.read_text())


def _first_step_seconds(code: Path, world: int, model: Path, tokens: Path, scratch: Path, run_id: str) -> float:
    """Launch -> the first step's metrics line of `python -m trainer` from `code` (a checkout) under torchrun."""
    work = scratch / "work"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
               "trainer", "--config", "local", "--data-dir", str(tokens), f"--run.work_dir={work}",
               f"--run.run_id={run_id}", f"--model.init_from={model}", "--training.num_steps=1",
               "--training.batch_size=1", "--training.seq_len=128", "--checkpoint.enabled=false",
               "--faults.schedule=", "--resilience.straggler_interval=0"]
    started = time.time()
    subprocess.run(command, check=True, cwd=code, capture_output=True, env={**os.environ, "PYTHONPATH": str(code)})
    first = json.loads((work / "fsx" / "runs" / run_id / "metrics.jsonl").read_text().splitlines()[0])
    return first["time"] - started


def _today_checkout(scratch: Path) -> Path | None:
    folder = scratch / "today"
    made = subprocess.run(["git", "worktree", "add", "--detach", str(folder), TODAY_COMMIT], cwd=ROOT,
                          capture_output=True, text=True)
    if made.returncode != 0:
        print(f"no worktree at {TODAY_COMMIT} ({made.stderr.strip()}): today's seconds to the first step are left "
              "out (a shallow clone?)", file=sys.stderr)
        return None
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="the base model's shape (small: 101 M parameters)")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--samples", type=int, default=2, help="runs of each start, alternating paths")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "startup.json")
    args = parser.parse_args()

    (ROOT / "work").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-", dir=ROOT / "work"))  # on disk: /tmp may be tmpfs
    today = None
    try:
        model = scratch / "base"
        weights_bytes = _make_model(model, args.preset)
        tokens = demo_token_dir(scratch, documents=300)
        today = _today_checkout(scratch)
        figures: dict = {"preset": args.preset, "weights_bytes": weights_bytes, "world_sizes": {}}
        for world in (int(w) for w in args.world_sizes.split(",")):
            row: dict = {key: {} for key in ("read_over_model_size", "peak_rss_over_shard", "load_seconds",
                                             "seconds_to_first_step")}
            row["ranks"] = {}
            for path in PATHS:
                ranks = _probe(path, world, model, scratch)
                row["ranks"][path] = ranks
                row["read_over_model_size"][path] = sum(r["storage_bytes_read"] for r in ranks) / weights_bytes
                row["peak_rss_over_shard"][path] = max(r["peak_rss_bytes"] / r["shard_bytes"] for r in ranks)
                row["load_seconds"][path] = max(r["load_seconds"] for r in ranks)
            starts: dict[str, list[float]] = {path: [] for path in PATHS}
            for sample in range(args.samples):
                for path, code in (("today", today), ("new", ROOT)):
                    if code is not None:
                        starts[path].append(_first_step_seconds(code, world, model, tokens, scratch,
                                                                f"{path}-{world}-{sample}"))
            row["seconds_to_first_step"] = {path: statistics.median(s) for path, s in starts.items() if s}
            figures["world_sizes"][str(world)] = row
            print(f"{world} rank(s): read/model today {row['read_over_model_size']['today']:.2f} new "
                  f"{row['read_over_model_size']['new']:.2f}; peak RSS/shard today "
                  f"{row['peak_rss_over_shard']['today']:.2f} new {row['peak_rss_over_shard']['new']:.2f}; first step "
                  + ", ".join(f"{p} {s:.1f} s" for p, s in row["seconds_to_first_step"].items()))
        write_results(args.output, figures, "bench/startup.py")
        print(args.output)
    finally:
        if today is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(today)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
