"""The in-memory copy kept across in-process restarts: capture, restore, agreement, mismatch."""

import pytest
import torch

from trainer.checkpoint.memory import MemorySnapshot


def _state(scale: float) -> dict:
    return {"model": {"w": torch.full((3, 2), scale)},
            "optim": {"state": {"w": {"step": torch.tensor(scale), "exp_avg": torch.full((3, 2), -scale)}},
                      "param_groups": [{"lr": 0.1 * scale, "params": ["w"]}]},
            "trainer": {"step": torch.tensor(int(scale))}}


def test_restore_fills_a_fresh_state_in_place_and_later_writes_do_not_leak_in():
    snapshot = MemorySnapshot(interval_steps=5)
    assert [s for s in range(1, 12) if snapshot.due(s)] == [5, 10]
    live = _state(2.0)
    snapshot.capture(10, live)
    live["model"]["w"].add_(100)  # training goes on after the copy

    fresh = _state(0.0)
    weight = fresh["model"]["w"]
    snapshot.restore_into(fresh)
    assert fresh["model"]["w"] is weight  # in place: the model's own tensors get the values
    assert torch.equal(weight, torch.full((3, 2), 2.0))
    assert torch.equal(fresh["optim"]["state"]["w"]["exp_avg"], torch.full((3, 2), -2.0))
    assert fresh["optim"]["param_groups"] == [{"lr": pytest.approx(0.2), "params": ["w"]}]
    assert int(fresh["trainer"]["step"]) == 2


def test_a_rebuilt_state_of_another_shape_is_refused():
    snapshot = MemorySnapshot(interval_steps=1)
    snapshot.capture(3, _state(1.0))
    other = _state(0.0)
    other["model"]["w"] = torch.zeros(4, 2)
    with pytest.raises(RuntimeError, match="model.w"):
        snapshot.restore_into(other)


def test_agreement_on_one_process(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        snapshot = MemorySnapshot(interval_steps=1)
        assert snapshot.agreed_step() is None
        snapshot.capture(7, _state(1.0))
        assert snapshot.agreed_step() == 7
    finally:
        dist.destroy_process_group()
