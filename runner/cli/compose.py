"""Hydra's side of the config, for the entry points (`runner.cli.app`, `runner.plan`) alone.

The schema (`runner.config.schema`) is registered in Hydra's ConfigStore: the root's typed sections
and the options of the groups it owns (`grid/default`, `trainer/default`, `launcher/bundled`,
`launcher/srun`, `launcher/slurm`, `logger/none`, `logger/tensorboard`). `conf/` holds the plugin
groups and the root's defaults list. Hydra's multi-line composition errors become the one line a
user needs.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner.config.options import describe
from runner.config.schema import (
    OBJECTIVES,
    ConfigSchema,
    GridConfig,
    LauncherConfig,
    LoggerConfig,
    SlurmConfig,
    TrainerConfig,
)


def _conf_dir() -> Path:
    """The plugin groups: `runner/conf` in an installed wheel, the project's `conf/` in a
    checkout (the wheel maps the one onto the other)."""
    packaged = Path(__file__).resolve().parents[1] / "conf"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "conf"


CONF_DIR = _conf_dir()
SCHEMA_NAME = "gridrun_schema"
# The groups whose `target` option takes a user's class or function by `_target_`.
TARGET_GROUPS = ("model", "dataset", "optimizer")
TARGET_OPTION = "target"
PRETRAINED_OPTION = "pretrained"  # model=pretrained: the model a weights directory describes

_registered = False


def register_configs() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=ConfigSchema)
    store.store(group="grid", name="default", node=GridConfig)
    store.store(group="trainer", name="default", node=TrainerConfig)
    store.store(group="launcher", name="bundled", node=LauncherConfig)
    store.store(group="launcher", name="srun", node=LauncherConfig(command="srun"))
    # A batch job continues from its newest checkpoint when Slurm starts it again (a requeue):
    # the run resumes `auto` unless the command line names a checkpoint (the first start finds
    # none and starts fresh).
    store.store(group="launcher", name="slurm", package="_global_",
                node={"launcher": LauncherConfig(slurm=SlurmConfig()),
                      "trainer": {"resume": "auto"}})
    store.store(group="logger", name="none", node=LoggerConfig)
    store.store(group="logger", name="tensorboard", node=LoggerConfig(name="tensorboard"))
    # The direction of a sweep follows the run's objective (conf/experiment/tune_lr.yaml).
    OmegaConf.register_new_resolver("gridrun_direction", lambda name: OBJECTIVES.get(name, name))
    for group in TARGET_GROUPS:
        # Not in struct mode: the user's own arguments are plain keys (model.width=64), not
        # Hydra's appended ones (+model.width=64).
        node = OmegaConf.create({"_target_": MISSING}, flags={"struct": False})
        store.store(group=group, name=TARGET_OPTION, node=node)
    # model=pretrained: the architecture and fields of a transformers directory's config.json
    # (model.weights=DIR), the user's keys on top (model.dropout=0.1).
    store.store(group="model", name=PRETRAINED_OPTION,
                node=OmegaConf.create({"name": PRETRAINED_OPTION, "weights": MISSING},
                                      flags={"struct": False}))
    _registered = True


def with_target_groups(args: list[str]) -> list[str]:
    """`args` with `GROUP=target` added where a `GROUP._target_=...` names a user's class and
    no `GROUP=` chooses the group's option: the default option's own keys (mlp's `hidden`)
    must not reach the user's constructor. Likewise `model=pretrained` where `model.weights=`
    names weights and nothing else chooses the model: the weights' directory then says which
    model it is."""
    added = []
    for group in TARGET_GROUPS:
        names_target = any(a.lstrip("+~").startswith(f"{group}._target_=") for a in args)
        chooses = any(a.lstrip("+~").split("=")[0] == group for a in args)
        if names_target and not chooses:
            added.append(f"{group}={TARGET_OPTION}")
        elif (group == "model" and not names_target and not chooses
              and any(a.lstrip("+~").startswith("model.weights=") for a in args)):
            added.append(f"model={PRETRAINED_OPTION}")
    # every model takes `weights`, which a model's own YAML (model=mlp) does not list: added
    # or overridden alike (Hydra's `++`)
    args = [f"++{a}" if a.startswith("model.weights=") else a for a in args]
    return [*args, *added]


def _chosen(args: list[str], group: str) -> str | None:
    """The option `args` choose for a config group (`launcher=slurm`: slurm), if any."""
    for arg in args:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == group:
            return value
    return None


def with_slurm_launcher(args: list[str]) -> list[str]:
    """`args` with `launcher=slurm` added where the sweep's Hydra launcher is Slurm's
    (`hydra/launcher=slurm`: every job a batch job) and no `launcher=` says otherwise."""
    if _chosen(args, "hydra/launcher") == "slurm" and _chosen(args, "launcher") is None:
        return [*args, "launcher=slurm"]
    return args


def slurm_options_problem(args: list[str]) -> str | None:
    """A `launcher.slurm.*` override without `launcher=slurm`, whose section is null then."""
    if _chosen(args, "launcher") == "slurm":
        return None
    for arg in args:
        key = arg.lstrip("+~").partition("=")[0]
        if key == "launcher.slurm" or key.startswith("launcher.slurm."):
            return f"{arg}: the Slurm options take effect under launcher=slurm (add it)"
    return None


# Hydra's flags that unpickle a file (`--experimental-rerun RUN/.hydra/config.pickle`): a pickle
# runs whatever code its bytes name, and a run directory may come from anyone.
PICKLE_FLAGS = ("--experimental-rerun",)


def pickle_flag_problem(args: list[str]) -> str | None:
    """The refusal of a Hydra flag that loads a pickle, as argparse reads one: `--flag FILE`,
    `--flag=FILE`, or a prefix it takes for the flag (`--exp`); None without one. Arguments
    after `--` are no flags."""
    for arg in args:
        if arg == "--":
            return None
        name = arg.partition("=")[0]
        if len(name) > 2 and any(flag.startswith(name) for flag in PICKLE_FLAGS):
            return (f"{name}: Hydra's rerun from a pickled config: refused (unpickling a file "
                    "runs any code it names; python -m runner.replay RUN_DIR runs a run again "
                    "from its config.yaml)")
    return None


def config_dirs(args: list[str]) -> list[str]:
    """The directories `--config-dir`/`-cd` adds to the config search path."""
    found = []
    for index, arg in enumerate(args):
        if arg in ("-cd", "--config-dir") and index + 1 < len(args):
            found.append(args[index + 1])
        elif arg.startswith("--config-dir="):
            found.append(arg.partition("=")[2])
    return found


def without_config_dirs(args: list[str]) -> list[str]:
    """`args` without the `--config-dir` flags (what remains are overrides and flags)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-cd", "--config-dir"):
            skip = True
        elif not arg.startswith("--config-dir="):
            kept.append(arg)
    return kept


def compose(overrides: list[str], with_hydra: bool = False,
            extra_dirs: list[str] | None = None) -> DictConfig:
    """The config `python -m runner OVERRIDES` would run (Hydra's errors are raised);
    `extra_dirs`: what `--config-dir` adds to the search path (searched before `conf/`)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    overrides = with_target_groups(overrides)
    if extra_dirs:
        paths = ",".join(f"file://{Path(d).resolve()}" for d in extra_dirs)
        overrides = [*overrides, f"hydra.searchpath=[{paths}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides,
                             return_hydra_config=with_hydra)


def _key_problem(exc: BaseException) -> str | None:
    """OmegaConf's own errors about one key, in the words of the validator."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    cause = exc.__cause__ if exc.__cause__ is not None else exc
    key = getattr(cause, "full_key", None)
    if not key:
        return None
    if isinstance(cause, ValidationError):
        match = re.search(r"Value '(.*)' of type '\w+' could not be converted to (\w+)",
                          str(cause))
        if match:
            wanted = {"Integer": int, "Float": float, "Boolean": bool, "String": str}.get(
                match.group(2))
            if wanted is not None:
                return f"{key}={match.group(1)}: must be {describe(wanted)}"
        match = re.search(r"Value '(.*)' is not a valid bool", str(cause))
        if match:
            return f"{key}={match.group(1)}: must be {describe(bool)}"
        return f"{key}: {str(cause).splitlines()[0]}"
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        parent, _, name = key.rpartition(".")
        known = _schema_keys(parent)
        if known is None:
            return None
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {parent + '.' if parent else ''}{close[0]}? " if close else ""
        return f"{key}: unknown key; {hint}valid: {', '.join(known)}"
    return None


def _schema_keys(section: str) -> list[str] | None:
    import dataclasses
    import typing

    from runner.config.schema import section_type

    schema: type = ConfigSchema
    for part in filter(None, section.split(".")):
        nested = section_type(typing.get_type_hints(schema).get(part))
        if nested is None:
            return None
        schema = nested
    return [f.name for f in dataclasses.fields(schema)]


def one_line(exc: BaseException) -> str:
    """Hydra's multi-line composition errors as the one line a user needs."""
    text = str(exc)
    missing = re.search(r"Could not find '(?:(.+)/)?([^'/]+)'", text)
    if missing:
        group, name = missing.group(1), missing.group(2)
        options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], re.MULTILINE)
        what = f"{group} '{name}'" if group else f"config '{name}'"
        return f"unknown {what}; available: {', '.join(options) or 'none'}"
    problem = _key_problem(exc)
    if problem:
        return problem
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("See https://", "full_key:", "object_type=",
                                        "reference_type=", "Config search path")):
            continue
        lines.append(line.rstrip("."))
    return "; ".join(lines)
