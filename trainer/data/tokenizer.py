"""Tokenizers: the built-in byte-level one, or a Hugging Face tokenizer folder as users have them. No hub access.

The built-in tokenizer is a real HF ``tokenizers`` object (byte-level BPE without merges: token id =
byte value, plus BOS 256 and EOS 257), so HF exports carry a tokenizer that transformers loads.

A folder is what ``save_pretrained`` writes (a base model's folder is one): ``tokenizer.json`` (the vocabulary,
the added special tokens), ``tokenizer_config.json`` (its BOS and EOS, the chat template) and whatever else it
holds (``chat_template.jinja``, ``special_tokens_map.json``). Training frames each document with that BOS and
EOS; an export copies the folder's files as they are, so the chat template and the special tokens' ids stay the
tokenizer's own.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from trainer.config.rules import InputError

BYTE = "byte"
_BOS, _EOS = "<|bos|>", "<|eos|>"
# A tokenizer folder's own files (what transformers' save_pretrained writes for a fast tokenizer, and what an
# export copies); never the model's weights or config beside them.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model")


class TokenizerError(InputError):
    """data.tokenizer names something that is not a usable tokenizer."""


@dataclass
class LoadedTokenizer:
    tokenizer: Tokenizer
    name: str
    bos_token: str | None
    eos_token: str | None
    folder: Path | None = None  # an HF tokenizer folder: the files an export copies
    chat_template: str | None = None
    pad_token: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def pad_id(self) -> int | None:
        return self.tokenizer.token_to_id(self.pad_token) if self.pad_token else None

    def content_hash(self) -> str:
        """The tokenizer's identity (xxh3-128): its folder's own files' contents, or the built-in one's
        serialization. The stage manifest, tokens.json, the checkpoint manifest and MLflow all carry it."""
        digest = xxhash.xxh3_128()
        if self.folder is None:
            digest.update(self.tokenizer.to_str().encode())
            return digest.hexdigest()
        for name in TOKENIZER_FILES:
            if (self.folder / name).is_file():
                digest.update(name.encode())
                digest.update((self.folder / name).read_bytes())
        return digest.hexdigest()

    def encode_documents(self, documents: list[str]) -> list[list[int]]:
        """Token ids per document, framed by BOS/EOS where the tokenizer has them."""
        bos, eos = self.bos_id, self.eos_id
        encoded = self.tokenizer.encode_batch(documents, add_special_tokens=False)
        return [([bos] if bos is not None else []) + e.ids + ([eos] if eos is not None else []) for e in encoded]

    def encode_to_array(self, documents: list[str], dtype: np.dtype, encoded: list[bytes] | None = None) -> np.ndarray:
        """The documents' framed token ids, concatenated (the shard format). The byte tokenizer's ids are the
        UTF-8 bytes: numpy does in one pass what the BPE machinery does per character, with the same result
        (documents that spell a special token go through the tokenizer, which turns them into that token).
        `encoded`: the documents' UTF-8 bytes, when the caller has them already."""
        if self.name == BYTE and not any(self.bos_token in d or self.eos_token in d for d in documents):
            encoded = encoded if encoded is not None else [document.encode("utf-8") for document in documents]
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            ids = np.empty(int(lengths.sum()) + 2 * len(encoded), dtype=dtype)
            starts = np.cumsum(lengths + 2) - lengths - 2  # each document's BOS
            framing = np.zeros(len(ids), dtype=bool)
            framing[starts] = framing[starts + lengths + 1] = True
            ids[starts], ids[starts + lengths + 1] = self.bos_id, self.eos_id
            ids[~framing] = np.frombuffer(b"".join(encoded), dtype=np.uint8)
            return ids
        return np.concatenate([np.asarray(ids, dtype=dtype) for ids in self.encode_documents(documents)])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def special_token_ids(self) -> dict[str, int | None]:
        """What a model config (and generation config) must say for generation to start and stop as trained."""
        return {"bos_token_id": self.bos_id, "eos_token_id": self.eos_id}

    def save(self, out_dir: Path) -> None:
        """A folder AutoTokenizer loads alone: an HF tokenizer's own files, copied as they are (its chat template,
        its special tokens and their ids); the byte tokenizer as tokenizer.json + tokenizer_config.json +
        special_tokens_map.json.

        The saved byte tokenizer adds BOS in front of a text, as every training document began: tokenizer(prompt)
        then gives the ids the model saw. (Training frames documents itself, with add_special_tokens=False.)
        """
        if self.folder is not None:
            for name in TOKENIZER_FILES:
                if (self.folder / name).is_file():
                    shutil.copy2(self.folder / name, Path(out_dir) / name)
            return
        tokenizer = copy.deepcopy(self.tokenizer)
        if self.bos_token is not None:
            bos = (self.bos_token, self.bos_id)
            tokenizer.post_processor = processors.TemplateProcessing(
                single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A {self.bos_token} $B", special_tokens=[bos])
        # No clean-up of spaces before punctuation: decode must give back the bytes the model produced.
        # transformers only here: importing it costs ~2 s, and tokenizing (the stage step, its workers) never saves
        from transformers import PreTrainedTokenizerFast

        PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=self.bos_token, eos_token=self.eos_token,
                                clean_up_tokenization_spaces=False).save_pretrained(str(out_dir))


def document_start_token(loaded: LoadedTokenizer) -> int:
    """The token each document of the shards begins with (data.document_mask restarts positions there)."""
    if loaded.bos_id is None:
        raise TokenizerError(f"data.document_mask: the tokenizer {loaded.name} has no BOS token, which marks where "
                             "each document of a window begins: turn data.document_mask off")
    return loaded.bos_id


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, as ``transformers.convert_slow_tokenizer.bytes_to_unicode``
    builds it (tests/unit/test_data.py compares the two): what the ByteLevel pre-tokenizer maps bytes to."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {byte: chr(byte) for byte in printable}, 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def _byte_tokenizer() -> LoadedTokenizer:
    byte_to_char = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([_BOS, _EOS])
    return LoadedTokenizer(tokenizer, BYTE, _BOS, _EOS)


def load_tokenizer(spec: str) -> LoadedTokenizer:
    """'byte', or a folder holding tokenizer.json (and optionally tokenizer_config.json for BOS/EOS)."""
    if spec == BYTE:
        return _byte_tokenizer()
    folder = Path(spec)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer: {path} not found; use 'byte' or a folder with an HF tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust library raises plain Exceptions for malformed files
        raise TokenizerError(f"data.tokenizer: {path} is not a valid HF tokenizer ({err})") from err
    bos = eos = pad = template = None
    config_path = folder / "tokenizer_config.json"
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except ValueError as err:
            raise TokenizerError(f"data.tokenizer: {config_path} is not valid JSON ({err})") from err
        bos, eos, pad = (_token_text(config.get(f"{role}_token")) for role in ("bos", "eos", "pad"))
        template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    for role, token in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad)):
        if token is not None and tokenizer.token_to_id(token) is None:
            raise TokenizerError(f"data.tokenizer: {config_path} names {role} {token!r}, which {path} does not have")
    return LoadedTokenizer(tokenizer, str(folder.resolve()), bos, eos, folder.resolve(), template, pad)


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value
