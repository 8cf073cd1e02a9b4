"""The numeric check's rules (trainer.resilience.numerics), the skipped windows (trainer.job.numeric_recovery),
the rollback streak (trainer.resilience.budget) and the numeric drills' grammar."""

import json
import math

import pytest
import torch

from trainer.config import ConfigError, load_config
from trainer.config.drills import parse_schedule
from trainer.job.numeric_recovery import past_skipped
from trainer.resilience.budget import rollback_streak
from trainer.resilience.numerics import NumericDrills, SpikeWindow, _differ, robust_zscore
from trainer.checkpoint.node_store import RankStore
from trainer.run.history import ControlState

STEADY = [3.0, 3.1, 2.9, 3.05, 2.95, 3.0, 3.1, 2.9]


def _window(values=STEADY, after=0) -> SpikeWindow:
    window = SpikeWindow(len(values), zscore=6.0, after_steps=after)
    for value in values:
        window.accept(value, value)
    return window


def test_the_robust_zscore_measures_in_median_absolute_deviations():
    z, median = robust_zscore(3.5, STEADY)
    assert median == 3.0
    assert z == pytest.approx(0.5 / (1.4826 * 0.075))


def test_a_window_without_spread_is_not_a_spike_for_the_same_value():
    assert robust_zscore(2.0, [2.0] * 8)[0] == 0
    assert robust_zscore(2.5, [2.0] * 8)[0] == pytest.approx(25)  # against a hundredth of the median


@pytest.mark.parametrize("loss, grad_norm, kind", [
    (math.nan, 1.0, "nonfinite_loss"), (math.inf, 1.0, "nonfinite_loss"), (3.0, math.nan, "nonfinite_grad_norm"),
    (3.0, -math.inf, "nonfinite_grad_norm"), (12.0, 3.0, "loss_spike"), (3.0, 30.0, "grad_norm_spike"),
])
def test_what_is_an_anomaly(loss, grad_norm, kind):
    assert _window().judge(20, loss, grad_norm)[0] == kind


def test_a_drop_is_no_spike_and_neither_is_the_usual_noise():
    assert _window().judge(20, 0.5, 0.5) is None
    assert _window().judge(20, 3.2, 3.2) is None


def test_spikes_wait_for_their_first_step_and_a_full_window_but_non_finite_values_never_wait():
    assert _window(after=30).judge(20, 12.0, 3.0) is None
    assert _window(after=30).judge(20, math.nan, 3.0)[0] == "nonfinite_loss"
    half = SpikeWindow(16, zscore=6.0, after_steps=0)
    for value in STEADY:
        half.accept(value, value)
    assert half.judge(20, 12.0, 3.0) is None
    assert SpikeWindow(8, zscore=0.0, after_steps=0).judge(20, 12.0, 3.0) is None  # 0: spikes unchecked


def test_a_resumed_window_holds_the_newest_record_of_each_step_up_to_the_resumed_one(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": s, "loss": 10.0 + s, "grad_norm": 1.0} for s in range(1, 13)]
    records += [{"step": 11, "loss": 99.0, "grad_norm": 1.0}]  # a replay of step 11 after a fault
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    window = SpikeWindow(4, zscore=6.0, after_steps=0)
    window.restore(metrics, 11)
    assert list(window.losses) == [18.0, 19.0, 20.0, 99.0]
    window.restore(tmp_path / "absent.jsonl", 11)
    assert list(window.losses) == []


def test_the_samples_of_skipped_windows_are_jumped_over_in_one_go():
    windows = [[16, 32], [32, 40], [100, 108]]
    assert past_skipped(8, windows) == 8
    assert past_skipped(16, windows) == 40
    assert past_skipped(104, windows) == 108


def test_rollbacks_count_in_a_row_while_each_comes_back_no_later_than_the_one_before():
    assert rollback_streak([]) == 0
    assert rollback_streak([60]) == 1
    assert rollback_streak([60, 60, 58]) == 3
    assert rollback_streak([60, 60, 75]) == 1  # it got past step 60: progress
    assert rollback_streak([60, 90, 90]) == 2


def test_the_control_records_keep_every_skipped_window():
    state = ControlState().fold([
        {"event": "data_skipped", "time": 1.0, "start": 72, "end": 88},
        {"event": "rollback", "time": 1.0, "anomaly_step": 10, "anomaly": "nonfinite_loss", "reloaded_step": 9,
         "window": [56, 88]}])
    assert state.skip_windows == [[72, 88]]
    assert state.rollbacks[0]["anomaly_step"] == 10
    assert ControlState.from_json(json.loads(json.dumps(state.__dict__))).skip_windows == [[72, 88]]


class _Events:
    def __init__(self):
        self.records = []

    def write(self, event, **fields):
        self.records.append({"event": event, **fields})


def test_a_poisoned_batch_poisons_the_loss_each_time_it_is_trained_and_is_one_fault():
    events = _Events()
    drills = NumericDrills(parse_schedule("nan@3:rank=1, spike@5:rank=0"), 1, events, set())
    loss = torch.tensor(2.0)
    assert drills.poison(loss, 0, 8) is loss  # step 1's batch
    assert math.isnan(drills.poison(loss, 16, 8))  # step 3's batch: samples 16..23
    assert math.isnan(drills.poison(loss, 16, 8))  # executed again: the same bad data
    assert drills.poison(loss, 32, 8) is loss  # step 5's is rank 0's drill
    assert [r["key"] for r in events.records] == ["nan@3:rank=1"]
    assert drills.take_fired() == ["nan@3:rank=1"] and drills.take_fired() == []


def test_an_sdc_flips_one_exponent_bit_of_a_gradient_that_holds_one_once():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    model[1].weight.grad = torch.tensor([[0.5, -0.25]])
    drills = NumericDrills(parse_schedule("sdc@4:rank=0"), 0, _Events(), set())
    drills.flip(model, 3)
    assert model[1].weight.grad[0, 0] == 0.5
    drills.flip(model, 4)
    assert model[1].weight.grad[0, 0] == 0.5 * 2.0 ** 128  # the largest value, 2^128 times itself
    drills.flip(model, 5)
    assert model[1].weight.grad[0, 0] == 0.5 * 2.0 ** 128
    fired = NumericDrills(parse_schedule("sdc@4:rank=0"), 0, _Events(), {"sdc@4:rank=0"})
    fired.flip(model, 4)  # fired before a restart: never again
    assert model[1].weight.grad[0, 0] == 0.5 * 2.0 ** 128


def test_a_rank_moved_when_its_figures_differ_beyond_rounding():
    assert not _differ(2.0, 2.0) and not _differ(math.nan, math.nan) and not _differ(math.inf, math.inf)
    assert _differ(math.inf, 2.0) and _differ(2.0, 2.1) and not _differ(2.0, 2.0 + 1e-9)


def test_a_bug_fires_on_every_attempt_and_keeps_its_plain_key():
    [bug] = parse_schedule("bug@6:rank=1")
    assert bug.repeat and bug.key == "bug@6:rank=1"


@pytest.mark.parametrize("schedule", ["sdc@5", "nan@t=30", "spike@5:repeat", "nan@5:group=1", "bug@5:repeat",
                                      "bug@t=3"])
def test_numeric_drills_outside_their_grammar_are_refused(schedule):
    with pytest.raises(ConfigError, match="faults.schedule"):
        load_config("local", [f"--faults.schedule={schedule}"])


@pytest.mark.parametrize("override, field", [
    ("--resilience.spike_window=4", "resilience.spike_window"), ("--resilience.skip_steps=0", "resilience.skip_steps"),
    ("--resilience.spike_zscore=-1", "resilience.spike_zscore"),
    ("--resilience.rollback_steps=-1", "resilience.rollback_steps")])
def test_bad_numeric_settings_name_their_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("local", [override])


def test_a_rollback_empties_the_node_memory_slots_of_later_steps(tmp_path):
    store = RankStore(tmp_path, node=0, rank=0, world_size=2, replica_of=1)
    state = {"w": torch.ones(2)}
    store.save(8, state)
    store.save(9, state)
    store.replica.write({"step": 9, "rank": 1, "world_size": 2, "format_version": 1, "nbytes": 0, "layout": []},
                        lambda buffer: "0")
    store.drop_after(8)
    assert store.own_steps() == [8] and store.replica.steps() == {}


def test_a_fingerprint_changes_with_any_one_bit_and_is_equal_for_equal_shards():
    from trainer.resilience.sdc import shard_fingerprint

    model = torch.nn.Linear(4, 3)
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    cpu = torch.device("cpu")
    assert torch.equal(shard_fingerprint(model, cpu), shard_fingerprint(twin, cpu))
    for bit in (0, 13, 30):  # the lowest mantissa bit, a middle one, the top exponent bit
        changed = torch.nn.Linear(4, 3)
        changed.load_state_dict(model.state_dict())
        with torch.no_grad():
            changed.weight.view(-1)[5:6].view(torch.int32).bitwise_xor_(1 << bit)
        assert not torch.equal(shard_fingerprint(changed, cpu), shard_fingerprint(model, cpu)), bit


def test_the_groups_apart_are_named_by_rank_and_a_majority_tells_which():
    from trainer.resilience.sdc import judge

    same = [[[1, 2]] * 3, [[5, 6]] * 3]  # table[rank][group]
    assert judge(same, [0, 1, 2]) is None
    flipped = [[[1, 2], [1, 2], [1, 3]], [[5, 6]] * 3]
    assert judge(flipped, [0, 1, 2]) == {"ranks": {0: [2]}, "minority": [2], "majority": True}
    two = [[[1, 2], [1, 3]], [[5, 6], [5, 6]]]
    found = judge(two, [0, 1])
    assert found == {"ranks": {0: [0, 1]}, "minority": [], "majority": False}
    assert judge([[[1, 2], [0, 0], [1, 2]]], [0, 2]) is None  # a group not taking part has no row


def test_a_bitflip_names_its_group_and_rank_and_needs_replica_groups():
    [flip] = parse_schedule("bitflip@60:group=1:rank=1")
    assert (flip.group, flip.rank, flip.key) == (1, 1, "bitflip@60:group=1:rank=1")
    with pytest.raises(ConfigError, match="one replica group"):
        load_config("local", ["--faults.schedule=bitflip@6:group=1"])
    with pytest.raises(ConfigError, match="bitflip@STEP:group=G"):
        load_config("local", ["--faults.schedule=bitflip@6:rank=1"])


def test_sdc_settings_name_their_field():
    for override, field in (("--resilience.sdc_check_every=-1", "sdc_check_every"),
                            ("--resilience.sdc_strikes=0", "sdc_strikes")):
        with pytest.raises(ConfigError, match=field):
            load_config("local", [override])
