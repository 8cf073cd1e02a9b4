"""Validation, evaluation and export of a trained model, today's path against the new one, side by side at 1 and 2
ranks: what each process holds, how long each part takes, what goes through the tracking server.

    .venv/bin/python bench/evaluate.py                     # ~10 min on 2 cores; writes bench/results/evaluate.json
    .venv/bin/python bench/evaluate.py --preset tiny --world-sizes 1   # harness check

The model: the `small` preset's shape (101 M parameters with the byte vocabulary), trained one step by the trainer
(`python -m trainer` under torchrun, checkpoint every step), twice per world size: run A, then run B with A's export
as its champion. A real MLflow tracking server on loopback (its artifact store a folder, whose growth is what went
through it). Two paths:
- today (the commit before issue 41, from a git worktree): validate loads the checkpoint into one process (fp32) and
  checks it; evaluate loads the candidate into one process, computes full fp32 logits, downloads the champion
  through the tracking server and evaluates it; the export is written by one process and uploaded through the
  tracking server (``client.log_artifacts``), then registered;
- new: validate streams the checkpoint a tensor at a time; the training's ranks evaluate the candidate, export it in
  shards (each rank its part) and read the champion from its export (the record's ``seconds`` and per-rank
  memory); the gate registers the export's URI.
Per world size: ``peak_rss_over_model``: a process's peak RSS over what it held after its imports, over the model's
fp32 bytes (for the ranks: the largest rank's, over the whole model, and ``rank_peak_rss_over_shard`` over its own
shard); ``seconds``; ``bytes_through_tracking_server``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, demo_token_dir, write_results  # noqa: E402  (bench/ is the script's folder)

TODAY_COMMIT = "f605da9"  # the last commit before the evaluation moved onto the training's ranks (issue 41)
MODEL = "bench-llama"


def _train(world: int, preset: str, tokens: Path, work: Path, run_id: str, exports: str,
           champion: str | None) -> dict:
    """The new trainer: one step, its checkpoint, and its final evaluation and export (the record)."""
    run_dir = work / "fsx" / "runs" / run_id
    if champion:
        (run_dir / "eval").mkdir(parents=True, exist_ok=True)
        (run_dir / "eval" / "champion.json").write_text(json.dumps({"name": MODEL, "version": "1", "source": champion}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
               "trainer", "--config", "local", "--data-dir", str(tokens), f"--run.work_dir={work}",
               f"--run.run_id={run_id}", f"--model.preset={preset}", "--training.num_steps=1",
               "--training.batch_size=1", "--training.seq_len=128", "--checkpoint.interval_steps=1",
               "--checkpoint.memory_interval_steps=0", "--faults.schedule=", "--resilience.straggler_interval=0",
               "--eval.batch_size=2", "--eval.max_batches=2", "--eval.prompts=The", "--eval.max_new_tokens=8",
               f"--eval.export_uri={exports}"]
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True)
    return json.loads((run_dir / "eval" / "step-000001.json").read_text())


def _probe(code: Path, *args: str) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "evaluate_probe.py"), *args], cwd=code,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(code)})
    if proc.returncode != 0:
        raise RuntimeError(f"evaluate_probe {args[0]} ({code}) failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _today_checkout(scratch: Path) -> Path:
    folder = scratch / "today"
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), TODAY_COMMIT], cwd=ROOT, check=True,
                   capture_output=True)
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="the model's shape (small: 101 M parameters)")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "evaluate.json")
    args = parser.parse_args()

    from pipelines.local_stack import MlflowServer, S3Server

    (ROOT / "work").mkdir(exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-evaluate-", dir=ROOT / "work"))  # on disk: /tmp may be tmpfs
    today = None
    try:
        tokens = demo_token_dir(scratch, documents=300)
        today = _today_checkout(scratch)
        figures: dict = {"preset": args.preset, "world_sizes": {}}
        with MlflowServer(scratch / "mlflow") as server, S3Server(log_dir=scratch / "s3"):
            import boto3

            boto3.client("s3").create_bucket(Bucket="bench-exports")  # the exports' S3 (a server refuses local paths)
            artifacts = str(scratch / "mlflow" / "artifacts")
            for world in (int(w) for w in args.world_sizes.split(",")):
                work, exports = scratch / f"work-{world}", f"s3://bench-exports/world-{world}"
                first = _train(world, args.preset, tokens, work, f"a{world}", exports, None)
                second = _train(world, args.preset, tokens, work, f"b{world}", exports, first["export"]["uri"])
                checkpoint = str(work / "fsx" / "runs" / f"b{world}" / "checkpoints" / "step-000001")
                model_bytes = sum(second["memory"]["shard_bytes"])
                today_export = _probe(today, "export_today", str(work / "fsx" / "runs" / f"a{world}" / "checkpoints" /
                                                                 "step-000001"), server.tracking_uri, artifacts, MODEL)
                today_eval = _probe(today, "evaluate_today", checkpoint, str(tokens), server.tracking_uri, MODEL, "128")
                validate = {path: _probe(code, "validate", checkpoint) for path, code in (("today", today),
                                                                                          ("new", ROOT))}
                record = str(work / "fsx" / "runs" / f"b{world}" / "eval" / "step-000001.json")
                gate = _probe(ROOT, "gate", record, server.tracking_uri, artifacts, MODEL)
                memory = second["memory"]
                rank_growth = [peak - before for peak, before in zip(memory["peak_rss_bytes"],
                                                                      memory["rss_before_bytes"])]
                candidate_seconds = second["candidate"]["eval_seconds"] + sum(
                    t["seconds"] for t in second["candidate"]["tasks"].values())
                row = {
                    "model_bytes_fp32": model_bytes,
                    "validate": {path: {"seconds": v["seconds"], "peak_rss_bytes": v["peak_rss_bytes"],
                                        "peak_rss_over_model": v["peak_rss_bytes"] / model_bytes}
                                 for path, v in validate.items()},
                    "evaluate": {
                        "today": {"seconds": today_eval["seconds"], "peak_rss_bytes": today_eval["peak_rss_bytes"],
                                  "peak_rss_over_model": today_eval["peak_rss_bytes"] / model_bytes},
                        "new": {"seconds_final_evaluation": second["seconds"],
                                "seconds_candidate_heldout_and_tasks": candidate_seconds,
                                "peak_rss_over_model": max(rank_growth) / model_bytes,
                                "rank_peak_rss_over_shard": [g / s for g, s in zip(rank_growth, memory["shard_bytes"])],
                                "rank_peak_rss_growth_bytes": rank_growth, "gate_seconds": gate["seconds"],
                                "gate_peak_rss_bytes": gate["peak_rss_bytes"],
                                "gate_peak_rss_over_model": gate["peak_rss_bytes"] / model_bytes}},
                    "export": {
                        "today": {"seconds": today_export["seconds"], "peak_rss_bytes": today_export["peak_rss_bytes"],
                                  "peak_rss_over_model": today_export["peak_rss_bytes"] / model_bytes,
                                  "bytes_through_tracking_server": today_export["bytes_through_tracking_server"]},
                        "new": {"seconds": second["export"]["seconds"], "bytes": second["export"]["bytes"],
                                "weight_files": second["export"]["weight_files"],
                                "bytes_through_tracking_server": gate["bytes_through_tracking_server"]}},
                    "champion_loss": {"today": today_eval["champion_loss"],
                                      "new": second["champion"].get("heldout_loss")},
                }
                figures["world_sizes"][str(world)] = row
                print(f"{world} rank(s), model {model_bytes / 1e6:.0f} MB fp32: validate peak RSS/model today "
                      f"{row['validate']['today']['peak_rss_over_model']:.2f} new "
                      f"{row['validate']['new']['peak_rss_over_model']:.3f}; "
                      f"evaluate today {row['evaluate']['today']['peak_rss_over_model']:.2f}, new ranks "
                      f"{row['evaluate']['new']['peak_rss_over_model']:.2f} (gate "
                      f"{row['evaluate']['new']['gate_peak_rss_over_model']:.3f}); through MLflow today "
                      f"{row['export']['today']['bytes_through_tracking_server'] / 1e6:.0f} MB, new "
                      f"{row['export']['new']['bytes_through_tracking_server']} B")
        write_results(args.output, figures, "bench/evaluate.py")
        print(args.output)
    finally:
        if today is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(today)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
