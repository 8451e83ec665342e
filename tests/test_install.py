"""gridrun as an installed tool: the wheel carries the configs, the console scripts answer
`--help`, `--version` and shell completion from any directory, the planner is a Hydra app that
starts no MPI job and leaves nothing behind."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT

BIN = Path(sys.executable).parent
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(),
                    re.MULTILINE)[1]  # type: ignore[index]
# What a build needs from the checkout (the wheel's contents, the readme, the license).
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "conf", "runner", "strategies",
                "hydra_plugins")
# The packages outside the standard library that --help and --version may import.
HELP_IMPORTS = {"runner", "hydra", "omegaconf", "antlr4", "yaml", "packaging"}


def script(name: str) -> str:
    path = BIN / name
    assert path.exists(), f"{path} missing: reinstall (make setup) to get the console scripts"
    return str(path)


def run(*command: str, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def checkout_packages() -> set[str]:
    """Every package of the checkout: a directory with an __init__.py."""
    return {str(p.parent.relative_to(ROOT)) for folder in ("runner", "strategies",
                                                            "hydra_plugins")
            for p in (ROOT / folder).rglob("__init__.py")}


def test_the_wheel_carries_configs_types_scripts_and_the_launcher(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in BUILD_INPUTS:  # built from a copy: the checkout gets no build/ or egg-info
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, source / name)
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                "--no-index", "-w", str(tmp_path / "dist"), ".", cwd=source)
    assert built.returncode == 0, built.stderr
    wheel = next((tmp_path / "dist").glob("gridrun-*.whl"))
    assert wheel.name.startswith(f"gridrun-{VERSION}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"runner/conf/{p.relative_to(ROOT / 'conf')}"
               for p in (ROOT / "conf").rglob("*.yaml")}
    assert {"runner/conf/config.yaml", "runner/conf/plan.yaml",
            "runner/conf/model/mlp.yaml"} <= configs
    assert configs <= names, sorted(configs - names)
    assert not any(n.startswith("conf/") for n in names)
    assert {"runner/py.typed", "strategies/py.typed",
            "hydra_plugins/gridrun_launcher/__init__.py",
            "hydra_plugins/gridrun_launcher/mpi_launcher.py"} <= names
    assert "hydra_plugins/__init__.py" not in names  # a namespace shared with Hydra's plugins
    missing = {p for p in checkout_packages() if f"{p}/__init__.py" not in names}
    assert not missing, f"packages not in the wheel (add them to pyproject.toml): {missing}"
    info = f"gridrun-{VERSION}.dist-info"
    entry_points = zipfile.ZipFile(wheel).read(f"{info}/entry_points.txt").decode()
    assert "gridrun = runner.cli.app:run" in entry_points
    assert "gridrun-plan = runner.plan.__main__:run" in entry_points
    metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: MIT" in metadata and "Typing :: Typed" in metadata
    assert "Requires-Dist: cloudpickle" in metadata
    assert 'extra == "sweep"' in metadata
    assert f"{info}/licenses/LICENSE" in names


def test_the_checkout_reads_its_own_conf() -> None:
    """The editable install maps nothing into the checkout: `runner/conf` exists in a wheel only."""
    from runner.cli.compose import CONF_DIR

    assert not (ROOT / "runner" / "conf").exists()
    assert CONF_DIR == ROOT / "conf"


def test_help_text_lists_groups_options_keys_and_examples() -> None:
    from runner.cli.help import help_text

    text = help_text()
    assert text.startswith("usage: gridrun ")
    lines = text.splitlines()
    for group in ("model", "dataset", "grid", "strategy", "optimizer", "trainer", "launcher",
                  "logger", "experiment"):
        assert any(line.startswith(f"  {group} ") for line in lines), group
    for group_dir in (ROOT / "conf").iterdir():
        for option in group_dir.glob("*.yaml"):
            assert option.stem in text, f"{group_dir.name}={option.stem}"
    assert "mlp*" in text and "grid*" in text and "sgd*" in text  # the defaults marked
    assert "srun" in text and "tensorboard" in text  # ConfigStore groups' options
    assert "model=cnn" in text and "channels=[16, 32]" in text  # an option's keys
    # the engine's keys with type (and the choices or range the schema declares), default and
    # the field's docstring
    assert any(line.split()[:4] == ["trainer.steps", "int>=1", "=", "300"] for line in lines)
    assert "Training steps (global batches)." in text
    assert "trainer.eval_every" in text and "int>=1|null = 100" in text
    assert any(line.split()[:4] == ["trainer.precision", "fp32|bf16|fp16", "=", "fp32"]
               for line in lines)
    assert "float[1..31536000]|null = 300.0" in text  # trainer.comm_timeout_s
    assert "plan.calibrate" not in text  # the planner's keys: gridrun-plan --help
    for example in ("gridrun grid.pc=2", "gridrun -m grid.pr=1,2",
                    "gridrun model._target_=my_pkg.nets.MyNet model.width=64",
                    "gridrun-plan plan.world=16", "--hydra-help"):
        assert example in text


def test_help_and_version_import_neither_torch_nor_mpi() -> None:
    # what --help imports, not how long it takes: a time (even as a ratio to torch's import)
    # moved past any bound on a loaded machine, while the set of imported packages does not
    probe = ("import sys; before = set(sys.modules)\n"
             "from runner.cli.help import help_text, plan_help_text, version_text\n"
             "help_text(); plan_help_text(); text = version_text()\n"
             "names = {m.split('.')[0] for m in set(sys.modules) - before}\n"
             "print(sorted(n for n in names if n not in sys.stdlib_module_names\n"
             "             and not n.startswith(('_cython', 'cython_runtime'))))\n"
             "print(text)")
    result = run(sys.executable, "-c", probe, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    imported, *version = result.stdout.splitlines()
    # Hydra's ConfigStore and the YAML files, nothing heavier: no torch, numpy, mpi4py, strategies
    assert set(ast.literal_eval(imported)) <= HELP_IMPORTS, imported
    assert version[0] == f"gridrun {VERSION}"
    assert "Hydra 1." in version[1] and "torch " in version[1] and "mpi4py " in version[1]


def test_console_script_version_from_any_directory(tmp_path: Path) -> None:
    result = run(script("gridrun"), "--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == f"gridrun {VERSION}"
    result = run(script("gridrun"), "--help", cwd=tmp_path)
    assert result.returncode == 0 and "config groups" in result.stdout
    assert not list(tmp_path.iterdir())


def test_shell_completion_through_the_console_script(tmp_path: Path) -> None:
    line = "gridrun model="
    query = run(script("gridrun"), "-sc", "query=bash", cwd=tmp_path,
                env={"COMP_LINE": line, "COMP_POINT": str(len(line))})
    assert query.returncode == 0, query.stderr
    assert "model=cnn" in query.stdout.split()
    # what a user does: install the completion in bash, then press tab after `model=c`
    shell = ('eval "$(gridrun -sc install=bash)"; COMP_LINE="gridrun model=c"; '
             'COMP_POINT=${#COMP_LINE}; COMP_CWORD=1; hydra_bash_completion; '
             'echo "${COMPREPLY[@]}"')
    bash = shutil.which("bash")
    assert bash is not None
    done = run(bash, "-c", shell, cwd=tmp_path,
               env={"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"model=cnn", "model=cnn_large"}
    plan = run(script("gridrun-plan"), "-sc", "query=bash", cwd=tmp_path,
               env={"COMP_LINE": "gridrun-plan plan.wo", "COMP_POINT": "20"})
    assert plan.stdout.split() == ["plan.world="]
    assert not list(tmp_path.iterdir())


def plan(*args: str, cwd: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return run(sys.executable, "-m", "runner.plan", *args, cwd=cwd,
               env={"GRIDRUN_CALIBRATION": str(tmp_path / "none.json")})


def test_a_plan_leaves_no_run_directory(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = plan("plan.world=2", "plan.alpha=1e-5", "plan.beta=1e-9", cwd=work,
                  tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "plan: 2 ranks" in result.stdout and "← best" in result.stdout
    assert not list(work.iterdir())


def test_plan_multirun_runs_one_plan_per_job_without_mpi(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    # overrides on both sides of -m: Hydra's parser takes one run of them, the planner sorts
    result = plan("plan.alpha=1e-5", "-m", "plan.world=2,4", "plan.beta=1e-9", cwd=work,
                  tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    jobs = [line for line in out.splitlines() if line.startswith("plan job ")]
    assert len(jobs) == 2 and "plan.world=2" in jobs[0] and "plan.world=4" in jobs[1]
    assert out.count("← best") == 2 and "plan: 2 ranks" in out and "plan: 4 ranks" in out
    assert "sweep table" not in out  # gridrun's MPI launcher was not used
    # the sweep's record alone: no run directory per job
    left = sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file())
    assert len(left) == 1 and left[0].endswith("-plan/multirun.yaml"), left
    launcher = plan("--cfg", "hydra", cwd=work, tmp_path=tmp_path)
    assert "BasicLauncher" in launcher.stdout and "MPILauncher" not in launcher.stdout


def test_plan_multirun_bad_input_is_one_line(tmp_path: Path) -> None:
    bad = (["-m", "plan.world=2,abc"], ["-m", "plan.world=2", "model=nope,cnn"],
           ["-m", "plan.world=[2"])
    failing_job = ["-m", "plan.world=0,2", "plan.alpha=1e-5", "plan.beta=1e-9"]
    commands = [*bad, failing_job]
    works = [tmp_path / f"work{i}" for i in range(len(commands))]  # a sweep directory each
    for work in works:
        work.mkdir()
    with ThreadPoolExecutor(len(commands)) as pool:  # the planners side by side
        results = list(pool.map(lambda args, work: plan(*args, cwd=work, tmp_path=tmp_path),
                                commands, works))
    for args, result in zip(bad, results, strict=False):
        assert result.returncode == 2, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    # a job that fails while planning is named; the sweep goes on and exits 2
    result = results[-1]
    assert result.returncode == 2
    assert "error: job 0 (plan.world=0 " in result.stderr and "must be >= 1" in result.stderr
    assert "plan: 2 ranks" in result.stdout


def test_plan_help_and_config(tmp_path: Path) -> None:
    result = plan("--help", cwd=tmp_path, tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: gridrun-plan")
    for key in ("plan.world", "plan.calibrate", "plan.alpha", "plan.layers", "plan.out"):
        assert key in result.stdout
    assert str(tmp_path / "none.json") in result.stdout  # where the calibration is read
    job = plan("--cfg", "job", "plan.world=12", cwd=tmp_path, tmp_path=tmp_path)
    assert job.returncode == 0 and "world: 12" in job.stdout and "model:" in job.stdout
    assert not list(tmp_path.iterdir())


# -- `make setup` on a CPU machine and on a GPU machine --------------------------------------------

def setup_commands(python: str, tmp_path: Path) -> list[str]:
    """What `make setup` would run to make a new .venv with `python` (make -n: nothing run)."""
    made = run("make", "-n", "-s", "setup", f"PYTHON={python}", f"VENV={tmp_path / 'venv'}",
               cwd=ROOT)
    assert made.returncode == 0, made.stderr
    return made.stdout.splitlines()


def test_setup_on_a_cpu_machine_pins_the_cpu_wheel(tmp_path: Path) -> None:
    """The commands of a machine whose Python's torch sees no GPU: exactly the CPU set-up."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this Python's torch sees a GPU: the GPU set-up applies")
    venv = tmp_path / "venv"
    assert setup_commands(sys.executable, tmp_path) == [
        f"{sys.executable} -m venv {venv}",
        f"{venv}/bin/python -m pip install --quiet --upgrade pip",
        f'{venv}/bin/python -m pip install --quiet "torch==2.13.0"',
        f"{venv}/bin/python -m pip install --quiet --config-settings editable_mode=compat "
        f'-e ".[bundled-mpi,dev,text,data,tensorboard,sweep,transformers]"',
        f"touch {venv}/.installed"]


def test_setup_on_a_gpu_machine_keeps_its_cuda_torch(tmp_path: Path) -> None:
    """A Python whose torch sees a GPU (faked: it answers the Makefile's question with 1): the
    venv sees its packages, and the CPU wheel is not installed over a torch that sees a GPU."""
    fake = tmp_path / "python-with-cuda-torch"
    fake.write_text("#!/bin/sh\necho 1\n")
    fake.chmod(0o755)
    venv = tmp_path / "venv"
    commands = setup_commands(str(fake), tmp_path)
    assert commands[0] == f"{fake} -m venv --system-site-packages {venv}"
    # the CPU wheel only where .venv does not see a CUDA torch after all
    assert commands[2] == (f'{venv}/bin/python -c "import torch; assert '
                           f'torch.cuda.is_available()" 2>/dev/null || {venv}/bin/python -m pip '
                           f'install --quiet "torch==2.13.0"')
    assert commands[3].endswith('-e ".[bundled-mpi,dev,text,data,tensorboard,sweep,transformers]"')
