import pytest

from trainer.config import load_config
from trainer.job.step import lr_at


def test_warmup_then_cosine_to_the_floor():
    cfg = load_config(None, ["--training.num_steps=100", "--training.warmup_steps=10", "--training.lr=1.0",
                             "--training.min_lr_ratio=0.1"])
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    values = [lr_at(s, cfg) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_run_shorter_than_warmup_is_all_warmup():
    cfg = load_config(None, ["--training.num_steps=5", "--training.warmup_steps=20", "--training.lr=1.0"])
    assert [round(lr_at(s, cfg), 3) for s in range(5)] == [0.05, 0.1, 0.15, 0.2, 0.25]


def test_xids_that_take_a_node_out_of_service():
    from trainer.resilience.health import classify_xids

    assert classify_xids([13, 31]) == {"xids": [13, 31], "node_bad": False, "node_bad_xids": []}
    assert classify_xids([79, 94, 94]) == {"xids": [79, 94], "node_bad": True, "node_bad_xids": [94]}


def test_gpu_health_is_a_no_op_on_cpu(tmp_path):
    import torch

    from trainer.resilience.health import GpuHealth
    from trainer.run.events import EventLog

    health = GpuHealth(torch.device("cpu"), EventLog(tmp_path, 0), interval_steps=1)
    assert not health.enabled
    health.maybe_check(1)
    assert not (tmp_path / "events" / "rank-0.jsonl").exists()
