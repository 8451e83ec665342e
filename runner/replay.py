"""`python -m runner.replay RUN_DIR [--run-dir NEW]`: run a run again from its `config.yaml`.

The replay starts from scratch in `RUN_DIR/replays/<time>/` unless `--run-dir` says otherwise,
then compares its per-step training losses with the original's: exit 0 when they are identical,
1 when they differ (naming the first step that does), 2 for bad input. Runs of an asynchronous
optimizer are not deterministic: their difference is reported, and the exit code is 0. No Hydra
here: the saved config is already resolved.

A run directory is data, not a program: it may have been copied from anyone, so the replay takes
from it what the training computes (seed, grid, trainer, model, dataset, strategy, optimizer,
logger, debug.isolate_comm) and nothing that names a program to run or a place outside the new
run directory:

- `launcher` (the whole section: command, nproc_flag, args) comes from this invocation: the
  bundled mpiexec, or `--launcher-command CMD` (`--launcher-nproc-flag`). `--trust-launcher`
  takes the run's own; a replay without it names the run's launcher in a note, so it can be seen
  before it is trusted. A list `command` (older files) is joined into the schema's string.
- `hydra` (a config.yaml gridrun wrote has none; no Hydra runs here) is dropped, and `plan` (the
  planner's, whose `out` is a file it writes) is reset to the defaults.
- `trainer.resume` is cleared: a replay starts from scratch, and a path there would have the
  validator and the ranks read a checkpoint from anywhere.
- `debug.fail_*` and `debug.slow_*` are reset unless `--keep-debug`: a copied run could kill
  itself, hang (for ever with `trainer.comm_timeout_s: null`) or sleep in every step. Only the
  steps both runs logged are compared, so a replay without the original's failure still
  compares the steps before it (a `nan` failure then differs from its step).
- `.hydra/`: only `overrides.yaml` is carried over, less the overrides of the keys above, so the
  resume command an interrupted replay prints repeats no launcher and no debug failure.
- Interpolations: gridrun writes config.yaml resolved and never writes `${...}` itself, so a run
  file (config.yaml, .hydra/overrides.yaml) holding one was not written by it as it stands, and
  resolving it (`${oc.env:NAME}`) would copy this machine's environment into the new run's
  files: it is refused, naming the key. Nothing in the run's files is resolved.

- Code: a `_target_` anywhere (a model, dataset or optimizer of the user's: any importable
  callable, `os.system` as well) and the `plugins` list name Python to import and call. Without
  `--trust` the replay refuses such a run before anything is imported, naming every piece of
  code it names, the files it checked without importing anything, and the names it left
  unimported (so unvalidated); `--trust` imports them, after printing each on a line of its
  own, and runs the run's launcher unless `--launcher-command` names another.
- Files: config.yaml, .hydra/overrides.yaml and the original's metrics.jsonl are all read
  before anything is imported or run, within the bounds of `runner/records/rundir_files.py` (size,
  line length, nesting, integer digits). A file beyond them is refused in one line naming it
  and its line, exit 2, so that exit 1 always means a replay that ran and differs (or did not
  complete). A metrics line that is no JSON is skipped, as one cut short by a crash.

Before anything runs, the replay prints the run directory it writes and the launcher command line
it starts (or that one rank trains in this process).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.cli.launch import RunFailed, RunInterrupted, checked_run, execute, mpi_command
from runner.config.schema import ConfigError, DebugConfig, LauncherConfig, PlanConfig, RunConfig
from runner.records import safe_paths
from runner.records.console import print_error, printable
from runner.records.rundir_files import NotYaml, RunFileError, parse_yaml, read_text
from runner.records.safe_paths import PathRefused
from runner.report.data import read_metrics

EXIT_DIFFERENT, EXIT_BAD_INPUT = 1, 2
DEBUG_KNOBS = ("fail_at_step", "fail_on_rank", "fail_mode", "slow_rank", "slow_seconds")
NOT_FROM_THE_RUN = ("launcher", "hydra", "plan", "trainer.resume")


class Refused(ValueError):
    """A run file the replay will not run from; the message is the one line the user sees."""


def training_losses(run_dir: Path) -> dict[int, float]:
    """Step → training loss from a run's `metrics.jsonl` (a line cut short is skipped);
    `RunFileError` for a file or line beyond the readers' bounds."""
    train, _, _ = read_metrics(run_dir / "metrics.jsonl")
    return {int(r["step"]): float(r["loss"]) for r in train if isinstance(r.get("loss"), float)}


def original_losses(run_dir: Path) -> dict[int, float] | None:
    """The original's training losses, read before anything runs (None: it has no
    metrics.jsonl); `Refused` for a file beyond the bounds, so that a replay never trains
    only to stop at its comparison."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    try:
        return training_losses(run_dir)
    except RunFileError as exc:
        raise Refused(str(exc)) from None


def compare(original: dict[int, float], replay: dict[int, float]) -> str | None:
    """None when the losses of every step both runs logged are identical; otherwise where they
    first differ. Steps only one run logged are not a difference: an interrupted original
    stops early, and one resumed from another directory's checkpoint starts late."""
    common = sorted(set(original) & set(replay))
    if not common:
        return "no step is logged by both runs: nothing to compare"
    for step in common:
        a, b = original[step], replay[step]
        if a != b and not (a != a and b != b):  # NaN == NaN for this purpose
            worst = max(abs(original[s] - replay[s]) for s in common)
            return (f"losses differ from step {step}: {a!r} then, {b!r} now (largest "
                    f"difference {worst:.3g})")
    return None


def uncompared(original: dict[int, float], replay: dict[int, float]) -> str | None:
    """A note on the steps only one of the runs logged."""
    only_original, only_replay = set(original) - set(replay), set(replay) - set(original)
    parts = [f"{len(steps)} step(s) only the {who} logged ({min(steps)}..{max(steps)})"
             for who, steps in (("original", only_original), ("replay", only_replay)) if steps]
    return f"not compared: {'; '.join(parts)}" if parts else None


def _read_yaml(path: Path) -> tuple[str, Any]:
    """A run file's text, and its plain values, nothing resolved; `Refused` when it is beyond
    the readers' bounds, no YAML, or holds a tag or an interpolation (all judged by
    runner/records/rundir_files.py)."""
    try:
        text = read_text(path, errors="strict")
        loaded = parse_yaml(text, path)
    except NotYaml as exc:
        at = f" (line {exc.line})" if exc.line is not None else ""
        raise Refused(f"{path}: cannot be read: {exc.why}{at}") from None
    except RunFileError as exc:
        raise Refused(str(exc)) from None
    except ValueError as exc:  # undecodable
        raise Refused(f"{path}: cannot be read: {str(exc).splitlines()[0]}") from None
    return text, loaded


def read_config(path: Path) -> dict[str, Any]:
    """A run's `config.yaml` as plain values, read as the ranks read it (OmegaConf's YAML) but
    never resolved: `Refused` for a file with an interpolation, or no mapping."""
    text, _ = _read_yaml(path)  # the bounds and the interpolation check, on the text as written
    try:
        loaded = OmegaConf.create(text)  # the text checked, not the file read again
    except Exception as exc:  # OmegaConf's own errors, or a recursion in YAML anchors
        raise Refused(f"{path}: cannot be read: {str(exc).splitlines()[0]}") from None
    if not isinstance(loaded, DictConfig):
        raise Refused(f"{path}: not a mapping of config keys")
    values = OmegaConf.to_container(loaded, resolve=False)
    assert isinstance(values, dict)
    return {str(k): v for k, v in values.items()}


def read_overrides(run_dir: Path) -> list[str] | None:
    """The run's `.hydra/overrides.yaml` as written (None: the run has none); `Refused` for one
    that is not a list of overrides or that holds an interpolation."""
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    loaded = _read_yaml(path)[1] or []
    if not isinstance(loaded, list) or not all(isinstance(o, str) for o in loaded):
        raise Refused(f"{path}: not a list of overrides")
    return loaded


def kept_override(override: str, keep_debug: bool = False) -> bool:
    """Whether the replay's `.hydra/overrides.yaml` repeats `override`: not for the keys the
    replay does not take from the run (`+`, `++` and `~` forms alike)."""
    key = override.split("=", 1)[0].strip().lstrip("+~")
    dropped = [*NOT_FROM_THE_RUN, *([] if keep_debug else [f"debug.{k}" for k in DEBUG_KNOBS])]
    if not keep_debug and key == "debug":  # the whole section at once
        return False
    return not any(key == d or key.startswith((f"{d}.", f"{d}/")) for d in dropped)


def launcher_section(own: Any, command: str | None = None, nproc_flag: str | None = None,
                     trust: bool = False) -> Any:
    """The replay's whole `launcher` section. Trusted: the run's own (a list `command`, as older
    files hold, joined into the schema's string; anything else is the validator's to refuse).
    Otherwise this invocation's: `command` (None: the bundled mpiexec) and `nproc_flag`."""
    if not trust:
        return dataclasses.asdict(LauncherConfig(command=command, nproc_flag=nproc_flag or "-n"))
    if own is None:
        return dataclasses.asdict(LauncherConfig())
    if isinstance(own, dict) and isinstance(own.get("command"), list):
        return {**own, "command": shlex.join(str(word) for word in own["command"])}
    return own


def _unused_launcher(own: Any, used: dict[str, Any]) -> str | None:
    """The run's launcher settings that neither the defaults nor this replay's launcher hold."""
    if own is None:
        return None
    if not isinstance(own, dict):
        return f"launcher={own!r}"
    defaults = dataclasses.asdict(LauncherConfig())
    parts = [f"launcher.{k}={v!r}" for k, v in own.items()
             if (k not in defaults or v != defaults[k]) and v != used.get(k)]
    return " ".join(parts) or None


def replay_config(values: dict[str, Any], *, launcher_command: str | None = None,
                  nproc_flag: str | None = None, trust_launcher: bool = False,
                  keep_debug: bool = False) -> tuple[dict[str, Any], list[str]]:
    """The config the replay runs, from a run's (see the module docstring for what is taken
    from where), and the notes that say what was left out."""
    cfg = copy.deepcopy(values)
    notes: list[str] = []
    if cfg.pop("hydra", None) is not None:
        notes.append("the run's config.yaml has a hydra section (gridrun writes none): dropped")
    if "plan" in cfg:
        cfg["plan"] = dataclasses.asdict(PlanConfig())
    own = cfg.get("launcher")
    used = launcher_section(own, launcher_command, nproc_flag, trust_launcher)
    cfg["launcher"] = used
    unused = None if trust_launcher else _unused_launcher(own, used)
    if unused:
        whose = "--launcher-command's" if launcher_command else "the bundled mpiexec"
        notes.append(f"the run's own launcher is not used ({unused}); this replay runs {whose} "
                     "(--trust-launcher runs the run's own)")
    trainer = cfg.get("trainer")
    if isinstance(trainer, dict) and trainer.get("resume") is not None:
        notes.append(f"the original ran with trainer.resume={trainer['resume']}; the replay "
                     "starts from scratch (a resume from another directory's checkpoint logs no "
                     "early steps: only the steps both runs logged are compared)")
        trainer["resume"] = None
    debug = cfg.get("debug")
    if isinstance(debug, dict) and not keep_debug:
        defaults = DebugConfig()
        changed = [f"debug.{k}={debug[k]!r}" for k in DEBUG_KNOBS
                   if k in debug and debug[k] != getattr(defaults, k)]
        debug.update({k: getattr(defaults, k) for k in DEBUG_KNOBS if k in debug})
        if changed:
            notes.append(f"the run's {' '.join(changed)} not replayed: no rank is made to fail "
                         "or straggle (--keep-debug keeps them)")
    return cfg, notes


def code_pieces(values: dict[str, Any]) -> list[tuple[str, Any]]:
    """(key, name) of every piece of code a run's config names for import: each `_target_`
    and each module of `plugins` (`plugins[i]`)."""
    found: list[tuple[str, Any]] = []

    def visit(value: Any, key: str) -> None:  # the file's nesting is bounded: recursion is safe
        if isinstance(value, dict):
            for name, item in value.items():
                path = f"{key}.{name}" if key else str(name)
                if name == "_target_":
                    found.append((path, item))
                else:
                    visit(item, path)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                visit(item, f"{key}[{index}]")

    visit({k: v for k, v in values.items() if k != "plugins"}, "")
    plugins = values.get("plugins")
    if isinstance(plugins, list):
        found += [(f"plugins[{index}]", module) for index, module in enumerate(plugins)]
    elif plugins:
        found.append(("plugins", plugins))
    return found


def code_named(values: dict[str, Any]) -> list[str]:
    """The code a run's config names, as a refusal names it: each `_target_` by its key, and
    the `plugins` list as written."""
    named = [f"{key}={name}" for key, name in code_pieces(values)
             if not key.startswith("plugins")]
    if values.get("plugins"):
        named.append(f"plugins={values['plugins']}")
    return named


def _untrusted(config_path: Path, values: dict[str, Any], checked: list[str]) -> str:
    """The refusal of a run that names code, when the replay is not told to trust it: the
    code, what was checked without importing it, and what was left unimported."""
    names = ", ".join(str(name) for _, name in code_pieces(values))
    return (f"{config_path} names code to import and call: {', '.join(code_named(values))}; "
            f"checked without importing anything: {', '.join(checked)} (read as data, nothing "
            f"resolved); not imported, so neither validated nor run: {names}; a run directory "
            "may come from anyone: read these, then replay with --trust")


def launch_line(run: RunConfig, run_dir: Path) -> str:
    """What the replay starts: the launcher's command line, or that one rank trains here."""
    if run.grid.size == 1:
        return "none: 1 rank, trained in this process"
    return shlex.join(mpi_command(run.launcher, run.grid.size, run_dir))


def _asynchronous(optimizer: str) -> bool:
    """Whether the optimizer's replicas meet in an order no config fixes."""
    from runner.config.registry import OPTIMIZERS, load_plugins

    load_plugins()
    try:
        return bool(OPTIMIZERS.get(optimizer).asynchronous)
    except Exception:  # an unknown name: the validator has refused it already
        return False


def _holds_a_run(path: Path) -> bool:
    return any((path / name).exists() for name in ("config.yaml", "metrics.jsonl",
                                                     "summary.json"))


def _read_run(run_dir: Path, trust: bool) -> tuple[dict[str, Any], list[str] | None,
                                                     dict[int, float] | None]:
    """The run's config, overrides and training losses, every file read before anything is
    imported or run; `Refused` for a file beyond the bounds, or for a run that names code when
    the replay is not told to trust it. Trusted, each piece of code is named on a line of its
    own before any of it is imported."""
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise Refused(f"{run_dir}: not a run directory (no config.yaml)")
    values = read_config(config_path)
    overrides = read_overrides(run_dir)
    original = original_losses(run_dir)
    code = code_pieces(values)
    if code and not trust:
        checked = ["config.yaml", *([".hydra/overrides.yaml"] if overrides is not None else []),
                   *(["metrics.jsonl"] if original is not None else [])]
        raise Refused(_untrusted(config_path, values, checked))
    for key, name in code:
        print(printable(f"note: importing what the run names (--trust): {key}={name}"),
              file=sys.stderr)
    return values, overrides, original


def _replay_dir(run_dir: Path, new_dir: Path | None) -> Path:
    """Where the replay writes, registered as a run directory root: `new_dir`, or a new
    `replays/<time>/` inside the run, reached from it without following a link; `Refused` for
    a place on a link or one that already holds a run (the original itself, say: its losses
    would be overwritten)."""
    if new_dir is None:
        safe_paths.register_root(run_dir)
        new_dir = run_dir / "replays" / time.strftime("%Y%m%d-%H%M%S")
        refused = safe_paths.refusal_on_the_way(run_dir, new_dir.relative_to(run_dir))
        if refused is not None:
            raise Refused(str(refused))
    safe_paths.register_root(new_dir)
    if _holds_a_run(new_dir):
        raise Refused(f"{new_dir} already holds a run: choose another --run-dir")
    return new_dir


def _announce(run_dir: Path, new_dir: Path, run: RunConfig, notes: list[str]) -> None:
    """The notes on what the replay left out, where it writes and what it starts."""
    for line in notes:
        print(printable(f"note: {line}"), file=sys.stderr)
    print(printable(f"replaying {run_dir} in {new_dir}"))
    print(printable(f"launcher: {launch_line(run, new_dir)}"), flush=True)


def _write_overrides(new_dir: Path, overrides: list[str], keep_debug: bool) -> None:
    """The replay's `.hydra/overrides.yaml`: the overrides a resume command repeats."""
    kept = [o for o in overrides if kept_override(o, keep_debug)]
    safe_paths.replace_file(new_dir, ".hydra/overrides.yaml", yaml.safe_dump(kept).encode(),
                            create_dirs=True)


def _compared(run_dir: Path, new_dir: Path, original: dict[int, float] | None,
              run: RunConfig) -> int:
    """The exit code of a replay that completed, its losses compared with the original's and
    the outcome printed: a difference is expected of an asynchronous optimizer."""
    if original is None:
        print("the original has no metrics.jsonl: nothing to compare")
        return 0
    again = training_losses(new_dir)
    difference = compare(original, again)
    note = uncompared(original, again)
    if note:
        print(note)
    if difference is None:
        common = len(set(original) & set(again))
        print(printable(f"identical: the {common} training losses of {run_dir} repeated "
                        "exactly"))
        return 0
    if _asynchronous(run.optimizer.name):
        print(f"{difference} — expected: asynchronous replicas meet in an order no config fixes")
        return 0
    print_error(difference)
    return EXIT_DIFFERENT


def replay(run_dir: Path, new_dir: Path | None = None, *, launcher_command: str | None = None,
           nproc_flag: str | None = None, trust_launcher: bool = False,
           keep_debug: bool = False, trust: bool = False) -> int:
    """Run `run_dir`'s config again into `new_dir` and compare the losses; the exit code.
    `trust`: import the code the run names (and run its launcher)."""
    try:
        values, overrides, original = _read_run(run_dir, trust)
    except Refused as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    trust_launcher = trust_launcher or (trust and launcher_command is None)
    values, notes = replay_config(values, launcher_command=launcher_command,
                                  nproc_flag=nproc_flag, trust_launcher=trust_launcher,
                                  keep_debug=keep_debug)
    try:
        new_dir = _replay_dir(run_dir, new_dir)
        made = not new_dir.exists()
        cfg = OmegaConf.create(values)
        run = checked_run(cfg, new_dir)
        _announce(run_dir, new_dir, run, notes)
        if overrides is not None:
            _write_overrides(new_dir, overrides, keep_debug)
    except (Refused, ConfigError, PathRefused) as exc:
        print_error(str(exc))
        return EXIT_BAD_INPUT
    try:
        execute(cfg, new_dir, run)
    except ConfigError as exc:
        if made:  # nothing ran: leave nothing behind
            with contextlib.suppress(OSError):
                safe_paths.remove_tree(*safe_paths.locate(new_dir))
        print_error(str(exc))
        return EXIT_BAD_INPUT
    except (RunFailed, RunInterrupted) as exc:
        print_error(f"the replay did not complete: {exc}")
        return EXIT_DIFFERENT
    return _compared(run_dir, new_dir, original, run)


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m runner.replay",
        description="Run a run again from its config.yaml and compare the losses. The launcher "
                    "is this command's, never the run's unless --trust-launcher.")
    parser.add_argument("run_dir", type=Path, help="the run directory to replay")
    parser.add_argument("--run-dir", dest="new_dir", type=Path, default=None,
                        help="where the replay goes (default: RUN_DIR/replays/<time>/)")
    launcher = parser.add_mutually_exclusive_group()
    launcher.add_argument("--launcher-command", metavar="CMD", default=None,
                          help="the launcher of P > 1 ranks, with its own arguments, as "
                               "launcher.command (default: the bundled mpiexec)")
    launcher.add_argument("--trust-launcher", action="store_true",
                          help="run the run's own launcher section (a replay without this flag "
                               "names it)")
    parser.add_argument("--trust", action="store_true",
                        help="import and call the code the run names (_target_, plugins) and, "
                             "unless --launcher-command says otherwise, run its launcher; "
                             "without it such a run is refused, its code named")
    parser.add_argument("--launcher-nproc-flag", metavar="FLAG", default=None,
                        help="with --launcher-command: its flag for the number of ranks "
                             "(default: -n)")
    parser.add_argument("--keep-debug", action="store_true",
                        help="keep the run's debug.fail_* and debug.slow_* (a rank made to "
                             "fail, hang or straggle); reset by default")
    args = parser.parse_args(argv)
    if args.launcher_nproc_flag is not None and args.launcher_command is None:
        parser.error("--launcher-nproc-flag goes with --launcher-command")
    return replay(args.run_dir, args.new_dir, launcher_command=args.launcher_command,
                  nproc_flag=args.launcher_nproc_flag, trust_launcher=args.trust_launcher,
                  keep_debug=args.keep_debug, trust=args.trust)


if __name__ == "__main__":
    sys.exit(main())
