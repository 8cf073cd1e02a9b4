"""Losses as the bit-identity tests compare them (the integration tests' helper)."""

from pathlib import Path

from trainer.run.run_dir import read_jsonl

# The learning rate after warm-up does not depend on training.num_steps (trainer.job.schedule): a run's first k steps
# are the same whatever its horizon, so one clean run serves every test of its shape as the reference its faulty
# runs' losses must equal, bit for bit (the clean_reference fixture, tests/integration/conftest.py).
STEADY = ["--training.lr_schedule=constant"]


def losses_by_step(path: Path) -> dict[int, float]:
    """{step: loss} of every step trained, from metrics.jsonl — each step's first record (the point MLflow and the
    run's figures keep: trainer.planning.measured) — after checking that every replay of a step after a fault
    computed the same loss, bit for bit, as its first computation: the resume is exact."""
    first: dict[int, float] = {}
    for record in read_jsonl(path):
        step = int(record["step"])
        if step not in first:
            first[step] = record["loss"]
        assert record["loss"] == first[step], f"step {step} replayed with loss {record['loss']}, first {first[step]}"
    return first


def first_steps(reference: dict[int, float], steps: int) -> dict[int, float]:
    """The reference's losses of steps 1..steps (a run of that many steps)."""
    return {step: loss for step, loss in reference.items() if step <= steps}
