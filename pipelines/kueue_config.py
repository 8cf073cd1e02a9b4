"""Kueue's cluster-wide Configuration with what this project needs merged in (manifests/kueue-config/needs.yaml),
everything else left as the cluster has it.

    kubectl -n kueue-system get configmap kueue-manager-config \\
        -o jsonpath='{.data.controller_manager_config\\.yaml}' > kueue-current.yaml
    python -m pipelines.kueue_config kueue-current.yaml > kueue-merged.yaml
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

NEEDS = Path(__file__).resolve().parents[1] / "manifests" / "kueue-config" / "needs.yaml"
GROUP = "config.kueue.x-k8s.io/"


class KueueConfigError(ValueError):
    """A cluster Configuration this project cannot run under as is; the message names the field and the fix."""


def needs() -> dict[str, Any]:
    return yaml.safe_load(NEEDS.read_text())


def merge(current: dict[str, Any], wanted: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cluster's Configuration plus the frameworks, waitForPodsReady and queue-name policy wanted."""
    wanted = needs() if wanted is None else wanted
    if not str(current.get("apiVersion", "")).startswith(GROUP) or current.get("kind") != "Configuration":
        raise KueueConfigError(f"not a Kueue Configuration (apiVersion {current.get('apiVersion')!r}, kind "
                               f"{current.get('kind')!r}): pass the ConfigMap's controller_manager_config.yaml")
    merged = copy.deepcopy(current)
    if merged.get("manageJobsWithoutQueueName") and "managedJobsNamespaceSelector" not in merged:
        raise KueueConfigError(
            "manageJobsWithoutQueueName is true: Kueue would hold fsx-prepare and KFP's step pods, which name no "
            "queue; set it false, or exempt the namespaces resilient-train and kubeflow with "
            "managedJobsNamespaceSelector")
    merged.setdefault("manageJobsWithoutQueueName", wanted["manageJobsWithoutQueueName"])
    ready = merged.get("waitForPodsReady") or {}
    if not ready.get("enable"):
        merged["waitForPodsReady"] = {**wanted["waitForPodsReady"], **{k: v for k, v in ready.items() if k != "enable"}}
    integrations = merged.setdefault("integrations", {})
    frameworks = integrations.setdefault("frameworks", [])
    frameworks.extend(f for f in wanted["integrations"]["frameworks"] if f not in frameworks)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.kueue_config", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("current", help="the cluster's controller_manager_config.yaml, or - for standard input")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.current == "-" else Path(args.current).read_text()
        current = yaml.safe_load(text)
        if not isinstance(current, dict):
            raise KueueConfigError("the current Configuration is empty or not a mapping")
        merged = merge(current)
    except (KueueConfigError, OSError, yaml.YAMLError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(merged, sort_keys=False), end="")  # the command's output: the merged Configuration
    return 0


if __name__ == "__main__":
    sys.exit(main())
