"""The next-token loss, computed a chunk of positions at a time: no step or evaluation holds [batch, seq, vocab]
logits (fp32 for the softmax) at once.

At Llama-3.1-8B's shapes a sequence of 8,192 positions has 8,192 x 128,256 logits: 2.1 GB in bf16 and 4.2 GB more
in fp32 for the cross-entropy, per sequence, plus as much again for their gradient. In chunks of `chunk` positions
only one chunk's logits exist; in training each chunk's head projection is recomputed in the backward pass
(activation checkpointing), which costs one more matmul of the head (about 2 % of an 8B step's FLOPs) and keeps
the saved activations at the hidden states alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


IGNORE = -100  # a target that counts for nothing (padding): F.cross_entropy's ignore_index


def _eager_chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, reduction: str = "sum"):
    logits = head(hidden).float()
    losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1),
                             reduction="none" if reduction == "greedy" else reduction, ignore_index=IGNORE)
    if reduction == "sum":
        return losses
    if reduction == "greedy":  # and whether each target is the argmax there (lm-eval's is_greedy); IGNORE: True
        return losses.view(targets.shape), (logits.argmax(-1) == targets) | (targets == IGNORE)
    return losses.view(targets.shape)


_chunk_loss = _eager_chunk_loss


def compile_chunk_loss() -> None:
    """From now on each chunk's head projection and cross-entropy run compiled (training.compile): the fp32
    logits' upcast, log-softmax and gather fuse instead of each writing a chunk-sized tensor."""
    global _chunk_loss
    _chunk_loss = torch.compile(_eager_chunk_loss)


def chunked_cross_entropy(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, chunk: int,
                          reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of head(hidden) against targets ([batch, positions] each), summed (reduction="sum"), averaged
    over the targets that count ("mean": IGNORE targets are in neither the sum nor the count), or each position's
    ("none": [batch, positions], 0 where the target is IGNORE; "greedy": those and whether each target is the
    logits' argmax). The logits of `chunk` positions exist at a time. (A mean over a batch split across
    micro-batches and ranks is the job's: trainer.job.step.)"""
    assert reduction in ("mean", "sum", "none", "greedy"), reduction
    if reduction == "greedy":
        with torch.no_grad():  # scoring only (lm-eval)
            pieces = [_eager_chunk_loss(hidden[:, start:start + chunk], targets[:, start:start + chunk], head, "greedy")
                      for start in range(0, hidden.size(1), chunk)]
            return torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)
    if reduction == "none":
        with torch.no_grad():  # scoring only (evaluation tasks)
            return torch.cat([_chunk_loss(hidden[:, start:start + chunk], targets[:, start:start + chunk], head,
                                          "none") for start in range(0, hidden.size(1), chunk)], dim=1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.size(1), chunk):
        piece, piece_targets = hidden[:, start:start + chunk], targets[:, start:start + chunk]
        if torch.is_grad_enabled() and hidden.requires_grad:
            total = total + checkpoint(_chunk_loss, piece, piece_targets, head, use_reentrant=False)
        else:
            total = total + _chunk_loss(piece, piece_targets, head)
    if reduction == "sum":
        return total
    return total / (targets != IGNORE).sum().clamp(min=1)  # every target counts: the same bits as / numel
