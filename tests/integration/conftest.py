from pathlib import Path

import pytest

from pipelines.demo_data import demo_files
from trainer.config import load_config
from trainer.data import tokenize_files

# Small enough for 2 CPU ranks in seconds; still the real model, FSDP2, gloo and DCP.
FAST_TRAINING = ["--training.batch_size=4", "--training.seq_len=32", "--training.warmup_steps=2",
                 "--training.log_every=2", "--eval.max_batches=4"]


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    for name, body in demo_files(300).items():
        (raw / name).write_bytes(body)
    out = tmp_path_factory.mktemp("tokens")
    tokenize_files(sorted(raw.iterdir()), out, 0.1)
    return out


def _training_config(work_dir: Path, run_id: str, *extra: str):
    # The node-memory tier in the test's own folder: no test sees another's copies.
    return load_config("local", [f"--run.work_dir={work_dir}", f"--run.run_id={run_id}",
                                 f"--checkpoint.memory_dir={work_dir}/node-memory", *FAST_TRAINING, *extra])


@pytest.fixture(scope="session")
def training_config():
    """training_config(work_dir, run_id, *overrides) -> Config for a fast 2-rank CPU run."""
    return _training_config


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, token_dir):
    """One real 2-rank training run (8 steps, checkpoints at 4 and 8), shared by the tests that read it."""
    from components.train.local import run_local_training

    cfg = _training_config(tmp_path_factory.mktemp("work"), "trained", "--training.num_steps=8",
                          "--checkpoint.interval_steps=4")
    result = run_local_training(cfg, token_dir)
    return cfg, result
