"""Fine-tuning records (conversations, prompt/completion pairs) as token rows: rendered by the tokenizer's own chat
template, the targets the assistant's tokens, packed several to a row without cross-talk.

    fmt = ConversationFormat("chat", seq_len=4096)
    rendered = render(record, template, fmt)          # the text and the character spans that are targets
    ids, targets = tokenize_rendered(loaded, rendered)
    rows = pack([len(ids) ...], fmt.seq_len + 1)      # which conversations share each row

**Targets without generation markers.** transformers' ``return_assistant_tokens_mask`` needs ``{% generation %}``
in the template, which Llama 3's and Qwen3's do not have. An assistant turn's target is found from the rendering
itself: the conversation up to that turn, rendered with ``add_generation_prompt=True``, is a prefix of the whole
rendering (what the model sees before it answers); the target runs from there through the turn's content and the
text the template closes the turn with (``<|im_end|>``, ``<|eot_id|>``: the model learns to stop). That closing text
is what the template puts after the content when the turn is rendered last. A template that does neither (the
prefix is not a prefix, the content is not rendered verbatim) is a BadRecord naming what differs.

**Rows.** A row is ``seq_len + 1`` tokens (inputs are its first seq_len, labels its last): whole conversations
one after another, then padding. Each conversation's positions restart at 0, and the model attends within runs of
consecutive positions only (transformers' packed-sequence mask from ``position_ids``; flash attention's varlen
path on the GPU), so no conversation sees another. A target crossing into the next conversation is never counted.
Conversations are packed best-fit decreasing within a window of PACK_WINDOW of them, in their order: the rows are
a function of the data alone.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from trainer.config.rules import InputError

PACK_WINDOW = 4096  # conversations packed together: bounds memory and keeps a file's rows near its order
TARGET, START = 1, 2  # a token's flags: it is a counted target (the label of the position before); it begins a run


class BadRecord(InputError):
    """One record of a fine-tuning corpus cannot be trained as given; the message says what is wrong."""


@dataclass(frozen=True)
class ConversationFormat:
    """How the stage step reads and tokenizes a fine-tuning corpus (data.format chat or prompt_completion)."""

    kind: str  # "chat" | "prompt_completion"
    seq_len: int
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    loss_on: str = "assistant"  # "assistant" | "all"
    too_long: str = "drop"  # "drop" | "truncate"
    bad_records: str = "fail"  # "fail" | "skip"

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.messages_field,) if self.kind == "chat" else (self.prompt_field, self.completion_field)

    def key(self) -> str:
        """What changes the tokens: part of the shards' cache key."""
        return (f"{self.kind}:{self.seq_len}:{','.join(self.fields)}:{self.loss_on}:{self.too_long}:"
                f"{self.bad_records}")


@dataclass(frozen=True)
class Rendered:
    text: str
    spans: tuple[tuple[int, int], ...]  # [start, end) characters that are targets
    templated: bool = True  # rendered by the chat template (else plain prompt + completion, framed BOS ... EOS)


def conversation_format(data, seq_len: int) -> ConversationFormat | None:
    """How the stage step tokenizes the corpus of a data section (trainer.config.data): None for text."""
    if not data.fine_tuning:
        return None
    return ConversationFormat(data.format, seq_len, data.messages_field, data.prompt_field, data.completion_field,
                              data.loss_on, data.too_long, data.bad_records)


def messages_of(record: Any, fmt: ConversationFormat) -> list[dict[str, Any]] | tuple[str, str]:
    """The record's conversation (a list of {role, content}), or a (prompt, completion) pair of plain text."""
    if not isinstance(record, dict):
        raise BadRecord(f"not a JSON object but a {type(record).__name__}")
    missing = [name for name in fmt.fields if name not in record]
    if missing:
        raise BadRecord(f"no {missing[0]!r} field (data.{_field_setting(fmt, missing[0])}), found {sorted(record)}")
    if fmt.kind == "chat":
        return _checked_messages(record[fmt.messages_field], fmt.messages_field)
    prompt, completion = record[fmt.prompt_field], record[fmt.completion_field]
    if isinstance(prompt, str) and isinstance(completion, str):
        if not completion:
            raise BadRecord(f"the {fmt.completion_field!r} field is empty: nothing to train on")
        return prompt, completion
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt/completion (TRL's)
        messages = (_checked_messages(prompt, fmt.prompt_field, need_assistant=False)
                    + _checked_messages(completion, fmt.completion_field))
        return messages
    raise BadRecord(f"{fmt.prompt_field!r} and {fmt.completion_field!r} must both be text or both be lists of "
                    f"messages, found {type(prompt).__name__} and {type(completion).__name__}")


def _field_setting(fmt: ConversationFormat, name: str) -> str:
    return {fmt.messages_field: "messages_field", fmt.prompt_field: "prompt_field",
            fmt.completion_field: "completion_field"}[name]


def _checked_messages(messages: Any, field: str, need_assistant: bool = True) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRecord(f"the {field!r} field must be a non-empty list of {{role, content}} messages, found "
                        f"{type(messages).__name__ if not isinstance(messages, list) else 'an empty list'}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRecord(f"{field}[{index}] is not a {{role, content}} message: {str(message)[:80]!r}")
        if not isinstance(message.get("content"), str):
            raise BadRecord(f"{field}[{index}] ({message['role']}) has no text 'content'")
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise BadRecord(f"the {field!r} field has no assistant turn: nothing to train on "
                        f"(roles: {[m['role'] for m in messages]})")
    return messages


class ChatTemplate:
    """A tokenizer's chat template as transformers applies it (apply_chat_template), without tokenizing."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer  # only where a chat corpus is tokenized

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        if not self.tokenizer.chat_template:
            raise InputError(f"data.tokenizer: {folder} has no chat template (tokenizer_config.json's chat_template "
                             "or chat_template.jinja): data.format=chat renders every conversation with it. Use the "
                             "instruct model's tokenizer, or data.format=prompt_completion with text fields")

    def __call__(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as err:  # jinja2's raise_exception (a role the template refuses) and template errors
            raise BadRecord(f"the tokenizer's chat template refuses it: {err}") from err


def render(record: Any, template: ChatTemplate | None, fmt: ConversationFormat) -> Rendered:
    """The record's training text and its target spans (every character with loss_on=all)."""
    conversation = messages_of(record, fmt)
    if isinstance(conversation, tuple):  # plain prompt + completion: no template, the tokenizer's BOS/EOS frame it
        prompt, completion = conversation
        text = prompt + completion
        start = 0 if fmt.loss_on == "all" else len(prompt)
        return Rendered(text, ((start, len(text)),), templated=False)
    if template is None:
        raise InputError("data.format=chat needs a tokenizer with a chat template (data.tokenizer)")
    text = template(conversation)
    if fmt.loss_on == "all":
        return Rendered(text, ((0, len(text)),))
    spans, cursor = [], 0
    for index, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = template(conversation[:index], add_generation_prompt=True)
        if not text.startswith(prompt) or len(prompt) < cursor:
            raise BadRecord(f"the chat template renders the conversation before assistant turn {index} differently "
                            "from its start in the whole conversation: its targets cannot be told apart (use "
                            "data.loss_on=all)")
        alone = template(conversation[:index + 1])
        content = message["content"].strip()
        at = text.find(content, len(prompt)) if content else len(prompt)
        if at < 0:
            raise BadRecord(f"the chat template does not render assistant turn {index}'s content as it is: its "
                            "targets cannot be found (use data.loss_on=all)")
        closing = alone[alone.rfind(content) + len(content):] if content else ""
        end = at + len(content)
        if closing and text.startswith(closing, end):
            end += len(closing)
        spans.append((len(prompt), end))
        cursor = end
    return Rendered(text, tuple(spans))


def tokenize_rendered(loaded, rendered: Rendered) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, whether each token is a target) of a rendered record. A templated text carries its own special
    tokens (BOS, turn markers); a plain prompt/completion is framed BOS ... EOS like a pre-training document, its EOS
    a target (the model learns to stop)."""
    encoding = loaded.tokenizer.encode(rendered.text, add_special_tokens=False)
    ids = np.asarray(encoding.ids, dtype=np.int64)
    starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
    ends = np.asarray([end for _, end in encoding.offsets], dtype=np.int64)
    target = np.zeros(len(ids), dtype=bool)
    for start, end in rendered.spans:
        target |= (ends > start) & (starts < end)  # a token overlapping a target span (a merge across its edge)
    if rendered.templated:
        return ids, target
    bos, eos = loaded.bos_id, loaded.eos_id
    head = [bos] if bos is not None else []
    tail = [eos] if eos is not None else []
    return (np.concatenate([np.asarray(head, dtype=np.int64), ids, np.asarray(tail, dtype=np.int64)]),
            np.concatenate([np.zeros(len(head), bool), target, np.ones(len(tail), bool)]))


def pack(lengths: Iterable[int], capacity: int) -> list[list[int]]:
    """Rows of conversations (indices into lengths, each <= capacity): best-fit decreasing over each window of
    PACK_WINDOW conversations, in order (the fullest row it fits, found by bisection among the rows' free room);
    within a row, conversations keep their order."""
    lengths = list(lengths)
    rows: list[list[int]] = []
    for first in range(0, len(lengths), PACK_WINDOW):
        window = range(first, min(first + PACK_WINDOW, len(lengths)))
        open_rows: list[tuple[int, int]] = []  # (free room, row), sorted
        members: list[list[int]] = []
        for index in sorted(window, key=lambda i: (-lengths[i], i)):
            assert 0 < lengths[index] <= capacity, (lengths[index], capacity)
            at = bisect.bisect_left(open_rows, (lengths[index], -1))
            if at == len(open_rows):
                members.append([])
                room, row = capacity, len(members) - 1
            else:
                room, row = open_rows.pop(at)
            members[row].append(index)
            if room > lengths[index]:
                bisect.insort(open_rows, (room - lengths[index], row))
        rows.extend(sorted(row) for row in members)
    return rows


def row_arrays(pieces: list[tuple[np.ndarray, np.ndarray]], rows: list[list[int]], capacity: int, pad_id: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """The rows as one token array and one flags array (TARGET, START), each row `capacity` long: its
    conversations, then padding (a run of its own, no target)."""
    tokens = np.full(len(rows) * capacity, pad_id, dtype=np.int64)
    flags = np.zeros(len(rows) * capacity, dtype=np.uint8)
    for number, row in enumerate(rows):
        at = number * capacity
        for index in row:
            ids, target = pieces[index]
            tokens[at:at + len(ids)] = ids
            flags[at:at + len(ids)] = np.where(target, TARGET, 0)
            flags[at] |= START
            flags[at] &= ~np.uint8(TARGET)  # a conversation's first token is no one's target
            at += len(ids)
        if at < (number + 1) * capacity:
            flags[at] = START
    return tokens, flags


def labels_and_positions(rows: np.ndarray, flags: np.ndarray, ignore: int) -> tuple[np.ndarray, np.ndarray,
                                                                                       np.ndarray]:
    """(inputs, labels, position_ids) of [n, seq_len + 1] rows and their flags: labels IGNORE where the next token
    is no target; positions restart at each run's first token."""
    inputs = rows[:, :-1]
    labels = np.where(flags[:, 1:] & TARGET, rows[:, 1:], ignore)
    return inputs, labels, positions_from_starts(flags[:, :-1] & START != 0)


def positions_from_starts(starts: np.ndarray) -> np.ndarray:
    """Each position's offset from the latest True at or before it in its row (row start counts as one)."""
    width = starts.shape[1]
    index = np.broadcast_to(np.arange(width, dtype=np.int64), starts.shape)
    marked = np.where(starts, index, 0)
    marked[:, 0] = 0
    return index - np.maximum.accumulate(marked, axis=1)


def end_of_turn_ids(template: ChatTemplate, loaded) -> list[int]:
    """The special token the template closes an assistant turn with (Llama 3's <|eot_id|>, ChatML's <|im_end|>),
    where it is one: a model fine-tuned on these turns stops there (the export's generation_config.json)."""
    probe = "0123456789"
    text = template([{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}])
    closing = text[text.rfind(probe) + len(probe):]
    ids = loaded.tokenizer.encode(closing, add_special_tokens=False).ids if closing else []
    special = {index for index, token in loaded.tokenizer.get_added_tokens_decoder().items() if token.special}
    return ids[:1] if ids and ids[0] in special else []


@functools.cache
def chat_template(folder: str) -> ChatTemplate:
    return ChatTemplate(folder)
