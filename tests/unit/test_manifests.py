import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"


@pytest.mark.parametrize("kustomization", sorted(MANIFESTS.rglob("kustomization.yaml")),
                         ids=lambda p: str(p.parent.relative_to(MANIFESTS)))
def test_every_kustomization_builds(kustomization):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl not found: install it (https://kubernetes.io/docs/tasks/tools/) to build manifests")
    built = subprocess.run(["kubectl", "kustomize", str(kustomization.parent)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    objects = [o for o in yaml.safe_load_all(built.stdout) if o]
    assert objects and all(o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "resilient-train" for o in objects)
