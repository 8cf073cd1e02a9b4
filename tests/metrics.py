"""Losses as the bit-identity tests compare them (the integration tests' helper)."""

from pathlib import Path

from trainer.run.run_dir import read_jsonl


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
