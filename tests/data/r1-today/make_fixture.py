"""Made tests/data/r1-today/losses.json: the per-step losses of a clean run in two shapes, one node of 2 ranks and
2 nodes of 2 ranks, on the test suite's token data (tests/integration/conftest.py's token_dir and FAST_TRAINING),
with the versions that computed them. First from a checkout of commit 32e85b0 (before replica groups); made again
at commit 9a17704, whose sample order (issue 40: the k-th sample a function of (seed, k), epochs without
replacement) changed the batches R = 1 trains; and at commit 3c00563, whose sample order (issue 50: a corpus's
permutations keyed by its name and content hash, not its position) changed them again — each the one change of
its losses its issue allowed. Before the last, 3c00563's code with its corpora keyed by position (the order a run
begun before data phases resumes in) reproduced 9a17704's fixture bit for bit in both shapes.

    PYTHONPATH=. .venv/bin/python tests/data/r1-today/make_fixture.py /tmp/r1/work > out   # in that checkout

The runs print their launchers' output too: losses.json is the last JSON object of `out`. It was made again at
9a17704 with the CPU kernels pinned to baseline x86-64 instructions (ENV below, recorded as `env`; the test sets
the same): the losses of unpinned kernels depend on the host's CPU in their last bits. Pinned, an AMD EPYC host
still computed three 1x2 losses 1 ulp off the figures made on the earlier sessions' host, with 3c00563's code as
with today's: its run of this script at 3c00563 is `losses_on_cpu["AuthenticAMD"]` (the test takes the figures of
its host's vendor where the fixture has them; `cpu_vendor` below is printed for that).
"""
import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from components.train.local import run_local_training  # noqa: E402
from pipelines.demo_data import demo_files  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data.shards import tokenize_files  # noqa: E402
from trainer.run.run_dir import read_jsonl  # noqa: E402

SHAPES = {"1x2": ["--training.num_nodes=1"], "2x2": ["--training.num_nodes=2"]}
FAST = ["--training.batch_size=4", "--training.seq_len=32", "--training.warmup_steps=2", "--training.log_every=2",
        "--eval.max_batches=4", "--resilience.straggler_interval=5"]
# AdamW decays every parameter, as it did before issue 44's no-decay groups (the test passes the same)
ONE_GROUP = ["--optimizer.no_decay=[]"]

# torch, oneDNN and MKL read these when they load: set before any training process starts
ENV = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "COMPATIBLE"}
os.environ.update(ENV)
work = Path(sys.argv[1])
shutil.rmtree(work, ignore_errors=True)
(work / "raw").mkdir(parents=True)
for name, body in demo_files(300).items():
    (work / "raw" / name).write_bytes(body)
tokenize_files(sorted((work / "raw").iterdir()), work / "tokens", 0.1)
losses = {}
for shape, flags in SHAPES.items():
    cfg = load_config("local", [f"--run.work_dir={work / shape}", f"--run.run_id=r1-{shape}",
                                f"--checkpoint.memory_dir={work / shape}/node-memory", *FAST,
                                "--training.num_steps=8", "--checkpoint.interval_steps=4", *ONE_GROUP, *flags])
    run_local_training(cfg, work / "tokens")
    losses[shape] = {str(r["step"]): r["loss"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")}
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
vendor = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
print(json.dumps({"commit": commit, "cpu_vendor": vendor, "torch": version("torch"),
                  "transformers": version("transformers"),
                  "settings": FAST + ["--training.num_steps=8", "--checkpoint.interval_steps=4"], "env": ENV,
                  "losses": losses}, indent=1))
