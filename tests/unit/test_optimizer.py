"""A fresh AdamW's state written directly (trainer.model.optimizer.initialize_state) must be exactly what
torch.distributed.checkpoint's get_state_dict creates with its zero-gradient step, and train the same after, for
each implementation; the no-decay groups hold the parameters optimizer.no_decay names."""

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from trainer.config import OptimizerConfig, TrainingConfig
from trainer.model.optimizer import build_optimizer, initialize_state

CPU = torch.device("cpu")


def build(model, implementation: str = "auto", no_decay=("nothing",)):
    return build_optimizer(model, TrainingConfig(lr=1e-2, weight_decay=0.1),
                           OptimizerConfig(implementation=implementation, no_decay=list(no_decay)), CPU)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train_step(model, optimizer) -> None:
    torch.manual_seed(1)
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("implementation,no_decay", [("auto", ()), ("fused", ()), ("foreach", ("bias",))])
def test_the_direct_state_equals_the_zero_gradient_step_and_trains_the_same(implementation, no_decay):
    torch_model = _model()
    ours_model = copy.deepcopy(torch_model)
    torch_optimizer = build(torch_model, implementation, no_decay)
    ours_optimizer = build(ours_model, implementation, no_decay)
    _init_optim_state(torch_optimizer)
    initialize_state(ours_optimizer)

    theirs, ours = torch_optimizer.state_dict(), ours_optimizer.state_dict()
    assert theirs["state"].keys() == ours["state"].keys()
    for key, expected in theirs["state"].items():
        for name, value in expected.items():
            mine = ours["state"][key][name]
            assert mine.dtype == value.dtype and mine.device == value.device and torch.equal(mine, value)
    for a, b in zip(torch_model.parameters(), ours_model.parameters()):
        assert torch.equal(a, b)  # the zero-gradient step changed no weight

    for _ in range(3):
        _train_step(torch_model, torch_optimizer)
        _train_step(ours_model, ours_optimizer)
    for a, b in zip(torch_model.parameters(), ours_model.parameters()):
        assert torch.equal(a, b)


def test_state_that_exists_is_left_alone():
    model = _model()
    optimizer = build(model)
    _train_step(model, optimizer)
    before = copy.deepcopy(optimizer.state_dict())
    initialize_state(optimizer)
    after = optimizer.state_dict()
    for key, values in before["state"].items():
        for name, value in values.items():
            assert torch.equal(after["state"][key][name], value)


def test_the_no_decay_groups_hold_the_parameters_they_name():
    from trainer.model.build import build_model
    from transformers import LlamaConfig

    model = build_model(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2), seed=0)
    optimizer = build_optimizer(model, TrainingConfig(weight_decay=0.1), OptimizerConfig(), CPU)
    names = {id(p): name for name, p in model.named_parameters()}
    by_decay = {group["weight_decay"]: sorted(names[id(p)] for p in group["params"]) for group in optimizer.param_groups}
    assert set(by_decay) == {0.1, 0.0}
    assert by_decay[0.0] == sorted(["model.embed_tokens.weight", "model.norm.weight",
                                    *(f"model.layers.{i}.{norm}.weight" for i in range(2)
                                      for norm in ("input_layernorm", "post_attention_layernorm"))])
    assert all(".mlp." in name or ".self_attn." in name or name == "lm_head.weight" for name in by_decay[0.1])
    assert len(by_decay[0.0]) + len(by_decay[0.1]) == len(names)

    every = build_optimizer(model, TrainingConfig(weight_decay=0.1), OptimizerConfig(no_decay=[]), CPU)
    assert [group["weight_decay"] for group in every.param_groups] == [0.1]


def test_the_cpus_auto_implementation_trains_what_the_for_loop_trains_bit_for_bit():
    """auto on the CPU is foreach, for its fewer dispatches; the values must be the for-loop's (torch's default
    for FSDP2's DTensor parameters, what tests/data/r1-today's figures were trained with)."""
    models = [_model(), _model()]
    optimizers = [build(models[0], "auto", ("bias",)), build(models[1], "for_loop", ("bias",))]
    assert optimizers[0].defaults["foreach"] is True and optimizers[1].defaults["foreach"] is False
    for _ in range(5):
        for model, optimizer in zip(models, optimizers):
            _train_step(model, optimizer)
    for a, b in zip(*(model.parameters() for model in models)):
        assert torch.equal(a, b)
