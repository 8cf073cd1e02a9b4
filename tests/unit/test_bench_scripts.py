"""Every benchmark script imports and answers --help without starting a measurement.

No other test imports bench/: a refactor that removed a name a benchmark used (bench/checkpoint.py importing
trainer.planning.measured.save_stalls) broke `make bench` at its first command and nothing noticed. Each script
runs as `python bench/X.py --help` would run it (its folder first on sys.path, __name__ == "__main__"), in this
process, so torch and the project are imported once for all of them.
"""

from __future__ import annotations

import contextlib
import io
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for p in (ROOT / "bench").rglob("*.py") if "__pycache__" not in p.parts)
SCRIPTS = [p for p in FILES if '__name__ == "__main__"' in p.read_text()]
MODULES = [p for p in FILES if p not in SCRIPTS]  # imported by the scripts (common.py, report_control_plane.py)


def _tracked_changes() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--", "bench"], cwd=ROOT, capture_output=True,
                          text=True).stdout


@pytest.mark.parametrize("script", SCRIPTS, ids=[str(p.relative_to(ROOT / "bench")) for p in SCRIPTS])
def test_a_bench_script_imports_and_prints_its_help(script, monkeypatch):
    before = _tracked_changes()
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(script.parent))
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code in (0, None), f"{script} --help exited {exited.value.code}"
    assert "usage:" in out.getvalue(), f"{script} --help printed no usage: it ignores --help"
    assert _tracked_changes() == before, f"{script} --help wrote files under bench/"


@pytest.mark.parametrize("module", MODULES, ids=[p.name for p in MODULES])
def test_a_bench_module_imports(module, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    runpy.run_path(str(module), run_name=f"bench_{module.stem}")
