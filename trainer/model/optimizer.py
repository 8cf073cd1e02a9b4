"""The optimizer (AdamW): its parameter groups (decayed or not), its implementation, and its state before the
first step."""

from __future__ import annotations

import logging

import torch

from trainer.config import OptimizerConfig, TrainingConfig

log = logging.getLogger(__name__)


def parameter_groups(model: torch.nn.Module, weight_decay: float, no_decay: list[str]) -> list[dict]:
    """Two groups: the parameters whose name contains a fragment of `no_decay` at weight decay 0, the rest at
    `weight_decay` (a group with no parameters is left out: torch refuses an empty one)."""
    decayed, exempt = [], []
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            (exempt if any(fragment in name for fragment in no_decay) else decayed).append(parameter)
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: torch.nn.Module, training: TrainingConfig, optimizer: OptimizerConfig,
                    device: torch.device) -> torch.optim.AdamW:
    implementation = optimizer.implementation
    if implementation == "auto":
        # torch's own default takes the for-loop for FSDP2's DTensor parameters: a dispatch per parameter and
        # operation, ~15 % of a small model's CPU step. foreach computes the same values bit for bit
        # (tests/unit/test_optimizer.py) in a dispatch per group and operation.
        implementation = "fused" if device.type == "cuda" else "foreach"
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]
    groups = parameter_groups(model, training.weight_decay, optimizer.no_decay)
    decayed = sum(len(group["params"]) for group in groups if group["weight_decay"] > 0)
    log.info("AdamW (%s): %d parameter tensors decayed, %d not (optimizer.no_decay=%s)", implementation, decayed,
             sum(len(group["params"]) for group in groups) - decayed, optimizer.no_decay)
    return torch.optim.AdamW(groups, lr=training.lr, betas=(0.9, 0.95), **flags)


def optimizer_groups_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[dict]:
    """The optimizer's parameter groups as torch.distributed.checkpoint's state dicts name them (parameters by
    their fully qualified names): what a loaded state's groups are set to, so hyperparameters and grouping are
    this run's config, whatever grouping the checkpoint was written with."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [{**{key: value for key, value in group.items() if key != "params"},
             "params": [names[id(parameter)] for parameter in group["params"]]} for group in optimizer.param_groups]


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh AdamW the state torch.distributed.checkpoint's get_state_dict would create, without the
    arithmetic.

    get_state_dict needs the state to exist; for a fresh optimizer it runs a whole step with zero gradients
    and lr 0 (torch's _init_optim_state), which leaves step 1 and zero moments and costs ~1 s per restart on
    101 M parameters here, since every start asks for the state dict to resume into. Writing that state
    directly gives the same values (tests/unit/test_optimizer.py) in a tenth of the time. The fused AdamW keeps
    its step on the parameter's device (torch.optim.adam's _init_group). Other optimizers, and AdamW variants
    whose state differs (amsgrad, capturable), are left to get_state_dict.
    """
    if type(optimizer) is not torch.optim.AdamW or optimizer.state:
        return
    groups = optimizer.param_groups
    if any(g["amsgrad"] or g["capturable"] for g in groups):
        return
    for group in groups:
        for parameter in group["params"]:
            if parameter.requires_grad:
                step_device = parameter.device if group["fused"] else "cpu"
                optimizer.state[parameter] = {
                    "step": torch.tensor(1.0, dtype=torch.float32, device=step_device),
                    "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                }
