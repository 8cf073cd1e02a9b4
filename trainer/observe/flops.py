"""What a step achieved against the hardware: model FLOPs utilisation (MFU), TFLOP/s per GPU, and the CUDA
allocator's peaks, per step, for metrics.jsonl, MLflow and the progress line.

The model's FLOPs per token are torchtitan's formula (torchtitan/models/utils.py get_dense_model_nparams_and_flops,
after the PaLM paper's appendix B): 6 x the parameters that are not the token embedding (a forward's
multiply-add is 2 FLOPs per weight and token, the backward twice that) plus 12 x layers x heads x head_dim x
sequence length for the attention's two score matmuls (QK^T and the weights times V; forward and backward).
Recomputation by activation checkpointing is not counted: MFU counts the model's FLOPs, not the hardware's.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak per GPU, FLOP/s (NVIDIA's data sheets; torchtitan's tools/utils.py get_peak_flops):
# the same spec at half the sparse figure NVIDIA headlines.
PEAK_BF16_FLOPS = (
    ("H100 NVL", 835e12), ("H100 PCIe", 756e12), ("H100", 989e12),  # SXM, and the variants named first
    ("H200", 989e12),
    ("B200", 2250e12),
    ("B300", 2250e12),  # Blackwell Ultra: FP4 rises, bf16 stays at B200's
)


def flops_per_token(num_parameters: int, embedding_parameters: int, layers: int, heads: int, head_dim: int,
                    seq_len: int) -> float:
    """Training FLOPs per token: 6 N (N without the token embedding, a lookup) + 12 L H Q T."""
    return 6.0 * (num_parameters - embedding_parameters) + 12.0 * layers * heads * head_dim * seq_len


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """flops_per_token of a (sharded) causal LM of any family (head_dim from its config): a DTensor's numel is the
    whole parameter's."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return flops_per_token(sum(p.numel() for p in model.parameters()), model.model.embed_tokens.weight.numel(),
                           config.num_hidden_layers, config.num_attention_heads, head_dim, seq_len)


def peak_flops(device: torch.device, peak_tflops: float = 0.0) -> float | None:
    """The device's dense bf16 peak (FLOP/s): training.peak_tflops when set, else by the device's name; None
    when it is unknown (the CPU, an unlisted GPU)."""
    if peak_tflops:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_of(name)
    if peak is None:
        log.warning("no bf16 peak known for %r: mfu is not reported (set training.peak_tflops)", name)
    return peak


def peak_of(device_name: str) -> float | None:
    """The table's peak for a CUDA device name (NVIDIA H100 80GB HBM3, NVIDIA H200, ...)."""
    return next((flops for fragment, flops in PEAK_BF16_FLOPS if fragment in device_name), None)


class StepFigures:
    """Per step: tflops_per_gpu and mfu from the step's trained tokens, and on CUDA the allocator's peaks of the
    step (GiB) and its retries (a retry is a cudaMalloc that failed, the cache freed, and tried again: the sign
    of fragmentation, which expandable_segments avoids)."""

    def __init__(self, model: torch.nn.Module, seq_len: int, gpus: int, device: torch.device,
                 peak_tflops: float = 0.0):
        self.per_token = model_flops_per_token(model, seq_len)
        self.gpus, self.device = gpus, device
        self.peak = peak_flops(device, peak_tflops)
        self._retries = 0
        if device.type == "cuda":
            self._retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
            torch.cuda.reset_peak_memory_stats(device)

    def step(self, tokens: int, seconds: float) -> dict[str, float]:
        achieved = tokens * self.per_token / max(seconds, 1e-9) / self.gpus
        figures = {"tflops_per_gpu": achieved / 1e12}
        if self.peak:
            figures["mfu"] = achieved / self.peak
        if self.device.type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            figures.update(cuda_max_allocated_gib=stats.get("allocated_bytes.all.peak", 0) / 2**30,
                           cuda_max_reserved_gib=stats.get("reserved_bytes.all.peak", 0) / 2**30,
                           cuda_alloc_retries=stats.get("num_alloc_retries", 0) - self._retries)
            self._retries = stats.get("num_alloc_retries", 0)
            torch.cuda.reset_peak_memory_stats(self.device)
        return figures
