#!/usr/bin/env bash
# The GPU check for a lent H200 (the device tool): at most 8 minutes, one JSON document on stdout (also written to
# $OUT/gpu_check.json after every run, so a check cut off by its time limit still leaves what it measured).
#
#   bash bench/gpu_check.sh                                              # the repository root, on the GPU machine
#   PRESET=tiny SMALL=tiny BACKEND=gloo SEQ=128 STEPS=6 VOCAB=0 bash bench/gpu_check.sh   # its plumbing, on a CPU
#
# What it measures (bench/README.md says what to compare the figures with):
#   perf-*    the 1B preset at sequence length 8,192 with its published 128,256-token vocabulary (VOCAB; the byte
#             tokenizer's ids fill it: a throughput check), 1 GPU, no checkpoints: mfu, TFLOP/s per GPU, tokens/s and
#             the CUDA allocator's peaks, for compile off and on, and for selective (op) against full checkpointing;
#   memcopy   perf-eager again with the node-memory copy after every step and an async FSx save at step 10: the
#             step's wall time against perf-eager's (the copy's cost), and the loop's stall per save;
#   restart   SIGKILL of the training process under ft_launcher on NCCL (one rank: NCCL refuses two ranks on one
#             GPU): its first step compiling cold and again after the restart (the run folder's compile cache), and
#             its recovery seconds from node memory; the `small` preset;
#   nan       a NaN drill: caught in its step, rolled back and skipped; the `small` preset.
#   mem-*     perf-eager's model without checkpointing, with full checkpointing, and with 4 micro-batches a step
#             (gradients accumulated unsharded): with the perf runs, each run's peak allocated memory against the
#             estimate of trainer.planning.model_size for its config (`memory_estimate_over_max_allocated`).
#
# The GPU image brings its own torch; the project runs from this checkout (PYTHONPATH), its other needs from wheels
# carried in .whl/ where the image lacks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=${PRESET:-llama3-1b} SMALL=${SMALL:-small} BACKEND=${BACKEND:-nccl} SEQ=${SEQ:-8192} STEPS=${STEPS:-14}
VOCAB=${VOCAB:-128256}  # model.vocab_size of the perf runs (0: the preset's own, else the tokenizer's)
WORK=${WORK:-/tmp/gpu-check}
RUNS=${RUNS:-"perf-eager perf-compiled memcopy restart nan perf-compiled-full mem-none mem-full mem-accum4"}  # a rerun of some: RUNS="restart nan"
RESULTS=${OUT:-$WORK}
rm -rf "$WORK/work" && mkdir -p "$WORK" "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 - "$BACKEND" <<'PY'
import sys, torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "", file=sys.stderr)
sys.exit(0 if torch.cuda.is_available() or sys.argv[1] != "nccl" else 1)
PY
[ -d "$WORK/tokens" ] || python3 - "$WORK" <<'PY'
import sys
from pathlib import Path
from pipelines.demo_data import demo_files
from trainer.data.shards import tokenize_files
out = Path(sys.argv[1])
raw = out / "raw"; raw.mkdir(parents=True, exist_ok=True)
for name, body in demo_files(3000).items():
    (raw / name).write_bytes(body)
tokenize_files(sorted(raw.iterdir()), out / "tokens", 0.05)
PY
# A 1B model's state (fp32 params and AdamW) is 12 GB: two node-memory slots and the pinned staging copy; on disk
# where /dev/shm cannot hold them (a container's default is 64 MB).
MEMORY_DIR=/dev/shm/gpu-check
[ "$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt $((40 * 1024 * 1024)) ] 2>/dev/null \
  || MEMORY_DIR="$WORK/node-memory"
common=(--config local --run.work_dir="$WORK/work" --training.backend="$BACKEND" --training.nproc_per_node=1
        --training.warmup_steps=2 --training.log_every=2 --faults.schedule= --checkpoint.memory_dir="$MEMORY_DIR"
        --eval.every_steps=0 --eval.max_batches=2 --eval.max_new_tokens=8 --eval.export_dtype=bfloat16)
perf=(--model.preset="$PRESET" --model.vocab_size="$VOCAB" --training.batch_size=2 --training.seq_len="$SEQ" --training.num_steps="$STEPS"
      --training.activation_checkpointing=selective --training.selective_ac=op)
wanted() { [[ " $RUNS " == *" $1 "* ]]; }
run() {  # name, time limit (s), extra args...: torchrun, one process
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local started=$SECONDS
  printf '%s\n' "${common[@]}" "$@" > "$RESULTS/$name.args"  # the run's config, for the memory estimate
  timeout -k 5 "$limit" torchrun --standalone --nproc-per-node 1 -m trainer --data-dir "$WORK/tokens" "${common[@]}" \
    --run.run_id="check-$name" "$@" > "$RESULTS/$name.log" 2>&1 || echo "$name: exit $?" >> "$RESULTS/$name.log"
  echo "$name: $((SECONDS - started)) s" >&2
  rm -rf "$WORK/work/fsx/runs/check-$name/checkpoints" "$WORK/work/fsx/runs/check-$name/export" "$MEMORY_DIR"
}
launched() {  # name, time limit (s), extra overrides...: the project's launcher (ft_launcher: restarts)
  local name=$1 limit=$2; shift 2
  wanted "$name" || return 0
  local started=$SECONDS
  timeout -k 5 "$limit" python3 - "$WORK" "$name" "${common[@]}" "$@" > "$RESULTS/$name.log" 2>&1 <<'PY' \
    || echo "$name: exit $?" >> "$RESULTS/$name.log"
import sys
from pathlib import Path
from components.train.local import run_local_training
from trainer.config import load_config
work, name, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
config = overrides[overrides.index("--config") + 1]
rest = [o for i, o in enumerate(overrides) if o != "--config" and (i == 0 or overrides[i - 1] != "--config")]
cfg = load_config(config, [*rest, f"--run.run_id=check-{name}"])
print(run_local_training(cfg, work / "tokens"))
PY
  echo "$name: $((SECONDS - started)) s" >&2
  rm -rf "$WORK/work/fsx/runs/check-$name/checkpoints" "$WORK/work/fsx/runs/check-$name/export" "$MEMORY_DIR"
}
summarize() {
  python3 bench/gpu_check_report.py "$WORK" "$RESULTS" "$PRESET" "$SEQ" ${1:+"$1"}
}
run perf-eager 80 "${perf[@]}" --training.compile=false --checkpoint.enabled=false; summarize
run perf-compiled 110 "${perf[@]}" --training.compile=true --checkpoint.enabled=false; summarize
run memcopy 70 "${perf[@]}" --training.num_steps=10 --training.compile=false --checkpoint.mode=async --checkpoint.interval_steps=10 \
  --checkpoint.keep_last=1 --checkpoint.memory_interval_steps=1 --checkpoint.memory_copy=async; summarize
small=(--model.preset="$SMALL" --training.batch_size=4 --training.seq_len=2048 --training.num_steps=16
       --checkpoint.interval_steps=8 --checkpoint.memory_interval_steps=1)
launched restart 130 "${small[@]}" --faults.schedule=sigkill@10:rank=0; summarize
run nan 90 "${small[@]}" --resilience.rollback_steps=2 --resilience.skip_steps=2 --faults.schedule=nan@12:rank=0
summarize
run perf-compiled-full 90 "${perf[@]}" --training.compile=true --training.activation_checkpointing=full \
  --checkpoint.enabled=false
mem=("${perf[@]}" --training.num_steps=6 --training.compile=false --checkpoint.enabled=false)
run mem-none 80 "${mem[@]}" --training.activation_checkpointing=none; summarize
run mem-full 80 "${mem[@]}" --training.activation_checkpointing=full; summarize
run mem-accum4 100 "${mem[@]}" --training.grad_accum_steps=4; summarize
summarize final
