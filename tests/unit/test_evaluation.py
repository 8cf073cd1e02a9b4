"""Pure parts of the evaluation: the loss in chunks, the export's file layout, the eval config, what MLflow gets."""

import pytest
import torch
import torch.nn.functional as F

from components.run_metrics import step_rows
from trainer.checkpoint.hf_export import file_layout
from trainer.config import ConfigError, load_config
from trainer.evaluate.tasks import load_task, multiple_choice
from trainer.model.loss import IGNORE, chunked_cross_entropy


@pytest.fixture
def head_and_batch():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(3, 37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 37))
    return head, hidden, targets


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_the_chunked_loss_and_its_gradients_are_the_full_logits_ones(head_and_batch, chunk):
    head, hidden, targets = head_and_batch
    full = F.cross_entropy(head(hidden).reshape(-1, 50), targets.reshape(-1))
    full_grads = torch.autograd.grad(full, [hidden, head.weight])
    chunked = chunked_cross_entropy(hidden, head, targets, chunk)
    chunked_grads = torch.autograd.grad(chunked, [hidden, head.weight])
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    for mine, theirs in zip(chunked_grads, full_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-7)


def test_the_chunked_loss_per_position_ignores_padding(head_and_batch):
    head, hidden, targets = head_and_batch
    targets = targets.clone()
    targets[:, 30:] = IGNORE
    per_position = chunked_cross_entropy(hidden.detach(), head, targets, 8, reduction="none")
    assert per_position.shape == targets.shape and (per_position[:, 30:] == 0).all()
    expected = F.cross_entropy(head(hidden.detach()).reshape(-1, 50), targets.reshape(-1), reduction="sum",
                               ignore_index=IGNORE)
    assert per_position.sum().item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_export_starts_a_new_file_before_one_would_pass_the_limit():
    shapes = {"a": ((10, 10), 4), "b": ((10, 10), 4), "c": ((30, 10), 4), "d": ((1,), 4)}  # 400, 400, 1200, 4 B
    assert file_layout(shapes, max_file_bytes=800) == {"a": 1, "b": 1, "c": 2, "d": 3}  # c alone: larger than 800
    assert file_layout(shapes, max_file_bytes=10**9) == dict.fromkeys(shapes, 1)


@pytest.mark.parametrize("override, field", [
    ("--eval.every_steps=-1", "eval.every_steps"), ("--eval.tasks=multiple_choice,,x:y", "eval.tasks"),
    ("--eval.export_uri=s3://Bad_Bucket/x", "eval.export_uri"),
    ("--eval.export_max_file_gb=0", "eval.export_max_file_gb"),
    ("--eval.export_dtype=int8", "eval.export_dtype"), ("--training.loss_chunk=0", "training.loss_chunk")])
def test_a_bad_eval_setting_is_refused_naming_it(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("local", [override])


def test_the_export_goes_under_the_run_id_and_step():
    cfg = load_config("local", ["--run.run_id=r1", "--eval.export_uri=s3://bucket/exports/"])
    assert cfg.export_uri(12) == "s3://bucket/exports/r1/step-000012"
    local = load_config("local", ["--run.run_id=r1"])
    assert local.export_uri(12) == str(local.run_dir / "export" / "step-000012")


def test_an_unknown_task_names_itself_and_the_shipped_ones():
    assert load_task("multiple_choice") is multiple_choice
    with pytest.raises(ConfigError, match=r"eval.tasks: 'nowhere:task' is not an importable module:function .*"
                                          r"shipped tasks: multiple_choice"):
        load_task("nowhere:task")


def test_every_validation_reaches_mlflow_whatever_the_step_cadence():
    records = [{"step": s, "loss": 1.0} for s in range(1, 8)] + [{"step": 6, "loss": 2.0}]  # step 6 replayed
    records[2]["val_loss"] = 0.5  # step 3
    sent, newest = step_rows(records, after=0, every=5)
    assert [r["step"] for r in sent] == [3, 5] and newest == 7
