"""The async save's stager: what it hands the write is the state's values, with the staged DTensors kept
between saves (DCP's DefaultStager deep-copies every wrapper every save: trainer/checkpoint/stager.py)."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from trainer.checkpoint.backends import TorchAsyncBackend
from trainer.checkpoint.stager import ReusingStager


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _trained(mesh):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4, bias=False))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(3, 8)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    return model, optimizer, step


def _state(model, optimizer, step: int):
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "trainer": {"step": torch.tensor(step), "note": f"s{step}"}}


def _leaves(tree, path=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{path}.{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, f"{path}.{index}")
    else:
        yield path, tree


def _assert_same_values(staged, source):
    staged_leaves, source_leaves = dict(_leaves(staged)), dict(_leaves(source))
    assert staged_leaves.keys() == source_leaves.keys()
    for path, value in source_leaves.items():
        if isinstance(value, torch.Tensor):
            assert type(staged_leaves[path]) is type(value), path
            local = value.to_local() if isinstance(value, DTensor) else value
            mine = staged_leaves[path].to_local() if isinstance(value, DTensor) else staged_leaves[path]
            assert mine.device.type == "cpu" and torch.equal(mine, local), path
            assert mine.data_ptr() != local.data_ptr(), f"{path} was not copied: the write would see later steps"
        else:
            assert staged_leaves[path] == value, path


def test_later_saves_refill_the_staged_dtensors_and_a_changed_layout_is_staged_afresh(one_rank):
    model, optimizer, train_step = _trained(one_rank)
    stager = ReusingStager(StagingOptions(False, False, False, False))
    first = stager.stage(_state(model, optimizer, 1))
    _assert_same_values(first, _state(model, optimizer, 1))

    train_step()
    source = _state(model, optimizer, 2)
    second = stager.stage(source)
    _assert_same_values(second, source)
    assert stager.full_stagings == 1
    staged_dtensors = [(path, v) for path, v in _leaves(first) if isinstance(v, DTensor)]
    assert len(staged_dtensors) >= 3 and all(v is dict(_leaves(second))[path] for path, v in staged_dtensors), \
        "the second save built new DTensor wrappers (DCP's deep copy, ~0.5 ms each)"
    assert second is not first and second["model"] is not first["model"]

    source["extra"] = {"w": torch.ones(2)}  # a new key: another layout
    third = stager.stage(source)
    _assert_same_values(third, source)
    assert stager.full_stagings == 2
    shared = {"a": source["trainer"]["step"], "b": source["trainer"]["step"]}
    stager.stage(shared)
    apart = {"a": torch.tensor(1), "b": torch.tensor(2)}  # staged into one buffer above: must not stay shared
    _assert_same_values(stager.stage(apart), apart)
    assert stager.full_stagings == 4
    stager.close()


def test_the_async_backend_writes_each_save_with_its_own_values(one_rank, tmp_path):
    model, optimizer, train_step = _trained(one_rank)
    backend = TorchAsyncBackend(torch.device("cpu"), nice=0, executor="thread")
    saved = {}
    for step in (1, 2, 3):
        state = _state(model, optimizer, step)
        saved[step] = {k: v.to_local().clone() for k, v in state["model"].items()}
        backend.start(state, tmp_path / f"step-{step}").wait()
        train_step()
    backend.close()
    assert backend.stager.full_stagings == 1
    for step, weights in saved.items():
        state = _state(model, optimizer, 0)
        dcp.load(state, checkpoint_id=str(tmp_path / f"step-{step}"))
        assert int(state["trainer"]["step"]) == step and state["trainer"]["note"] == f"s{step}"
        for key, value in weights.items():
            assert torch.equal(state["model"][key].to_local(), value), (step, key)
