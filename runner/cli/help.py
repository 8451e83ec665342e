"""What `gridrun --help`, `gridrun-plan --help` and `--version` print.

Everything is read from where it is defined, so the help cannot drift from the code: the config
groups and their options from `conf/` (runner.cli.compose.CONF_DIR) and Hydra's ConfigStore (the
groups the schema registers: grid, trainer, launcher, logger, and each plugin group's `target`),
the defaults from `conf/config.yaml`, and the engine's keys with their type, default and the
docstring under each field from the dataclasses of `runner/config/schema.py` (the docstrings read
with `ast` from its source). Versions come from the installed packages' metadata; nothing here
imports torch or mpi4py, so `--help` and `--version` answer at once.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
import sys
import textwrap
import types
import typing
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from runner.cli.compose import CONF_DIR, TARGET_GROUPS, TARGET_OPTION, register_configs
from runner.config import schema as config_module

# The groups in the order a user meets them, and how each is introduced.
GROUP_ORDER = ("model", "dataset", "grid", "strategy", "optimizer", "trainer", "launcher",
               "logger", "experiment")
GROUP_HINTS = {
    "grid": "the process grid pr x pc: keys below",
    "trainer": "the training loop: keys below",
    "launcher": "how ranks start: the bundled mpiexec, srun, or a Slurm batch job: keys below",
    "logger": "where metrics go besides metrics.jsonl",
    "experiment": "a named bundle of the above, applied last",
}
# The engine's sections gridrun's help lists; `plan` is the planner's (gridrun-plan --help).
PLAN_SECTION = "plan"

EXAMPLES = [
    ("gridrun", "the defaults: an MLP on digits, strategy=grid on a 2 x 2 grid"),
    ("gridrun grid.pc=2", "override any key: KEY=VALUE"),
    ("gridrun model=cnn strategy=data grid.pr=1 grid.pc=4", "choose options of the groups"),
    ("gridrun -m grid.pr=1,2", "a sweep: one MPI job per combination, then a sweep table"),
    ("gridrun launcher=slurm launcher.slurm.time=1:00:00", "a Slurm batch job; -m "
     "hydra/launcher=slurm submits a sweep's jobs at once"),
    ("gridrun model._target_=my_pkg.nets.MyNet model.width=64",
     "your own model class, with its own arguments"),
    ("gridrun experiment=digits_cnn", "a named experiment"),
    ("gridrun --cfg job", "print the composed config, run nothing"),
    ("gridrun-plan plan.world=16", "which grid and strategy for 16 ranks? (starts no MPI job)"),
    ('eval "$(gridrun -sc install=bash)"', "tab completion of groups and keys in bash"),
]

PLAN_EXAMPLES = [
    ("gridrun-plan plan.world=16", "every pr x pc of 16 ranks, for every strategy"),
    ("gridrun-plan model=alexnet trainer.batch_size=256 plan.world=16 plan.layers=true",
     "a model planned from its shapes, with the per-layer breakdown"),
    ("gridrun-plan -m plan.world=4,8,16", "one plan per job"),
    ("gridrun-plan plan.world=8 plan.out=plan.json", "the plan as JSON too"),
    ("gridrun-plan plan.calibrate=true", "measure this machine's α and β for later plans and runs"),
]


def _width() -> int:
    return max(60, min(120, shutil.get_terminal_size((100, 24)).columns))


def _value(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _type_name(annotation: Any) -> str:
    """`int`, `float|null`, `list[str]`: the type a key takes."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        named = [_type_name(a) for a in args if a is not type(None)]
        return "|".join(named) + ("|null" if type(None) in args else "")
    if origin is not None:
        inner = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(annotation, "__name__", str(annotation))


def _declared_type(annotation: Any, declared: Mapping[str, Any]) -> str:
    """The type with what the schema's field declares of its values: `fp32|bf16|fp16`,
    `int>=1`, `float[1..3e+07]|null`."""
    name = _type_name(annotation)
    if "choices" in declared:
        return "|".join(declared["choices"])
    if "minimum" not in declared:
        return name
    base, null, _ = name.partition("|null")
    low, high = declared["minimum"], declared.get("maximum")
    bound = f"[{low:.15g}..{high:.15g}]" if high is not None else f">={low:.15g}"
    return f"{base}{bound}{'|null' if null else ''}"


def _field_docs() -> dict[tuple[str, str], str]:
    """(class, field) -> the docstring under the field in runner/config/schema.py, on one line."""
    source = Path(config_module.__file__ or "")
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):  # no source installed: the help goes without the docs
        return {}
    docs: dict[tuple[str, str], str] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for field, after in zip(node.body, node.body[1:], strict=False):
            if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[(node.name, field.target.id)] = " ".join(after.value.value.split())
    return docs


def engine_keys(only: str | None = None,
                skip: tuple[str, ...] = ()) -> list[tuple[str, str, str]]:
    """(key, `type = default`, doc) for the keys of the engine's schema: its top-level keys and
    sections (the plugin groups are not the schema's: their options are the groups' files)
    without those in `skip`; or `only` one section's."""
    docs = _field_docs()
    rows: list[tuple[str, str, str]] = []

    def add(schema: type[Any], prefix: str) -> None:
        hints = typing.get_type_hints(schema)
        for field in dataclasses.fields(schema):
            annotation = hints[field.name]
            section = config_module.section_type(annotation)
            if section is not None and section is not annotation:  # null unless chosen
                rows.append((f"{prefix}{field.name}", "section|null = null",
                             docs.get((schema.__name__, field.name), "")))
            if section is not None:
                if prefix or (field.name == only if only else field.name not in skip):
                    add(section, f"{prefix}{field.name}.")
                continue
            if not prefix and (only or field.name in config_module.PLUGIN_GROUPS):
                continue
            if field.default is not dataclasses.MISSING:
                default: Any = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:
                default = "???"
            shown_type = _declared_type(annotation, field.metadata)
            rows.append((f"{prefix}{field.name}", f"{shown_type} = {_value(default)}",
                         docs.get((schema.__name__, field.name), "")))

    add(config_module.ConfigSchema, "")
    return rows


def _group_options() -> dict[str, list[str]]:
    """Every config group and its options: `conf/`'s files and the ConfigStore's entries."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    groups: dict[str, set[str]] = {}
    for folder in sorted(p for p in CONF_DIR.iterdir() if p.is_dir()):
        groups.setdefault(folder.name, set()).update(f.stem for f in folder.glob("*.yaml"))
    store = ConfigStore.instance()
    for group in store.list(""):
        if group.endswith(".yaml") or group == "hydra":
            continue
        groups.setdefault(group, set()).update(
            name.removesuffix(".yaml") for name in store.list(group))
    order = {name: i for i, name in enumerate(GROUP_ORDER)}
    return {g: sorted(groups[g], key=lambda o: (o == TARGET_OPTION, o))
            for g in sorted(groups, key=lambda g: (order.get(g, len(order)), g))}


def _defaults() -> dict[str, str | None]:
    """Each group's default option, from conf/config.yaml's defaults list."""
    loaded = yaml.safe_load((CONF_DIR / "config.yaml").read_text()) or {}
    chosen: dict[str, str | None] = {}
    for entry in loaded.get("defaults", []):
        if isinstance(entry, dict):
            for group, option in entry.items():
                if not str(group).startswith("override "):
                    chosen[str(group)] = option
    return chosen


def _description(path: Path) -> str:
    """The leading comment of a config file as one line, without its command-line example."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if not text.startswith("@package"):
            lines.append(text)
    text = " ".join(" ".join(lines).split())
    text = re.split(r":?\s+(?:python -m runner|gridrun)\b", text)[0]
    return text.rstrip(":. ")


def _option_keys(path: Path) -> str:
    """An option file's own keys and their defaults: `hidden=[128, 128] activation=relu`."""
    loaded = yaml.safe_load(path.read_text()) or {}
    return " ".join(f"{k}={_value(v)}" for k, v in loaded.items()
                    if k not in ("name", "defaults"))


def _rows(rows: list[tuple[str, str]], indent: int = 2, gap: int = 2) -> list[str]:
    """Two columns, the second wrapped under itself."""
    if not rows:
        return []
    first = min(max(len(a) for a, _ in rows), 34)
    width = _width()
    lines = []
    for left, right in rows:
        pad = " " * (indent + first + gap)
        wrapped = textwrap.wrap(right, width, initial_indent=pad, subsequent_indent=pad,
                                break_long_words=False, break_on_hyphens=False)
        if len(left) > first:
            lines.append(" " * indent + left)
            lines.extend(wrapped)
            continue
        wrapped = wrapped or [pad]
        lines.append(" " * indent + left.ljust(first) + " " * gap + wrapped[0].lstrip())
        lines.extend(wrapped[1:])
    return lines


def _key_rows(keys: list[tuple[str, str, str]]) -> list[str]:
    return _rows([(key, f"{kind}  {doc}" if doc else kind) for key, kind, doc in keys])


def help_text() -> str:
    """`gridrun --help`."""
    groups = _group_options()
    defaults = _defaults()
    out = [
        "usage: gridrun [GROUP=OPTION] [KEY=VALUE] ...  train (also: python -m runner)",
        "       gridrun -m KEY=A,B [KEY=VALUE] ...      a sweep: one MPI job per combination",
        "       gridrun --cfg job [KEY=VALUE] ...       print the composed config, run nothing",
        "       gridrun --version | --help | --hydra-help",
        "",
        "Declarative distributed training on MPI: pick a model, a dataset, a process grid",
        "pr x pc, a parallel strategy and a replica optimizer; gridrun starts the MPI ranks,",
        "trains, and leaves a run directory (outputs/<date>/<time>/, or hydra.run.dir=...).",
        "Bad input is one line on stderr and exit code 2, before anything starts.",
        "",
        f"config groups (GROUP=OPTION; * marks the default; files under {CONF_DIR}):",
    ]
    rows = []
    for group, options in groups.items():
        names = [f"{o}*" if o == defaults.get(group) else o for o in options]
        hint = GROUP_HINTS.get(group, "")
        if group in TARGET_GROUPS:
            hint = f"{TARGET_OPTION}: your own, {group}._target_=module.Class"
        rows.append((group, "  ".join(names) + (f"  ({hint})" if hint else "")))
    out += _rows(rows)
    out += ["", "options of the plugin groups (GROUP.KEY=VALUE; each option's keys and defaults):"]
    rows = []
    for group in groups:
        folder = CONF_DIR / group
        if group == "experiment" or not folder.is_dir():
            continue
        for option in groups[group]:
            if (folder / f"{option}.yaml").is_file():
                rows.append((f"{group}={option}", _option_keys(folder / f"{option}.yaml")))
    out += _rows(rows)
    if (CONF_DIR / "experiment").is_dir():
        out += ["", "experiments (experiment=NAME):"]
        out += _rows([(p.stem, _description(p))
                      for p in sorted((CONF_DIR / "experiment").glob("*.yaml"))])
    out += ["", "engine keys (KEY=VALUE; type = default; from runner/config/schema.py):"]
    out += _key_rows(engine_keys(skip=(PLAN_SECTION,)))
    out += ["", "examples:"]
    out += _rows(EXAMPLES)
    out += ["",
            "The planner's keys: gridrun-plan --help. Hydra's own flags (--cfg, --info, -cd,",
            "--multirun, -sc install=bash, ...) and its groups: gridrun --hydra-help."]
    return "\n".join(out)


def plan_help_text() -> str:
    """`gridrun-plan --help`."""
    from runner.config.machine import calibration_path

    out = [
        "usage: gridrun-plan [GROUP=OPTION] [KEY=VALUE] ...   plan (also: python -m runner.plan)",
        "       gridrun-plan -m KEY=A,B [KEY=VALUE] ...       one plan per combination",
        "       gridrun-plan plan.calibrate=true              measure this machine's α and β",
        "       gridrun-plan --cfg job [KEY=VALUE] ...        print the composed config",
        "       gridrun-plan --version | --help | --hydra-help",
        "",
        "Lists every factorisation pr x pc of plan.world for each strategy that can run it: the",
        "bytes and α–β time communicated per step, parameter and activation bytes per rank, the",
        "best grid marked, and why the other combinations are impossible. Starts no MPI job and",
        "writes no run directory. Takes every group and key of gridrun (gridrun --help lists",
        "them): model, dataset, strategy, trainer.batch_size, ... Bad input is one line on",
        "stderr and exit code 2.",
        "",
        "planner keys (KEY=VALUE; type = default; from runner/config/schema.py):",
    ]
    out += _key_rows(engine_keys(only=PLAN_SECTION))
    path = calibration_path()
    state = "stored" if path.is_file() else "not measured yet: the defaults are used"
    out += ["", f"calibration: {path} ({state})",
            "  per machine, in the user's cache; GRIDRUN_CALIBRATION=FILE chooses another"]
    out += ["", "examples:"]
    out += _rows(PLAN_EXAMPLES)
    return "\n".join(out)


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def version_text() -> str:
    """`gridrun --version`: gridrun's version and those it runs on (from the packages'
    metadata: nothing is imported)."""
    own = _installed("gridrun") or "(not installed: pip install -e .)"
    parts = [f"{name} {_installed(dist) or 'not installed'}"
             for name, dist in (("Hydra", "hydra-core"), ("torch", "torch"),
                                ("mpi4py", "mpi4py"))]
    mpich = _installed("mpich")
    if mpich:
        parts.append(f"bundled MPICH {mpich}")
    parts.append(f"Python {sys.version.split()[0]}")
    return f"gridrun {own}\n{', '.join(parts)}"
