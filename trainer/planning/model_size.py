"""What a model costs, from its dimensions alone (no torch): its parameters, the bytes a start reads, the bytes
its training state holds, and an estimate of each GPU's memory.

    shape = model_shape(cfg, data_dir)     # the base model's config.json (model.init_from), else the preset
    shape.parameters, shape.state_bytes, gpu_memory_of(shape, cfg)

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


def layer_activation_elements(shape: ModelShape, activation_checkpointing: str) -> int:
    """Elements one decoder layer keeps per token from its forward for its backward (in the compute dtype).

    none: what each op's backward needs, eager, under sdpa's flash path (no [seq, seq] scores): each RMSNorm its
    input, the normalized input and its output (3h, twice), q, k and v after rope, the attention's output and
    its contiguous copy for o_proj (3q + 2kv), gate, up, silu(gate) and their product (4i); compiled blocks keep
    less (inductor fuses the norms: ~0.75 of this on the CPU). full: the layer's input alone (the rest is
    recomputed in the backward); selective (op, trainer.model.parallelize._op_level_contexts): the input, of the
    matmuls every second output (q, v, gate, down), and the attention's output. Measured against a real step's
    saved bytes by tests/unit/test_model_size.py."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    if activation_checkpointing == "full":
        return h
    if activation_checkpointing == "selective":
        return h + (q + kv + i + h) + q
    return 6 * h + 3 * q + 2 * kv + 4 * i


def gpu_memory_bytes(shape: ModelShape, *, shard_ranks: int, batch_size: int, seq_len: int,
                     activation_checkpointing: str = "none", selective_every: int = 0, grad_accum_steps: int = 1,
                     reduce_gradients: str = "per_step", param_bytes: int = 2, reduce_bytes: int = 4,
                     loss_chunk: int = 1024) -> dict[str, int]:
    """An estimate of one GPU's memory in a training step under FSDP2 (trainer.model.parallelize):
    - sharded_state: fp32 parameters, gradients and AdamW's two moments, over shard_ranks;
    - gathered_layers: two layers unsharded in the compute dtype at a time (the next one prefetched);
    - accumulated_gradients: with grad_accum_steps > 1 and reduce_gradients per_step, FSDP2 keeps every
      parameter's unsharded gradient between micro-batches, in the reduce dtype (torch/distributed/fsdp/
      _fully_shard/_fsdp_param.py, to_accumulated_grad_if_needed: upcast to reduce_dtype), the whole model's;
    - activations: each layer's saved elements (layer_activation_elements) per token, in the compute dtype;
      selective_every N > 0 checkpoints every N-th layer fully and keeps the others' whole;
    - recomputed_layer: with checkpointing, one layer's activations recomputed during its backward;
    - logits: one loss chunk's (trainer.model.loss: `loss_chunk` positions of every sequence at a time), in the
      compute dtype, in fp32 for the cross-entropy, and the fp32 gradient."""
    tokens = batch_size * seq_len
    sharded = SHARDED_BYTES_PER_PARAMETER * shape.parameters // shard_ranks
    gathered = 2 * param_bytes * shape.layer_parameters
    accumulated = (reduce_bytes * shape.parameters
                   if grad_accum_steps > 1 and reduce_gradients == "per_step" else 0)
    whole = layer_activation_elements(shape, "none")
    layers = shape.num_hidden_layers
    if activation_checkpointing == "selective" and selective_every > 0:
        checkpointed = math.ceil(layers / selective_every)
        per_token = checkpointed * layer_activation_elements(shape, "full") + (layers - checkpointed) * whole
    else:
        per_token = layers * layer_activation_elements(shape, activation_checkpointing)
    # The final norm's input, normalized input and output (the loss's chunks recompute their logits from it).
    activations = param_bytes * tokens * (per_token + 3 * shape.hidden_size)
    recomputed = param_bytes * tokens * whole if activation_checkpointing != "none" else 0
    logits = batch_size * min(loss_chunk, seq_len) * shape.vocab_size * (param_bytes + 4 + 4)
    parts = {"sharded_state": sharded, "gathered_layers": gathered, "accumulated_gradients": accumulated,
             "activations": activations, "recomputed_layer": recomputed, "logits": logits}
    return {**parts, "total": sum(parts.values())}


def gpu_memory_of(shape: ModelShape, cfg, *, on_gpu: bool = True) -> dict[str, int]:
    """gpu_memory_bytes for a config's training (its ranks, batch, checkpointing, accumulation and dtypes)."""
    t = cfg.training
    param = t.mixed_precision_param
    param_bytes = DTYPE_BYTES[param] if param != "auto" else (2 if on_gpu else 4)
    return gpu_memory_bytes(shape, shard_ranks=t.num_nodes * t.nproc_per_node // t.replica_groups,
                            batch_size=t.batch_size, seq_len=t.seq_len,
                            activation_checkpointing=t.activation_checkpointing,
                            selective_every=0 if t.selective_ac == "op" else int(t.selective_ac),
                            grad_accum_steps=t.grad_accum_steps, reduce_gradients=t.reduce_gradients,
                            param_bytes=param_bytes, reduce_bytes=DTYPE_BYTES[t.mixed_precision_reduce],
                            loss_chunk=t.loss_chunk)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes < 2**40 else f"{nbytes / 2**40:.2f} TiB"


def throughput_seconds(nbytes: float, megabytes_per_second: float) -> float:
    return nbytes / (megabytes_per_second * 1e6) if megabytes_per_second > 0 else math.inf
