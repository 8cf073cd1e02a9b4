"""A base model and a tokenizer from S3, staged like a corpus and checked once, before any GPU time is spent.

    staged = stage_models(cfg)        # model.init_from and data.tokenizer when they are S3 prefixes

Each prefix goes under ``<fsx_root>/models/<last segment of the prefix>-<hash of the URI>/``: its files in ``hf/``
by the same machinery as a corpus (copy or DRA, incremental, verified against S3's checksums, hostile keys
refused), then ``stage-manifest.json`` (the objects, the URI, the content hash). A base model is also converted
once: its config.json checked as a family we build (llama, mistral, qwen2, qwen3), every safetensors file parsed
and checked against it, the files hashed (``weights-index.json``, trainer.model.base) — unchanged files keep their
digests, so a re-stage of the same weights reads nothing again. The trainer then reads each rank's shard straight
from the staged files. A tokenizer is loaded once to prove it loads; it must be the base model's
(trainer.model.base.check_tokenizer_fits: its ids within the model's vocabulary, its BOS/EOS/PAD the ids the model's
config names), checked here, naming both values. Unless data.tokenizer names another, the tokenizer is the base
model's own, from the same prefix. An S3 prefix of lm-eval task YAMLs and their data (eval.lm_eval_include_path) is
staged the same way, for the final evaluation to read from FSx.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Iterator

from components.stage.s3_copy import StageInputError
from components.stage.shards import dataset_lock
from components.stage.staging import STAGE_MANIFEST, make_folder, previous_objects, stage_prefix
from trainer.config import Config
from trainer.config.rules import is_s3_uri
from trainer.config.tree import STAGED_FILES
from trainer.data.tokenizer import TokenizerError, load_tokenizer
from trainer.run.run_dir import write_json

log = logging.getLogger(__name__)


def stage_models(cfg: Config, fsx=None) -> list[dict[str, Any]]:
    """Stage and check model.init_from and the tokenizer (cfg.tokenizer_source: data.tokenizer, else the base
    model's own), those that are S3 prefixes (one staging when they are the same prefix); then the tokenizer must
    fit the model. Returns each one's manifest."""
    staged: list[dict[str, Any]] = []
    if cfg.model.init_from.startswith("s3://"):
        staged.append(stage_model(cfg, cfg.model.init_from, "model.init_from", weights=True, fsx=fsx))
    tokenizer = cfg.tokenizer_source
    if tokenizer.startswith("s3://") and not cfg.tokenizer_follows_model:
        staged.append(stage_model(cfg, tokenizer, "data.tokenizer", weights=False, fsx=fsx))
    check_tokenizer(cfg)
    if is_s3_uri(cfg.eval.lm_eval_include_path):
        staged.append(stage_task_folder(cfg, cfg.eval.lm_eval_include_path, fsx))
    return staged


@contextlib.contextmanager
def _staging(cfg: Config, uri: str, field: str, kind: str, fsx=None) -> Iterator[tuple[Path, Path, dict[str, Any]]]:
    """An S3 prefix staged into <fsx_root>/models/<name>-<hash>/hf under its folder's lock: yields (the folder, hf/,
    the record to complete); the stage manifest is written after the caller's checks pass, last (a half-staged
    prefix never has a manifest claiming it complete)."""
    folder = cfg.staged_model_dir(uri)
    files_dir = folder / STAGED_FILES
    make_folder(folder)
    with dataset_lock(folder):
        started = time.perf_counter()
        manifest_path = folder / STAGE_MANIFEST
        staged = stage_prefix(cfg.data, uri, files_dir, cfg.fsx_root, previous_objects(manifest_path), fsx,
                              field=field)
        staged.pop("files")
        record = {**staged, "kind": kind, "field": field, "dir": str(files_dir)}
        yield folder, files_dir, record
        record["stage_seconds"] = time.perf_counter() - started
        write_json(manifest_path, record)


def stage_task_folder(cfg: Config, uri: str, fsx=None) -> dict[str, Any]:
    """eval.lm_eval_include_path's S3 prefix (task YAMLs and their data) onto FSx, as a tokenizer's is: the trainer
    finds it at cfg.lm_eval_include_dir. A prefix without a task YAML is refused."""
    with _staging(cfg, uri, "eval.lm_eval_include_path", "lm_eval_tasks", fsx) as (_, files_dir, record):
        record["task_files"] = sorted(str(p.relative_to(files_dir)) for p in files_dir.rglob("*.y*ml"))
        if not record["task_files"]:
            raise StageInputError(f"eval.lm_eval_include_path: {uri} holds no task YAML (*.yaml): upload the lm-eval "
                                  "task files and the data they name")
    return record


def stage_model(cfg: Config, uri: str, field: str, *, weights: bool, fsx=None) -> dict[str, Any]:
    with _staging(cfg, uri, field, "model" if weights else "tokenizer", fsx) as (folder, files_dir, record):
        if weights:
            # torch and transformers (a meta build checks the shapes): only where a base model is staged, so the
            # stage steps of a run without one start without them (~4 s of imports each)
            from trainer.model.base import BASE_INDEX, index_base_weights, read_base_config, read_index

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
            record.update(tokenizer_vocab_size=loaded.vocab_size, tokenizer_hash=loaded.content_hash(),
                          chat_template=loaded.chat_template is not None)
        elif not weights or cfg.tokenizer_follows_model:
            raise_no_tokenizer(cfg, uri, files_dir)
    return record


def raise_no_tokenizer(cfg: Config, uri: str, files_dir: Path) -> None:
    if cfg.tokenizer_follows_model:
        raise TokenizerError(f"data.tokenizer is unset, so the base model's own tokenizer is used, but model.init_from="
                             f"{uri} staged no tokenizer.json (into {files_dir}): upload the model's tokenizer files "
                             "(tokenizer.json, tokenizer_config.json) beside its weights, or set data.tokenizer to the "
                             "tokenizer it was trained with")
    raise TokenizerError(f"data.tokenizer: {uri} staged no tokenizer.json (into {files_dir}): point it at a Hugging "
                         "Face tokenizer's prefix (tokenizer.json, tokenizer_config.json)")


def check_tokenizer(cfg: Config) -> None:
    """The tokenizer must be the base model's (trainer.model.base.check_tokenizer_fits): refused before any
    training, naming both values (a model trained from scratch takes the tokenizer's size and ids)."""
    base = cfg.base_model_dir
    if base is None:
        return
    if cfg.tokenizer_follows_model and not (Path(cfg.tokenizer_spec) / "tokenizer.json").is_file():
        raise_no_tokenizer(cfg, cfg.model.init_from, Path(cfg.tokenizer_spec))
    from trainer.model.base import check_tokenizer_fits  # torch and transformers: only with a base model

    check_tokenizer_fits(load_tokenizer(cfg.tokenizer_spec), base)
