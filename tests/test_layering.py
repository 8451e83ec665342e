"""The rooms of the house in the order a run passes through them (docs/architecture.md): every
sub-package of runner/ is a room (read from the folders, so a new folder must be given a floor),
as are strategies/, the Hydra launcher and runner/'s own top-level modules. A module may import
its own floor and the floors below it, never one above; inside a room, the order of its modules
(`ORDER`) holds the same way. Read from the source (every import statement, also those inside
functions), so a new upward import fails here. docs/architecture.md names every module, and
every module it names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("runner", "strategies", "hydra_plugins")

# Top to bottom: a floor's rooms.
FLOORS: list[tuple[str, set[str]]] = [
    ("the commands", {"runner.__main__", "runner.reproduce", "hydra_plugins.gridrun_launcher"}),
    ("the tools that start runs or read them", {"runner.replay", "runner.plan", "runner.export"}),
    ("the head", {"runner.cli"}),
    ("a rank, and the reports of runs", {"runner.training", "runner.report"}),
    ("checkpoints", {"runner.checkpoint", "runner.weights"}),
    ("plugins", {"runner.optim", "runner.zoo", "runner.data"}),
    ("config and strategies", {"runner.config", "strategies"}),
    ("the cost model", {"runner.cost"}),
    ("the distributed-tensor core and the records", {"runner.core", "runner.records", "runner"}),
]

# Inside a room, top to bottom: its modules' order (a room not named here has none). In
# strategies/ a family folder takes one place as a whole: the six `strategy=` choices, then the
# families, then the contract every family shares.
ORDER: dict[str, list[set[str]]] = {
    "strategies": [
        {"auto"},
        {"fsdp", "model"},
        {"data", "grid", "domain"},
        {"layouts", "plans", "transformer", "sharding"},
        {"layers"},
        {"registry", "compiled", "recompute"},
        {"base"},
        {"exchange", "probe"},
    ],
    "runner.cli": [
        {"app", "worker", "slurm_job"},
        {"compose", "help", "launch", "sweep"},
        {"mpijob"},
        {"preflight", "validation", "slurm"},
    ],
    "runner.training": [
        {"supervisor", "mpienv", "rank"},
        {"loop"},
        {"summary"},
        {"resume", "feeding"},
        {"step", "evaluation", "sampling"},
        {"state"},
        {"interrupt"},
        {"assembly"},
        {"devices", "precision", "memory"},
    ],
    "runner.checkpoint": [
        {"resume"},
        {"read", "write"},
        {"format"},
        {"layout", "space"},
    ],
    "runner.config": [
        {"machine"},
        {"schema", "options", "registry"},
    ],
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


MODULES = {module_name(p) for p in sources()}


def room_of(module: str) -> str:
    """A sub-package of runner/ is a room, a module directly in runner/ is one by itself."""
    parts = module.split(".")
    if parts[0] == "runner":
        if len(parts) > 1 and (ROOT / "runner" / parts[1] / "__init__.py").is_file():
            return f"runner.{parts[1]}"
        return module
    if parts[0] == "hydra_plugins":
        return ".".join(parts[:2])
    return parts[0]


def floor_of(room: str) -> int | None:
    return next((i for i, (_, rooms) in enumerate(FLOORS) if room in rooms), None)


def tier_of(module: str) -> int | None:
    """The module's place in its room's ORDER (None where the room has none)."""
    tiers = ORDER.get(room_of(module))
    if tiers is None:
        return None
    name = module[len(room_of(module)) + 1:].split(".")[0]  # a module, or its family folder
    return next((i for i, tier in enumerate(tiers) if name in tier), None)


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
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def test_every_room_has_a_floor_and_every_floor_a_room() -> None:
    rooms = {room_of(m) for m in MODULES}
    named = set().union(*(members for _, members in FLOORS))
    assert not rooms - named, f"add these rooms to FLOORS: {sorted(rooms - named)}"
    assert not named - rooms, f"no such rooms (remove them from FLOORS): {sorted(named - rooms)}"


def test_every_module_of_an_ordered_room_has_its_place() -> None:
    unplaced = [m for m in MODULES if room_of(m) in ORDER and m != room_of(m)
                and tier_of(m) is None]
    assert not unplaced, f"add these to ORDER: {sorted(unplaced)}"
    for room, tiers in ORDER.items():
        for tier in tiers:
            missing = {name for name in tier if f"{room}.{name}" not in MODULES}
            assert not missing, f"no such modules in {room} (remove them from ORDER): {missing}"


def test_no_module_imports_a_floor_above_it() -> None:
    upward = []
    for path in sources():
        module = module_name(path)
        own = floor_of(room_of(module))
        assert own is not None
        for imported in project_imports(path):
            theirs = floor_of(room_of(imported))
            if theirs is not None and theirs < own:
                upward.append(f"{module} ({FLOORS[own][0]}) imports {imported} "
                              f"({FLOORS[theirs][0]})")
    assert not upward, "\n".join(upward)


def test_no_module_imports_one_above_it_in_its_room() -> None:
    upward = []
    for path in sources():
        module = module_name(path)
        own = tier_of(module)
        for imported in project_imports(path):
            theirs = tier_of(imported)
            if (own is not None and theirs is not None and theirs < own
                    and room_of(imported) == room_of(module)):
                upward.append(f"{module} imports {imported}, above it in {room_of(module)}")
    assert not upward, "\n".join(upward)


def architecture_paths() -> tuple[set[str], list[str]]:
    """The files docs/architecture.md names, line by line: a path in backquotes (`runner/x.py`,
    or a folder, `runner/core/`), and a bare `name.py` after a folder on the same line is that
    folder's. Returns (the paths named, bare names without a folder before them)."""
    named: set[str] = set()
    orphans: list[str] = []
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        folder = None
        for token in re.findall(r"`([^`\s]+)`", line):
            if token.split("/")[0] in FOLDERS:
                path = token.rstrip("/")
                named.add(path)
                if not path.endswith(".py"):
                    folder = path
            elif re.fullmatch(r"\w+\.py", token):
                if folder is None:
                    orphans.append(token)
                else:
                    named.add(f"{folder}/{token}")
    return named, orphans


def test_architecture_names_every_module() -> None:
    named, _ = architecture_paths()
    missing = []
    for path in sources():
        relative = path.relative_to(ROOT)
        if relative.name in ("__init__.py", "__main__.py") and \
                str(relative.parent) in named:
            continue  # a package named by its folder
        if str(relative) not in named:
            missing.append(str(relative))
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_module_path_in_architecture_exists() -> None:
    named, orphans = architecture_paths()
    assert not orphans, f"docs/architecture.md names these without their folder: {orphans}"
    absent = sorted(p for p in named if not (ROOT / p).exists())
    assert not absent, f"docs/architecture.md names what does not exist: {absent}"


def test_the_loop_does_not_know_the_planner() -> None:
    assert not {m for m in project_imports(ROOT / "runner" / "training" / "loop.py")
                if m.startswith("runner.plan")}


def test_train_fits_on_a_page() -> None:
    tree = ast.parse((ROOT / "runner" / "training" / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno is not None and train.end_lineno - train.lineno + 1 <= 80


def _import_targets(module: str, node: ast.Import | ast.ImportFrom, modules: set[str],
                    packages: set[str]) -> set[str]:
    """The project modules an import statement in `module` names (`from a import b`: a.b if that
    is a module, else a; relative imports from the importing module's package)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module if module in packages else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                 for alias in node.names]
    found = set()
    for name in names:
        while name and name not in modules:  # `import a.b.c`: the longest prefix a module
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def _circle_through(start: str, graph: dict[str, set[str]]) -> str | None:
    """A shortest circle from `start` back to itself, breadth first, or None."""
    came_from: dict[str, str] = {}  # per module reached: the module that imports it
    todo = [start]
    while todo and start not in came_from:
        module = todo.pop(0)
        for imported in sorted(graph[module]):
            if imported not in came_from:
                came_from[imported] = module
                todo.append(imported)
    if start not in came_from:
        return None
    circle = [start]
    while len(circle) == 1 or circle[-1] != start:
        circle.append(came_from[circle[-1]])
    return " -> ".join(reversed(circle))


def test_strategies_import_no_circle_and_none_inside_functions() -> None:
    """Every import of strategies/ and runner/ (module level and inside functions) is an edge;
    no circle may pass through a strategies module, and no function in strategies/ imports a
    strategies module: an import inside a function is how a circle hides. Imports of other
    packages inside functions stay allowed (mpi4py initialises MPI on import)."""
    paths = sorted(p for folder in ("strategies", "runner") for p in (ROOT / folder).rglob("*.py"))
    trees = {module_name(p): ast.parse(p.read_text()) for p in paths}
    packages = {module_name(p) for p in paths if p.name == "__init__.py"}
    modules = set(trees)
    graph: dict[str, set[str]] = {}
    inside_functions: list[str] = []
    for module, tree in trees.items():
        graph[module] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                graph[module] |= _import_targets(module, node, modules, packages) - {module}
        if not module.startswith("strategies"):
            continue
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    inside_functions += [
                        f"{module}:{node.lineno} ({function.name}) imports {name}"
                        for name in sorted(_import_targets(module, node, modules, packages))
                        if name.startswith("strategies")]
    assert not inside_functions, "\n".join(sorted(set(inside_functions)))
    circles = [c for start in sorted(m for m in graph if m.startswith("strategies"))
               if (c := _circle_through(start, graph)) is not None]
    assert not circles, "\n".join(circles)


# Sizes a newcomer can read: modules of the strategies and the core (the cost model with it),
# functions everywhere but the benchmarks (a benchmark's main reads top to bottom).
MODULE_LINES = 700
FUNCTION_LINES = 60
SIZED_FOLDERS = ("strategies", "runner/core", "runner/cost")
FUNCTION_FOLDERS = ("runner", "strategies", "hydra_plugins", "tests", "examples")


def test_no_module_of_the_strategies_or_the_core_over_700_lines() -> None:
    long = [f"{p.relative_to(ROOT)}: {n}" for folder in SIZED_FOLDERS
            for p in sorted((ROOT / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MODULE_LINES]
    assert not long, f"over {MODULE_LINES} lines: {long}"


def test_no_function_over_60_lines_outside_the_benchmarks() -> None:
    long = []
    for folder in FUNCTION_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                        node.end_lineno is not None and \
                        node.end_lineno - node.lineno + 1 > FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, "\n".join(long)


def test_strategies_keep_the_choices_at_the_top_and_the_rest_in_families() -> None:
    """The `strategy=` choices (conf/strategy/X.yaml -> strategies/X.py), their contract and
    what every family shares at the top; everything else in family folders."""
    top = sorted(p.stem for p in (ROOT / "strategies").glob("*.py") if p.stem != "__init__")
    families = sorted(p.name for p in (ROOT / "strategies").iterdir()
                      if (p / "__init__.py").is_file())
    choices = sorted(p.stem for p in (ROOT / "conf" / "strategy").glob("*.yaml"))
    assert set(choices) <= set(top), f"a choice without its module: {set(choices) - set(top)}"
    assert len(top) <= 12, f"{len(top)} modules at the top of strategies/: {top}"
    assert len(families) >= 4, families
