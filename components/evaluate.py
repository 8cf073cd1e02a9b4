"""evaluate_checkpoint: held-out loss and perplexity of a validated checkpoint."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def evaluate_checkpoint(folder: Path, data_dir: Path, *, seq_len: int, batch_size: int,
                        max_batches: int) -> dict[str, Any]:
    """Mean next-token loss over fixed, non-overlapping windows of the held-out split."""
    import torch
    import torch.nn.functional as F

    from trainer.checkpoint import load_model_from_checkpoint
    from trainer.data import TokenBatches

    model, manifest = load_model_from_checkpoint(Path(folder))
    batches = TokenBatches.open(Path(data_dir), "val", seq_len, batch_size, seed=0)
    total_loss, total_tokens = 0.0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        for inputs, labels in batches.sequential(max_batches):
            logits = model(input_ids=torch.from_numpy(inputs)).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   torch.from_numpy(labels).reshape(-1), reduction="sum")
            total_loss += loss.item()
            total_tokens += labels.size
    seconds = time.perf_counter() - started
    if total_tokens == 0:
        raise ValueError(f"{data_dir}: the held-out split has no complete window of {seq_len + 1} tokens")
    heldout_loss = total_loss / total_tokens
    result = {"checkpoint": str(folder), "step": manifest["step"], "heldout_loss": heldout_loss,
              "perplexity": math.exp(heldout_loss), "eval_tokens": total_tokens,
              "eval_tokens_per_second": total_tokens / seconds}
    log.info("held-out loss %.4f (perplexity %.2f) over %d tokens at step %d", heldout_loss, result["perplexity"],
             total_tokens, manifest["step"])
    return result
