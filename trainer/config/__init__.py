"""The one configuration tree of resilient-train: sections, the root, the loader.

Every section is a dataclass; every field has a docstring right under it and is checked in
``__post_init__``. A run's configuration is loaded from YAML and then adjusted with
``--section.key=value`` overrides (the same syntax on the CLI, in ``make demo ARGS=…`` and in the KFP
pipeline's ``overrides`` parameter), so defaults live here and nowhere else.

    cfg = load_config("local", ["--training.num_steps=50"])
    cfg.training.num_steps  # 50

This module imports neither torch nor KFP: the CLI, the components and the trainer all use it.
"""

from trainer.config.loader import (CONFIG_DIR, config_from_dict, config_from_yaml_text, load_config, merge_overrides,
                                   parse_overrides, resolve_config_path)
from trainer.config.platform import EvalConfig, KubernetesConfig, LocalConfig, MlflowConfig
from trainer.config.resilience import FaultsConfig, ResilienceConfig
from trainer.config.rules import ConfigError, check_s3_uri
from trainer.config.data import DataConfig, DatasetConfig
from trainer.config.model import MODEL_PRESETS, ModelConfig
from trainer.config.training import CheckpointConfig, OptimizerConfig, RunConfig, TrainingConfig
from trainer.config.tree import Config

__all__ = ["CONFIG_DIR", "Config", "ConfigError", "CheckpointConfig", "DataConfig", "DatasetConfig", "EvalConfig",
           "FaultsConfig", "KubernetesConfig", "LocalConfig", "MODEL_PRESETS", "MlflowConfig", "ModelConfig",
           "OptimizerConfig",
           "ResilienceConfig", "RunConfig", "TrainingConfig", "check_s3_uri", "config_from_dict", "config_from_yaml_text",
           "load_config", "merge_overrides", "parse_overrides", "resolve_config_path"]
