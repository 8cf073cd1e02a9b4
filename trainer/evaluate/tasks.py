"""Evaluation tasks besides the held-out loss (eval.tasks): entry points that get the sharded model and the
tokenizer and return metrics.

    eval.tasks: "multiple_choice,my_package.evals:arithmetic"

An entry point is ``module:function`` (or the name of a task shipped here) taking a `TaskContext` and returning
{metric name: number}. It runs on every rank of the evaluating ranks at once (the model is sharded: its forward is
a collective), so it must make the same forward calls on each; `TaskContext.score` does that for log-likelihood
scoring, the usual way to evaluate a base model. What a task raises is caught and recorded under its name: the gate
then decides on the loss alone, unless eval.tasks_required.

Shipped: ``multiple_choice``, accuracy on a jsonl of {"question", "choices": [...], "answer": index} (eval.task_file;
empty: trainer/evaluate/data/multiple_choice.jsonl), each choice scored by its log-likelihood after the question
(``accuracy``) and per token (``accuracy_norm``), as lm-evaluation-harness scores multiple-choice tasks.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from trainer.config.rules import ConfigError
from trainer.evaluate.heldout import Ranks, score_sequences

log = logging.getLogger(__name__)

BUILTIN = {"multiple_choice": "trainer.evaluate.tasks:multiple_choice"}
BUNDLED_MULTIPLE_CHOICE = Path(__file__).parent / "data" / "multiple_choice.jsonl"


@dataclass
class TaskContext:
    """What a task gets: the model (sharded: call it on every rank alike), the tokenizer (trainer.data.tokenizer),
    the evaluating ranks, eval.task_file."""

    model: torch.nn.Module
    tokenizer: Any
    ranks: Ranks
    task_file: str = ""

    def score(self, sequences: list[tuple[list[int], int]]) -> list[tuple[float, int]]:
        """Log-likelihood of each sequence's tokens from its given position on, and their count (collective)."""
        return score_sequences(self.model, sequences, self.ranks)


def load_task(entry_point: str) -> Callable[[TaskContext], dict[str, float]]:
    """The function an eval.tasks entry names; ConfigError naming it when it cannot be imported."""
    target = BUILTIN.get(entry_point, entry_point)
    module_name, _, function = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), function)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"eval.tasks: {entry_point!r} is not an importable module:function ({err}); shipped tasks: "
                          f"{', '.join(BUILTIN)}") from err


def run_tasks(entry_points: list[str], context: TaskContext) -> dict[str, dict[str, Any]]:
    """Each task's metrics and seconds, or its error (the task's name and what it raised)."""
    results = {}
    for entry_point in entry_points:
        started = time.perf_counter()
        try:
            metrics = {key: float(value) for key, value in load_task(entry_point)(context).items()}
            results[entry_point] = {"metrics": metrics, "seconds": time.perf_counter() - started}
            log.info("eval task %s: %s", entry_point, ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        except Exception as err:  # noqa: BLE001 - a user's task: recorded under its name, the gate decides
            results[entry_point] = {"error": f"{type(err).__name__}: {err}", "seconds": time.perf_counter() - started}
            log.error("eval task %s failed: %s: %s", entry_point, type(err).__name__, err)
    return results


def multiple_choice(context: TaskContext) -> dict[str, float]:
    """Accuracy on a multiple-choice jsonl: the choice the model finds likeliest after the question."""
    path = Path(context.task_file) if context.task_file else BUNDLED_MULTIPLE_CHOICE
    items = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if not (isinstance(item.get("choices"), list) and isinstance(item.get("answer"), int)
                and 0 <= item["answer"] < len(item["choices"])):
            raise ValueError(f"{path}:{number}: needs \"question\", \"choices\" (a list) and \"answer\" (an index "
                             "into choices)")
        items.append(item)
    if not items:
        raise ValueError(f"{path}: no questions")
    tokenizer = context.tokenizer
    sequences, owners = [], []
    for index, item in enumerate(items):
        [question] = tokenizer.encode_documents([item["question"]])
        if tokenizer.eos_id is not None and question and question[-1] == tokenizer.eos_id:
            question = question[:-1]  # the choice continues the question
        for choice in item["choices"]:
            [answer] = tokenizer.encode_documents([" " + choice])
            answer = [t for t in answer if t not in (tokenizer.bos_id, tokenizer.eos_id)]
            sequences.append((question + answer, len(question)))
            owners.append(index)
    scores = context.score(sequences)
    correct = correct_norm = 0
    position = 0
    for item in items:
        choice_scores = scores[position:position + len(item["choices"])]
        position += len(item["choices"])
        correct += max(range(len(choice_scores)), key=lambda c: choice_scores[c][0]) == item["answer"]
        correct_norm += max(range(len(choice_scores)),
                            key=lambda c: choice_scores[c][0] / max(1, choice_scores[c][1])) == item["answer"]
    return {"accuracy": correct / len(items), "accuracy_norm": correct_norm / len(items), "questions": len(items)}
