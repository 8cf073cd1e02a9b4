"""How the model runs on its ranks: the device mesh, activation checkpointing, torch.compile and FSDP2, in
torchtitan's order (checkpointing wraps what compile compiles, FSDP2 shards the result), from `training`'s
throughput fields (docs/throughput.md).

    mesh = device_mesh(cfg.training, world_size, device)   # 1-D (FSDP) or 2-D (replicate x shard: HSDP)
    model = parallelize(model, cfg.training, device, mesh)
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainer.config import TrainingConfig
from trainer.model import loss as loss_module

log = logging.getLogger(__name__)

REPLICATE, SHARD = "dp_replicate", "dp_shard"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Op-level selective checkpointing keeps these ops' outputs (torchtitan's _save_list: what is costly to recompute
# and cheap to keep); every other op is recomputed in the backward, and of the matmuls every second one too.
_SAVED_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops._c10d_functional.reduce_scatter_tensor.default, torch.ops.aten.max.default}


def local_shard(value):
    """A DTensor's local shard (FSDP2's parameters, their gradients and optimizer state): this rank's part, sharing
    its storage; anything else as it is."""
    return value.to_local() if hasattr(value, "to_local") else value


def device_mesh(training: TrainingConfig, world_size: int, device: torch.device) -> DeviceMesh:
    """The ranks' mesh: (replicate, shard) when training.data_parallel_replicate_degree > 1, else one dimension.
    Replicas are the mesh's rows: ranks [0, shard) are replica 0, the next `shard` ranks replica 1 (a node's
    ranks stay in one replica, so the shard dimension's all-gathers stay on NVLink where they can)."""
    replicate = training.data_parallel_replicate_degree
    if replicate == 1:
        return init_device_mesh(device.type, (world_size,), mesh_dim_names=(SHARD,))
    assert world_size % replicate == 0, (world_size, replicate)  # TrainingConfig checks the job's ranks
    return init_device_mesh(device.type, (replicate, world_size // replicate), mesh_dim_names=(REPLICATE, SHARD))


def param_dtype(training: TrainingConfig, device: torch.device) -> torch.dtype:
    if training.mixed_precision_param == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[training.mixed_precision_param]


def compiles(training: TrainingConfig, device: torch.device) -> bool:
    return device.type == "cuda" if training.compile == "auto" else bool(training.compile)


def parallelize(model: torch.nn.Module, training: TrainingConfig, device: torch.device,
                mesh: DeviceMesh) -> torch.nn.Module:
    """Activation checkpointing, compile, then FSDP2 (each decoder layer its own unit, then the root)."""
    apply_activation_checkpointing(model, training)
    if compiles(training, device):
        for layer in model.model.layers:
            layer.compile()  # in place: the module, its names and its state-dict keys stay as they are
        loss_module.compile_chunk_loss()
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype(training, device),
                                 reduce_dtype=DTYPES[training.mixed_precision_reduce])
    layers = list(model.model.layers)
    for index, layer in enumerate(layers):
        # torchtitan's default: the last layer's parameters are the backward's first need, so they stay gathered.
        reshard = {"always": True, "never": False}.get(training.reshard_after_forward, index < len(layers) - 1)
        fully_shard(layer, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mixed, reshard_after_forward=training.reshard_after_forward == "always")
    log.info("parallelized: mesh %s, params %s, reduce %s, checkpointing %s, compile %s, reshard_after_forward %s",
             dict(zip(mesh.mesh_dim_names, mesh.shape)), mixed.param_dtype, mixed.reduce_dtype,
             describe_checkpointing(training), compiles(training, device), training.reshard_after_forward)
    return model


def describe_checkpointing(training: TrainingConfig) -> str:
    if training.activation_checkpointing != "selective":
        return training.activation_checkpointing
    return "selective (op)" if training.selective_ac == "op" else f"selective (every {training.selective_ac} layers)"


def apply_activation_checkpointing(model: torch.nn.Module, training: TrainingConfig) -> None:
    """Through transformers' own per-layer checkpointing (GradientCheckpointingLayer): no wrapper module, so
    parameter names and state-dict keys stay those of the family's class (LlamaForCausalLM, Qwen3ForCausalLM,
    ...)."""
    mode = training.activation_checkpointing
    if mode == "none":
        return
    kwargs = {"use_reentrant": False}
    if mode == "selective" and training.selective_ac == "op":
        kwargs["context_fn"] = _op_level_contexts
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.25's name for it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if mode == "selective" and training.selective_ac != "op":
        for index, layer in enumerate(model.model.layers):
            layer.gradient_checkpointing = index % training.selective_ac == 0


def _op_level_contexts():
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:  # counted per forward and per recompute alike: the same choice
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)

