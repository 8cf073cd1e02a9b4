"""Fine-tuning records as token rows (trainer.data.conversations): the tokenizer's own chat template renders them, the
assistant's turns are the targets (found without {% generation %} markers, which Llama 3's and Qwen3's templates do
not have), bad records say what is wrong, and packed rows keep each conversation to itself in every family."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.conversations import (START, TARGET, BadRecord, ConversationFormat, chat_template,
                                        labels_and_positions, pack, render, row_arrays, tokenize_rendered)
from trainer.data.tokenizer import load_tokenizer
from trainer.model.build import build_model
from trainer.model.families import SUPPORTED_MODEL_TYPES

sys.path.insert(0, str(Path(__file__).parents[1]))
from base_model import CHAT_TEMPLATE, train_tokenizer  # noqa: E402
from unit.test_families import family_config  # noqa: E402

# Qwen3's rule that sets it apart (its chat_template, simplified to it): an assistant turn after the last user turn
# opens with an empty <think></think> block, earlier ones do not; and a role it does not know raises.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Unexpected message role: ' + m.role) }}{%- endif %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "How are you"},
                {"role": "assistant", "content": "Well, thanks."}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two tokenizer folders as save_pretrained writes them: a Llama-3-style template and a Qwen3-style one."""
    root = tmp_path_factory.mktemp("tokenizers")
    texts = ["Hi there", "Hello.", "How are you", "Well, thanks.", "Be brief."] * 10
    out = {}
    for name, template in (("llama3", CHAT_TEMPLATE), ("qwen3", QWEN3_LIKE)):
        tokenizer = train_tokenizer(texts)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tokenizer.chat_template = template
        tokenizer.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _targets_text(folder: str, record: dict, fmt: ConversationFormat) -> str:
    loaded = load_tokenizer(folder)
    ids, target = tokenize_rendered(loaded, render(record, chat_template(folder), fmt))
    return loaded.tokenizer.decode(ids[target].tolist(), skip_special_tokens=False)


def test_the_targets_are_each_assistant_turn_through_its_end_of_turn_in_a_llama3_template(folders):
    fmt = ConversationFormat("chat", 256)
    rendered = render({"messages": CONVERSATION}, chat_template(folders["llama3"]), fmt)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["Hello.<|eot_id|>", "Well, thanks.<|eot_id|>"]
    targets = _targets_text(folders["llama3"], {"messages": CONVERSATION}, fmt)
    assert targets == "Hello.<|eot_id|>Well, thanks.<|eot_id|>"


def test_a_qwen3_template_that_renders_the_last_turn_apart_still_gives_each_turns_targets(folders):
    """The conversation up to turn 2 rendered alone would open it with <think></think>, the whole conversation does
    not: the targets come from the whole rendering."""
    fmt = ConversationFormat("chat", 256)
    rendered = render({"messages": CONVERSATION}, chat_template(folders["qwen3"]), fmt)
    assert [rendered.text[a:b] for a, b in rendered.spans] == [
        "Hello.<|im_end|>\n", "<think>\n\n</think>\n\nWell, thanks.<|im_end|>\n"]


def test_loss_on_all_targets_every_token_and_prompt_completion_the_completion_and_eos(folders):
    loaded = load_tokenizer(folders["llama3"])
    everything = render({"messages": CONVERSATION}, chat_template(folders["llama3"]), ConversationFormat("chat", 256,
                                                                                                         loss_on="all"))
    ids, target = tokenize_rendered(loaded, everything)
    assert target.all()

    fmt = ConversationFormat("prompt_completion", 256)
    ids, target = tokenize_rendered(loaded, render({"prompt": "How are you", "completion": " Well."}, None, fmt))
    assert ids[0] == loaded.bos_id and ids[-1] == loaded.eos_id
    assert loaded.tokenizer.decode(ids[target].tolist(), skip_special_tokens=False) == " Well.<|end_of_text|>"
    assert not target[:len(loaded.tokenizer.encode("How are you", add_special_tokens=False).ids)].any()


@pytest.mark.parametrize("record, says", [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "no assistant turn"),
    ({"text": "Hi"}, "no 'messages' field (data.messages_field)"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "tool-call", "content": "x"},
                   {"role": "assistant", "content": "y"}]}, "Unexpected message role: tool-call"),
    ({"messages": [{"role": "assistant", "content": ["not", "text"]}]}, "has no text 'content'"),
    ({"messages": "Hi"}, "must be a non-empty list"),
])
def test_a_bad_record_says_what_is_wrong(folders, record, says):
    with pytest.raises(BadRecord, match=says.replace("(", r"\(").replace(")", r"\)")):
        render(record, chat_template(folders["qwen3"]), ConversationFormat("chat", 256))


def test_packing_places_every_conversation_once_within_a_row_and_pads_less():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, 3000).tolist()
    rows = pack(lengths, 129)
    assert sorted(i for row in rows for i in row) == list(range(3000))
    assert all(sum(lengths[i] for i in row) <= 129 for row in rows) and all(row == sorted(row) for row in rows)
    assert pack(lengths, 129) == rows
    unpacked_padding = 1 - sum(lengths) / (129 * len(lengths))
    packed_padding = 1 - sum(lengths) / (129 * len(rows))
    assert packed_padding < 0.05 < 0.4 < unpacked_padding


def test_a_rows_labels_never_cross_into_the_next_conversation_and_positions_restart():
    first = (np.array([10, 11, 12, 13]), np.array([False, False, True, True]))
    second = (np.array([20, 21, 22]), np.array([False, True, True]))
    tokens, flags = row_arrays([first, second], [[0, 1]], capacity=9, pad_id=0)
    assert tokens.tolist() == [10, 11, 12, 13, 20, 21, 22, 0, 0]
    assert (flags & START != 0).tolist() == [1, 0, 0, 0, 1, 0, 0, 1, 0]
    inputs, labels, positions = labels_and_positions(tokens[None], flags[None], -100)
    assert labels.tolist() == [[-100, 12, 13, -100, 21, 22, -100, -100]]  # 13 -> 20 is no target; padding none
    assert positions.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert not (flags & TARGET)[[0, 4, 7, 8]].any()
    from trainer.data.batches import IGNORE as DATA_IGNORE
    from trainer.model.loss import IGNORE as LOSS_IGNORE

    assert DATA_IGNORE == LOSS_IGNORE == -100  # the data side's copy (it imports no torch) is the loss's


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_a_packed_row_computes_each_conversation_as_if_it_were_alone(model_type):
    """The position_ids the rows carry are all it takes: each family's attention keeps to each conversation (Mistral's
    sliding window included). Without them the second conversation's logits are not its own."""
    model = build_model(family_config(model_type), seed=0).eval()
    rng = np.random.default_rng(1)
    a, b = rng.integers(3, 96, 11), rng.integers(3, 96, 13)
    row = torch.as_tensor(np.concatenate([a, b]))[None]
    positions = torch.as_tensor(np.concatenate([np.arange(11), np.arange(13)]))[None]
    with torch.no_grad():
        # (no KV cache, as in training: transformers detects packing only without one)
        packed = model(input_ids=row, position_ids=positions, use_cache=False).logits[0]
        alone = [model(input_ids=torch.as_tensor(x)[None], use_cache=False).logits[0] for x in (a, b)]
        crossed = model(input_ids=row, use_cache=False).logits[0]
        # the trainer's own call (targets: the chunked loss) sums the per-position losses of the packed logits
        targets = torch.cat([row[:, 1:], torch.full((1, 1), -100)], dim=1)
        losses = model(input_ids=row, targets=targets, position_ids=positions, loss_reduction="none", loss_chunk=7)
    reference = torch.nn.functional.cross_entropy(packed, targets[0], ignore_index=-100, reduction="none")
    torch.testing.assert_close(losses[0], reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(crossed[11:], alone[1], rtol=1e-3, atol=1e-3)


def test_conversational_prompt_completion_renders_the_prompt_turns_and_targets_the_completions(folders):
    """TRL's conversational prompt/completion: both fields lists of messages, the completion's assistant turns the
    targets, through the chat template."""
    record = {"prompt": CONVERSATION[:2], "completion": [CONVERSATION[2]]}
    fmt = ConversationFormat("prompt_completion", 256)
    assert _targets_text(folders["llama3"], record, fmt) == "Hello.<|eot_id|>"
    with pytest.raises(BadRecord, match="both be text or both be lists"):
        render({"prompt": "Hi", "completion": [CONVERSATION[2]]}, chat_template(folders["llama3"]), fmt)
