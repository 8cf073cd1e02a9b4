"""The model to train: its config (a base model's, of any family trainer.model.families builds, or a Llama preset's),
its build (random, or on the meta device for weights loaded after sharding); its sharding is
trainer.model.parallelize."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel

from trainer.config import ModelConfig
from trainer.config.model import preset_arguments
from trainer.data.tokenizer import LoadedTokenizer
from trainer.model.base import TokenizerMismatch, check_tokenizer_fits, read_base_config
from trainer.model.families import causal_lm_class

log = logging.getLogger(__name__)


def model_config_of(model: ModelConfig, base_dir: Path | None, tokenizer: LoadedTokenizer) -> PretrainedConfig:
    """The transformers config of the model to train: the base model's own (model.init_from: its family, its dimensions,
    its special-token ids, which the tokenizer's must be: trainer.model.base.check_tokenizer_fits), else the preset's
    (its published vocabulary, model.vocab_size, or the tokenizer's) with the tokenizer's BOS/EOS ids
    (LlamaConfig's defaults, 1 and 2, are some other tokenizer's). A tokenizer with more ids than the model has
    embedding rows is refused, naming both sizes."""
    if base_dir is not None:
        config = read_base_config(base_dir)
        check_tokenizer_fits(tokenizer, base_dir, config)
        return config
    config = LlamaConfig(**preset_arguments(model, tokenizer.vocab_size), **tokenizer.special_token_ids())
    if config.vocab_size < tokenizer.vocab_size:
        where = "model.vocab_size" if model.vocab_size else f"model.preset={model.preset}"
        raise TokenizerMismatch(f"the tokenizer (data.tokenizer) has {tokenizer.vocab_size} ids, the model's "
                                f"vocabulary {config.vocab_size} ({where}): use the tokenizer the model was "
                                "trained with")
    return config


def build_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Same seed, same initial weights on every rank (FSDP2 then keeps each rank's shard); fp32 whatever dtype the
    config names (a base model's config.json says bfloat16: the dtype of its files, not of training's master
    weights)."""
    torch.manual_seed(seed)
    # sdpa is deterministic on CPU and uses flash/memory-efficient kernels on GPU.
    model = causal_lm_class(config)._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    log.info("model: %.1f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def build_model_on_meta(config: PretrainedConfig) -> PreTrainedModel:
    """The model's structure on the meta device: no memory, no initialisation (~0.02 s for 101 M parameters
    instead of ~1 s). For a start whose weights come from a checkpoint or a base model anyway: shard it, then
    `materialize_on(model, device)` and load them (or `copy_initial_weights`)."""
    with torch.device("meta"):
        return causal_lm_class(config)._from_config(config, attn_implementation="sdpa", dtype=torch.float32)


def materialize_on(model: PreTrainedModel, device: torch.device) -> None:
    """Storage for a (sharded) meta model on device: parameters uninitialised, the rotary embedding's
    frequencies (buffers computed from the config, never saved) computed as a normal build does."""
    model.to_empty(device=device)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):  # each family's own class (LlamaRotaryEmbedding, ...)
            fresh = type(module)(config=module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer)
    unknown = [name for name, _ in model.named_buffers() if ".rotary_emb." not in name]
    assert not unknown, f"buffers a meta build leaves uninitialised: {unknown}"


def copy_initial_weights(sharded: PreTrainedModel, full: PreTrainedModel) -> None:
    """Each rank's shard of a fully built model's weights into the sharded one (FSDP2 shards dim 0 as
    torch.chunk does, which is what distribute_tensor computes; every rank holds the same full model, so
    no communication)."""
    full_parameters = dict(full.named_parameters())
    for name, parameter in sharded.named_parameters():
        source = full_parameters[name].detach().to(parameter.device)
        if isinstance(parameter, DTensor):
            source = distribute_tensor(source, parameter.device_mesh, parameter.placements,
                                       src_data_rank=None).to_local()
            parameter = parameter.to_local()
        with torch.no_grad():
            parameter.copy_(source)


def set_special_token_ids(model: PreTrainedModel, special_token_ids: dict[str, int | None]) -> None:
    """The tokenizer's BOS/EOS ids into the model's config and generation config (they are saved with it)."""
    model.config.update(special_token_ids)
    for key, value in special_token_ids.items():
        setattr(model.generation_config, key, value)
