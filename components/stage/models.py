"""A base model and a tokenizer from S3, staged like a corpus and checked once, before any GPU time is spent.

    staged = stage_models(cfg)        # model.init_from and data.tokenizer when they are S3 prefixes

Each prefix goes under ``<fsx_root>/models/<last segment of the prefix>/``: its files in ``hf/`` by the same
machinery as a corpus (copy or DRA, incremental, verified against S3's checksums, hostile keys refused), then
``stage-manifest.json`` (the objects, the URI, the content hash). A base model is also converted once: its
config.json checked as Llama-family, every safetensors file parsed and checked against it, the files hashed
(``weights-index.json``, trainer.model.base) — unchanged files keep their digests, so a re-stage of the same
weights reads nothing again. The trainer then reads each rank's shard straight from the staged files. A tokenizer
is loaded once to prove it loads; the base model's vocabulary must hold it (checked here, naming both sizes).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import xxhash

from components.stage.shards import dataset_lock
from components.stage.staging import STAGE_MANIFEST, make_folder, previous_objects, stage_prefix
from trainer.config import Config
from trainer.config.tree import STAGED_FILES
from trainer.data.tokenizer import TOKENIZER_FILES, TokenizerError, load_tokenizer
from trainer.model.base import BASE_INDEX, index_base_weights, read_base_config, read_index
from trainer.model.llama import VocabularyMismatch
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)


def stage_models(cfg: Config, fsx=None) -> list[dict[str, Any]]:
    """Stage and check model.init_from and data.tokenizer (those that are S3 prefixes; one staging when they are
    the same prefix); then the tokenizer must fit the model's vocabulary. Returns each one's manifest."""
    staged: list[dict[str, Any]] = []
    if cfg.model.init_from.startswith("s3://"):
        staged.append(stage_model(cfg, cfg.model.init_from, "model.init_from", weights=True, fsx=fsx))
    if cfg.data.tokenizer.startswith("s3://") and cfg.data.tokenizer != cfg.model.init_from:
        staged.append(stage_model(cfg, cfg.data.tokenizer, "data.tokenizer", weights=False, fsx=fsx))
    check_vocabulary(cfg)
    return staged


def stage_model(cfg: Config, uri: str, field: str, *, weights: bool, fsx=None) -> dict[str, Any]:
    folder = cfg.staged_model_dir(uri)
    files_dir = folder / STAGED_FILES
    make_folder(folder)
    with dataset_lock(folder):
        started = time.perf_counter()
        manifest_path = folder / STAGE_MANIFEST
        staged = stage_prefix(cfg.data, uri, files_dir, cfg.fsx_root, previous_objects(manifest_path), fsx,
                              field=field)
        staged.pop("files")
        record = {**staged, "kind": "model" if weights else "tokenizer", "field": field, "dir": str(files_dir)}
        if weights:
            config = read_base_config(files_dir)
            index = index_base_weights(files_dir, config, read_index(folder / BASE_INDEX))
            write_json(folder / BASE_INDEX, index)
            record.update(content_hash=index["content_hash"], parameters=index["parameters"],
                          weights_bytes=index["bytes"], vocab_size=config.vocab_size,
                          tie_word_embeddings=config.tie_word_embeddings, index=str(folder / BASE_INDEX))
            log.info("base model %s: %.1f M parameters, %.2f GB of weights, content hash %s", uri,
                     index["parameters"] / 1e6, index["bytes"] / 1e9, index["content_hash"][:12])
        if (files_dir / "tokenizer.json").is_file():
            loaded = load_tokenizer(str(files_dir))
            record.update(tokenizer_vocab_size=loaded.vocab_size, tokenizer_hash=tokenizer_hash(files_dir),
                          chat_template=loaded.chat_template is not None)
        elif not weights:
            raise_no_tokenizer(uri, files_dir)
        record["stage_seconds"] = time.perf_counter() - started
        write_json(manifest_path, record)  # last: a half-staged model never has a manifest claiming it complete
        return record


def tokenizer_hash(folder: Path) -> str:
    """The tokenizer's identity: its own files' contents (xxh3-128)."""
    digest = xxhash.xxh3_128()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            digest.update(name.encode())
            digest.update((folder / name).read_bytes())
    return digest.hexdigest()


def raise_no_tokenizer(uri: str, files_dir: Path) -> None:
    raise TokenizerError(f"data.tokenizer: {uri} staged no tokenizer.json (into {files_dir}): point it at a Hugging "
                         "Face tokenizer's prefix (tokenizer.json, tokenizer_config.json)")


def check_vocabulary(cfg: Config) -> None:
    """The tokenizer's ids must all have an embedding row in the base model: refused before any training, naming
    both sizes (a model trained from scratch takes the tokenizer's size)."""
    base = cfg.base_model_dir
    if base is None:
        return
    model_vocab = read_base_config(base).vocab_size
    tokenizer = load_tokenizer(cfg.tokenizer_spec)
    if tokenizer.vocab_size > model_vocab:
        raise VocabularyMismatch(f"data.tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids, the base model "
                                 f"(model.init_from, {base / 'config.json'}) a vocabulary of {model_vocab}: use the "
                                 "tokenizer the model was trained with")
