#!/usr/bin/env bash
# GPU smoke check for a lent H200 (see the device tool): FSDP2 + NVRx async checkpointing on NCCL with a
# ~1 B-parameter Llama (preset llama3-1b), printing the loop's stall per save and tokens/s. < 5 minutes.
#
#   bash bench/gpu_smoke.sh            # from the repository root on the GPU machine
#
# It installs the project into the machine's Python (the GPU image brings its own torch), makes a small
# token dataset, trains 30 steps with a checkpoint every 10 (async, NVRx writer), then again with sync
# saves, then once more with an injected exception at step 15 under NVRx in-process restart on NCCL, and
# prints the stalls, tokens/s and the recovery record.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-smoke}
mkdir -p "$OUT"
python3 -m pip install --quiet --no-deps -e . >/dev/null
python3 - <<'PY'
import torch, sys
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
from trainer.resilience.nvrx_compat import nvrx_version
print("nvidia-resiliency-ext", nvrx_version())
sys.exit(0 if torch.cuda.is_available() else 1)
PY
python3 - "$OUT" <<'PY'
import sys
from pathlib import Path
from pipelines.demo_data import demo_files
from trainer.data import tokenize_files
out = Path(sys.argv[1])
raw = out / "raw"; raw.mkdir(parents=True, exist_ok=True)
for name, body in demo_files(4000).items():
    (raw / name).write_bytes(body)
tokenize_files(sorted(raw.iterdir()), out / "tokens", 0.05)
PY
common=(--config local --run.work_dir="$OUT/work" --model.preset=llama3-1b --training.backend=nccl
        --training.nproc_per_node=1 --training.batch_size=4 --training.seq_len=2048 --training.num_steps=30
        --training.warmup_steps=5 --training.log_every=5 --checkpoint.interval_steps=10 --checkpoint.keep_last=1)
for mode in async sync; do
  timeout 150 torchrun --standalone --nproc-per-node 1 -m trainer --data-dir "$OUT/tokens" "${common[@]}" \
    --run.run_id="smoke-$mode" --checkpoint.mode=$mode 2>&1 | tee "$OUT/$mode.log" | grep -E "step [0-9]+/|committed|Error" || true
done
timeout 150 torchrun --standalone --nproc-per-node 1 -m trainer --data-dir "$OUT/tokens" "${common[@]}" \
  --run.run_id=smoke-inprocess --resilience.in_process=true --faults.schedule=exception@15:rank=0 2>&1 \
  | tee "$OUT/inprocess.log" | grep -E "recovered|injecting|Error" || true
python3 - "$OUT" <<'PY'
import json, sys, statistics
from pathlib import Path
from trainer.run.events import read_events
out = Path(sys.argv[1])
for mode in ("async", "sync"):
    run = out / "work" / "fsx" / "runs" / f"smoke-{mode}"
    stalls = [e["handoff_seconds"] for e in read_events(run, "checkpoint_stall")]  # one record per save
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    tps = statistics.median(m["tokens_per_second"] for m in metrics[5:])
    print(f"{mode}: stall per save {['%.3f' % s for s in stalls]} s, median {tps:,.0f} tokens/s, "
          f"mode {read_events(run, 'checkpoint_committed')[0]['mode']}")
for record in read_events(out / "work" / "fsx" / "runs" / "smoke-inprocess", "recovery"):
    print("in-process recovery on NCCL:", json.dumps(record))
PY
