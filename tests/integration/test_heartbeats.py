"""ft_launcher's heartbeats through the work at the end of a run that is no training step: the final evaluation
(thousands of forwards: every generated token is one) and the wait for the final checkpoint's background write.
Without them ft_launcher takes a final evaluation or write longer than its heartbeat timeout (60 s; an 8B
evaluation takes minutes, its 96 GB write ~160 s) for a hang and restarts the workers at the end of the run."""

import logging
import time

import pytest
import torch

from trainer.data.shards import load_meta
from trainer.data.tokenizer import load_tokenizer
from trainer.evaluate import evaluator as evaluator_module
from trainer.evaluate.evaluator import Evaluator
from trainer.evaluate.heldout import Ranks
from trainer.model.build import build_model, model_config_of
from trainer.resilience import hooks

pytestmark = pytest.mark.integration


def test_the_final_evaluation_beats_between_any_two_of_its_forwards(tmp_path, token_dir, training_config,
                                                                    monkeypatch):
    monkeypatch.setattr(evaluator_module, "BEAT_EVERY_SECONDS", 0.0)  # every forward may beat: count, not time
    cfg = training_config(tmp_path, "beats", "--eval.max_new_tokens=6", "--eval.tasks=multiple_choice",
                          "--eval.every_steps=2", "--eval.val_batches=3")
    tokenizer_spec = load_meta(token_dir)["tokenizer"]
    model = build_model(model_config_of(cfg.model, None, load_tokenizer(tokenizer_spec)), seed=0)
    trail: list[str] = []
    model.register_forward_pre_hook(lambda module, args: trail.append("forward"))
    evaluator = Evaluator(cfg, token_dir, model, Ranks(0, 1, torch.device("cpu"), cfg.eval.batch_size,
                                                       cfg.training.loss_chunk),
                          tokenizer_spec=tokenizer_spec, writes=lambda: True, beat=lambda: trail.append("beat"))

    record = evaluator.final(1, None)

    assert record["export"]["complete"] and len(record["candidate"]["generations"]) == len(cfg.eval.prompt_list)
    assert record["candidate"]["tasks"]["multiple_choice"]["metrics"], record["candidate"]["tasks"]
    forwards = trail.count("forward")
    assert forwards > 3 * cfg.eval.max_new_tokens  # held-out windows, the task's choices, every generated token
    runs = "".join("f" if entry == "forward" else "b" for entry in trail).split("b")
    assert max(len(run) for run in runs) <= 1, f"{max(len(run) for run in runs)} forwards in a row without a beat"

    trail.clear()  # between steps too: eval.val_batches windows
    assert "val_loss" in evaluator.periodic(2)
    assert trail.count("forward") >= 2 and "ff" not in "".join(entry[0] for entry in trail)


class _RankMonitorClient:
    """NVRx's RankMonitorClient as the Heartbeat uses it: connect once, then heartbeats."""

    def __init__(self):
        self.connected, self.beats = 0, []

    def init_workload_monitoring(self):
        self.connected += 1

    def send_heartbeat(self):
        assert self.connected == 1, "a heartbeat before the connection"
        self.beats.append(time.monotonic())

    def shutdown_workload_monitoring(self):
        self.connected = 0


def test_a_long_wait_on_a_background_write_beats_until_its_limit(monkeypatch, caplog):
    monkeypatch.setattr(hooks, "WAITING_BEAT_SECONDS", 0.02)
    heartbeat = hooks.Heartbeat()
    heartbeat.client = client = _RankMonitorClient()
    with heartbeat.while_waiting("a write before the first step", 10.0):
        time.sleep(0.2)
    assert client.beats == [] and client.connected == 0  # start-up's watchdog watches until the loop's first beat

    heartbeat.beat()  # the loop's first step
    with heartbeat.while_waiting("the final checkpoint's write", 10.0):
        time.sleep(0.3)
    assert len(client.beats) >= 4  # every 0.02 s for 0.3 s

    # Past its limit the wait is a hang: the beats stop, and ft_launcher restarts the workers.
    with caplog.at_level(logging.ERROR, logger=hooks.__name__):
        with heartbeat.while_waiting("the final checkpoint's write", 0.1):
            time.sleep(0.1)
            beats_at_limit = len(client.beats)
            time.sleep(0.3)
    assert len(client.beats) <= beats_at_limit + 1
    assert "the final checkpoint's write has been waited for" in caplog.text
    after = len(client.beats)
    time.sleep(0.1)
    assert len(client.beats) == after  # nothing is waited for: only the loop beats
    heartbeat.close()
    assert client.connected == 0
