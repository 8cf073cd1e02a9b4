"""Evaluation on the training's ranks, with the model sharded as it trains (FSDP2; bf16 compute on GPUs).

    windows = heldout_windows(data_dir, seq_len, batch_size, max_batches)   # the same windows every time
    heldout_loss(model, windows, ranks)                                     # collective
    score_sequences(model, sequences, ranks)                                # collective: tasks' log-likelihoods
    generate(model, tokenizer, prompts, max_new_tokens, ranks)              # collective: greedy, identical on all

A sharded model's forward is a collective (each layer's weights are gathered from every rank), so every rank calls
it the same number of times: the windows are dealt out to the ranks, and a rank with none left in a round scores a
window it has with weight zero. The loss is computed in chunks (trainer.model.loss).
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from trainer.data.batches import TokenBatches
from trainer.model.loss import IGNORE


@dataclass(frozen=True)
class Ranks:
    """The ranks evaluating together (a replica group's, or the whole job's) and this process's place in them."""

    rank: int
    world_size: int
    device: torch.device
    batch_size: int
    loss_chunk: int

    def all_reduce(self, tensor: torch.Tensor, op=None) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
        return tensor


@dataclass(frozen=True)
class Windows:
    inputs: np.ndarray  # [windows, seq_len] token ids
    targets: np.ndarray  # [windows, seq_len] the next token of each position (IGNORE: no target)
    fingerprint: str  # the windows' content: two evaluations with the same fingerprint are comparable
    positions: np.ndarray | None = None  # [windows, seq_len] where documents are masked (fine-tuning rows)


def heldout_windows(data_dir: Path, seq_len: int, batch_size: int, max_batches: int,
                    document_start: int | None = None) -> Windows:
    """The held-out split's first max_batches x batch_size windows (trainer.data.batches: fixed, unpermuted);
    document_start: the BOS of data.document_mask."""
    batches = TokenBatches.open(Path(data_dir), "val", seq_len, batch_size, seed=0)
    batches.document_start = document_start
    pairs = list(batches.sequential(max_batches))
    if not pairs:
        raise ValueError(f"{data_dir}: the held-out split has no complete window of {seq_len + 1} tokens")
    inputs = np.concatenate([p[0] for p in pairs]).astype(np.int64)
    targets = np.concatenate([p[1] for p in pairs]).astype(np.int64)
    positions = np.concatenate([p[2] for p in pairs]).astype(np.int64) if len(pairs[0]) > 2 else None
    content = inputs.tobytes() + targets[:, -1].tobytes()
    if positions is not None:  # which targets count, and where documents begin
        content += targets.tobytes() + positions.tobytes()
    digest = hashlib.sha256(content).hexdigest()[:16]
    return Windows(inputs, targets, f"{inputs.shape[0]}x{seq_len}-{digest}", positions)


def _rounds(count: int, ranks: Ranks) -> int:
    """Forward calls every rank makes for `count` items dealt out to the ranks in batches."""
    per_rank = math.ceil(count / ranks.world_size)
    return max(1, math.ceil(per_rank / ranks.batch_size))


def heldout_loss(model: torch.nn.Module, windows: Windows, ranks: Ranks) -> dict[str, Any]:
    """Mean next-token loss over the windows (all ranks' share, summed across them), perplexity, tokens/s."""
    vocab = model.config.vocab_size
    if int(windows.inputs.max()) >= vocab:
        raise ValueError(f"token id {int(windows.inputs.max())} is outside the model's vocabulary ({vocab}): the "
                         "model and the data use different tokenizers")
    started = time.perf_counter()
    mine = np.arange(ranks.rank, len(windows.inputs), ranks.world_size)
    totals = torch.zeros(2, dtype=torch.float64, device=ranks.device)
    with torch.no_grad():
        for round_ in range(_rounds(len(windows.inputs), ranks)):
            rows = mine[round_ * ranks.batch_size:(round_ + 1) * ranks.batch_size]
            weight = 1.0 if len(rows) else 0.0
            rows = rows if len(rows) else np.arange(1)  # this rank takes part in the collective forward
            inputs = torch.from_numpy(windows.inputs[rows]).to(ranks.device)
            targets = torch.from_numpy(windows.targets[rows]).to(ranks.device)
            extra = ({} if windows.positions is None else
                     {"position_ids": torch.from_numpy(windows.positions[rows]).to(ranks.device)})
            loss = model(input_ids=inputs, targets=targets, loss_reduction="sum", loss_chunk=ranks.loss_chunk,
                         **extra)
            totals[0] += weight * loss.double()
            totals[1] += weight * (targets != IGNORE).sum()
    ranks.all_reduce(totals)
    seconds = time.perf_counter() - started
    mean = float(totals[0] / totals[1])
    return {"heldout_loss": mean, "perplexity": math.exp(min(mean, 700.0)), "eval_tokens": int(totals[1]),
            "eval_seconds": seconds, "eval_tokens_per_second": float(totals[1]) / max(seconds, 1e-9),
            "eval_windows": windows.fingerprint}


def score_sequences(model: torch.nn.Module, sequences: list[tuple[list[int], int]], ranks: Ranks,
                    greedy: bool = False) -> list[tuple]:
    """For each (token ids, first scored position): the log-likelihood the model gives the tokens from that
    position on, and their count; with `greedy`, also whether each of those tokens is the model's argmax there
    (lm-eval's is_greedy, from the same chunks of logits). Every rank gets every sequence's score."""
    mine = list(range(ranks.rank, len(sequences), ranks.world_size))
    scores: dict[int, tuple] = {}
    with torch.no_grad():
        for round_ in range(_rounds(len(sequences), ranks)):
            batch = mine[round_ * ranks.batch_size:(round_ + 1) * ranks.batch_size]
            items = [sequences[i] for i in batch] or [([0, 0], 1)]  # a rank with none left still takes part
            width = max(len(ids) for ids, _ in items) - 1
            inputs = torch.zeros((len(items), width), dtype=torch.long)
            targets = torch.full((len(items), width), IGNORE, dtype=torch.long)
            for row, (ids, first) in enumerate(items):
                inputs[row, :len(ids) - 1] = torch.tensor(ids[:-1])
                targets[row, first - 1:len(ids) - 1] = torch.tensor(ids[first:])
            scored = model(input_ids=inputs.to(ranks.device), targets=targets.to(ranks.device),
                           loss_reduction="greedy" if greedy else "none", loss_chunk=ranks.loss_chunk)
            losses, hits = scored if greedy else (scored, None)
            for row, index in enumerate(batch):
                ids, first = sequences[index]
                score = (-float(losses[row].sum()), len(ids) - first)
                scores[index] = score + (bool(hits[row].all()),) if greedy else score
    gathered: list[Any] = [None] * ranks.world_size
    if ranks.world_size > 1:
        dist.all_gather_object(gathered, scores)
    else:
        gathered = [scores]
    merged = {index: score for part in gathered for index, score in part.items()}
    return [merged[i] for i in range(len(sequences))]


def greedy_continuation(model: torch.nn.Module, ids: list[int], max_new_tokens: int,
                        stop: Callable[[list[int]], bool]) -> list[int]:
    """The greedy tokens after `ids`, one forward each without a cache (every rank computes the same tokens, so
    every rank makes the same forward calls), until max_new_tokens or stop(the new tokens so far)."""
    tokens = list(ids)
    device = next(iter(model.parameters())).device
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([tokens], device=device), use_cache=False, logits_to_keep=1).logits
            tokens.append(int(logits[0, -1].argmax()))
            if stop(tokens[len(ids):]):
                break
    return tokens[len(ids):]


def generate(model: torch.nn.Module, tokenizer, prompts: list[str], max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of fixed prompts (greedy_continuation), each until EOS or max_new_tokens."""
    samples = []
    for prompt in prompts:
        [ids] = tokenizer.encode_documents([prompt])
        if tokenizer.eos_id is not None and ids and ids[-1] == tokenizer.eos_id:
            ids = ids[:-1]  # a prompt is an unfinished document
        new = greedy_continuation(model, ids, max_new_tokens, lambda tokens: tokens[-1] == tokenizer.eos_id)
        samples.append({"prompt": prompt, "completion": tokenizer.decode(new)})
    return samples
