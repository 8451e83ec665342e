"""The modules in the order a run passes through them (docs/architecture.md): a module may
import its own layer and the layers below it, never one above. Read from the source (every
import statement, also those inside functions), so a new upward import fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Top to bottom. A name ending in "." stands for every module under that package.
LAYERS: list[tuple[str, set[str]]] = [
    ("entry points", {
        "hydra_plugins.gridrun_launcher", "hydra_plugins.gridrun_launcher.app_jobs",
        "hydra_plugins.gridrun_launcher.app_rank", "hydra_plugins.gridrun_launcher.mpi_launcher",
        "runner.__main__", "runner.cli.app", "runner.cli.worker", "runner.plan.__main__",
        "runner.replay", "runner.report.__main__", "runner.reproduce.__main__",
        "runner.reproduce.grid"}),
    ("the head", {
        "runner.cli.compose", "runner.cli.help", "runner.cli.launch", "runner.cli.sweep",
        "runner.report", "runner.report.data", "runner.report.plots", "runner.report.summary",
        "runner.reproduce", "runner.reproduce.parallax", "runner.reproduce.runs",
        "runner.reproduce.sc17"}),
    ("the head's watch over a job", {"runner.cli.mpijob"}),
    ("checks before a run", {"runner.cli.preflight", "runner.cli.validation"}),
    ("process roles", {
        "runner.training.mpienv", "runner.training.rank", "runner.training.supervisor"}),
    ("the loop", {"runner.training.loop"}),
    ("the run's records", {"runner.training.summary"}),
    ("start or resume", {"runner.training.resume"}),
    ("the step", {
        "runner.training.evaluation", "runner.training.sampling", "runner.training.step"}),
    ("checkpoints, signals, boards", {
        "runner.checkpoint.store", "runner.records.board", "runner.training.interrupt"}),
    ("assembly", {"runner.training.assembly"}),
    ("devices and precision", {"runner.training.devices", "runner.training.precision"}),
    ("plugins", {
        "runner.optim.easgd", "runner.optim.parameter_server", "runner.optim.sync", "runner.plan",
        "runner.plan.calibration", "runner.plan.planner", "runner.zoo.corpus",
        "runner.zoo.datasets", "runner.zoo.models", "runner.zoo.userdata"}),
    ("machine costs", {"runner.config.machine"}),
    ("config and registries", {
        "runner.config.options", "runner.config.registry", "runner.config.schema"}),
    ("strategies", {"strategies."}),
    ("the distributed-tensor core", {"runner.core."}),
    ("utilities", {
        "runner", "runner.checkpoint", "runner.cli", "runner.config", "runner.optim",
        "runner.records", "runner.training", "runner.zoo", "runner.records.console",
        "runner.records.logs", "runner.records.process",
        "runner.records.rundir", "runner.records.rundir_files"}),
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
    assert not {m for m in project_imports(ROOT / "runner" / "training" / "loop.py")
                if m.startswith("runner.plan")}


def test_train_fits_on_a_page() -> None:
    tree = ast.parse((ROOT / "runner" / "training" / "loop.py").read_text())
    train = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert train.end_lineno is not None and train.end_lineno - train.lineno + 1 <= 80
