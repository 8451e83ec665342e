"""The modules in the order a run passes through them (docs/architecture.md): a module may
import its own layer and the layers below it, never one above. Read from the source (every
import statement, also those inside functions), so a new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A name ending in "." stands for every module under that package.
LAYERS: list[tuple[str, set[str]]] = [
    ("entry points", {"runner.__main__", "runner.app", "runner.worker", "runner.replay",
                      "runner.plan.__main__", "runner.report.__main__",
                      "runner.reproduce.__main__", "runner.reproduce.grid",
                      "hydra_plugins.gridrun_launcher",
                      "hydra_plugins.gridrun_launcher.mpi_launcher",
                      "hydra_plugins.gridrun_launcher.app_jobs",
                      "hydra_plugins.gridrun_launcher.app_rank"}),
    ("the head", {"runner.compose", "runner.help", "runner.launch", "runner.sweep", "runner.report",
                  "runner.report.data", "runner.report.plots", "runner.report.summary",
                  "runner.reproduce", "runner.reproduce.runs", "runner.reproduce.sc17",
                  "runner.reproduce.parallax"}),
    ("the head's watch over a job", {"runner.mpijob"}),
    ("checks before a run", {"runner.preflight", "runner.validation"}),
    ("process roles", {"runner.supervisor", "runner.mpienv", "runner.rank"}),
    ("the loop", {"runner.train"}),
    ("the run's records", {"runner.summary"}),
    ("start or resume", {"runner.resume"}),
    ("the step", {"runner.step", "runner.evaluation", "runner.sampling"}),
    ("checkpoints, signals, boards", {"runner.checkpoint", "runner.interrupt", "runner.board"}),
    ("assembly", {"runner.assembly"}),
    ("devices and precision", {"runner.devices", "runner.precision"}),
    ("plugins", {"runner.easgd", "runner.optim", "runner.models", "runner.datasets",
                 "runner.corpus", "runner.userdata", "runner.plan", "runner.plan.planner",
                 "runner.plan.calibration", "runner.parameter_server"}),
    ("machine costs", {"runner.machine"}),
    ("config and registries", {"runner.config", "runner.options", "runner.registry"}),
    ("strategies", {"strategies."}),
    ("the distributed-tensor core", {"runner.core."}),
    ("utilities", {"runner", "runner.rundir", "runner.rundir_files", "runner.console",
                   "runner.logs", "runner.process"}),
]


def layer_of(module: str) -> int | None:
    for index, (_, members) in enumerate(LAYERS):
        for member in members:
            if module == member or (member.endswith(".") and
                                    (module + ".").startswith(member)):
                return index
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            # `from runner.core import Partition`: the module is the longest prefix that is one
            while name and layer_of(name) is None:
                name = name.rpartition(".")[0]
            if name.split(".")[0] in ("runner", "strategies", "hydra_plugins"):
                found.add(name)
    return found


def sources() -> list[Path]:
    return sorted(p for folder in ("runner", "strategies", "hydra_plugins")
                  for p in (ROOT / folder).rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    unplaced = [module_name(p) for p in sources() if layer_of(module_name(p)) is None]
    assert not unplaced, f"add these to LAYERS: {unplaced}"


def test_no_module_imports_a_layer_above_it() -> None:
    upward = []
    for path in sources():
        module = module_name(path)
        own = layer_of(module)
        assert own is not None
        for imported in project_imports(path):
            theirs = layer_of(imported)
            if theirs is not None and theirs < own:
                upward.append(f"{module} ({LAYERS[own][0]}) imports {imported} "
                              f"({LAYERS[theirs][0]})")
    assert not upward, "\n".join(upward)


def test_the_loop_does_not_know_the_planner() -> None:
    assert not {m for m in project_imports(ROOT / "runner" / "train.py")
                if m.startswith("runner.plan")}


def test_train_fits_on_a_page() -> None:
    tree = ast.parse((ROOT / "runner" / "train.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno is not None and train.end_lineno - train.lineno + 1 <= 80


def test_strategies_import_no_circle_and_none_inside_functions() -> None:
    """Every import of strategies/ and runner/ (module level and inside functions) is an edge;
    no circle may pass through a strategies module, and no function in strategies/ imports a
    strategies module: an import inside a function is how a circle hides. Imports of other
    packages inside functions stay allowed (mpi4py initialises MPI on import)."""
    paths = sorted(p for folder in ("strategies", "runner") for p in (ROOT / folder).rglob("*.py"))
    trees = {module_name(p): ast.parse(p.read_text()) for p in paths}
    packages = {module_name(p) for p in paths if p.name == "__init__.py"}

    def targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
        """The project modules an import statement names (`from a import b`: a.b if that is a
        module, else a)."""
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = module if module in packages else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in trees else base
                     for alias in node.names]
        found = set()
        for name in names:
            while name and name not in trees:  # `import a.b.c`: the longest prefix a module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
        return found

    graph: dict[str, set[str]] = {}
    inside_functions: list[str] = []
    for module, tree in trees.items():
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[module] |= targets(module, node) - {module}
        if not module.startswith("strategies"):
            continue
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    inside_functions += [f"{module}:{node.lineno} ({function.name}) imports "
                                         f"{name}" for name in sorted(targets(module, node))
                                         if name.startswith("strategies")]
    assert not inside_functions, "\n".join(sorted(set(inside_functions)))

    # a circle through a strategies module: the module reached again from what it imports
    circles = []
    for start in sorted(m for m in graph if m.startswith("strategies")):
        came_from: dict[str, str] = {}  # per module reached: the module that imports it
        todo = [start]
        while todo and start not in came_from:
            module = todo.pop(0)
            for imported in sorted(graph[module]):
                if imported not in came_from:
                    came_from[imported] = module
                    todo.append(imported)
        if start in came_from:
            circle = [start]
            while len(circle) == 1 or circle[-1] != start:
                circle.append(came_from[circle[-1]])
            circles.append(" -> ".join(reversed(circle)))
    assert not circles, "\n".join(circles)
