"""Strict validation of custom resources against their CRD's openAPIV3Schema (tests/data/crds, see
SOURCES.md there for the upstream versions).

Like `kubectl create --validate=strict` / field_validation=Strict: unknown fields are errors (every object
schema that lists properties gets additionalProperties: false). CEL rules and webhooks are not run.
"""

from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

CRD_DIR = Path(__file__).parent / "data" / "crds"


def _strict(schema: Any) -> Any:
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if schema.get("x-kubernetes-int-or-string"):
            schema.pop("type", None)
            schema["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if "properties" in schema and "additionalProperties" not in schema and \
                not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@lru_cache(maxsize=None)
def _schemas() -> dict[tuple[str, str, str], dict]:
    schemas = {}
    for path in CRD_DIR.glob("*.yaml"):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
            for version in crd["spec"]["versions"]:
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                # metadata is validated by the API server itself, not the CRD schema.
                schema.get("properties", {}).pop("metadata", None)
                schemas[(group, version["name"], kind)] = _strict(schema)
    return schemas


def crd_errors(obj: dict[str, Any]) -> list[str]:
    """Schema violations of a custom resource; [] when it is valid. Raises KeyError for an unknown kind."""
    import jsonschema

    group, _, version = obj["apiVersion"].rpartition("/")
    schema = _schemas()[(group, version, obj["kind"])]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(body)]


def known_kinds() -> set[tuple[str, str, str]]:
    return set(_schemas())
