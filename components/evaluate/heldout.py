"""evaluate_checkpoint: held-out loss, perplexity and greedy generations of a validated checkpoint.

The promotion gate (``components.evaluate.promotion``) compares the result with the registered champion evaluated
on the same held-out windows, so the two numbers are comparable.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainer.checkpoint.load import load_model_from_checkpoint
from trainer.data.batches import TokenBatches
from trainer.data.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


def heldout_loss(model, data_dir: Path, *, seq_len: int, batch_size: int, max_batches: int) -> dict[str, float]:
    """Mean next-token loss over fixed, non-overlapping windows of the held-out split."""
    batches = TokenBatches.open(Path(data_dir), "val", seq_len, batch_size, seed=0)
    vocab = model.config.vocab_size
    total_loss, total_tokens = 0.0, 0
    started = time.perf_counter()
    with torch.inference_mode():
        for inputs, labels in batches.sequential(max_batches):
            if int(inputs.max()) >= vocab:
                raise ValueError(f"{data_dir}: token id {int(inputs.max())} is outside the model's vocabulary "
                                 f"({vocab}): the model and the data use different tokenizers")
            logits = model(input_ids=torch.from_numpy(inputs)).logits
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                   torch.from_numpy(labels).reshape(-1), reduction="sum")
            total_loss += loss.item()
            total_tokens += labels.size
    seconds = time.perf_counter() - started
    if total_tokens == 0:
        raise ValueError(f"{data_dir}: the held-out split has no complete window of {seq_len + 1} tokens")
    mean = total_loss / total_tokens
    return {"heldout_loss": mean, "perplexity": math.exp(mean), "eval_tokens": total_tokens,
            "eval_tokens_per_second": total_tokens / seconds}


def generate(model, tokenizer_spec: str, prompts: list[str], max_new_tokens: int) -> list[dict[str, str]]:
    """Greedy continuations of fixed prompts (deterministic: the same checkpoint gives the same text)."""
    tokenizer = load_tokenizer(tokenizer_spec)
    samples = []
    with torch.inference_mode():
        for prompt in prompts:
            [ids] = tokenizer.encode_documents([prompt])
            if tokenizer.eos_id is not None and ids and ids[-1] == tokenizer.eos_id:
                ids = ids[:-1]  # a prompt is an unfinished document
            inputs = torch.tensor([ids])
            output = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=tokenizer.eos_id or 0)
            samples.append({"prompt": prompt, "completion": tokenizer.decode(output[0, len(ids):].tolist())})
    return samples


def evaluate_checkpoint(folder: Path, data_dir: Path, *, seq_len: int, batch_size: int, max_batches: int,
                        prompts: list[str] = (), max_new_tokens: int = 0) -> dict[str, Any]:
    model, manifest = load_model_from_checkpoint(Path(folder))
    result = {"checkpoint": str(folder), "step": manifest["step"],
              **heldout_loss(model, data_dir, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches)}
    result["generations"] = (generate(model, manifest.get("tokenizer", "byte"), list(prompts), max_new_tokens)
                             if prompts and max_new_tokens > 0 else [])
    log.info("held-out loss %.4f (perplexity %.2f) over %d tokens at step %d", result["heldout_loss"],
             result["perplexity"], result["eval_tokens"], manifest["step"])
    return result
