"""The IAM roles of an overlay, read from what the overlay builds: each IRSA ServiceAccount, its namespace, the
role its annotation names and the role's permission policy; and the trust policy that lets exactly that
ServiceAccount assume it.

    python -m pipelines.iam --overlay manifests/overlays/prod \\
        --oidc-provider oidc.eks.us-east-1.amazonaws.com/id/EXAMPLED539D4633E53DE1B71EXAMPLE --account-id 123456789012 \\
        --out build/iam
writes build/iam/<role>-trust.json for each role and prints a line per role:
    role<TAB>namespace<TAB>service account<TAB>permission policy file

The namespace is the overlay's, not a constant: the kfp-standalone component moves the pipeline's ServiceAccount
to `kubeflow`, and a trust policy naming another namespace cannot be assumed (EKS, "IAM roles for service
accounts": the token's `sub` is system:serviceaccount:<namespace>:<name>). docs/first-run-on-eks.md runs these.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

IAM = Path(__file__).resolve().parents[1] / "manifests" / "iam"
ROLE_ANNOTATION = "eks.amazonaws.com/role-arn"
# Which permission policy each ServiceAccount's role carries (manifests/iam/README.md).
POLICIES = {"resilient-train-pipeline": "pipeline-policy.json", "resilient-train-trainer": "trainer-policy.json",
            "mlflow": "mlflow-policy.json"}


class IamError(ValueError):
    """An overlay or argument the roles cannot be derived from; the message names it."""


@dataclass(frozen=True)
class ServiceAccountRole:
    namespace: str
    service_account: str
    role_arn: str
    policy: Path

    @property
    def role_name(self) -> str:
        return self.role_arn.rsplit("/", 1)[-1]


def build_overlay(overlay: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        raise IamError("kubectl not found: it builds the overlay (kubectl kustomize)")
    built = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True)
    if built.returncode != 0:
        raise IamError(f"kubectl kustomize {overlay} failed: {built.stderr.strip()[:500]}")
    return [o for o in yaml.safe_load_all(built.stdout) if o]


def service_account_roles(objects: list[dict[str, Any]]) -> list[ServiceAccountRole]:
    roles = []
    for obj in objects:
        annotations = obj["metadata"].get("annotations") or {}
        if obj["kind"] != "ServiceAccount" or ROLE_ANNOTATION not in annotations:
            continue
        name = obj["metadata"]["name"]
        if name not in POLICIES:
            raise IamError(f"ServiceAccount {name} asks for a role, but manifests/iam has no policy for it")
        arn = annotations[ROLE_ANNOTATION]
        if not arn.startswith("arn:aws:iam::") or ":role/" not in arn:
            raise IamError(f"ServiceAccount {name}: {ROLE_ANNOTATION} {arn!r} is not a role ARN: set it in the "
                           "overlay's cluster-values.env")
        roles.append(ServiceAccountRole(obj["metadata"]["namespace"], name, arn, IAM / POLICIES[name]))
    return roles


def trust_policy(role: ServiceAccountRole, *, oidc_provider: str, account_id: str) -> dict[str, Any]:
    oidc_provider = oidc_provider.removeprefix("https://")
    if not account_id.isdigit() or len(account_id) != 12:
        raise IamError(f"--account-id {account_id!r} must be the 12-digit AWS account id")
    text = (IAM / "trust-policy.json").read_text()
    for placeholder, value in (("AWS_ACCOUNT_ID", account_id), ("OIDC_PROVIDER", oidc_provider),
                               ("SERVICE_ACCOUNT_NAMESPACE", role.namespace),
                               ("SERVICE_ACCOUNT", role.service_account)):
        text = text.replace(placeholder, value)
    return json.loads(text)


def write_trust_policies(overlay: Path, oidc_provider: str, account_id: str, out: Path) -> list[ServiceAccountRole]:
    roles = service_account_roles(build_overlay(overlay))
    out.mkdir(parents=True, exist_ok=True)
    for role in roles:
        policy = trust_policy(role, oidc_provider=oidc_provider, account_id=account_id)
        (out / f"{role.role_name}-trust.json").write_text(json.dumps(policy, indent=2) + "\n")
    return roles


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.iam", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--overlay", type=Path, required=True, help="the kustomize overlay, e.g. manifests/overlays/prod")
    parser.add_argument("--oidc-provider", required=True, help="the cluster's OIDC issuer (https:// is dropped)")
    parser.add_argument("--account-id", required=True, help="the 12-digit AWS account id")
    parser.add_argument("--out", type=Path, default=Path("build/iam"), help="where the trust policies go")
    args = parser.parse_args(argv)
    try:
        roles = write_trust_policies(args.overlay, args.oidc_provider, args.account_id, args.out)
    except IamError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for role in roles:  # the command's output, for the shell loop in docs/first-run-on-eks.md
        print(f"{role.role_name}\t{role.namespace}\t{role.service_account}\t{role.policy.relative_to(IAM.parents[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
