"""What a user can get wrong at the end of training — an export URI that cannot be written, a champion whose files
are gone, an evaluation task that raises — each a clear error and exit code, with nothing already saved lost."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from components.evaluate.promotion import decide_against
from components.evaluate.step import EvaluationTaskFailed, ExportFailed, run_evaluate
from trainer.checkpoint.export_store import ExportUriNotWritable, check_writable
from trainer.config.rules import InputError
from trainer.run.run_dir import RunDir, write_json

pytestmark = pytest.mark.integration

GONE = "s3://resilient-train-data/exports/an-old-run/step-000004"


@pytest.fixture(scope="module")
def module_s3(tmp_path_factory):
    from pipelines.local_stack import S3Server

    with S3Server(log_dir=tmp_path_factory.mktemp("s3-logs")) as server:
        import boto3

        boto3.client("s3").create_bucket(Bucket="resilient-train-data")
        yield server


@pytest.fixture(scope="module")
def unlucky_run(tmp_path_factory, token_dir, training_config, module_s3):
    """A 2-rank training whose export bucket does not exist, whose champion's export is gone, and one of whose
    tasks raises: the training still ends, its checkpoint committed, the record says what went wrong."""
    from components.train.local import run_local_training

    cfg = training_config(tmp_path_factory.mktemp("work"), "unlucky", "--training.num_steps=4",
                          "--checkpoint.interval_steps=4", "--faults.schedule=", "--eval.max_new_tokens=4",
                          "--eval.export_uri=s3://no-such-export-bucket/exports",
                          "--eval.tasks=multiple_choice,tests.eval_tasks:raises,tests.eval_tasks:vocabulary")
    write_json(RunDir(cfg.run_dir).champion, {"name": "resilient-train-llama", "version": "3", "source": GONE})
    result = run_local_training(cfg, token_dir)
    return cfg, result, json.loads(RunDir(cfg.run_dir).evaluation(4).read_text())


def test_an_unwritable_export_uri_is_refused_before_training(module_s3, tmp_path):
    with pytest.raises(ExportUriNotWritable, match=r"eval.export_uri='s3://no-such-export-bucket/x' is not writable "
                                                   r"\(.*NoSuchBucket.*\): give a prefix this job's role may write"):
        check_writable("s3://no-such-export-bucket/x")
    assert issubclass(ExportUriNotWritable, InputError)  # exit 2 from the CLI, as every input the run cannot use
    check_writable(str(tmp_path / "exports"))  # a folder that can be created is fine


def test_an_export_that_fails_at_the_end_keeps_the_checkpoint_and_names_it(unlucky_run):
    cfg, result, record = unlucky_run
    checkpoint = cfg.checkpoint_dir / "step-000004"
    assert result["checkpoint"] == str(checkpoint) and (checkpoint / "manifest.json").is_file()
    assert record["export"]["complete"] is False and "no-such-export-bucket" in record["export"]["error"]
    assert record["export"]["checkpoint"] == str(checkpoint)
    assert record["candidate"]["heldout_loss"] > 0  # evaluated all the same
    with pytest.raises(ExportFailed, match=rf"export of step 4 to s3://no-such-export-bucket/exports/unlucky/"
                                           rf"step-000004 failed: .*The validated checkpoint {checkpoint} stays"):
        run_evaluate(cfg, str(checkpoint))
    assert (checkpoint / "manifest.json").is_file()


def test_a_champion_whose_files_are_gone_is_recorded_not_fatal(unlucky_run):
    _, _, record = unlucky_run
    assert record["champion"]["version"] == "3" and record["champion"]["files_gone"] is True
    assert f"no complete export at {GONE}" in record["champion"]["error"]


@pytest.mark.parametrize("policy, promote, words", [
    ("promote", True, "promoted on the candidate's own evaluation (eval.champion_missing=promote)"),
    ("refuse", False, "the candidate is refused (eval.champion_missing=refuse)")])
def test_the_gate_decides_a_missing_champion_by_policy(unlucky_run, policy, promote, words):
    _, _, record = unlucky_run
    champion = SimpleNamespace(version="3", tags={})
    decision = decide_against(champion, record, 0.0, policy)
    assert decision.promote is promote and decision.reason.startswith("champion v3 cannot be evaluated, its "
                                                                      "export is gone (no complete export at")
    assert decision.reason.endswith(words)


def test_a_champion_evaluated_on_other_windows_defers_the_decision(unlucky_run):
    _, _, record = unlucky_run
    moved = SimpleNamespace(version="5", tags={"eval_windows": "another-dataset", "heldout_loss": "1.0"})
    decision = decide_against(moved, record, 0.0, "promote")
    assert decision.promote is False and decision.reason.startswith("deferred: champion v5 was not evaluated on")
    same = SimpleNamespace(version="5", tags={"eval_windows": record["windows"], "heldout_loss": "0.001"})
    assert decide_against(same, record, 0.0, "promote").reason.startswith("held-out loss")  # its recorded loss


def test_a_task_that_raises_is_named_and_the_others_still_count(unlucky_run):
    cfg, _, record = unlucky_run
    tasks = record["candidate"]["tasks"]
    assert tasks["tests.eval_tasks:raises"]["error"] == "RuntimeError: the task's data file is unreadable"
    assert tasks["tests.eval_tasks:vocabulary"]["metrics"] == {"vocab_size": 258.0, "ranks": 2.0}
    assert 0 <= tasks["multiple_choice"]["metrics"]["accuracy"] <= 1
    required = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, tasks_required=True))
    with pytest.raises(EvaluationTaskFailed, match=r"tests.eval_tasks:raises: RuntimeError: the task's data file"):
        run_evaluate(required, str(cfg.checkpoint_dir / "step-000004"))


def test_no_held_out_window_fails_the_evaluate_step_keeping_checkpoint_and_export(unlucky_run):
    """The trainer records why it could not evaluate (a held-out split shorter than one window) and still exports;
    the evaluate step fails saying so."""
    from components.evaluate.step import EvaluationMissing

    cfg, _, record = unlucky_run
    path = RunDir(cfg.run_dir).evaluation(4)
    original = path.read_text()
    try:
        write_json(path, {**record, "windows": None,
                          "candidate": {"error": "the held-out split has no complete window of 33 tokens"}})
        with pytest.raises(EvaluationMissing, match=r"held-out evaluation of step 4 failed .*no complete window of 33 "
                                                    r"tokens; the checkpoint .*step-000004 and its export .* stay"):
            run_evaluate(cfg, str(cfg.checkpoint_dir / "step-000004"))
    finally:
        path.write_text(original)


def test_a_finished_run_launched_again_only_evaluates(unlucky_run, token_dir):
    """Nothing left to train: the job resumes at its last step and runs the final evaluation and export again —
    the evaluation job of a finished run, with the same code."""
    from components.train.local import run_local_training

    cfg, _, _ = unlucky_run
    result = run_local_training(cfg, token_dir)
    assert result["steps"] == 4 and result["steps_this_launch"] == 0
    record = json.loads(RunDir(cfg.run_dir).evaluation(4).read_text())
    assert record["candidate"]["heldout_loss"] > 0 and record["export"]["complete"] is False  # the bucket is still gone
