"""The Llama-architecture model (transformers' LlamaForCausalLM) and its FSDP2 sharding."""

from __future__ import annotations

import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.config import MODEL_PRESETS, ModelConfig

log = logging.getLogger(__name__)


def llama_config(model: ModelConfig, vocab_size: int) -> LlamaConfig:
    """The transformers config for a preset; vocab_size comes from the tokenizer unless set."""
    preset = dict(MODEL_PRESETS[model.preset])
    return LlamaConfig(vocab_size=model.vocab_size or vocab_size, **preset)


def build_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Same seed, same initial weights on every rank (FSDP2 then keeps each rank's shard)."""
    torch.manual_seed(seed)
    # sdpa is deterministic on CPU and uses flash/memory-efficient kernels on GPU.
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    log.info("model: %.1f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def shard_model(model: LlamaForCausalLM, mixed_precision: bool) -> LlamaForCausalLM:
    """FSDP2: each decoder layer is its own unit, then the root (embeddings, norm, head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
