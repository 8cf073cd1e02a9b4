import json
from pathlib import Path

import pytest

from pipelines.demo_data import demo_files
from trainer.config import load_config
from trainer.data.shards import tokenize_files
from tests.metrics import STEADY, losses_by_step
from trainer.run.events import read_events

# Small enough for 2 CPU ranks in seconds; still the real model, FSDP2, gloo and DCP.
# Straggler reports every 5 steps: every clean run of the suite is a check for false positives (the audit below).
# The final evaluation's generations: 4 tokens a prompt (each token is a forward of the sharded model, a collective;
# 48, the default, cost ~3 s per training run here; tests/integration/test_pipeline_local.py keeps 48).
# The node-memory copy every step (not the planner's interval, checkpoint.memory_interval_steps=auto): the tests
# of recovery know which step each fault resumes from (tests/integration/test_memory_tier.py checks auto).
FAST_TRAINING = ["--training.batch_size=4", "--training.seq_len=32", "--training.warmup_steps=2",
                 "--training.log_every=2", "--eval.max_batches=4", "--eval.max_new_tokens=4",
                 "--resilience.straggler_interval=5", "--checkpoint.memory_interval_steps=1"]


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory) -> Path:
    raw = tmp_path_factory.mktemp("raw")
    for name, body in demo_files(300).items():
        (raw / name).write_bytes(body)
    # named "tokens", not "tokens0": a corpus's sample order is keyed by its name (its folder's, for a single one)
    # and its content, and tests/data/r1-today's fixture tokenized into a folder of that name
    out = tmp_path_factory.mktemp("tokens", numbered=False)
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


REFERENCE_STEPS = 40


@pytest.fixture(scope="session")
def clean_reference(tmp_path_factory, token_dir):
    """{step: loss} of one clean run of REFERENCE_STEPS steps in the shape of FAST_TRAINING and STEADY (1 node x 2
    ranks): what a fault-free run of that shape trains at each step, whatever its num_steps, its checkpoint interval
    and mode, its node memory or its restart settings — none of them changes what is computed, which is what the
    tests comparing with it assert of their faulty runs."""
    from components.train.local import run_local_training

    cfg = _training_config(tmp_path_factory.mktemp("reference"), "reference", *STEADY,
                           f"--training.num_steps={REFERENCE_STEPS}", "--checkpoint.interval_steps=4",
                           "--faults.schedule=")
    run_local_training(cfg, token_dir)
    losses = losses_by_step(cfg.run_dir / "metrics.jsonl")
    assert sorted(losses) == list(range(1, REFERENCE_STEPS + 1))
    return losses


AUDIT = "straggler-audit.jsonl"


@pytest.fixture(autouse=True)
def no_straggler_in_clean_runs(request, tmp_path, tmp_path_factory):
    """After each test: every run folder it trained in without a straggler drill reported no straggler. The
    reports it saw are added to the session's audit (printed at the end: the false-positive count)."""
    yield
    audit = tmp_path_factory.getbasetemp() / AUDIT
    for events_dir in tmp_path.rglob("events"):
        records = read_events(events_dir.parent)
        if any(r["event"] == "fault" and r.get("fault_type") == "straggler" for r in records):
            continue
        reports = [r for r in records if r["event"] == "straggler_report"]
        named = [r for r in records if r["event"] == "straggler"]
        lowest = min((r["lowest"]["score"] for r in reports if r["lowest"]), default=None)
        with audit.open("a") as handle:
            handle.write(json.dumps({"test": request.node.nodeid, "reports": len(reports), "named": len(named),
                                     "lowest": lowest}) + "\n")
        assert not named, f"a clean run named a straggler: {named}"


def pytest_terminal_summary(terminalreporter, config):
    base = config._tmp_path_factory.getbasetemp() if hasattr(config, "_tmp_path_factory") else None
    audit = base / AUDIT if base is not None else None
    if audit is None or not audit.is_file():
        return
    runs = [json.loads(line) for line in audit.read_text().splitlines()]
    lows = [r["lowest"] for r in runs if r["lowest"] is not None]
    terminalreporter.write_line(
        f"straggler audit: {sum(r['reports'] for r in runs)} reports over {len(runs)} clean run folders, "
        f"{sum(r['named'] for r in runs)} named a straggler; lowest relative score "
        f"{min(lows):.2f}" if lows else "straggler audit: no reports")
