"""What a model costs, from its dimensions alone (no torch): its parameters, the bytes a start reads, the bytes
its training state holds, and an estimate of each GPU's memory.

    shape = model_shape(cfg, data_dir)     # the base model's config.json (model.init_from), else the preset
    shape.parameters, shape.state_bytes, gpu_memory_bytes(shape, cfg)

Everything the launch sizes from the model — the node-memory volume, ft_launcher's first heartbeat, the start-up
phases' timeouts, the planner's save and reload costs, the GPU memory estimate — takes the real model's figures
from here, so a base model that matches no preset is sized as what it is.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import MODEL_PRESETS
from trainer.config.rules import InputError

BYTE_VOCAB = 258  # trainer.data.tokenizer's byte tokenizer: 256 bytes + BOS + EOS
# A resume reads per parameter: fp32 weights + AdamW's two fp32 moments.
STATE_BYTES_PER_PARAMETER = 12
# What FSDP2 keeps per parameter on a GPU, sharded: fp32 weights, fp32 gradients, AdamW's two moments.
SHARDED_BYTES_PER_PARAMETER = 16
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A model's dimensions (the fields of its HF config.json), of any family trainer.model.families builds."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False  # Qwen2's q/k/v projections (not o) have biases, whatever attention_bias says
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of q and k
    weights_dtype: str = "float32"  # how a base model's files store them (config.json's torch_dtype / dtype)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ModelShape":
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return cls(hidden_size=hidden, intermediate_size=int(config["intermediate_size"]),
                   num_hidden_layers=int(config["num_hidden_layers"]), num_attention_heads=heads,
                   num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads), vocab_size=int(config["vocab_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   attention_bias=bool(config.get("attention_bias", False)),
                   mlp_bias=bool(config.get("mlp_bias", False)),
                   qkv_bias=config.get("model_type") == "qwen2", qk_norm=config.get("model_type") == "qwen3",
                   weights_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"))

    @property
    def layer_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv + h) if self.attention_bias else 0)
        attention += (q + 2 * kv) if self.qkv_bias else 0
        attention += 2 * self.head_dim if self.qk_norm else 0
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        return attention + mlp + 2 * h  # two RMSNorms

    @property
    def parameters(self) -> int:
        embedding = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embedding
        return embedding + self.num_hidden_layers * self.layer_parameters + self.hidden_size + head

    @property
    def state_bytes(self) -> int:
        """What a checkpoint of the training state holds (and a resume from FSx reads)."""
        return self.parameters * STATE_BYTES_PER_PARAMETER

    @property
    def weights_bytes(self) -> int:
        """What a base model's safetensors files hold (their dtype's bytes per parameter)."""
        return self.parameters * DTYPE_BYTES.get(self.weights_dtype, 4)


def vocab_size(cfg, data_dir: Path | None) -> int:
    """A model trained from scratch: model.vocab_size, else the published preset's, else the staged tokenizer's
    (tokens.json), else the byte tokenizer's."""
    if cfg.model.vocab_size or MODEL_PRESETS[cfg.model.preset].get("vocab_size"):
        return cfg.model.vocab_size or MODEL_PRESETS[cfg.model.preset]["vocab_size"]
    meta = Path(data_dir) / "tokens.json" if data_dir else None
    if meta is not None and meta.is_file():
        return int(json.loads(meta.read_text())["vocab_size"])
    return BYTE_VOCAB


class ModelSizeError(InputError):
    """The model's size cannot be known: its config.json is not where model.init_from says."""


def model_shape(cfg, data_dir: Path | None = None) -> ModelShape:
    """The model this config trains: the base model's config.json when model.init_from is set (the staged copy of
    an S3 prefix, or the folder), else the preset with the tokenizer's vocabulary."""
    base = cfg.base_model_dir
    if base is not None:
        path = base / "config.json"
        if not path.is_file():
            raise ModelSizeError(f"model.init_from: {path} not found (the model's size comes from it): "
                                 + ("run the stage step first, which puts the base model there"
                                    if cfg.model.init_from.startswith("s3://") else "point it at an HF model folder"))
        return ModelShape.from_config(json.loads(path.read_text()))
    preset = MODEL_PRESETS[cfg.model.preset]
    return ModelShape.from_config({**preset, "vocab_size": vocab_size(cfg, data_dir)})


def gpu_memory_bytes(shape: ModelShape, *, shard_ranks: int, batch_size: int, seq_len: int,
                     activation_checkpointing: bool) -> dict[str, int]:
    """An estimate of one GPU's memory under FSDP2 with bf16 compute (parameters, gradients and AdamW sharded in
    fp32 over shard_ranks; two layers unsharded in bf16 at a time, for prefetch; activations of the sdpa
    (flash) attention path, 34 bytes per token and hidden unit per layer, Korthikanti et al. 2022, or the layer
    inputs alone with activation checkpointing; the logits in bf16 and in fp32 for the loss, and their gradient)."""
    tokens = batch_size * seq_len
    sharded = SHARDED_BYTES_PER_PARAMETER * shape.parameters // shard_ranks
    gathered = 2 * 2 * shape.layer_parameters
    per_layer = (2 if activation_checkpointing else 34) * tokens * shape.hidden_size
    activations = shape.num_hidden_layers * per_layer + (34 * tokens * shape.hidden_size if activation_checkpointing
                                                          else 0)
    logits = tokens * shape.vocab_size * (2 + 4 + 4)
    parts = {"sharded_state": sharded, "gathered_layers": gathered, "activations": activations, "logits": logits}
    return {**parts, "total": sum(parts.values())}


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes < 2**40 else f"{nbytes / 2**40:.2f} TiB"


def throughput_seconds(nbytes: float, megabytes_per_second: float) -> float:
    return nbytes / (megabytes_per_second * 1e6) if megabytes_per_second > 0 else math.inf
