"""The model families a base model's config.json may name, built through transformers' own classes.

    config = config_from_dict(raw)          # the family's config class, by model_type (LlamaConfig, Qwen3Config, ...)
    model_class = causal_lm_class(config)   # its *ForCausalLM with the project's chunked loss (trainer.model.loss)

Every family here is a decoder of the same shape (model.embed_tokens, model.layers[i] with self_attn and mlp,
model.norm, lm_head), so FSDP2's per-block sharding, activation checkpointing, compile, the DCP/HF start-up read
and the sharded export treat them alike; what differs — Qwen2's q/k/v bias, Qwen3's q/k RMSNorm, Mistral's sliding
window, the rope scalings — is transformers' code, not a copy of it.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from trainer.config.model import DEFAULT_MODEL_TYPE, SUPPORTED_MODEL_TYPES
from trainer.model.loss import chunked_cross_entropy


class UnsupportedFamily(ValueError):
    """A model_type this trainer does not build; the message names the supported ones."""


def check_model_type(model_type: Any) -> str:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedFamily(f"model_type {model_type!r} is not one this trainer builds: it trains "
                                f"{', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)}")
    return model_type


def config_from_dict(raw: dict[str, Any]) -> PretrainedConfig:
    """The family's transformers config of a config.json (or a manifest's model_config)."""
    model_type = check_model_type(raw.get("model_type", DEFAULT_MODEL_TYPE))
    return CONFIG_MAPPING[model_type].from_dict(raw)


def architecture_of(config: PretrainedConfig | str) -> str:
    """The class name transformers knows the family's causal LM by (config.json's `architectures`), of a config or
    a model_type."""
    model_type = check_model_type(config if isinstance(config, str) else config.model_type)
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


@functools.cache
def _with_chunked_loss(base: type) -> type:
    def forward(self, input_ids=None, targets=None, loss_reduction: str = "mean", loss_chunk: int = 1024, **kwargs):
        if targets is None:
            return base.forward(self, input_ids=input_ids, **kwargs)
        # No KV cache: a loss never decodes further, and transformers keeps packed documents apart (its mask from
        # position_ids) only without one
        hidden = self.model(input_ids=input_ids, use_cache=False, **kwargs).last_hidden_state
        return chunked_cross_entropy(hidden, self.lm_head, targets, loss_chunk, loss_reduction)

    forward.__doc__ = (f"{base.__name__}'s forward; given `targets` (the next token of each position: labels "
                       "already shifted), the loss computed in chunks of `loss_chunk` positions and no logits.")
    # The family's class name: transformers' save/load and the export's `architectures` read it.
    return type(base.__name__, (base,), {"forward": forward, "__module__": __name__,
                                         "__doc__": f"{base.__name__} with the chunked loss (trainer.model.loss)."})


def causal_lm_class(config: PretrainedConfig) -> type:
    """The family's *ForCausalLM whose forward, given `targets`, returns the chunked loss (called through the module:
    FSDP2's hooks gather the head for it); without targets it is transformers' own forward (generation). Same
    parameters and state-dict keys as the family's class."""
    check_model_type(config.model_type)
    return _with_chunked_loss(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
