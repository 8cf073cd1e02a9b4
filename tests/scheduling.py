"""Where a pod can land, by the rules of Kueue's flavor assignment and of kube-scheduler's node filters.

- Kueue (kubernetes-sigs/kueue, site/content/en/docs/concepts/resource_flavor.md; the flavor assigner,
  pkg/scheduler/flavorassigner): the flavors of a ClusterQueue's resource group are tried in order for each pod
  set. A flavor is skipped when the pod set's nodeSelector or required node affinity excludes the flavor's
  nodeLabels (only the keys the flavor labels are compared), when the flavor's nodeTaints are not tolerated, or
  when the quota left cannot hold the pod set. The assigned flavor's nodeLabels are added to the pods'
  nodeSelector and its tolerations to theirs.
- kube-scheduler (Kubernetes docs, "Assigning Pods to Nodes" and "Taints and Tolerations"): a node fits when it
  has every nodeSelector label, matches one of the required node affinity terms (every expression of the term:
  In, NotIn, Exists, DoesNotExist), and every NoSchedule/NoExecute taint it carries is tolerated.
"""

from __future__ import annotations

from typing import Any


def _expression_holds(expression: dict[str, Any], labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
    if operator == "In":
        return labels.get(key) in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise AssertionError(f"operator {operator} not modelled")


def _required_terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    affinity = pod.get("affinity", {}).get("nodeAffinity", {})
    return affinity.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [])


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") not in (None, "", taint["effect"]):
            continue
        if toleration.get("operator") == "Exists" and toleration.get("key") in (None, taint["key"]):
            return True
        if toleration.get("key") == taint["key"] and toleration.get("value") == taint.get("value"):
            return True
    return False


def fits(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    """kube-scheduler's NodeAffinity and TaintToleration filters for one node ({labels, taints})."""
    labels = node["labels"]
    if any(labels.get(key) != value for key, value in pod.get("nodeSelector", {}).items()):
        return False
    terms = _required_terms(pod)
    if terms and not any(all(_expression_holds(e, labels) for e in term.get("matchExpressions", []))
                         for term in terms):
        return False
    return all(_tolerates(pod.get("tolerations", []), taint) for taint in node.get("taints", [])
               if taint["effect"] in ("NoSchedule", "NoExecute"))


def _flavor_matches(pod: dict[str, Any], flavor_labels: dict[str, str]) -> bool:
    if any(key in flavor_labels and flavor_labels[key] != value for key, value in pod.get("nodeSelector", {}).items()):
        return False
    terms = _required_terms(pod)
    relevant = [[e for e in term.get("matchExpressions", []) if e["key"] in flavor_labels] for term in terms]
    return not terms or any(all(_expression_holds(e, flavor_labels) for e in term) for term in relevant)


def assign_flavors(pod_sets: list[tuple[str, int, dict[str, Any]]], queue: dict[str, Any],
                   flavors: dict[str, dict[str, Any]], quantity) -> dict[str, tuple[str, dict[str, Any]]]:
    """{pod set name: (flavor name, the pod as admitted)} for (name, count, pod spec) pod sets, in order."""
    [group] = queue["spec"]["resourceGroups"]
    left = {f["name"]: {r["name"]: quantity(r["nominalQuota"]) for r in f["resources"]} for f in group["flavors"]}
    assigned = {}
    for name, count, pod in pod_sets:
        requests: dict[str, float] = {}
        for container in pod["containers"]:
            for resource, amount in container.get("resources", {}).get("requests", {}).items():
                requests[resource] = requests.get(resource, 0) + count * quantity(amount)
        for entry in group["flavors"]:
            spec = flavors[entry["name"]].get("spec", {})
            if not _flavor_matches(pod, spec.get("nodeLabels", {})):
                continue
            if not all(_tolerates(pod.get("tolerations", []), t) for t in spec.get("nodeTaints", [])):
                continue
            if any(amount > left[entry["name"]].get(resource, 0) for resource, amount in requests.items()):
                continue
            for resource, amount in requests.items():
                left[entry["name"]][resource] -= amount
            admitted = {**pod, "nodeSelector": {**pod.get("nodeSelector", {}), **spec.get("nodeLabels", {})},
                        "tolerations": [*pod.get("tolerations", []), *spec.get("tolerations", [])]}
            assigned[name] = (entry["name"], admitted)
            break
        else:
            raise AssertionError(f"Kueue assigns no flavor to pod set {name} (requests {requests})")
    return assigned
