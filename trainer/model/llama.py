"""The Llama-architecture model (transformers' LlamaForCausalLM) and its FSDP2 sharding."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from trainer.config import MODEL_PRESETS, ModelConfig

log = logging.getLogger(__name__)


def llama_config(model: ModelConfig, vocab_size: int, special_token_ids: dict[str, int | None]) -> LlamaConfig:
    """The transformers config for a preset; vocab_size comes from the tokenizer unless set, and so do the
    BOS/EOS ids (LlamaConfig's defaults, 1 and 2, are some other tokenizer's)."""
    preset = dict(MODEL_PRESETS[model.preset])
    return LlamaConfig(vocab_size=model.vocab_size or vocab_size, **preset, **special_token_ids)


def build_model(config: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """Same seed, same initial weights on every rank (FSDP2 then keeps each rank's shard)."""
    torch.manual_seed(seed)
    # sdpa is deterministic on CPU and uses flash/memory-efficient kernels on GPU.
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    log.info("model: %.1f M parameters", sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def load_or_build_model(model: ModelConfig, vocab_size: int, seed: int,
                        special_token_ids: dict[str, int | None]) -> LlamaForCausalLM:
    """Weights from model.init_from (HF folder, local files only), else the preset with random weights."""
    if not model.init_from:
        return build_model(llama_config(model, vocab_size, special_token_ids), seed)
    folder = Path(model.init_from)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ValueError(f"model.init_from: {folder} must hold config.json and *.safetensors (an HF export)")
    torch.manual_seed(seed)  # layers the weights file does not cover are initialised reproducibly
    loaded = LlamaForCausalLM.from_pretrained(str(folder), local_files_only=True, use_safetensors=True,
                                              attn_implementation="sdpa", dtype=torch.float32)
    set_special_token_ids(loaded, special_token_ids)
    log.info("model: %.1f M parameters from %s", sum(p.numel() for p in loaded.parameters()) / 1e6, folder)
    return loaded


def build_model_on_meta(model: ModelConfig, vocab_size: int,
                        special_token_ids: dict[str, int | None]) -> LlamaForCausalLM:
    """The model's structure on the meta device: no memory, no initialisation (~0.02 s for 101 M parameters
    instead of ~1 s). For a start whose weights come from a checkpoint anyway: shard it, then
    `materialize_on(model, device)` and either load the checkpoint or `copy_initial_weights`."""
    if model.init_from:
        config = LlamaConfig.from_pretrained(model.init_from, local_files_only=True)
        config.update(special_token_ids)
    else:
        config = llama_config(model, vocab_size, special_token_ids)
    with torch.device("meta"):
        return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def materialize_on(model: LlamaForCausalLM, device: torch.device) -> None:
    """Storage for a (sharded) meta model on device: parameters uninitialised, the rotary embedding's
    frequencies (buffers computed from the config, never saved) computed as a normal build does."""
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, LlamaRotaryEmbedding):
            fresh = LlamaRotaryEmbedding(config=module.config)
            for name, buffer in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buffer)
    unknown = [name for name, _ in model.named_buffers() if ".rotary_emb." not in name]
    assert not unknown, f"buffers a meta build leaves uninitialised: {unknown}"


def copy_initial_weights(sharded: LlamaForCausalLM, full: LlamaForCausalLM) -> None:
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


def set_special_token_ids(model: LlamaForCausalLM, special_token_ids: dict[str, int | None]) -> None:
    """The tokenizer's BOS/EOS ids into the model's config and generation config (they are saved with it)."""
    model.config.update(special_token_ids)
    for key, value in special_token_ids.items():
        setattr(model.generation_config, key, value)


def shard_model(model: LlamaForCausalLM, mixed_precision: bool) -> LlamaForCausalLM:
    """FSDP2: each decoder layer is its own unit, then the root (embeddings, norm, head)."""
    kwargs = {}
    if mixed_precision:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model
