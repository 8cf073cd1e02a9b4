"""A fresh AdamW's state written directly (trainer.model.optimizer.initialize_state) must be exactly what
torch.distributed.checkpoint's get_state_dict creates with its zero-gradient step, and train the same after."""

import copy

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from trainer.model.optimizer import build_optimizer, initialize_state


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train_step(model, optimizer) -> None:
    torch.manual_seed(1)
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_the_direct_state_equals_the_zero_gradient_step_and_trains_the_same():
    torch_model = _model()
    ours_model = copy.deepcopy(torch_model)
    torch_optimizer = build_optimizer(torch_model, lr=1e-2, weight_decay=0.1)
    ours_optimizer = build_optimizer(ours_model, lr=1e-2, weight_decay=0.1)
    _init_optim_state(torch_optimizer)
    initialize_state(ours_optimizer)

    theirs, ours = torch_optimizer.state_dict(), ours_optimizer.state_dict()
    assert theirs["state"].keys() == ours["state"].keys()
    for key, expected in theirs["state"].items():
        for name, value in expected.items():
            assert ours["state"][key][name].dtype == value.dtype and torch.equal(ours["state"][key][name], value)
    for a, b in zip(torch_model.parameters(), ours_model.parameters()):
        assert torch.equal(a, b)  # the zero-gradient step changed no weight

    for _ in range(3):
        _train_step(torch_model, torch_optimizer)
        _train_step(ours_model, ours_optimizer)
    for a, b in zip(torch_model.parameters(), ours_model.parameters()):
        assert torch.equal(a, b)


def test_state_that_exists_is_left_alone():
    model = _model()
    optimizer = build_optimizer(model, lr=1e-2, weight_decay=0.1)
    _train_step(model, optimizer)
    before = copy.deepcopy(optimizer.state_dict())
    initialize_state(optimizer)
    after = optimizer.state_dict()
    for key, values in before["state"].items():
        for name, value in values.items():
            assert torch.equal(after["state"][key][name], value)
