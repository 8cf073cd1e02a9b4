"""Each image's requirements resolve on its base: the Python, the platform and the pins the base enforces
(`pip install --dry-run --report`, which resolves against PyPI without installing anything).

- pipeline image: python:3.11-slim-bookworm (glibc 2.36), the project's own pins (constraints.txt).
- trainer image: NGC PyTorch 25.10 (Python 3.12, glibc 2.39 — what the NVRx >= 0.6 wheels need), whose
  /etc/pip/constraint.txt pins torch (docker/trainer-base-constraints.txt stands in for it). A requirement
  that wanted another torch, or kfp's pins, would fail here instead of in the image build.
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kube import ROOT

DOCKER = ROOT / "docker"


def manylinux(glibc_minor: int) -> list[str]:
    """The platform tags a glibc 2.<minor> x86-64 system accepts (pip matches --platform exactly)."""
    tags = [f"manylinux_2_{minor}_x86_64" for minor in range(glibc_minor, 16, -1)]
    return [*tags, "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def start_resolving(tmp_path, requirements, constraints, python: str | None = None,
                    glibc_minor: int = 0) -> tuple[subprocess.Popen, Path]:
    """python=None: this interpreter and platform (the pipeline image's own: Python 3.11 on Debian 12, like
    this machine). Otherwise that Python on that glibc, wheels only (pip's rule for foreign platforms)."""
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "-r", str(requirements), "-c", str(constraints)]
    if python is not None:
        command += ["--target", str(tmp_path / "target"), "--only-binary=:all:", "--python-version", python,
                    "--implementation", "cp"]
        for tag in manylinux(glibc_minor):
            command += ["--platform", tag]
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), report


def resolved(started: tuple[subprocess.Popen, Path]) -> dict[str, str]:
    """{name: version} pip chose, once it has."""
    proc, report = started
    _, stderr = proc.communicate(timeout=600)
    if proc.returncode != 0 and ("Could not fetch URL" in stderr or "NewConnectionError" in stderr):
        pytest.fail(f"the package index is unreachable: {stderr[-500:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """Both images' resolutions, started together: each is mostly a wait on the package index (~30 s apiece)."""
    started = {"trainer": start_resolving(tmp_path_factory.mktemp("trainer"), DOCKER / "trainer-requirements.txt",
                                          DOCKER / "trainer-base-constraints.txt", "3.12", 39),
               "pipeline": start_resolving(tmp_path_factory.mktemp("pipeline"), DOCKER / "pipeline-requirements.txt",
                                           ROOT / "constraints.txt")}
    yield started
    for proc, _ in started.values():
        proc.kill()
        proc.communicate()


def test_the_trainer_image_resolves_on_ngc_without_replacing_its_torch_or_pulling_kfp(resolutions):
    found = resolved(resolutions["trainer"])
    assert found["torch"] == "2.9.0"  # the base's, as pinned
    assert tuple(int(p) for p in found["nvidia-resiliency-ext"].split(".")[:2]) >= (0, 6)
    # replica groups: a cp312 wheel exists and installs beside the base's torch (it asks torch>=2.7)
    assert tuple(int(p) for p in found["torchft"].split(".")[:2]) >= (0, 2)
    assert "kfp" not in found and "mlflow" not in found


def test_the_pipeline_image_resolves_with_the_projects_pins(resolutions):
    assert sys.version_info[:2] == (3, 11)  # python:3.11-slim-bookworm
    found = resolved(resolutions["pipeline"])
    assert found["torch"].split("+")[0] == "2.13.0"  # the CPU build, as the image installs it
    assert {"kfp", "kfp-kubernetes", "mlflow", "psycopg2-binary", "resilient-train"} <= set(found)
    assert "nvidia-resiliency-ext" in found


def test_the_dockerfiles_build_what_the_configs_and_manifests_expect():
    trainer = (DOCKER / "trainer.Dockerfile").read_text()
    pipeline = (DOCKER / "pipeline.Dockerfile").read_text()
    assert "efa_installer.sh" in trainer and "--skip-kmod" in trainer and "ofi-nccl" in trainer
    assert "/etc/pip/constraint.txt" in trainer and "kfp" not in trainer.split("No kfp here")[1].split("RUN pip")[1]
    assert "-c constraints.txt" in pipeline and "download.pytorch.org/whl/cpu" in pipeline
    for text in (trainer, pipeline):
        assert "USER 10001" in text


def test_the_images_smoke_imports_name_modules_that_exist():
    """Each Dockerfile ends its build with `python -c "import …"`; a renamed module must fail here, not in CI's
    image build."""
    for dockerfile in ("trainer.Dockerfile", "pipeline.Dockerfile"):
        [imports] = re.findall(r'python -c "import ([\w., ]+)', (DOCKER / dockerfile).read_text())
        for module in (m.strip() for m in imports.split(",")):
            if module.split(".")[0] in ("components", "pipelines", "trainer"):
                assert importlib.util.find_spec(module) is not None, f"{dockerfile} imports {module}: no such module"
