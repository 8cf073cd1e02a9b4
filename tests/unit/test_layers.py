"""The house rules of the code base (issue 14), checked on the source itself.

- pipelines/ → components/ → trainer/: no layer imports one above it, and no module imports itself back
  through others (a cycle only works while some import hides inside a function);
- no module over 450 lines, and each says in its first line what it is for;
- the run folder's file names are spelled in trainer/run/run_dir.py and nowhere else;
- everything trainer/ imports at module level is in the training image: docker/trainer-requirements.txt,
  what those requirements pull in, or the NGC PyTorch base (torch).
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["trainer", "components", "pipelines"]  # lowest first
MAX_LINES = 450
RUN_DIR_NAMES = ["config.yaml", "result.json", "metrics.jsonl", "train.log", "summary.json", "generations.json",
                 "lease.lock", "lease.json", "trainjob.json", "mlflow-spool", "rejected.jsonl", "pipeline.log"]
NGC_BASE = {"torch"}  # what the training image's base brings (docker/trainer.Dockerfile)


def modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def module_level_imports(path: Path) -> list[str]:
    """Modules imported at module level (not inside functions), as absolute dotted names."""
    imported = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return imported


def all_imports(path: Path) -> list[str]:
    """Every module imported anywhere in the file, inside functions too."""
    imported = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return imported


def project_graph() -> dict[str, set[str]]:
    """Who imports whom among the project's modules, counting imports inside functions (they hide cycles)."""
    known = modules()
    graph = {}
    for name, path in known.items():
        targets = {t for t in all_imports(path) if t in known and t != name}
        # A package's __init__ may re-export its own submodules; that is not a dependency between modules.
        graph[name] = {t for t in targets if not t.startswith(name + ".") and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(project_graph()) == []


def test_no_layer_imports_a_layer_above_it():
    wrong = []
    for name, targets in project_graph().items():
        level = LAYERS.index(name.split(".")[0])
        wrong += [f"{name} -> {t}" for t in targets if LAYERS.index(t.split(".")[0]) > level]
    assert wrong == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_each_module_is_short_and_says_what_it_is_for(name):
    path = modules()[name]
    source = path.read_text()
    assert len(source.splitlines()) <= MAX_LINES, f"{path}: over {MAX_LINES} lines"
    docstring = ast.get_docstring(ast.parse(source))
    assert docstring and docstring.strip(), f"{path}: no module docstring"


def test_run_folder_names_are_spelled_only_in_run_dir():
    spelled = []
    for name, path in modules().items():
        if name == "trainer.run.run_dir":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            spelled += [f"{path.relative_to(ROOT)}:{number}: {file_name}" for file_name in RUN_DIR_NAMES
                        if re.search(rf"[\"']{re.escape(file_name)}[\"']", code)]
    assert spelled == []


def _requirement_names(path: Path) -> set[str]:
    names = set()
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _with_dependencies(names: set[str]) -> set[str]:
    """The names and, transitively, what they require (from this environment's installed metadata)."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            todo.append(re.split(r"[<>=!~\[; (]", requirement, maxsplit=1)[0].lower().replace("_", "-"))
    return seen


def test_the_training_image_has_everything_trainer_imports_at_module_level():
    provided = _with_dependencies(_requirement_names(ROOT / "docker" / "trainer-requirements.txt")) | NGC_BASE
    owners = packages_distributions()
    missing = {}
    for name, path in modules().items():
        if not name.startswith("trainer"):
            continue
        for imported in module_level_imports(path):
            top = imported.split(".")[0]
            if top in ("trainer", "__future__") or top in sys.stdlib_module_names:
                continue
            dists = {d.lower().replace("_", "-") for d in owners.get(top, [top])}
            if not dists & provided:
                missing.setdefault(top, []).append(name)
    assert missing == {}, "add these to docker/trainer-requirements.txt or import them where they are optional"


def test_imports_inside_functions_say_why():
    """An import below module level needs a comment (heavy, optional, KFP's function-only packaging) on its
    line or on the comment lines right above its block of imports."""
    unexplained = []
    for name, path in modules().items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or node.col_offset == 0:
                continue
            index = node.lineno - 1
            explained = "#" in lines[index]
            while not explained and index > 0:
                index -= 1
                text = lines[index].strip()
                if text.startswith("#") or (text.startswith(("import ", "from ")) and "#" in text):
                    explained = True
                elif not (text == "" or text.startswith(("import ", "from "))):
                    break
            if not explained:
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert unexplained == []
