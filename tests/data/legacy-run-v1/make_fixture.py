"""Made tests/data/legacy-run-v1 once, from a checkout of commit 14fb929 (events/rank-N.jsonl): a drill recovered
with progress, then a crash loop stopped mid-streak (ft_launcher's own --max-restarts ends it).

    .venv/bin/python tests/data/legacy-run-v1/make_fixture.py /tmp/legacy/work   # in that checkout
"""
import os, shutil, subprocess, sys, time, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pipelines.demo_data import demo_files
from trainer.data.shards import tokenize_files
from trainer.config import load_config
from tests.launch import start_launcher

work = Path(sys.argv[1]); shutil.rmtree(work, ignore_errors=True); work.mkdir(parents=True)
raw = work / "raw"; raw.mkdir()
for name, body in demo_files(300).items():
    (raw / name).write_bytes(body)
tokens = work / "tokens"; tokenize_files(sorted(raw.iterdir()), tokens, 0.1)
FAST = ["--training.batch_size=4", "--training.seq_len=32", "--training.warmup_steps=2", "--training.log_every=2",
        "--eval.max_batches=4", "--resilience.straggler_interval=5"]
cfg = load_config("local", [f"--run.work_dir={work}", "--run.run_id=legacy", f"--checkpoint.memory_dir={work}/node-memory",
                            *FAST, "--training.num_steps=12", "--checkpoint.interval_steps=2", "--checkpoint.mode=sync",
                            "--checkpoint.memory_interval_steps=0", "--checkpoint.keep_last=1",
                            "--faults.schedule=sigkill@3:rank=1, exception@6:repeat",
                            "--resilience.max_restarts=3", "--resilience.max_restarts_without_progress=3",
                            "--resilience.heartbeat_timeout=8", "--resilience.initial_heartbeat_timeout=90"])
proc, token = start_launcher(cfg, tokens, RESILIENT_TRAIN_BUDGET_SINCE="1796000000.0")
print("exit", proc.wait(timeout=600))
print(subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout)
