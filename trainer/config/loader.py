"""Loading a configuration: YAML (a file or a bundled name) plus ``--section.key=value`` overrides, with
errors that name the field."""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from trainer.config.rules import ConfigError
from trainer.config.tree import Config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "pipelines" / "configs"


def _field_types(section_cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(section_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(section_cls)}


def _coerce(name: str, annotation: Any, value: Any) -> Any:
    """Convert a YAML value or an override string to the field's type, or raise naming the field."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{name}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        # e.g. int | Literal["auto"]: the first member that takes the value; the error lists them all.
        problems = []
        for member in typing.get_args(annotation):
            try:
                return _coerce(name, member, value)
            except ConfigError as err:
                problems.append(str(err).removeprefix(f"{name}: "))
        raise ConfigError(f"{name}: {' or '.join(problems)}")
    if origin is list:
        [item_type] = typing.get_args(annotation)
        if isinstance(value, str):  # an override: the list as YAML (JSON is YAML)
            try:
                value = yaml.safe_load(value) if value.strip() else []
            except yaml.YAMLError as err:
                raise ConfigError(f"{name}: not a YAML list: {err}") from err
        if not isinstance(value, list):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(f"{name}[{index}]", item_type, item) for index, item in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a mapping of {', '.join(_field_types(annotation))}, got {value!r}")
        types_ = _field_types(annotation)
        unknown = [key for key in value if key not in types_]
        if unknown:
            raise _unknown("key", f"{name}.{unknown[0]}", [f"{name}.{k}" for k in types_])
        return annotation(**{key: _coerce(f"{name}.{key}", types_[key], item) for key, item in value.items()})
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        if not math.isfinite(number):
            raise ConfigError(f"{name}: must be a finite number, got {value!r}")
        return number
    if annotation is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}: expected a string, got {value!r}")
    raise AssertionError(f"unsupported annotation {annotation!r} for {name}")


# Keys a release moved: a config that still names one is told where it went.
MOVED_KEYS = {"model.activation_checkpointing": "training.activation_checkpointing (none, full or selective)"}


def _unknown(kind: str, name: str, valid: list[str]) -> ConfigError:
    if name in MOVED_KEYS:
        return ConfigError(f"{name} moved to {MOVED_KEYS[name]}")
    return ConfigError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(valid)}")


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from nested plain data (parsed YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"configuration must be a mapping of sections, got {type(raw).__name__}")
    sections = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
    built: dict[str, Any] = {}
    for section_name, values in raw.items():
        if section_name not in sections:
            raise _unknown("section", section_name, list(sections))
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"{section_name}: expected a mapping of keys, got {values!r}")
        section_cls = sections[section_name]
        types_ = _field_types(section_cls)
        kwargs = {}
        for key, value in values.items():
            full = f"{section_name}.{key}"
            if key not in types_:
                raise _unknown("key", full, [f"{section_name}.{k}" for k in types_])
            kwargs[key] = _coerce(full, types_[key], value)
        built[section_name] = section_cls(**kwargs)
    return Config(**built)


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, str]]:
    """Turn ['--training.num_steps=5', 'run.seed=1'] into {'training': {'num_steps': '5'}, ...}."""
    nested: dict[str, dict[str, str]] = {}
    for item in overrides:
        text = item[2:] if item.startswith("--") else item
        key, sep, value = text.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r} must look like --section.key=value")
        section, _, name = key.partition(".")
        nested.setdefault(section, {})[name] = value
    return nested


def resolve_config_path(config: str | Path) -> Path:
    """A path to a YAML file, or the name of a bundled config (e.g. 'local' for configs/local.yaml)."""
    path = Path(config).expanduser()
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{config}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ConfigError(f"config file {str(config)!r} not found; pass a YAML path or one of: {', '.join(names)}")


def load_config(config: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config (path or bundled name; None for defaults) and apply overrides.

    Two keys of a file are the loader's, not sections: ``extends: <file>`` (a path beside this file, or a bundled
    name) takes that config first, this file's keys over it, section by section; ``cluster_values: <file>`` (a
    path beside this file: a kustomize overlay's ``KEY=value`` env file) fills each ``${KEY}`` in a string value,
    so that a cluster's values are written once, where its manifests take them from."""
    raw: dict[str, Any] = {}
    if config is not None:
        path = resolve_config_path(config)
        raw, values_file = _read_config_file(path, ())
        raw = _fill_placeholders(raw, _read_env_file(values_file) if values_file else {}, values_file or path)
    return merge_overrides(raw, overrides)


def _read_config_file(path: Path, seen: tuple[Path, ...]) -> tuple[dict[str, Any], Path | None]:
    """(the file's sections over those of what it extends, the cluster_values file: its own, else its base's)."""
    if path.resolve() in seen:
        raise ConfigError(f"{path}: extends itself through {' -> '.join(str(p) for p in seen)}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base_name, values_name = raw.pop("extends", None), raw.pop("cluster_values", None)
    values_file = _beside(path, values_name, "cluster_values") if values_name is not None else None
    if base_name is None:
        return raw, values_file
    base_path = path.parent / str(base_name)
    base, base_values = _read_config_file(base_path if base_path.is_file() else resolve_config_path(str(base_name)),
                                          (*seen, path.resolve()))
    merged = {section: dict(values or {}) for section, values in base.items()}
    for section, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ConfigError(f"{path}: {section}: expected a mapping of keys, got {values!r}")
        merged.setdefault(section, {}).update(values or {})
    return merged, values_file or base_values


def _beside(path: Path, name: Any, key: str) -> Path:
    found = path.parent / str(name)
    if not found.is_file():
        raise ConfigError(f"{path}: {key}: {found} not found (a path beside the config file: run from a checkout of "
                          "the repository, whose manifests/ the EKS configs take their cluster's values from)")
    return found


def _read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines, blank lines and # comments: kustomize's configMapGenerator `envs` format."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected KEY=value, got {line!r}")
        values[key.strip()] = value.strip()
    return values


_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _fill_placeholders(value: Any, values: dict[str, str], source: Path, name: str = "") -> Any:
    """Every ${KEY} in the strings of `value` replaced by values[KEY]; a key the file lacks names the field."""
    if isinstance(value, dict):
        return {key: _fill_placeholders(item, values, source, f"{name}.{key}" if name else str(key))
                for key, item in value.items()}
    if isinstance(value, list):
        return [_fill_placeholders(item, values, source, f"{name}[{index}]") for index, item in enumerate(value)]
    if not isinstance(value, str):
        return value
    missing = [key for key in _PLACEHOLDER.findall(value) if key not in values]
    if missing and source.suffix in (".yaml", ".yml"):
        raise ConfigError(f"{name}: ${{{missing[0]}}} in {source}, which names no cluster_values file (a base "
                          "config: run a config that extends it and names its cluster's cluster-values.env)")
    if missing:
        raise ConfigError(f"{name}: ${{{missing[0]}}} is not set in {source} (cluster_values): add "
                          f"{missing[0]}=... there")
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], value)


def merge_overrides(raw: dict[str, Any], overrides: list[str]) -> Config:
    merged = {section: dict(values or {}) for section, values in raw.items()}
    for section, values in parse_overrides(list(overrides)).items():
        merged.setdefault(section, {}).update(values)
    return config_from_dict(merged)


def config_from_yaml_text(text: str, overrides: list[str] = ()) -> Config:
    """Config from YAML or JSON text (JSON is YAML) plus overrides."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"configuration text is not valid YAML/JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError("configuration YAML must be a mapping of sections")
    return merge_overrides(raw, overrides)
