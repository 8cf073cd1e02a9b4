"""Helpers for the manifest tests: build a kustomization, find pod templates and RBAC grants in a build."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"


def kustomize(path: Path) -> str:
    if shutil.which("kubectl") is None:
        pytest.fail("kubectl not found: install it (https://kubernetes.io/docs/tasks/tools/); it includes kustomize")
    built = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return built.stdout


def build(path: Path) -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all(kustomize(path)) if o]


def pod_template_objects(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(object, namespace, pod template with its metadata) of every pod template: Deployments, Jobs and each
    replicated job of a ClusterTrainingRuntime (whose pods run in the TrainJob's namespace, given by the caller)."""
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] in ("Deployment", "Job"):
            yield obj, namespace, obj["spec"]["template"]
        if obj["kind"] == "ClusterTrainingRuntime":
            for job in obj["spec"]["template"]["spec"]["replicatedJobs"]:
                yield obj, None, job["template"]["spec"]["template"]


def pod_templates(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, dict[str, Any]]]:
    """(object, namespace, pod spec) of every pod template (pod_template_objects)."""
    for obj, namespace, template in pod_template_objects(objects):
        yield obj, namespace, template["spec"]


def grants(objects: list[dict[str, Any]], service_account: str, namespace: str) -> set[tuple[str, str, str, str]]:
    """(namespace or '*', apiGroup, resource, verb) the ServiceAccount may do, from the Roles, ClusterRoles
    and their bindings in the build (RBAC is purely additive: the union of every bound rule)."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o for o in objects
             if o["kind"] in ("Role", "ClusterRole")}
    found = set()
    for binding in (o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == service_account and s.get("namespace") == namespace
                   for s in binding.get("subjects", [])):
            continue
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else "*"
        ref = binding["roleRef"]
        role = roles.get((ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"]))
        assert role is not None, f"{binding['kind']} {binding['metadata']['name']} binds a missing {ref}"
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        found.add((scope, group, resource, verb))
    return found
