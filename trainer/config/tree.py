"""The root of the configuration tree: one section per concern, the derived paths and the run's hashes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.config.drills import NETWORK_FAULTS, parse_schedule, unfirable
from trainer.config.platform import EvalConfig, KubernetesConfig, LocalConfig, MlflowConfig
from trainer.config.resilience import FaultsConfig, ResilienceConfig
from trainer.config.rules import ConfigError, is_s3_uri, require, staged_folder_name
from trainer.config.timeouts import check_timeouts
from trainer.config.data import DataConfig
from trainer.config.model import MODEL_PRESETS, PUBLISHED_PRESETS, ModelConfig
from trainer.config.training import CheckpointConfig, OptimizerConfig, RunConfig, TrainingConfig
from trainer.run.run_dir import RunDir


STAGED_FILES = "hf"  # below <fsx_root>/models/<name>/: a staged model's or tokenizer's own files


@dataclass
class Config:
    """A whole run: one section per concern."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    local: LocalConfig = field(default_factory=LocalConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)

    def __post_init__(self) -> None:
        # The loader already refuses inf/nan; this covers a Config built in code.
        for section in dataclasses.fields(self):
            values = getattr(self, section.name)
            for item in dataclasses.fields(values):
                value = getattr(values, item.name)
                if isinstance(value, float):
                    require(math.isfinite(value), f"{section.name}.{item.name}", f"must be a finite number, got {value}")
        # A drill that could never fire in this run would "pass" while testing nothing: refused here, where the
        # whole run is known (the schedule's grammar is checked by its own section).
        why = unfirable(parse_schedule(self.faults.schedule),
                        world_size=self.training.nproc_per_node * self.training.num_nodes,
                        checkpoints=self.checkpoint.enabled, replica_groups=self.training.replica_groups,
                        num_nodes=self.training.num_nodes)
        require(why is None, "faults.schedule", f"{why}; fix or drop that item")
        network_drills = [f.key for f in parse_schedule(self.faults.schedule) if f.type in NETWORK_FAULTS]
        require(not network_drills or (self.local.node_network == "netns" and not self.kubernetes.enabled),
                "faults.schedule", f"{', '.join(network_drills)}: a network drill cuts a node's link from outside its "
                "network namespace, which only the local runner has: set local.node_network=netns (and leave "
                "kubernetes.enabled false)")
        require(self.local.node_network == "loopback" or self.training.num_nodes > 1, "local.node_network",
                "netns gives each node a network of its own: it needs training.num_nodes > 1")
        check_timeouts(self)
        self._check_tokenizer()
        require(self.resilience.min_replica_groups <= self.training.replica_groups, "resilience.min_replica_groups",
                f"must be in [1, training.replica_groups={self.training.replica_groups}] (0: every group)")
        require(self.training.replica_groups == 1 or self.local.node_loss != "restart_job", "local.node_loss",
                "restart_job restarts every group at a node's loss; replica groups replace the node in its group")
        require(self.resilience.on_straggler == "report" or self.training.num_nodes > 1, "resilience.on_straggler",
                "replace_node takes a slow node out of a multi-node job (training.num_nodes > 1); a one-node job "
                "has no node to replace it with: use report")
        require(self.resilience.on_straggler == "report" or self.resilience.straggler_interval > 0,
                "resilience.on_straggler", "replace_node needs straggler detection (resilience.straggler_interval > 0)")

    def _check_tokenizer(self) -> None:
        """A model must see the ids it was made for: a base model its own tokenizer's, a published preset its
        published vocabulary's (the files' checks, BOS/EOS against the base model's, are trainer.model.base's)."""
        init, tokenizer = self.model.init_from, self.data.tokenizer
        require(not (init and tokenizer == "byte"), "data.tokenizer",
                f"'byte' with model.init_from={init}: a base model is trained further with the tokenizer it was "
                f"trained with, not with byte ids (its BOS/EOS would be 256/257). Leave data.tokenizer unset to take "
                f"the base model's own (tokenizer.json beside its weights), or name that tokenizer's folder or S3 "
                f"prefix")
        published = PUBLISHED_PRESETS.get(self.model.preset)
        if published and not init and self.tokenizer_source == "byte" and not self.model.vocab_size:
            raise ConfigError(
                f"data.tokenizer: the byte tokenizer (258 ids) with model.preset={self.model.preset}, which is "
                f"{published} with its {MODEL_PRESETS[self.model.preset]['vocab_size']:,}-token vocabulary: name that "
                "model's tokenizer (data.tokenizer: its folder or S3 prefix), or set model.vocab_size to train byte "
                "ids into an embedding of that size on purpose (a throughput check)")

    @property
    def tokenizer_source(self) -> str:
        """data.tokenizer as the user meant it: as given, else the base model's own (model.init_from: the same
        folder or S3 prefix), else the built-in byte tokenizer."""
        return self.data.tokenizer or self.model.init_from or "byte"

    @property
    def tokenizer_follows_model(self) -> bool:
        """The tokenizer is the base model's own, from the same folder or S3 prefix."""
        init = self.model.init_from
        return bool(init) and self.tokenizer_source.rstrip("/") == init.rstrip("/")

    # Derived paths, resolved against run.work_dir; the stored fields stay as the user wrote them.
    @property
    def work_dir(self) -> Path:
        return Path(self.run.work_dir).expanduser().resolve()

    @property
    def fsx_root(self) -> Path:
        return Path(self.data.fsx_root).expanduser().resolve() if self.data.fsx_root else self.work_dir / "fsx"

    @property
    def dataset_dir(self) -> Path:
        return self.fsx_root / "datasets" / self.data.dataset_name

    def dataset_dir_of(self, name: str) -> Path:
        """A corpus's folder: its staged files (raw/), token shards and stage manifest."""
        return self.fsx_root / "datasets" / name

    def staged_model_dir(self, uri: str) -> Path:
        """Where the stage step puts a model or tokenizer S3 prefix: <fsx_root>/models/<last segment>-<hash>/ (one
        folder per URI: trainer.config.rules.staged_folder_name), the files in hf/ beside its stage manifest and
        the weights' index."""
        return self.fsx_root / "models" / staged_folder_name(uri)

    @property
    def lm_eval_include_dir(self) -> str:
        """eval.lm_eval_include_path as the trainer reads it: the folder, or where the stage step put the S3 prefix
        (<fsx_root>/models/<last segment>-<hash>/hf, staged like a tokenizer); empty when unset."""
        path = self.eval.lm_eval_include_path
        return str(self.staged_model_dir(path) / STAGED_FILES) if is_s3_uri(path) else path

    @property
    def base_model_dir(self) -> Path | None:
        """The base model's HF folder the trainer reads: model.init_from, or hf/ of where the stage step put it."""
        init = self.model.init_from
        if not init:
            return None
        return self.staged_model_dir(init) / STAGED_FILES if is_s3_uri(init) else Path(init).expanduser()

    @property
    def tokenizer_spec(self) -> str:
        """The tokenizer as the tokenizing steps load it: 'byte', a folder, or the staged copy of an S3 prefix
        (tokenizer_source: data.tokenizer, else the base model's own)."""
        spec = self.tokenizer_source
        return str(self.staged_model_dir(spec) / STAGED_FILES) if is_s3_uri(spec) else spec

    @property
    def run_dir(self) -> Path:
        """This run's folder on the shared file system: config, step results, logs, metrics,
        checkpoints (by default) and summary.json. On EKS every pod sees it through the FSx mount."""
        assert self.run.run_id, "run.run_id must be set before run paths are used"
        return self.fsx_root / "runs" / self.run.run_id

    @property
    def checkpoint_dir(self) -> Path:
        if self.checkpoint.dir:
            return Path(self.checkpoint.dir).expanduser().resolve()
        return RunDir(self.run_dir).checkpoints

    def export_uri(self, step: int) -> str:
        """Where the HF export of `step` goes (eval.export_uri: an S3 prefix or a folder; default <run dir>/export)."""
        if not self.eval.export_uri:
            return str(self.run_dir / "export" / f"step-{step:06d}")
        root = self.eval.export_uri if is_s3_uri(self.eval.export_uri) else str(Path(self.eval.export_uri).expanduser()
                                                                                .resolve())
        return f"{root.rstrip('/')}/{self.run.run_id}/step-{step:06d}"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.work_dir / 'mlflow.db'}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """One line of JSON (also valid YAML): what the KFP pipeline's config_json parameter carries."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        """Hash of everything that shapes training (not run identity or local plumbing)."""
        shaping = {k: v for k, v in self.to_dict().items() if k in ("data", "model", "training")}
        shaping["data"] = {k: v for k, v in shaping["data"].items() if k not in ("fsx_root", "s3_endpoint_url")}
        shaping["data"]["tokenizer"] = self.tokenizer_source  # unset means the base model's (or byte): the same run
        return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]
