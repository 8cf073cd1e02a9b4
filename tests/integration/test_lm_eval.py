"""lm-evaluation-harness tasks through the trainer's adapter (trainer.evaluate.lm_eval_tasks) against lm-eval's own
Hugging Face model (HFLM) on the same saved model: a multiple-choice task (loglikelihood), a rolling-perplexity task
(loglikelihood_rolling) and a generation task (generate_until), all from task YAMLs over a jsonl shipped in
tests/data/lm_eval, offline. The same scores, so a user's lm-eval numbers and the pipeline's gate agree."""

import json
from pathlib import Path

import pytest
import torch

from tests.base_model import make_base_model
from trainer.data.tokenizer import load_tokenizer
from trainer.evaluate.heldout import Ranks
from trainer.evaluate.lm_eval_tasks import metrics_of, run_lm_eval, task_specs
from trainer.evaluate.tasks import TaskContext
from trainer.model.families import causal_lm_class, config_from_dict

pytestmark = pytest.mark.integration

TASKS = Path(__file__).parents[1] / "data" / "lm_eval"
YAMLS = [str(TASKS / name) for name in ("capitals.yaml", "capitals_text.yaml", "capitals_generate.yaml")]


def _texts() -> list[str]:
    rows = [json.loads(line) for line in (TASKS / "capitals.jsonl").read_text().splitlines()]
    facts = [f"Question: What is the capital of {r['country']}?\nAnswer: {r['choices'][r['answer']]}." for r in rows]
    return facts * 12


def test_the_adapters_scores_are_lm_evals_own_on_the_same_model(tmp_path):
    from lm_eval import simple_evaluate

    folder = tmp_path / "model"
    make_base_model(folder, _texts(), hidden=64, steps=80)
    config = config_from_dict(json.loads((folder / "config.json").read_text()))
    model = causal_lm_class(config).from_pretrained(str(folder), dtype=torch.float32).eval()
    context = TaskContext(model, load_tokenizer(str(folder)), Ranks(0, 1, torch.device("cpu"), 4, 64))
    ours = run_lm_eval(context, YAMLS, max_length=128)
    assert all("metrics" in record for record in ours.values()), ours

    theirs = metrics_of(simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu", "max_length": 128},
        tasks=task_specs(YAMLS), bootstrap_iters=0, log_samples=False, verbosity="ERROR"))
    print({task: record["metrics"] for task, record in ours.items()}, theirs)
    assert sorted(ours) == ["lm_eval:capitals", "lm_eval:capitals_generate", "lm_eval:capitals_text"]
    for task, metrics in theirs.items():
        mine = ours[f"lm_eval:{task}"]["metrics"]
        assert sorted(mine) == sorted(metrics)
        for name, value in metrics.items():
            assert mine[name] == pytest.approx(value, rel=1e-4), (task, name)
    assert ours["lm_eval:capitals"]["metrics"]["acc"] > 0.5  # it learnt the capitals (chance: 1/3)

    # eval.lm_eval_chat_template: lm-eval renders each prompt with the tokenizer's chat template, through the adapter
    # as through HFLM
    chat = run_lm_eval(context, YAMLS[:1], max_length=128, chat=True)["lm_eval:capitals"]["metrics"]
    chat_theirs = metrics_of(simple_evaluate(
        model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu", "max_length": 128},
        tasks=task_specs(YAMLS[:1]), apply_chat_template=True, bootstrap_iters=0, log_samples=False,
        verbosity="ERROR"))["capitals"]
    assert chat == pytest.approx(chat_theirs, rel=1e-4)
    assert ours["lm_eval:capitals_generate"]["metrics"]["exact_match"] > 0  # some answers generated right


def test_a_task_that_cannot_run_is_recorded_under_its_name(tmp_path):
    (tmp_path / "broken.yaml").write_text((TASKS / "capitals.yaml").read_text().replace("capitals.jsonl",
                                                                                        "missing.jsonl"))
    folder = tmp_path / "model"
    make_base_model(folder, _texts()[:20], hidden=32, steps=2)
    config = config_from_dict(json.loads((folder / "config.json").read_text()))
    model = causal_lm_class(config).from_pretrained(str(folder), dtype=torch.float32).eval()
    context = TaskContext(model, load_tokenizer(str(folder)), Ranks(0, 1, torch.device("cpu"), 4, 64))
    recorded = run_lm_eval(context, [str(tmp_path / "broken.yaml")], max_length=128)
    assert list(recorded) == ["lm_eval:broken"] and "missing.jsonl" in recorded["lm_eval:broken"]["error"]


def test_a_task_folder_in_s3_is_staged_and_its_tasks_run_by_name(s3_server, tmp_path):
    """eval.lm_eval_include_path as an S3 prefix of task YAMLs and their data: the stage step copies it onto FSx and
    the evaluation finds a task by its name there, its data file relative to the YAML. A prefix without a task YAML
    is refused before any training."""
    import boto3

    from components.stage.models import stage_models
    from components.stage.s3_copy import StageInputError
    from trainer.config import load_config

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="evals")
    for path in TASKS.iterdir():
        s3.upload_file(str(path), "evals", f"tasks/v1/{path.name}")
    s3.put_object(Bucket="evals", Key="empty/v1/README.md", Body=b"no tasks here")
    cfg = load_config(None, [f"--run.work_dir={tmp_path}", "--eval.lm_eval_include_path=s3://evals/tasks/v1",
                             "--eval.lm_eval_tasks=capitals"])
    [record] = stage_models(cfg)
    assert record["kind"] == "lm_eval_tasks" and "capitals.yaml" in record["task_files"]
    include = Path(cfg.lm_eval_include_dir)
    assert (include / "capitals.jsonl").is_file()

    folder = tmp_path / "model"
    make_base_model(folder, _texts(), hidden=32, steps=20)
    config = config_from_dict(json.loads((folder / "config.json").read_text()))
    model = causal_lm_class(config).from_pretrained(str(folder), dtype=torch.float32).eval()
    context = TaskContext(model, load_tokenizer(str(folder)), Ranks(0, 1, torch.device("cpu"), 4, 64))
    recorded = run_lm_eval(context, cfg.eval.lm_eval_task_list, include_path=str(include), max_length=128)
    assert set(recorded["lm_eval:capitals"]["metrics"]) == {"acc", "acc_norm"}, recorded

    empty = load_config(None, [f"--run.work_dir={tmp_path}", "--eval.lm_eval_include_path=s3://evals/empty/v1"])
    with pytest.raises(StageInputError, match="holds no task YAML"):  # exit code 2: the input
        stage_models(empty)
