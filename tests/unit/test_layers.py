"""The house rules of the code base (issue 14), checked on the source itself.

- pipelines/ → components/ → localcluster/ → trainer/: no layer imports one above it, and no module imports itself back
  through others (a cycle only works while some import hides inside a function);
- no module over 450 lines (a prompt to look, not a rule to split one concept by), and each says in its first line
  what it is for;
- trainer/ is grouped by concern (issue 31): its rooms stack in ROOMS' order and no import runs from a lower
  room up to a higher one; its root holds only the package, `python -m trainer`, the env module and the stable
  entry points that pod specs carry (thin, and each of them starts); the env module imports nothing; nothing
  under launch/ or run/ pulls torch in at import (a node's launcher starts fast); nothing imports job/ but the
  entry points and the fork server;
- the run folder's file names are spelled in trainer/run/run_dir.py and nowhere else;
- everything trainer/ imports at module level is in the training image: docker/trainer-requirements.txt,
  what those requirements pull in, or the NGC PyTorch base (torch).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["trainer", "localcluster", "components", "pipelines"]  # lowest first
MAX_LINES = 450
# trainer/'s rooms, lowest first: a module may import its own room and the ones below it.
ROOMS = ["trainer.env", "trainer.run", "trainer.config", "trainer.planning", "trainer.observe", "trainer.data",
         "trainer.model", "trainer.resilience", "trainer.checkpoint", "trainer.evaluate", "trainer.launch", "trainer.job"]
# The commands rendered manifests and running jobs' pod specs carry (`python -m <module>`): kept as thin
# entry points at the root, so a job keeps its pod spec when its image is upgraded.
ENTRY_POINTS = {"trainer.launcher": "trainer.launch.launcher", "trainer.rendezvous_store": "trainer.launch.rendezvous_store",
                "trainer.node_health": "trainer.resilience.health", "trainer.warm_start": "trainer.launch.warm_start",
                "trainer.export": "trainer.checkpoint.export", "trainer.lighthouse": "trainer.launch.lighthouse"}
ROOT_MODULES = {"trainer", "trainer.__main__", "trainer.env", *ENTRY_POINTS}
FORK_SERVER = "trainer.launch.warm_start"  # its job is to import the trainer ahead of time, inside its functions
RUN_DIR_NAMES = ["config.yaml", "result.json", "metrics.jsonl", "train.log", "summary.json", "generations.json",
                 "lease.lock", "lease.json", "trainjob.json", "mlflow-spool", "rejected.jsonl", "pipeline.log",
                 "control.jsonl", "failures.jsonl", "periodic.jsonl", "control-state.json", "samples.jsonl"]
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


def _room(name: str) -> int | None:
    """The room's level of a trainer module (None: the root's package, __main__ and entry points)."""
    for level, room in enumerate(ROOMS):
        if name == room or name.startswith(room + "."):
            return level
    return None


def test_trainer_root_holds_only_the_package_the_env_module_and_the_stable_entry_points():
    at_root = {name for name in modules() if name.startswith("trainer") and name.count(".") <= 1
               and not (ROOT / name.replace(".", "/")).is_dir()} | {"trainer"}
    assert at_root == ROOT_MODULES
    assert all(_room(name) is not None for name in modules() if name.startswith("trainer.") and name not in ROOT_MODULES)


def test_no_import_runs_from_a_lower_room_of_trainer_up_to_a_higher_one():
    wrong = []
    for name, targets in project_graph().items():
        level = _room(name) if name.startswith("trainer.") else None
        if level is None:
            continue
        for target in targets:
            if target.startswith("trainer.") and (_room(target) or 0) > level and not (
                    name == FORK_SERVER and target.startswith("trainer.job.")
                    and target not in module_level_imports(modules()[name])):
                wrong.append(f"{name} -> {target}")
    assert wrong == []


def test_nothing_imports_job_but_the_entry_points_and_the_fork_server():
    importers = {name for name, targets in project_graph().items()
                 if any(t == "trainer.job" or t.startswith("trainer.job.") for t in targets)}
    assert {name for name in importers if not name.startswith("trainer.job")} <= {"trainer.__main__", FORK_SERVER}


def test_the_env_module_imports_nothing():
    tree = ast.parse((ROOT / "trainer" / "env.py").read_text())
    assert [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))] == []


def test_a_nodes_launcher_and_the_run_folder_import_no_torch():
    """Imported for real, in a fresh interpreter: nothing under launch/ or run/, nor the entry points a node
    runs, brings torch in (the fork server imports the trainer inside its functions, once it serves)."""
    node_entry_points = set(ENTRY_POINTS) - {"trainer.export"}  # export loads a checkpoint: torch is its job
    names = sorted(n for n in modules() if n.startswith(("trainer.launch", "trainer.run")) or n in node_entry_points)
    assert packages_imported_by(names, ("torch",)) == []


def packages_imported_by(names: list[str], packages: tuple[str, ...]) -> list[str]:
    """The modules of `packages` that importing `names` brings in, in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {packages!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_each_stable_entry_point_is_thin(entry):
    """A docstring, imports, and `if __name__ == "__main__":` calling into its room: nothing else to keep."""
    tree = ast.parse(modules()[entry].read_text())
    kinds = [type(node).__name__ for node in tree.body]
    assert kinds[0] == "Expr" and kinds[-1] == "If" and set(kinds[1:-1]) <= {"Import", "ImportFrom"}, kinds
    assert ENTRY_POINTS[entry] in module_level_imports(modules()[entry])


@pytest.mark.parametrize("command, expected", [
    (["trainer", "--help"], "usage: python -m trainer "),
    (["trainer.launcher", "torchrun", "--help"], "--nproc-per-node"),  # torch.distributed.run's own usage
    (["trainer.rendezvous_store", "--help"], "usage: python -m trainer.rendezvous_store"),
    (["trainer.node_health", "--help"], "usage: python -m trainer.node_health"),
    (["trainer.export", "--help"], "usage: python -m trainer.export"),
    (["trainer.lighthouse"], "one replica group"),  # no TrainJob arguments: nothing to serve, done
])
def test_each_stable_entry_point_starts(command, expected):
    done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0 and expected in done.stdout, done.stdout + done.stderr


def test_the_fork_server_entry_point_starts_and_serves(tmp_path):
    from trainer.launch.warm_start import wait_until_serving

    socket_path = tmp_path / "server.sock"
    server = subprocess.Popen([sys.executable, "-m", "trainer.warm_start", str(socket_path)], cwd=ROOT)
    try:
        assert wait_until_serving(str(socket_path), timeout=120, server=server.pid)
    finally:
        server.kill()
        server.wait()


# Each task of a pipeline run is a fresh process (a pod on EKS): the steps that touch no tensor start without torch
# and transformers (~4 s of imports each on 2 cores). The stage steps bring them in only to stage a base model.
LIGHT_STEPS = ["components.prepare.step", "components.stage.step", "components.evaluate.step",
               "components.finalize.step"]


def test_the_steps_that_touch_no_tensor_import_no_torch():
    assert packages_imported_by(LIGHT_STEPS, ("torch", "transformers")) == []
