"""The tokenizer a run trains with is the one its base model was trained with (issue 50): unset, it is the base
model's own; the byte tokenizer with a base model is refused; a tokenizer whose BOS, EOS or PAD ids are not the
ones the model's config.json and generation_config.json name is refused naming both values; and staged folders are
one per URI."""

import json

import pytest

from tests.base_model import train_tokenizer
from trainer.config import ConfigError, load_config
from trainer.config.rules import staged_folder_name
from trainer.data.tokenizer import load_tokenizer
from trainer.model.base import TokenizerMismatch, check_tokenizer_fits

BASE = "s3://models/base-models/Llama-3.1-8B"
TEXTS = [f"the cat {i} sat on the mat near the river {i % 7}." for i in range(200)]


def test_unset_the_tokenizer_is_the_base_models_own_and_byte_without_one():
    cfg = load_config(None, [f"--model.init_from={BASE}"])
    assert cfg.data.tokenizer == "" and cfg.tokenizer_source == BASE and cfg.tokenizer_follows_model
    assert cfg.tokenizer_spec == str(cfg.staged_model_dir(BASE) / "hf") == str(cfg.base_model_dir)
    # the same run whether the tokenizer is left unset or named as the model's prefix
    assert load_config(None, [f"--model.init_from={BASE}", f"--data.tokenizer={BASE}/"]).tokenizer_follows_model
    assert load_config(None, [f"--model.init_from={BASE}", f"--data.tokenizer={BASE}"]).config_hash() == cfg.config_hash()
    scratch = load_config(None, [])
    assert scratch.tokenizer_source == scratch.tokenizer_spec == "byte" and not scratch.tokenizer_follows_model
    apart = load_config(None, [f"--model.init_from={BASE}", "--data.tokenizer=s3://models/tokenizers/llama3"])
    assert not apart.tokenizer_follows_model and apart.tokenizer_spec.endswith("/hf")


def test_the_byte_tokenizer_with_a_base_model_is_refused_naming_both():
    with pytest.raises(ConfigError, match=rf"data.tokenizer: 'byte' with model.init_from={BASE}: a base model is "
                                          r"trained further with the tokenizer it was trained with, not with byte "
                                          r"ids \(its BOS/EOS would be 256/257\)\. Leave data.tokenizer unset"):
        load_config(None, [f"--model.init_from={BASE}", "--data.tokenizer=byte"])


def test_two_prefixes_that_end_alike_stage_into_two_folders_each_named_for_its_uri():
    one, other = staged_folder_name("s3://a/x/hf"), staged_folder_name("s3://b/y/hf")
    assert one != other and one.startswith("hf-") and other.startswith("hf-") and len(one) == len("hf-") + 8
    assert staged_folder_name("s3://a/x/hf/") == one  # a trailing '/' names the same prefix
    assert staged_folder_name("s3://bucket").startswith("bucket-")
    assert staged_folder_name("s3://b/odd name+1").startswith("odd-name-1-")
    cfg = load_config(None, [])
    assert cfg.staged_model_dir("s3://a/x/hf") != cfg.staged_model_dir("s3://b/y/hf")


def _model_folder(tmp_path, **ids):
    """A tokenizer's files and a config.json (plus generation_config.json when ids has 'generation') beside them."""
    tokenizer = train_tokenizer(TEXTS)
    tokenizer.save_pretrained(tmp_path)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": len(tokenizer),
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    generation = ids.pop("generation", None)
    (tmp_path / "config.json").write_text(json.dumps({**config, **ids}))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return load_tokenizer(str(tmp_path))


def test_the_base_models_own_tokenizer_fits_it(tmp_path):
    tokenizer = _model_folder(tmp_path, generation={"bos_token_id": 0, "eos_token_id": [4, 1]})  # an instruct's EOSes
    assert (tokenizer.bos_id, tokenizer.eos_id) == (0, 1)
    check_tokenizer_fits(tokenizer, tmp_path)


@pytest.mark.parametrize("ids, message", [
    ({"bos_token_id": 5}, r"its bos_token '<\|begin_of_text\|>' is id 0, but the base model \(model.init_from, "
                          r".*config.json\) names bos_token_id 5 in config.json"),
    ({"generation": {"eos_token_id": [7, 8]}}, r"its eos_token '<\|end_of_text\|>' is id 1, but .* names "
                                               r"eos_token_id \[7, 8\] in generation_config.json"),
    ({"vocab_size": 100}, r"has 384 ids, the base model \(model.init_from, .*config.json\) a vocabulary of 100"),
])
def test_a_tokenizer_that_is_not_the_base_models_is_refused_naming_both_values(tmp_path, ids, message):
    tokenizer = _model_folder(tmp_path, **ids)
    with pytest.raises(TokenizerMismatch, match=message):
        check_tokenizer_fits(tokenizer, tmp_path)


def test_the_byte_tokenizer_against_a_base_model_names_its_256(tmp_path):
    _model_folder(tmp_path)
    with pytest.raises(TokenizerMismatch, match=r"data.tokenizer \(byte\): its bos_token '<\|bos\|>' is id 256, but"):
        check_tokenizer_fits(load_tokenizer("byte"), tmp_path)


def test_a_tokenizers_content_hash_is_its_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = _model_folder(tmp_path / "a")
    assert _model_folder(tmp_path / "b").content_hash() == one.content_hash()  # the same files
    config = json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())
    (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|eot_id|>"}))
    assert load_tokenizer(str(tmp_path / "b")).content_hash() != one.content_hash()
    assert load_tokenizer("byte").content_hash() == load_tokenizer("byte").content_hash() != one.content_hash()
