"""The data section: where the corpus comes from (one S3 prefix, or several mixed by weight), how its documents
are read, and how the stage step puts it on the FSx mount."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from trainer.config.rules import check_s3_uri, is_s3_uri, require

DATASET_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass
class DatasetConfig:
    """One corpus of a mixture: an S3 prefix, its share of the samples and where its documents' text is."""

    name: str = ""
    """Folder under <fsx_root>/datasets that receives this corpus's files and token shards (letters, digits, '.',
    '_', '-'); also its name in the metrics (samples/<name>, epoch/<name>)."""

    s3_uri: str = ""
    """S3 prefix holding this corpus's documents, as s3://bucket/prefix."""

    weight: float = 1.0
    """Relative share of the training samples drawn from this corpus (> 0): weights 3 and 1 give 3 samples of
    the first for each of the second, whatever the corpora's sizes (a smaller corpus is repeated sooner)."""

    text_field: str = ""
    """JSONL key / parquet column of the text in this corpus; empty takes data.text_field."""

    def check(self, where: str) -> None:
        require(bool(DATASET_NAME.match(self.name)), f"{where}.name",
                f"{self.name!r} must be a plain folder name (letters, digits, '.', '_', '-')")
        check_s3_uri(self.s3_uri, f"{where}.s3_uri")
        require(math.isfinite(self.weight) and self.weight > 0, f"{where}.weight",
                f"must be > 0, got {self.weight} (leave the corpus out instead)")


@dataclass
class DataConfig:
    """Where the training data comes from (S3) and where the trainer reads it (the FSx mount)."""

    s3_uri: str = "s3://resilient-train-data/datasets/demo"
    """S3 prefix holding the documents (*.jsonl, *.jsonl.gz, *.jsonl.zst, *.parquet, *.txt) to stage, as
    s3://bucket/prefix. Ignored when data.datasets is set."""

    fsx_root: str = ""
    """FSx for Lustre mount path (a local directory locally); empty means <run.work_dir>/fsx."""

    dataset_name: str = "demo"
    """Folder under <fsx_root>/datasets that receives the staged files and token shards of data.s3_uri; with
    data.datasets, the folder of the mixture's tokens.json (each corpus has its own folder)."""

    datasets: list[DatasetConfig] = field(default_factory=list)
    """Several corpora mixed by weight, each {name, s3_uri, weight, text_field}; empty: the one corpus
    data.s3_uri. On the command line: --data.datasets='[{name: web, s3_uri: "s3://b/web", weight: 3}, ...]'."""

    text_field: str = "text"
    """JSONL key / parquet column holding each document's text (a corpus of data.datasets may name its own)."""

    format: Literal["text", "chat", "prompt_completion"] = "text"
    """What a record is: 'text' (pre-training: data.text_field's text), 'chat' (fine-tuning: data.messages_field's
    list of {role, content}, rendered by the tokenizer's chat template) or 'prompt_completion' (fine-tuning:
    data.prompt_field and data.completion_field, both text or both lists of messages). Fine-tuning records are
    packed several to a row, each attending only to itself (docs/fine-tuning.md)."""

    messages_field: str = "messages"
    """data.format=chat: the JSONL key / parquet column of each record's conversation."""

    prompt_field: str = "prompt"
    """data.format=prompt_completion: the field of the prompt (never a target)."""

    completion_field: str = "completion"
    """data.format=prompt_completion: the field of the completion (the targets)."""

    loss_on: Literal["assistant", "all"] = "assistant"
    """Fine-tuning: the targets are the assistant's turns (and the completion) only, or 'all' tokens of a record."""

    too_long: Literal["drop", "truncate"] = "drop"
    """Fine-tuning: a record longer than training.seq_len + 1 tokens is dropped, or truncated to it (a truncated
    record with no target left is dropped); both are counted in tokens.json and logged."""

    bad_records: Literal["fail", "skip"] = "fail"
    """Fine-tuning: a record that cannot be trained (a missing field, no assistant turn, a role the chat template
    refuses) fails the stage naming its file and line, or is skipped and counted."""

    document_mask: bool = False
    """Pre-training: each document of a window attends only to itself, its positions starting at 0 at its BOS (the
    same masking fine-tuning rows always have). Off: windows attend across documents, as pre-training usually does."""

    unknown_files: Literal["skip", "fail"] = "skip"
    """Staged files that are no document format (_SUCCESS markers, READMEs, .csv): 'skip' them, counted in the
    stage manifest and on the console, or 'fail' the stage naming them."""

    s3_endpoint_url: str = ""
    """S3 endpoint override (e.g. an S3-compatible server); empty uses boto3's standard resolution
    (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, then AWS)."""

    tokenizer: str = ""
    """The tokenizer: empty (default) takes the base model's own (model.init_from's folder or S3 prefix, which
    must hold tokenizer.json), or the built-in byte tokenizer when training from scratch; 'byte' (built-in
    byte-level tokenizer, no files: from scratch only); a folder with an HF tokenizer (tokenizer.json and
    tokenizer_config.json); or the S3 prefix of one (s3://bucket/prefix: staged like the model, under
    <fsx_root>/models/<last segment>-<hash of the URI>/hf). With a base model, its BOS and EOS ids must be the
    ones the model's config.json and generation_config.json name."""

    on_mixture_change: Literal["refuse", "new_phase"] = "refuse"
    """A continuation (or restart) whose corpora differ from what the run trained so far (a corpus added,
    removed, re-weighted, or its content re-staged): 'refuse' it, naming the change, before any step; or start a
    'new_phase' of the data at the current position of the sample stream: the samples already drawn stay drawn,
    each corpus kept goes on with its own windows where it left off, and the order from there is a function of
    (seed, phase, k) (docs/continued-pretraining.md)."""

    val_fraction: float = 0.05
    """Fraction of the documents held out for evaluation (chosen deterministically by document hash)."""

    max_workers: int = 8
    """Parallel S3 downloads during staging."""

    tokenize_tasks: int = 1
    """Tasks that tokenize the staged text (a dsl.ParallelFor, one pod each on EKS), each a group of whole files
    into one token shard: the same tokens and content hash for any number. Raise it for a corpus beyond one pod."""

    stage_mode: Literal["copy", "dra"] = "copy"
    """'copy': parallel verified download onto any POSIX path (local disk, NVMe, EFS, the local demo);
    'dra': link the FSx for Lustre file system to the S3 prefix with a Data Repository Association and
    import its metadata (file contents load on first read, or are preloaded). One DRA per corpus and per
    model prefix (a file system holds at most 8)."""

    delete_removed: bool = False
    """Copy mode: delete staged files whose objects are no longer in S3."""

    fsx_file_system_id: str = ""
    """DRA mode: the FSx for Lustre file system mounted at fsx_root (fs-…)."""

    dra_auto_import: str = "NEW,CHANGED,DELETED"
    """DRA mode: S3 events the file system imports automatically (comma-separated; empty = none)."""

    dra_import_timeout_seconds: float = 3600.0
    """DRA mode: the longest wait for the DRA to become AVAILABLE and for the metadata import task."""

    dra_poll_seconds: float = 15.0
    """DRA mode: first polling interval for DRA and task state (doubles up to 8x)."""

    preload: bool = True
    """DRA mode: preload file contents with `lfs hsm_restore` when the lfs tool exists (else lazy load)."""

    require_lustre_mount: bool = True
    """DRA mode: refuse to stage unless fsx_root is a Lustre mount (false only for dry runs and tests)."""

    on_bad_key: Literal["fail", "skip"] = "fail"
    """What to do with an S3 key that cannot safely become a file below the dataset folder ('..', '.', empty
    segments, NUL, a segment over NAME_MAX, a file that other keys use as a folder, two keys on one path):
    'fail' the stage naming the keys, or 'skip' them with a warning (counted in the stage manifest)."""

    def __post_init__(self) -> None:
        require(self.stage_mode in ("copy", "dra"), "data.stage_mode", "must be 'copy' or 'dra'")
        if self.stage_mode == "dra":
            require(re.fullmatch(r"fs-[0-9a-f]{8,17}", self.fsx_file_system_id) is not None,
                     "data.fsx_file_system_id", "must be an FSx file system id (fs-0123456789abcdef0) in dra mode")
        events = [e.strip() for e in self.dra_auto_import.split(",") if e.strip()]
        require(all(e in ("NEW", "CHANGED", "DELETED") for e in events), "data.dra_auto_import",
                 "must list NEW, CHANGED and/or DELETED")
        require(self.dra_import_timeout_seconds > 0, "data.dra_import_timeout_seconds", "must be > 0")
        require(self.dra_poll_seconds > 0, "data.dra_poll_seconds", "must be > 0")
        require(self.on_bad_key in ("fail", "skip"), "data.on_bad_key", "must be 'fail' or 'skip'")
        require(self.unknown_files in ("skip", "fail"), "data.unknown_files", "must be 'skip' or 'fail'")
        require(self.format in ("text", "chat", "prompt_completion"), "data.format",
                f"must be 'text', 'chat' or 'prompt_completion', got {self.format!r}")
        require(self.loss_on in ("assistant", "all"), "data.loss_on", "must be 'assistant' or 'all'")
        require(self.too_long in ("drop", "truncate"), "data.too_long", "must be 'drop' or 'truncate'")
        require(self.bad_records in ("fail", "skip"), "data.bad_records", "must be 'fail' or 'skip'")
        for name in ("messages_field", "prompt_field", "completion_field"):
            require(bool(getattr(self, name).strip()), f"data.{name}", "must name a JSONL key / parquet column")
        require(self.prompt_field != self.completion_field, "data.completion_field",
                "must differ from data.prompt_field")
        require(self.on_mixture_change in ("refuse", "new_phase"), "data.on_mixture_change",
                "must be 'refuse' or 'new_phase'")
        check_s3_uri(self.s3_uri, "data.s3_uri")
        require(bool(DATASET_NAME.match(self.dataset_name)), "data.dataset_name",
                f"{self.dataset_name!r} must be a plain folder name (letters, digits, '.', '_', '-')")
        require(bool(self.text_field.strip()), "data.text_field", "must name the JSONL key / parquet column")
        require(0.0 < self.val_fraction < 0.5, "data.val_fraction", "must be in (0, 0.5)")
        require(self.max_workers >= 1, "data.max_workers", "must be >= 1")
        require(1 <= self.tokenize_tasks <= 10000, "data.tokenize_tasks", "must be in [1, 10000]")
        if is_s3_uri(self.tokenizer):
            check_s3_uri(self.tokenizer, "data.tokenizer")
        for index, dataset in enumerate(self.datasets):
            dataset.check(f"data.datasets[{index}]")
        names = [d.name for d in self.datasets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        require(not repeated, "data.datasets", f"names must differ: {', '.join(repeated)} appear(s) twice")
        require(self.dataset_name not in names, "data.dataset_name",
                f"{self.dataset_name!r} names the mixture's folder: give it a name none of data.datasets has")

    def sources(self) -> list[DatasetConfig]:
        """The corpora to stage and mix, each with its text field resolved: data.datasets, or data.s3_uri alone."""
        if not self.datasets:
            return [DatasetConfig(self.dataset_name, self.s3_uri, 1.0, self.text_field)]
        return [DatasetConfig(d.name, d.s3_uri, d.weight, d.text_field or self.text_field) for d in self.datasets]

    @property
    def fine_tuning(self) -> bool:
        """Records of conversations or prompt/completion pairs, packed with targets masked (not raw text)."""
        return self.format != "text"

    @property
    def mixed(self) -> bool:
        """Several corpora: the trainer's data folder holds the mixture's tokens.json, each corpus its own."""
        return bool(self.datasets)

    @property
    def bucket(self) -> str:
        return self.s3_uri[len("s3://") :].split("/", 1)[0]

    @property
    def prefix(self) -> str:
        parts = self.s3_uri[len("s3://") :].split("/", 1)
        return parts[1].strip("/") if len(parts) > 1 else ""
