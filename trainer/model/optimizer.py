"""The optimizer (AdamW) and its state before the first step."""

from __future__ import annotations

import torch


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh AdamW the state torch.distributed.checkpoint's get_state_dict would create, without the
    arithmetic.

    get_state_dict needs the state to exist; for a fresh optimizer it runs a whole step with zero gradients
    and lr 0 (torch's _init_optim_state), which leaves step 1 and zero moments and costs ~1 s per restart on
    101 M parameters here, since every start asks for the state dict to resume into. Writing that state
    directly gives the same values (tests/unit/test_optimizer.py) in a tenth of the time. Other optimizers,
    and AdamW variants whose state differs (amsgrad, capturable, fused), are left to get_state_dict.
    """
    if type(optimizer) is not torch.optim.AdamW or optimizer.state:
        return
    groups = optimizer.param_groups
    if any(g["amsgrad"] or g["capturable"] or g["fused"] for g in groups):
        return
    for group in groups:
        for parameter in group["params"]:
            if parameter.requires_grad:
                optimizer.state[parameter] = {
                    "step": torch.tensor(1.0),
                    "exp_avg": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(parameter, memory_format=torch.preserve_format),
                }
