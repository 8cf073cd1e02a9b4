"""MFU's arithmetic (trainer.observe.flops): the FLOPs per token of a preset against a count by hand, the peaks by
device name, and a step's figures."""

import pytest
import torch
from transformers import LlamaConfig

from trainer.config import MODEL_PRESETS
from trainer.model.build import build_model
from trainer.observe.flops import StepFigures, model_flops_per_token, peak_of


def test_the_tiny_presets_flops_per_token_match_a_count_by_hand():
    # tiny: hidden 256, MLP 688, 3 layers, 8 heads of 32, 4 KV heads, the byte vocabulary (258), untied head.
    per_layer = (256 * 256      # q
                 + 2 * 256 * 128  # k and v: 4 KV heads x 32
                 + 256 * 256      # o
                 + 3 * 256 * 688  # gate, up, down
                 + 2 * 256)       # two RMSNorms
    assert per_layer == 725_504
    without_embedding = 3 * per_layer + 256 + 258 * 256  # the layers, the final norm, the head
    attention = 12 * 3 * 8 * 32 * 128  # 12 x layers x heads x head_dim x sequence length
    model = build_model(LlamaConfig(vocab_size=258, **MODEL_PRESETS["tiny"]), seed=0)
    assert sum(p.numel() for p in model.parameters()) == without_embedding + 258 * 256
    assert model_flops_per_token(model, seq_len=128) == 6 * without_embedding + attention == 14_636_544


@pytest.mark.parametrize("name, tflops", [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 NVL", 835),
                                          ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989), ("NVIDIA B200", 2250),
                                          ("NVIDIA B300 SXM6 AC", 2250), ("NVIDIA A10G", None)])
def test_the_peak_comes_from_the_device_name(name, tflops):
    assert peak_of(name) == (tflops * 1e12 if tflops else None)


def test_a_steps_figures_on_the_cpu_with_a_peak_set():
    model = build_model(LlamaConfig(vocab_size=258, **MODEL_PRESETS["tiny"]), seed=0)
    figures = StepFigures(model, seq_len=128, gpus=2, device=torch.device("cpu"), peak_tflops=1.0)
    step = figures.step(tokens=2 * 8 * 128, seconds=0.5)
    achieved = 2 * 8 * 128 * 14_636_544 / 0.5 / 2
    assert step["tflops_per_gpu"] == pytest.approx(achieved / 1e12)
    assert step["mfu"] == pytest.approx(achieved / 1e12)
    assert "mfu" not in StepFigures(model, 128, 2, torch.device("cpu")).step(1024, 0.5)  # no peak known
