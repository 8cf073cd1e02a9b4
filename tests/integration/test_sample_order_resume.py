"""The sample order survives a resume at another world size, with real processes: a run at 4 ranks stopped after
step 3 and resumed at 2 ranks (twice the micro-steps: the same global batch) trains exactly the global sample
indices an uninterrupted 4-rank run trains, step by step, none repeated or skipped — and so the same windows, which
are a function of (seed, index) alone (tests/unit/test_sample_order.py)."""

import numpy as np
import pytest

from components.train.local import run_local_training
from trainer.run.events import read_events
from trainer.run.run_dir import RunDir, read_jsonl

pytestmark = pytest.mark.integration

COMMON = ["--training.batch_size=2", "--checkpoint.interval_steps=3", "--faults.schedule=",
          "--resilience.straggler_interval=0"]  # 4 processes on 2 cores: no timing audit (tests/integration/conftest)


def _steps(cfg) -> dict[int, dict]:
    """Each step's first record (a replay adds none here: no faults)."""
    steps: dict[int, dict] = {}
    for record in read_jsonl(RunDir(cfg.run_dir).metrics):
        steps.setdefault(int(record["step"]), record)
    return steps


def test_a_run_resumed_at_2_ranks_trains_the_samples_of_an_uninterrupted_4_rank_run(tmp_path, token_dir,
                                                                                    training_config):
    whole = training_config(tmp_path / "whole", "whole", *COMMON, "--training.nproc_per_node=4",
                            "--training.num_steps=6")
    run_local_training(whole, token_dir)
    first = training_config(tmp_path / "split", "split", *COMMON, "--training.nproc_per_node=4",
                            "--training.num_steps=3")
    run_local_training(first, token_dir)
    resumed = training_config(tmp_path / "split", "split", *COMMON, "--training.nproc_per_node=2",
                              "--training.grad_accum_steps=2", "--training.num_steps=6")
    result = run_local_training(resumed, token_dir)

    assert result["steps"] == 6 and result["world_size"] == 2
    [resume] = [r for r in read_events(resumed.run_dir, "resume") if r["step"] == 3]
    assert resume["source"] == "disk"  # the checkpoint of 4 ranks, resharded onto 2
    expected, got = _steps(whole), _steps(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    assert [got[s]["first_sample"] for s in got] == [expected[s]["first_sample"] for s in expected] == \
        list(range(0, 48, 8))
    assert all(got[s]["samples"] == 8 and got[s]["samples_skipped"] == 0 for s in got)
    seen = np.concatenate([np.arange(r["first_sample"], r["first_sample"] + r["samples"]) for r in got.values()])
    assert np.array_equal(np.sort(seen), np.arange(48))  # every index once
    assert got[6]["samples_seen"] == expected[6]["samples_seen"] == 48
