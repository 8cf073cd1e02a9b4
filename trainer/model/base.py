"""A base model in Hugging Face format (config.json + *.safetensors): checked once, then read shard by shard.

    config = read_base_config(folder)                       # a family we build, or a BaseModelError naming the field
    index = index_base_weights(folder, config)              # once per content hash: the stage step's conversion
    stats = load_base_weights(model, folder, index)         # each rank reads only its own rows (collective)

The conversion checks what a start would otherwise find out on every rank, and writes it down: every safetensors
file parses (header, offsets, size), every tensor the config implies is there with its shape, and the files'
content hash (xxh3-128 of each, combined). The index lists each tensor's file, dtype and shape, so a start reads
one small JSON file instead of every rank opening every file's header.

The load is torch DCP's with its Hugging Face reader (``HuggingFaceStorageReader``: safetensors slices, DCP's
planner): the model is built on the meta device and sharded (FSDP2: each rank holds rows of every tensor) before
any weight exists, and DCP asks each rank's reader for exactly its rows, which are read from the file and copied
(converted to the parameter's dtype) into the rank's shard. No rank ever holds the whole model, and the job reads
each weight once (the reader counts the bytes). Names need no mapping: the model is the family's transformers
class (LlamaForCausalLM, Qwen3ForCausalLM, ...: trainer.model.families), whose state dict is the checkpoint's; with
tied embeddings lm_head.weight is the embedding.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from trainer.config.rules import InputError
from trainer.data.tokenizer import LoadedTokenizer
from trainer.model.families import SUPPORTED_MODEL_TYPES, architecture_of, causal_lm_class, config_from_dict
from trainer.run.digest import hash_file

log = logging.getLogger(__name__)

INDEX_FORMAT_VERSION = 2  # 2: each tensor's byte offsets in its file
BASE_INDEX = "weights-index.json"  # beside a staged model's hf/ folder (the stage step writes it)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class BaseModelError(InputError):
    """model.init_from names something that is not a usable base model of a family we build; the message names the
    file and the field."""


def read_base_config(folder: Path) -> PretrainedConfig:
    """The base model's config.json as its family's transformers config (LlamaConfig, Qwen3Config, ...); refused,
    naming the field, when it is not a causal LM of a family we build (trainer.model.families)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise BaseModelError(f"model.init_from: {path} not found: point it at a Hugging Face model folder "
                             "(config.json + *.safetensors) or its S3 prefix") from None
    except (OSError, ValueError) as err:
        raise BaseModelError(f"model.init_from: {path} is not a readable JSON file ({err})") from err
    if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise BaseModelError(f"{path}: model_type {raw.get('model_type')!r} is not a family this trainer builds: "
                             f"model.init_from takes {', '.join(repr(t) for t in SUPPORTED_MODEL_TYPES)} models")
    causal_lm = architecture_of(raw["model_type"])
    architectures = raw.get("architectures") or [causal_lm]
    if causal_lm not in architectures:
        raise BaseModelError(f"{path}: architectures {architectures} has no {causal_lm}: model.init_from takes causal "
                             f"language models ({causal_lm} for model_type {raw['model_type']!r})")
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else rope
    if rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
        key = "rope_scaling" if "rope_scaling" in raw else "rope_parameters"
        raise BaseModelError(f"{path}: {key} type {rope_type!r} is not one transformers implements "
                             f"({', '.join(['default', *ROPE_INIT_FUNCTIONS])})")
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(raw.get(field), int) or raw[field] <= 0:
            raise BaseModelError(f"{path}: {field} must be a positive integer, got {raw.get(field)!r}")
    try:
        return config_from_dict(raw)
    except (TypeError, ValueError) as err:
        raise BaseModelError(f"{path}: not a valid {raw['model_type']} config ({err})") from err


class TokenizerMismatch(InputError):
    """The tokenizer is not the base model's: more ids than its embedding has rows, or other BOS/EOS/PAD ids than
    its config names; the message names both values."""


def check_tokenizer_fits(tokenizer: LoadedTokenizer, folder: Path, config: PretrainedConfig | None = None) -> None:
    """The tokenizer must be the one the base model in `folder` was trained with: every id within the model's
    vocabulary, and its BOS, EOS and PAD tokens (those it has) the ids config.json and generation_config.json
    name (one of them, where a file lists several: an instruct model's EOS ids). A TokenizerMismatch naming both
    values otherwise — before any step, in the stage step and again at a start."""
    folder = Path(folder)
    config = config or read_base_config(folder)
    where = f"the base model (model.init_from, {folder / 'config.json'})"
    if tokenizer.vocab_size > config.vocab_size:
        raise TokenizerMismatch(f"data.tokenizer ({tokenizer.name}) has {tokenizer.vocab_size} ids, {where} a "
                                f"vocabulary of {config.vocab_size}: use the tokenizer the model was trained with")
    named = {"config.json": json.loads((folder / "config.json").read_text())}  # as written: no config class defaults
    generation = folder / "generation_config.json"
    if generation.is_file():
        try:
            named["generation_config.json"] = json.loads(generation.read_text())
        except ValueError as err:
            raise BaseModelError(f"model.init_from: {generation} is not valid JSON ({err})") from err
    ids = {"bos": (tokenizer.bos_token, tokenizer.bos_id), "eos": (tokenizer.eos_token, tokenizer.eos_id),
           "pad": (tokenizer.pad_token, tokenizer.pad_id)}
    for role, (token, token_id) in ids.items():
        for file, values in named.items():
            expected = values.get(f"{role}_token_id")
            if token_id is None or expected is None:
                continue  # a tokenizer without a BOS (Qwen's) frames nothing with one; a model may name no PAD
            if token_id != expected and not (isinstance(expected, list) and token_id in expected):
                raise TokenizerMismatch(
                    f"data.tokenizer ({tokenizer.name}): its {role}_token {token!r} is id {token_id}, but {where} "
                    f"names {role}_token_id {expected} in {file}: it is not the tokenizer the model was trained with. "
                    "Leave data.tokenizer unset to take the base model's own (tokenizer.json beside its weights), or "
                    "point it at that tokenizer")


def expected_tensors(config: PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of this config holds, with their shapes (a meta build: no memory)."""
    with torch.device("meta"):
        model = causal_lm_class(config)._from_config(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # the embedding's: HF checkpoints of tied models leave it out
    return shapes


def index_base_weights(folder: Path, config: PretrainedConfig, previous: dict[str, Any] | None = None, *,
                       hash_files: bool = True) -> dict[str, Any]:
    """Check every safetensors file of the folder against the config and hash it; the index (see the module's
    docstring). `previous`: an earlier index of the same folder, whose digests stand for files of the same size
    and modification time (a re-stage that changed nothing hashes nothing). hash_files=False: the headers only
    (a folder given by hand, checked at a start; its content_hash is None)."""
    from safetensors import SafetensorError, safe_open  # the same library transformers and DCP's reader use

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise BaseModelError(f"model.init_from: {folder} has no *.safetensors files: only safetensors weights load "
                             "(convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))")
    known = {f["name"]: f for f in (previous or {}).get("files", [])}
    tensors: dict[str, dict[str, Any]] = {}
    listed = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    part = handle.get_slice(name)
                    tensors[name] = {"file": path.name, "dtype": part.get_dtype(), "shape": list(part.get_shape())}
        except (SafetensorError, OSError, ValueError) as err:
            raise BaseModelError(f"{path}: not a valid safetensors file ({err}): stage the model again") from err
        with path.open("rb") as handle:  # safetensors: a u64 length, then the JSON header (safe_open checked it)
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        header_bytes = 8 + length
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name]["offsets"] = entry["data_offsets"]
        stat = path.stat()
        old = known.get(path.name)
        same = old is not None and (old["bytes"], old["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)
        listed.append({"name": path.name, "bytes": stat.st_size, "header_bytes": header_bytes,
                       "mtime_ns": stat.st_mtime_ns,
                       "xxh3": old["xxh3"] if same else hash_file(path) if hash_files else None})
    expected = expected_tensors(config)
    for name, shape in expected.items():
        found = tensors.get(name)
        if found is None:
            raise BaseModelError(f"model.init_from: {folder} has no tensor {name!r} in its safetensors files: not a "
                                 f"complete {architecture_of(config)} checkpoint of its config.json")
        if tuple(found["shape"]) != shape:
            raise BaseModelError(f"{folder / found['file']}: {name} has shape {found['shape']}, its config.json "
                                 f"implies {list(shape)}")
        if found["dtype"] not in _DTYPES:
            raise BaseModelError(f"{folder / found['file']}: {name} is {found['dtype']}, not a float type this "
                                 f"trainer loads ({', '.join(_DTYPES)})")
    combined = xxhash.xxh3_128()
    for entry in listed:
        combined.update(f"{entry['name']}:{entry['xxh3']};".encode())
    return {"format_version": INDEX_FORMAT_VERSION, "content_hash": combined.hexdigest() if hash_files else None,
            "files": listed,
            "bytes": sum(f["bytes"] for f in listed),
            "parameters": sum(int(torch.Size(tensors[n]["shape"]).numel()) for n in expected),
            "tensors": {name: tensors[name] for name in expected}}


class BaseWeightsReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader (its metadata and planning: any sharding of the model gets its slices), reading
    through the index when there is one: the metadata from it (one small file, instead of every safetensors header
    on every rank), and each slice that is a run of whole rows (every FSDP2 shard) with positional reads of exactly
    its bytes, the file opened for random access — a memory map's read-around would fetch the next rank's rows too,
    and on a cold cache every rank would read most of the file. Any other slice goes through DCP's own path. Every
    byte read is counted (``bytes_read``)."""

    def __init__(self, folder: Path, index: dict[str, Any] | None = None):
        super().__init__(str(folder))
        self._index = index
        self.bytes_read = 0

    def read_metadata(self) -> Metadata:
        if self._index is None:
            return super().read_metadata()
        state: dict[str, TensorStorageMetadata] = {}
        storage: dict[MetadataIndex, _HFStorageInfo] = {}
        for name, tensor in self._index["tensors"].items():
            shape, dtype = torch.Size(tensor["shape"]), _DTYPES[tensor["dtype"]]
            state[name] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=shape,
                                                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)),
                                                                             sizes=shape)])
            storage[MetadataIndex(fqn=name, offset=[0] * len(shape))] = _HFStorageInfo(
                relative_path=os.path.join(self.path, tensor["file"]), shape=shape, dtype=dtype)
        metadata = Metadata(state_dict_metadata=state, storage_data=storage)
        metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._index is None:
            return super().read_data(plan, planner)
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self._index["tensors"][item.storage_index.fqn]["file"], []).append(item)
        headers = {f["name"]: f["header_bytes"] for f in self._index["files"]}
        other = []
        for name, items in by_file.items():
            fd = os.open(os.path.join(self.path, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                other += [item for item in items if not self._read_rows(fd, headers[name], item, planner)]
            finally:
                os.close(fd)
        if other:
            files = {self._index["tensors"][item.storage_index.fqn]["file"] for item in other}
            self.bytes_read += sum(headers[name] for name in files)  # DCP's path reads their headers
            return super().read_data(LoadPlan(other), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_rows(self, fd: int, header_bytes: int, item, planner: LoadPlanner) -> bool:
        """Read a slice of whole rows into its target with positional reads; False for any other slice."""
        tensor = self._index["tensors"][item.storage_index.fqn]
        shape, dtype = tensor["shape"], _DTYPES[tensor["dtype"]]
        if any(item.storage_offsets[1:]) or list(item.lengths[1:]) != shape[1:]:
            return False
        row = int(torch.Size(shape[1:]).numel()) * dtype.itemsize
        start = header_bytes + tensor["offsets"][0] + item.storage_offsets[0] * row
        buffer = torch.empty(item.lengths[0] * row, dtype=torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], start + done)
            if got == 0:
                raise BaseModelError(f"{os.path.join(self.path, tensor['file'])}: ends before the rows of "
                                     f"{item.storage_index.fqn}: the file changed since the stage step checked it; "
                                     "stage the model again")
            done += got
        target = planner.resolve_tensor(item).detach()
        target.copy_(buffer.view(dtype).view(list(item.lengths)))
        planner.commit_tensor(item, target)
        self.bytes_read += len(view)
        return True

    def _process_read_request(self, f, req, planner) -> None:  # DCP's own path (no index, or an odd slice)
        super()._process_read_request(f, req, planner)
        self.bytes_read += int(torch.Size(req.lengths).numel()) * self.storage_data[req.storage_index].dtype.itemsize


def load_base_weights(model: torch.nn.Module, folder: Path, index: dict[str, Any] | None = None,
                      *, no_dist: bool = False, reader: BaseWeightsReader | None = None) -> dict[str, Any]:
    """Collective: fill the (sharded, materialised) model's parameters from the base model's files, each rank its
    own rows. Returns what this rank read. `reader`: a BaseWeightsReader of the folder (bench/startup_probe.py
    measures through one)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the embedding itself
    reader = reader or BaseWeightsReader(Path(folder), index)
    dcp.load(state, storage_reader=reader, no_dist=no_dist)
    return {"bytes_read": reader.bytes_read, "tensors": len(state)}


def read_index(path: Path) -> dict[str, Any] | None:
    try:
        index = json.loads(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return index if index.get("format_version") == INDEX_FORMAT_VERSION else None
