"""The model families a base model's config.json may name (trainer.model.families): each is transformers' own class,
whose loss the trainer's chunked loss reproduces, built on the meta device and materialised like a Llama, its layers
checkpointed (full, selective by op or by layer) to the same gradients."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer.model.base import BaseModelError, expected_tensors, read_base_config
from trainer.model.build import build_model, build_model_on_meta, materialize_on
from trainer.model.families import SUPPORTED_MODEL_TYPES, architecture_of, config_from_dict
from trainer.config import TrainingConfig
from trainer.model.loss import IGNORE
from trainer.model.parallelize import apply_activation_checkpointing
from trainer.planning.model_size import ModelShape

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# What sets each family apart, as its config.json says it.
FAMILIES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}, tie_word_embeddings=False),
    "mistral": dict(sliding_window=8, tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1_000_000.0),  # q/k/v projections with bias
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),  # q/k RMSNorm per head
}
# A parameter only that family's architecture has.
OWN_PARAMETER = {"qwen2": "model.layers.0.self_attn.q_proj.bias", "qwen3": "model.layers.0.self_attn.q_norm.weight"}


def family_config(model_type: str):
    return config_from_dict({"model_type": model_type, **SMALL, **FAMILIES[model_type]})


def test_every_supported_family_is_tested():
    assert sorted(FAMILIES) == sorted(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_trainers_loss_is_transformers_own_loss_of_the_same_model(model_type):
    config = family_config(model_type)
    ours = build_model(config, seed=3)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    plain.load_state_dict(ours.state_dict())
    assert type(ours).__name__ == architecture_of(config) == type(plain).__name__
    assert isinstance(ours, type(plain))
    assert ours.state_dict().keys() == plain.state_dict().keys()
    if model_type in OWN_PARAMETER:
        assert OWN_PARAMETER[model_type] in dict(ours.named_parameters())
    ids = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)  # the next token; none after the last
    with torch.no_grad():
        expected = plain(input_ids=ids, labels=ids).loss
        chunked = ours(input_ids=ids, targets=targets, loss_chunk=10)
    torch.testing.assert_close(chunked, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_meta_build_materialised_computes_what_a_normal_build_does(model_type):
    config = family_config(model_type)
    built = build_model(config, seed=5)
    meta = build_model_on_meta(config)
    materialize_on(meta, torch.device("cpu"))  # the rotary frequencies: the family's own, from its config
    meta.load_state_dict(built.state_dict())
    ids = torch.randint(3, config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(meta(input_ids=ids).logits, built(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_base_models_config_json_gives_its_familys_config_and_tensors(tmp_path, model_type):
    config = family_config(model_type)
    raw = {**config.to_dict(), "architectures": [architecture_of(config)]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    read = read_base_config(tmp_path)
    assert type(read) is type(config) and read.model_type == model_type
    tensors = expected_tensors(read)
    assert ("lm_head.weight" in tensors) == (not config.tie_word_embeddings)  # tied: the embedding's
    if model_type in OWN_PARAMETER:
        assert OWN_PARAMETER[model_type] in tensors


def test_a_config_json_naming_another_familys_class_is_refused(tmp_path):
    raw = {**family_config("qwen3").to_dict(), "architectures": ["LlamaForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BaseModelError, match=r"architectures \['LlamaForCausalLM'\] has no Qwen3ForCausalLM"):
        read_base_config(tmp_path)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@pytest.mark.parametrize("mode, selective", [("full", "op"), ("selective", "op"), ("selective", 2)])
def test_activation_checkpointing_of_each_family_gives_the_gradients_of_none(model_type, mode, selective):
    config = family_config(model_type)
    ids = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
    gradients = []
    for training in (TrainingConfig(), TrainingConfig(activation_checkpointing=mode, selective_ac=selective)):
        model = build_model(config, seed=7)
        apply_activation_checkpointing(model, training)
        expected = [training.activation_checkpointing != "none" and (selective == "op" or index % selective == 0)
                    for index in range(config.num_hidden_layers)]
        assert [layer.gradient_checkpointing for layer in model.model.layers] == expected
        model.train()
        model(input_ids=ids, targets=targets, loss_chunk=10).backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    plain, checkpointed = gradients
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_planners_parameter_count_is_the_familys_built_model(model_type):
    """What sizes node memory, the first heartbeat, restore timeouts and the GPU memory estimate (trainer.planning)
    counts each family's own parameters: Qwen2's q/k/v biases, Qwen3's q/k norms, tied or untied heads."""
    config = family_config(model_type)
    built = sum(p.numel() for p in build_model_on_meta(config).parameters())
    assert ModelShape.from_config(config.to_dict()).parameters == built


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_MODEL_TYPES if t != "llama"])  # Llama's: test_throughput
def test_each_familys_blocks_compiled_train_what_eager_trains(model_type):
    """training.compile compiles each decoder block in place (trainer.model.parallelize): the family's attention
    (Qwen2's biases, Qwen3's q/k norms, Mistral's sliding window), on packed rows' position_ids, gives eager's loss
    and gradients."""
    eager, compiled = build_model(family_config(model_type), seed=0), build_model(family_config(model_type), seed=0)
    for layer in compiled.model.layers:
        layer.compile()
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(3, 96, (2, 24), generator=generator) for _ in range(2))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)  # two documents a row
    losses = [model(input_ids=inputs, targets=targets, position_ids=positions, loss_chunk=7)
              for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_greedy_scores_are_the_full_logits_log_likelihoods_and_argmax_hits():
    """loss_reduction="greedy" (lm-eval's loglikelihood and is_greedy, trainer.evaluate.lm_eval_tasks): per position
    the negative log-likelihood of the target and whether it is the argmax, from chunks of the logits, equal to the
    full logits' (which an 8B model's evaluation must never hold)."""
    model = build_model(family_config("llama"), seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randint(3, 96, (3, 20), generator=generator)
    with torch.no_grad():
        logits = model(input_ids=inputs, use_cache=False).logits.float()
    targets = logits.argmax(-1)  # every position greedy ...
    targets[0, 3] = (targets[0, 3] + 1) % 96  # ... but two
    targets[2, 11] = (targets[2, 11] + 5) % 96
    targets[1, :4] = IGNORE
    with torch.no_grad():
        losses, hits = model(input_ids=inputs, targets=targets, loss_reduction="greedy", loss_chunk=7)
    reference = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE,
                                                  reduction="none")
    torch.testing.assert_close(losses, reference, rtol=1e-5, atol=1e-6)
    assert (~hits).nonzero().tolist() == [[0, 3], [2, 11]]
