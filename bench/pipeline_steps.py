"""Where the local pipeline's time outside the training job goes: KFP's local runner, imports, MLflow, exit.

    .venv/bin/python bench/pipeline_steps.py --summary work/fsx/runs/<run>/summary.json   # ~1 min

Measured side by side in one run, each in fresh processes (the way kfp.local runs every task):
- kfp_task_seconds: one task of a pipeline of trivial components through ``kfp.local.SubprocessRunner``
  (what KFP's local runner itself costs per task: a Python process, kfp's executor, its files);
- import_seconds per step: ``python -c "import <the step's module>"`` less ``python -c "pass"``;
- mlflow_import_seconds and mlflow_sqlite_store_seconds: importing MLflow's client, and opening the sqlite
  store the local default uses (SQLAlchemy engine, schema check) — paid once by the process that drives a
  local run (components/delivery.py), and by evaluate, whose promotion gate reads the registry;
- exit_seconds: an interpreter's teardown after torch, transformers and MLflow are loaded.
With --summary (a finished local run), each step's printed wall time is split into these and the rest
(the step's own work). Writes bench/results/pipeline_steps.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, write_results  # noqa: E402  (bench/ is the script's folder)

# The module each step's component body imports for its logic, and whether the step itself opens MLflow in a
# local run: since the driving process delivers the spool (components/delivery.py) only evaluate does (the
# promotion gate reads the model registry); its import is already in evaluate's import time.
STEPS = {"prepare": ("components.prepare.step", False), "fingerprint": ("components.stage.staging", False),
         "stage": ("components.stage.step", False), "tokenize": ("components.stage.step", False),
         "collect shards": ("components.stage.step", False), "record stage": ("components.stage.step", False),
         "train": ("components.train.step", False), "validate": ("components.validate.step", False),
         "evaluate": ("components.evaluate.step", True), "finalize": ("components.finalize.step", False)}


def _wall(code: str, samples: int = 3) -> float:
    """Best wall time of a fresh interpreter running `code` (in this project's environment)."""
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True, cwd=ROOT, capture_output=True)
        times.append(time.perf_counter() - started)
    return min(times)


def _inner(code: str) -> float:
    """Seconds `code` takes inside a fresh interpreter (its own clock, without start-up and teardown)."""
    timed = f"import time\n_t = time.perf_counter()\n{code}\nprint(time.perf_counter() - _t)"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", timed], check=True, cwd=ROOT, capture_output=True,
                          text=True)
    return float(done.stdout.strip().splitlines()[-1])


def kfp_task_seconds(tasks: int = 4) -> float:
    """Per task: a pipeline of `tasks` chained trivial components through kfp.local's SubprocessRunner."""
    script = f"""
import time, tempfile
import kfp.local
from kfp import dsl

@dsl.component(install_kfp_package=False)
def noop(text: str) -> str:
    return text

@dsl.pipeline
def chain():
    task = noop(text="x")
    for _ in range({tasks - 1}):
        task = noop(text=task.output)

kfp.local.init(runner=kfp.local.SubprocessRunner(use_venv=False), pipeline_root=tempfile.mkdtemp())
started = time.perf_counter()
chain()
print(time.perf_counter() - started)
"""
    path = Path(tempfile.mkdtemp(prefix="bench-kfp-")) / "chain.py"  # KFP reads a component's source file
    path.write_text(script)
    done = subprocess.run([sys.executable, "-W", "ignore", str(path)], check=True, cwd=ROOT, capture_output=True,
                          text=True)
    return float(done.stdout.strip().splitlines()[-1]) / tasks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", type=Path, help="a finished local run's summary.json, to split its steps")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "pipeline_steps.json")
    args = parser.parse_args()

    empty = _wall("pass")
    imports = {step: max(0.0, _wall(f"import {module}") - empty) for step, (module, _) in STEPS.items()}
    mlflow_import = _inner("from mlflow.tracking import MlflowClient")
    store = tempfile.mkdtemp(prefix="bench-mlflow-")
    _inner(f"from mlflow.tracking import MlflowClient; MlflowClient('sqlite:///{store}/mlflow.db').search_experiments()")
    # The store opened once before (tables created), as every step finds it; the clock restarts after the import.
    mlflow_store = _inner(f"from mlflow.tracking import MlflowClient\n_t = time.perf_counter()\n"
                          f"MlflowClient('sqlite:///{store}/mlflow.db').search_experiments()")
    loaded = "import torch, transformers\nfrom mlflow.tracking import MlflowClient"
    exit_seconds = max(0.0, _wall(loaded) - empty - _inner(loaded))
    figures = {"python_start_seconds": empty, "kfp_task_seconds": kfp_task_seconds(),
               "import_seconds": imports, "mlflow_import_seconds": mlflow_import,
               "mlflow_sqlite_store_seconds": mlflow_store, "exit_seconds": exit_seconds}
    if args.summary:
        summary = json.loads(args.summary.read_text())
        split = {}
        for step, seconds in summary.get("step_seconds", {}).items():
            module, writes_mlflow = STEPS[step]
            parts = {"kfp_runner": figures["kfp_task_seconds"], "imports": imports[step],
                     "mlflow": mlflow_store if writes_mlflow else 0.0}  # (its import: in the step's imports)
            if step == "train":
                parts["training_job"] = summary["steps"]["train"]["job_wall_seconds"]
            parts["rest"] = seconds - sum(parts.values())
            split[step] = {"wall": seconds, **parts}
        figures["summary"] = str(args.summary)
        figures["outside_job_seconds"] = summary.get("outside_job_seconds")
        figures["steps"] = split
        figures["outside_job_split"] = {key: sum(s.get(key, 0.0) for s in split.values())
                                        for key in ("kfp_runner", "imports", "mlflow", "rest")}
        figures["kfp_runner_share_of_outside_job"] = (figures["outside_job_split"]["kfp_runner"]
                                                      / figures["outside_job_seconds"])
    write_results(args.output, figures, "bench/pipeline_steps.py")
    print(json.dumps({k: v for k, v in figures.items()}, indent=1, default=lambda v: round(v, 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
