"""A base model as a user brings one, made here: a small model of a family (Llama by default: GQA, tied embeddings,
llama3 rope scaling; Mistral, Qwen2, Qwen3) that has learnt a little of the corpus, saved with save_pretrained in bf16
over several safetensors files, and a byte-level BPE tokenizer trained here with `tokenizers`, with its BOS, EOS,
Llama-3-style special tokens and chat template, saved beside it — the layout of a Hugging Face model folder."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
                 "<|end_header_id|>\n\n{{ message['content'] }}<|eot_id|>{% endfor %}"
                 "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def train_tokenizer(texts: list[str], vocab_size: int = 384):
    """A byte-level BPE tokenizer (as Llama 3's is) that adds BOS in front of a text, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                             special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


# What sets each family's config.json apart (transformers' classes implement the rest: Qwen2's q/k/v bias, Qwen3's
# q/k RMSNorm).
FAMILY_OPTIONS = {
    "llama": dict(tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
    "mistral": dict(tie_word_embeddings=False, sliding_window=16),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1_000_000.0),
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),
}


def make_base_model(folder: Path, texts: list[str], *, hidden: int = 64, layers: int = 2, steps: int = 60,
                    vocab_size: int | None = None, shard: str = "64KB", seed: int = 0, family: str = "llama"):
    """Save the tokenizer and a model of `family` (config.json's model_type) that learnt `steps` steps of the texts
    into folder; returns the tokenizer. vocab_size: the model's rows (default: the tokenizer's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    tokenizer = train_tokenizer(texts)
    config = AutoConfig.for_model(family, vocab_size=vocab_size or len(tokenizer), hidden_size=hidden,
                                  intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=256,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  **FAMILY_OPTIONS[family])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    ids = [i for text in texts for i in [*tokenizer(text)["input_ids"], tokenizer.eos_token_id]]
    windows = torch.tensor(ids[: len(ids) // 33 * 33]).view(-1, 33)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):  # a little pre-training, so that its loss is far from a random model's
        batch = windows[torch.randint(0, len(windows), (16,), generator=torch.Generator().manual_seed(step))]
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.to(torch.bfloat16).save_pretrained(folder, max_shard_size=shard)
    tokenizer.save_pretrained(folder)
    return tokenizer


def loss_of(folder: Path, inputs, labels) -> float:
    """The model's mean next-token loss on a batch, in plain transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(inputs)).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), torch.as_tensor(labels).reshape(-1)).item()
