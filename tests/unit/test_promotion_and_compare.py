"""The promotion gate's decisions and the comparison table's formats."""

import csv
import io
import json

import pytest

from components.evaluate.promotion import decide
from pipelines.compare import COLUMNS, render


def test_the_first_model_is_promoted():
    decision = decide(2.0, None, threshold=0.01)
    assert decision.promote and decision.reason == "no champion registered yet"


@pytest.mark.parametrize("candidate, champion, threshold, promote", [
    (1.90, 2.00, 0.0, True),     # better
    (2.00, 2.00, 0.0, False),    # equal is not better
    (2.10, 2.00, 0.0, False),    # worse
    (1.99, 2.00, 0.01, False),   # better, but not by the required 1 %
    (1.97, 2.00, 0.01, True),    # better by more than 1 %
])
def test_the_gate_needs_the_threshold_beaten(candidate, champion, threshold, promote):
    decision = decide(candidate, champion, threshold, champion_version="3")
    assert decision.promote is promote
    assert "champion v3" in decision.reason and decision.champion_loss == champion


ROWS = [{"run": "b", "started": "2026-11-29 12:00", "status": "FINISHED", "trigger": "ci",
         "config_differences": "training.lr=0.001", "goodput": 0.91234, "recoveries": 1.0, "lost_steps": 3.0,
         "checkpoint_stall_s": 0.2, "final_train_loss": 0.25, "heldout_loss": 0.3, "promoted": "true"},
        {"run": "a", "started": "2026-11-28 12:00", "status": "FAILED", "trigger": "schedule",
         "config_differences": "training.lr=0.002", "goodput": None, "recoveries": None, "lost_steps": None,
         "checkpoint_stall_s": None, "final_train_loss": None, "heldout_loss": None, "promoted": ""}]


def test_formats():
    assert json.loads(render(ROWS, "json"))[0]["goodput"] == 0.91234
    parsed = list(csv.DictReader(io.StringIO(render(ROWS, "csv"))))
    assert parsed[0]["goodput"] == "0.9123" and parsed[1]["heldout_loss"] == "" and list(parsed[0]) == COLUMNS
    markdown = render(ROWS, "markdown").splitlines()
    assert markdown[0] == "| " + " | ".join(COLUMNS) + " |" and len(markdown) == 4
    table = render(ROWS, "table").splitlines()
    assert table[0].split() == COLUMNS and table[1].startswith("b ")
    with pytest.raises(ValueError, match="--format 'xml'"):
        render(ROWS, "xml")


def test_a_candidate_with_the_champions_very_loss_does_not_beat_its_tag():
    """The champion's loss read back from its version's tag (a run on the same windows) is the loss it was registered
    with, bit for bit: an identical retrain ties and keeps the champion at threshold 0. With the tag rounded to 6
    decimals (3.269128) the same 3.26912784576416 won, and four identical concurrent runs all promoted."""
    from types import SimpleNamespace

    from components.evaluate.promotion import WINDOWS_TAG, decide_against, loss_tag

    for loss in (3.26912784576416, 0.1 + 0.2, 2.0 / 3.0, 5.5):
        champion = SimpleNamespace(version="1", tags={"heldout_loss": loss_tag(loss), WINDOWS_TAG: "w"})
        record = {"candidate": {"heldout_loss": loss}, "windows": "w"}
        decision = decide_against(champion, record, 0.0, "promote")
        assert decision.promote is False and decision.champion_loss == loss, decision.reason
        better = decide_against(champion, {**record, "candidate": {"heldout_loss": loss * (1 - 1e-12)}}, 0.0, "promote")
        assert better.promote is True
