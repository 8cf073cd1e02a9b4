"""A continuation that changes what the run trains (issue 50), with real 2-rank launches: the same run id again, with
more steps and another data mixture. The mixture's change is refused before any step, naming it (exit 2 from the
pipeline: TrainingInputError); with data.on_mixture_change=new_phase the run goes on in a new data phase, its
samples before the boundary as they were; and the learning rate of every step already trained stays as it was."""

import pytest

from components.stage.shards import write_mixture
from components.train.local import run_local_training
from localcluster.processes import TrainingInputError
from pipelines.demo_data import demo_files
from trainer.config import DatasetConfig
from trainer.config.rules import InputError
from trainer.data.shards import tokenize_files
from trainer.run.events import read_events
from trainer.run.run_dir import read_json, read_jsonl

pytestmark = pytest.mark.integration

SHAPE = ["--checkpoint.interval_steps=2", "--faults.schedule=", "--eval.max_batches=1", "--eval.every_steps=0",
         "--resilience.straggler_interval=0", "--training.warmup_steps=2"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora (web, code) and two mixtures of them: web 3 : code 1, then web 1 : code 1."""
    root = tmp_path_factory.mktemp("corpora")
    files = demo_files(300)
    tokens = {}
    for name, part in (("web", list(files)[:2]), ("code", list(files)[2:])):
        raw = root / f"{name}-raw"
        raw.mkdir()
        for file in part:
            (raw / file).write_bytes(files[file])
        tokens[name] = tokenize_files(sorted(raw.iterdir()), root / name, 0.1)
    for folder, weights in (("first", {"web": 3, "code": 1}), ("second", {"web": 1, "code": 1})):
        write_mixture(root / folder, [(DatasetConfig(name=name, weight=weight), root / name, tokens[name])
                                      for name, weight in weights.items()])
    return root


def _lrs(cfg) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_jsonl(cfg.run_dir / "metrics.jsonl")}


def test_a_continuation_with_another_mixture_is_refused_then_trains_a_new_data_phase_at_a_continuous_lr(
        tmp_path, corpora, training_config):
    first = training_config(tmp_path, "extend", *SHAPE, "--training.num_steps=4")
    run_local_training(first, corpora / "first")
    trained = _lrs(first)
    [phase0] = read_events(first.run_dir, "data_phase")
    assert phase0["phase"] == 0 and [c["name"] for c in phase0["corpora"]] == ["code", "web"]

    # the same run, 4 steps more, on the other mixture: refused at its start, before any step, naming the change
    more = training_config(tmp_path, "extend", *SHAPE, "--training.num_steps=8")
    with pytest.raises(TrainingInputError, match=r"data.datasets: the corpora differ from those this run drew its "
                                                 r"first 32 samples from \(data phase 0\): web weight 3 -> 1\. .*"
                                                 r"--data.on_mixture_change=new_phase") as refused:
        run_local_training(more, corpora / "second")
    assert isinstance(refused.value, InputError)  # the pipeline's exit 2
    assert read_json(more.run_dir / "gave_up.json")["cause"] == "input"
    assert max(_lrs(more)) == 4  # nothing trained

    # asked for: a new data phase from sample 32 (step 4); 2 ranks x batch 4 x 4 steps drew web 24, code 8
    phased = training_config(tmp_path, "extend", *SHAPE, "--training.num_steps=8", "--data.on_mixture_change=new_phase")
    result = run_local_training(phased, corpora / "second")
    assert result["steps"] == 8
    phases = read_events(phased.run_dir, "data_phase")
    assert [(p["phase"], p["start"], p["step"]) for p in phases] == [(0, 0, 0), (1, 32, 4)]
    assert {c["name"]: c["offset"] for c in phases[1]["corpora"]} == {"code": 8, "web": 24}
    metrics = read_jsonl(phased.run_dir / "metrics.jsonl")
    last = metrics[-1]
    assert (last["samples/web"], last["samples/code"]) == (24 + 16, 8 + 16)  # 1 : 1 after the boundary

    # the LR: steps 1-4 as the first launch trained them; then the cosine's floor (it ended at the old horizon 4),
    # not a jump back up to the cosine of an 8-step horizon
    lrs = _lrs(phased)
    assert [lrs[s] for s in range(1, 5)] == [trained[s] for s in range(1, 5)]
    floor = first.training.lr * first.training.min_lr_ratio
    assert [lrs[s] for s in range(5, 9)] == [pytest.approx(floor)] * 4
    schedules = read_events(phased.run_dir, "lr_schedule")
    assert schedules[-1]["decision"] == "kept" and schedules[-1]["horizon"] == 4
    assert "training.num_steps 4 -> 8 would change the LR of steps already trained" in schedules[-1]["why"]
