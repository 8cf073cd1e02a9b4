#!/usr/bin/env bash
# GPU smoke check for a lent H200 (see the device tool): FSDP2 + NVRx async checkpointing on NCCL with a
# ~1 B-parameter Llama (preset llama3-1b), the loop's stall per save and tokens/s, then an in-process restart on
# NCCL, and a NaN drill. About 6 minutes. Prints one JSON document (also written to $OUT/gpu_smoke.json when OUT is set).
#
#   bash bench/gpu_smoke.sh                         # from the repository root on the GPU machine
#   PRESET=tiny BACKEND=gloo SEQ=128 bash bench/gpu_smoke.sh   # the script's own plumbing, on a CPU
#
# The GPU image brings its own torch; the project runs from this checkout (PYTHONPATH), its other needs from
# wheels carried in .whl/ where the image lacks them. It makes a small token dataset, trains STEPS steps with a
# checkpoint every 10 (async, NVRx's writer), again with sync saves, then once more with an injected exception
# under NVRx's in-process restart, and a NaN drill (caught, rerun, rolled back and skipped). Each run's
# checkpoints are removed once its records are read (disk), and the JSON is rewritten after every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-llama3-1b} BACKEND=${BACKEND:-nccl} SEQ=${SEQ:-2048} STEPS=${STEPS:-20}
WORK=${WORK:-/tmp/gpu-smoke}
RESULTS=${OUT:-$WORK}
rm -rf "$WORK" && mkdir -p "$WORK" "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - "$BACKEND" <<'PY'
import sys, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", file=sys.stderr)
sys.exit(0 if torch.cuda.is_available() or sys.argv[1] != "nccl" else 1)
PY
python3 - "$WORK" <<'PY'
import sys
from pathlib import Path
from pipelines.demo_data import demo_files
from trainer.data.shards import tokenize_files
out = Path(sys.argv[1])
raw = out / "raw"; raw.mkdir(parents=True, exist_ok=True)
for name, body in demo_files(4000).items():
    (raw / name).write_bytes(body)
tokenize_files(sorted(raw.iterdir()), out / "tokens", 0.05)
PY
# Node memory every 10 steps, like the FSx saves: a 1 B model's state (params and AdamW, fp32) is 12 GB, two
# copies; on disk where /dev/shm cannot hold them (a container's default is 64 MB).
MEMORY_DIR=/dev/shm/gpu-smoke
[ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt $((30 * 1024 * 1024)) ] 2>/dev/null \
  || MEMORY_DIR="$WORK/node-memory"
echo "node memory in $MEMORY_DIR" >&2
common=(--config local --run.work_dir="$WORK/work" --model.preset="$PRESET" --training.backend="$BACKEND"
        --training.nproc_per_node=1 --training.batch_size=4 --training.seq_len="$SEQ" --training.num_steps="$STEPS"
        --training.warmup_steps=5 --training.log_every=5 --checkpoint.interval_steps=10 --checkpoint.keep_last=1
        --checkpoint.memory_interval_steps=10 --checkpoint.memory_dir="$MEMORY_DIR" --faults.schedule=
        --eval.every_steps=0 --eval.max_batches=2 --eval.max_new_tokens=8 --eval.export_dtype=bfloat16)
run() {  # name, extra args...
  local name=$1; shift
  local started=$SECONDS
  timeout 150 torchrun --standalone --nproc-per-node 1 -m trainer --data-dir "$WORK/tokens" "${common[@]}" \
    --run.run_id="smoke-$name" "$@" > "$RESULTS/$name.log" 2>&1 || echo "$name: exit $?" >> "$RESULTS/$name.log"
  echo "$name: $((SECONDS - started)) s" >&2
  rm -rf "$WORK/work/fsx/runs/smoke-$name/checkpoints" "$WORK/work/fsx/runs/smoke-$name/export" "$MEMORY_DIR"
}
summarize() {  # the JSON of the runs so far: a check cut off by its time limit still leaves its figures
python3 - "$WORK" "$RESULTS" "$PRESET" "$SEQ" "${1:-}" <<'PY'
import json, statistics, sys
from pathlib import Path
import torch
from trainer.resilience.nvrx_compat import nvrx_version
from trainer.run.events import read_events
from trainer.run.run_dir import read_json
work, results, preset, seq, final = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5] == "final"
report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
          "torch": torch.__version__, "nvidia_resiliency_ext": nvrx_version(), "preset": preset, "seq_len": seq,
          "runs": {}}
for name in ("async", "sync", "inprocess", "nan"):
    run = work / "work" / "fsx" / "runs" / f"smoke-{name}"
    log = (results / f"{name}.log").read_text(errors="replace") if (results / f"{name}.log").exists() else ""
    figures = {"result": read_json(run / "result.json"), "log_tail": log.splitlines()[-15:]}
    if (run / "metrics.jsonl").exists():
        metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        later = metrics[5:] or metrics
        figures.update(steps=len(metrics), median_tokens_per_second=statistics.median(m["tokens_per_second"] for m in later),
                       median_step_seconds=statistics.median(m["step_seconds"] for m in later),
                       last_loss=metrics[-1]["loss"] if metrics else None)
    if (run / "events").exists():
        figures["stalls"] = [{k: e.get(k) for k in ("step", "mode", "loop_wait_seconds", "handoff_seconds",
                                                     "memory_seconds", "write_seconds")}
                             for e in read_events(run, "checkpoint_stall")]
        figures["commits"] = [{k: e.get(k) for k in ("step", "mode", "bytes", "write_seconds", "background_seconds")}
                              for e in read_events(run, "checkpoint_committed")]
        figures["recoveries"] = read_events(run, "recovery")
        figures["numeric"] = [{k: v for k, v in e.items() if k not in ("rank", "attempt", "by_dataset")}
                              for e in read_events(run) if e["event"] in ("numeric_anomaly", "numeric_rerun",
                                                                           "rollback", "checkpoint_refused")]
    if figures["result"]:
        figures["result"] = {k: figures["result"].get(k) for k in ("steps", "final_loss", "wall_seconds",
                                                                   "num_parameters", "final_checkpoint_wait_seconds",
                                                                   "final_evaluation_seconds")}
    report["runs"][name] = figures
text = json.dumps(report, indent=1, default=str)
(results / "gpu_smoke.json").write_text(text)
if final:
    print(text)
PY
}
run async --checkpoint.mode=async; summarize
run sync --checkpoint.mode=sync; summarize
run inprocess --checkpoint.mode=async --resilience.in_process=true --faults.schedule=exception@12:rank=0; summarize
run nan --checkpoint.mode=async --resilience.rollback_steps=2 --resilience.skip_steps=2 --faults.schedule=nan@15:rank=0; summarize
summarize final
