"""A user's own model, data and plugins (examples/byo): trained with real ranks from the user's
project directory, and refused in one line before anything starts when they do not fit."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.cli.compose import compose
from runner.cli.validation import validate
from runner.config.schema import ConfigError
from tests.conftest import read_summary, train_losses

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ROOT / "examples" / "byo"  # the user's project: their package and config files
TIMEOUT_S = 180


def gridrun(*args: str, cwd: Path = PROJECT) -> subprocess.CompletedProcess[str]:
    """`python -m runner ARGS` run from the user's project directory, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": ""})


def ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


SMALL = ("trainer.steps=12", "trainer.batch_size=32", "trainer.eval_every=null",
         "trainer.dtype=float64")


def test_user_model_and_tensors_train_the_same_on_one_and_two_ranks(tmp_path: Path) -> None:
    """`model._target_` and `dataset._target_` (tensors) under `data`: two ranks reproduce one
    process; the run returns its objective (summary.json)."""
    user = ("model._target_=my_pkg.nets.ResidualMLP", "model.width=16",
            "dataset._target_=my_pkg.data.blobs", "dataset.features=8", "strategy=data",
            *SMALL)
    one, two = tmp_path / "p1", tmp_path / "p2"
    ok(gridrun(*user, "grid.pr=1", "grid.pc=1", f"hydra.run.dir={one}"))
    ok(gridrun(*user, "grid.pr=1", "grid.pc=2", f"hydra.run.dir={two}"))
    assert train_losses(one) == pytest.approx(train_losses(two), rel=1e-9, abs=1e-12)
    assert train_losses(one)[-1] < train_losses(one)[0]
    objective = read_summary(two)["objective"]
    assert objective["name"] == "val_loss" and objective["direction"] == "minimize"
    assert objective["value"] == read_summary(two)["val_loss"]


def test_registered_plugin_and_map_style_dataset_on_two_ranks(tmp_path: Path) -> None:
    """A model registered in the user's module (`plugins`) is known on every rank, and each
    rank reads only the rows of a map-style dataset that it needs."""
    logs = tmp_path / "reads"
    logs.mkdir()
    steps, batch = 6, 32
    ok(gridrun("--config-dir", "conf", "plugins=[my_pkg.register]", "model=wide_mlp",
               "model.width=8",
               "dataset._target_=my_pkg.data.rows", f"dataset.log_dir={logs}",
               "strategy=data", "grid.pr=1", "grid.pc=2", f"trainer.steps={steps}",
               f"trainer.batch_size={batch}", "trainer.eval_every=null",
               f"hydra.run.dir={tmp_path / 'run'}"))
    reads = {path.stem: collections.Counter(line.split()[0] for line in path.open())
             for path in logs.glob("*.log")}
    ranks = {name: counts for name, counts in reads.items() if name in ("0", "1")}
    assert set(ranks) == {"0", "1"}, reads
    val_rows = 512 - 512 * 3 // 4
    for counts in ranks.values():
        # its half of every batch, its half of the validation set, and row 0 for the shapes
        assert steps * batch // 2 <= counts["train"] <= steps * batch // 2 + 2, reads
        assert counts["val"] == val_rows // 2, reads


def test_a_config_dir_of_the_users_own(tmp_path: Path) -> None:
    ok(gridrun("--config-dir", "conf", "model=resmlp", "dataset=blobs", "model.width=8",
               "strategy=data", "grid.pr=1", "grid.pc=1", "trainer.steps=5",
               f"hydra.run.dir={tmp_path / 'run'}"))
    assert read_summary(tmp_path / "run")["status"] == "completed"


@pytest.mark.parametrize("args,message", [
    (["model._target_=no_such_pkg.Net"],
     "model._target_=no_such_pkg.Net: cannot import no_such_pkg"),
    (["--config-dir", "conf", "model=resmlp", "dataset=blobs", "dataset.features=abc"],
     "dataset.features=abc: must be an integer"),
])
def test_bad_user_code_is_one_line_before_anything_starts(tmp_path: Path, args: list[str],
                                                          message: str) -> None:
    run_dir = tmp_path / "run"
    result = gridrun(*args, "strategy=data", "grid.pr=1", "grid.pc=2", f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
    assert not run_dir.exists()


@pytest.fixture
def users_project(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(PROJECT))


def problems_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(compose(["grid.pr=1", "grid.pc=2", "strategy=data", *overrides]))
    return str(caught.value)


@pytest.mark.usefixtures("users_project")
@pytest.mark.parametrize("overrides,message", [
    (["model._target_=my_pkg.nets.Nothing"], "my_pkg.nets has no attribute or module 'Nothing'"),
    (["model._target_=my_pkg.data.Rows"],
     "model._target_=my_pkg.data.Rows: missing required option(s) model.x, model.y"),
    (["model._target_=my_pkg.data.blobs"], "returned a tuple, not a torch.nn.Module"),
    (["model._target_=my_pkg.nets.ResidualMLP", "model.depth=2"],
     "model._target_=my_pkg.nets.ResidualMLP: unknown option(s) model.depth; valid: width"),
    (["model._target_=torch.nn.Linear", "model.in_features=3", "model.out_features=10"],
     "does not fit the dataset's inputs of shape (1, 8, 8)"),
    (["dataset._target_=my_pkg.data.blobs", "dataset.classes=4",
      "model._target_=torch.nn.Linear", "model.in_features=16", "model.out_features=10"],
     "gives outputs of shape (10,), the dataset has 4 classes"),
    (["dataset._target_=my_pkg.nets.ResidualMLP"],
     "dataset._target_=my_pkg.nets.ResidualMLP: missing required option(s)"),
    # model and grid split its module tree (strategies/layers/tree.py); domain needs images
    (["model._target_=my_pkg.nets.ResidualMLP", "strategy=domain", "grid.pr=2", "grid.pc=1"],
     "strategy=domain splits images in height: ResidualMLP must start with convolutions or "
     "pooling"),
    (["optimizer._target_=torch.optim.Adafactor", "strategy=grid", "grid.pr=2", "grid.pc=1"],
     "optimizer._target_=torch.optim.Adafactor: its update of a parameter depends on the whole "
     "parameter, which strategy=grid splits"),
    (["optimizer._target_=torch.nn.Linear"], "neither a torch.optim.Optimizer class nor"),
    (["plugins=[my_pkg.nowhere]"], "plugins: cannot import my_pkg.nowhere"),
    (["objective=accuracy"], "objective=accuracy: must be one of val_loss, val_accuracy"),
])
def test_what_does_not_fit_is_named(overrides: list[str], message: str) -> None:
    assert message in problems_of(*overrides)


@pytest.mark.usefixtures("users_project")
def test_what_fits_passes() -> None:
    validate(compose(["grid.pr=1", "grid.pc=2", "strategy=data", "plugins=[my_pkg.register]",
                      "model=wide_mlp", "dataset._target_=my_pkg.data.rows",
                      "optimizer._target_=torch.optim.Adafactor"],
                     extra_dirs=[str(PROJECT / "conf")]))


# the README's line: a transformer of the user's own split by a plan given on the command line
PLANNED_LM = ["model._target_=my_pkg.nets.TinyLM", "dataset=tokens", "strategy=grid",
              "grid.pr=2", "grid.pc=2",
              "strategy.plan={blocks.*.attn.qkv: fused_qkv, blocks.*.attn.out: rowwise, "
              "blocks.*.fc1: colwise, blocks.*.fc2: rowwise, head: vocab}"]


@pytest.mark.usefixtures("users_project")
def test_the_readmes_planned_language_model_passes_and_a_wrong_plan_is_named() -> None:
    validate(compose(PLANNED_LM))
    with pytest.raises(ConfigError) as caught:
        validate(compose([*PLANNED_LM[:-1], "strategy.plan={blocks.*.fc2: rowwise}"]))
    assert ("blocks.0.fc2 (Linear) is rowwise but no colwise module before it splits its input "
            "features") in str(caught.value)


def test_an_optuna_search_over_gridrun_runs(tmp_path: Path) -> None:
    """Hydra's Optuna sweeper (the `sweep` extra) drives gridrun: every trial returns its
    run's objective, the best value is the best run's, and the sweep table keeps every trial
    (Optuna launches one batch per trial)."""
    import csv

    import yaml

    sweep = tmp_path / "sweep"
    ok(gridrun("-m", "experiment=tune_lr", "hydra.sweeper.n_trials=2", "trainer.steps=5",
               f"hydra.sweep.dir={sweep}", cwd=ROOT))
    objectives = [read_summary(run)["objective"]["value"] for run in sorted(sweep.glob("[0-9]"))]
    assert len(objectives) == 2
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == min(objectives)
    with (sweep / "sweep_summary.csv").open() as table:
        assert [row["job"] for row in csv.DictReader(table)] == ["0", "1"]


def test_the_target_option_without_a_target_says_what_it_needs() -> None:
    assert problems_of("model=target") == ("model._target_: missing (model=target takes your own "
                                           "class or function: "
                                           "model._target_=my_pkg.module.Name)")


# -- a user's data, checked in the head ------------------------------------------------------

class MapRows:
    """A map-style dataset over tensors, its rows optionally replaced."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int,
                 odd: dict[int, tuple[object, object] | Exception] | None = None,
                 length: int | None = None) -> None:
        self.x, self.y, self.num_classes, self.odd = x, y, num_classes, odd or {}
        self.length = len(x) if length is None else length  # a length may overstate the rows

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[object, object]:
        row = self.odd.get(index, (self.x[index], self.y[index]))
        if isinstance(row, Exception):  # a row that cannot be read (a missing record)
            raise row
        return row


def pairs(rows: int = 40, features: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(rows, features, generator=generator),
            torch.randint(0, 3, (rows,), generator=generator))


BAD_DATA = {
    "val features differ": (lambda: (pairs(), pairs(8, 5)),
                            "the val set has inputs of shape (5,), the training set's are (4,)"),
    "a label below 0": (lambda: ((pairs()[0], pairs()[1] - 1), pairs(8)),
                        "the train set's row 5: target -1 is outside [0, 3) classes"),
    "an empty validation split": (lambda: (pairs(), pairs(0)), "the val set is empty"),
    "nan in the inputs": (lambda: ((pairs()[0].index_fill(0, torch.tensor([3]), float("nan")),
                                    pairs()[1]), pairs(8)),
                          "the train set's row 3: input value nan is not finite"),
    "a map-style label past the classes": (
        lambda: (MapRows(*pairs(), num_classes=3, odd={39: (pairs()[0][0], 7)}),
                 MapRows(*pairs(8), num_classes=3)),
        "the train set's row 39: target 7 is outside [0, 3) classes (read in the head: rows "
        "0..39, 16 of 40)"),
    "a map-style row of another shape": (
        lambda: (MapRows(*pairs(), num_classes=3), MapRows(*pairs(8), num_classes=3,
                                                           odd={7: (pairs(1, 6)[0][0], 1)})),
        "the val set's row 7 has inputs of shape (6,), the training set's are (4,)"),
    "a label of 10^9 (no class index)": (
        lambda: ((pairs()[0], pairs()[1].index_fill(0, torch.tensor([5]), 10 ** 9)), pairs(8)),
        "the labels reach 1000000000 but take only 4 values"),
    "an infinity in the val inputs": (
        lambda: (pairs(), (pairs(8)[0].index_fill(0, torch.tensor([1]), float("inf")),
                           pairs(8)[1])),
        "the val set's row 1: input value inf is not finite"),
    "an empty training split": (lambda: (pairs(0), pairs(8)), "the train set is empty"),
    "a map-style dataset silent on its classes": (
        lambda: (SilentRows(*pairs()), SilentRows(*pairs(8))),
        "the training Dataset says nothing of its classes"),
    "a map-style val label past the classes": (
        lambda: (MapRows(*pairs(), num_classes=3),
                 MapRows(*pairs(8), num_classes=3, odd={0: (pairs()[0][0], 3)})),
        "the val set's row 0: target 3 is outside [0, 3) classes"),
    "bool targets": (lambda: ((pairs()[0], pairs()[1] > 0), pairs(8)),
                     "the train targets must be class indices (integers, one per row), got "
                     "torch.bool"),
    "float targets": (lambda: ((pairs()[0], pairs()[1].double()), pairs(8)),
                      "the train targets must be class indices (integers, one per row), got "
                      "torch.float64"),
    "complex features": (lambda: ((pairs()[0].to(torch.complex64), pairs()[1]), pairs(8)),
                         "the train set's row 0: input (-1.1258398294448853+0j) is a "
                         "torch.complex64: inputs are real numbers"),
    "a map-style bool target": (
        lambda: (MapRows(*pairs(), num_classes=3, odd={3: (pairs()[0][3], torch.tensor(True))}),
                 MapRows(*pairs(8), num_classes=3)),
        "the train set's row 3: target True is a torch.bool, not a class index (an integer)"),
    "map-style complex features": (
        lambda: (MapRows(pairs()[0].to(torch.complex64), pairs()[1], num_classes=3),
                 MapRows(*pairs(8), num_classes=3)),
        "the train set's row 0: input (-1.1258398294448853+0j) is a torch.complex64"),
    "a map-style row of text": (
        lambda: (MapRows(*pairs(), num_classes=3, odd={3: ("abc", 1)}),
                 MapRows(*pairs(8), num_classes=3)),
        "the train set's row 3: its input is a str, not a tensor or a number"),
    "a map-style length past its rows": (
        lambda: (MapRows(*pairs(), num_classes=3, length=41), MapRows(*pairs(8), num_classes=3)),
        "the train set's row 40 cannot be read (IndexError: index 40 is out of bounds for "
        "dimension 0 with size 40): its __len__ says 41 rows"),
}


class SilentRows(MapRows):
    """A map-style dataset that declares no classes."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        super().__init__(x, y, 0)
        del self.num_classes


@pytest.mark.parametrize("case", BAD_DATA)
def test_a_users_data_is_checked_in_the_head(case: str) -> None:
    from runner.zoo.userdata import TargetDataset, UserDatasetError

    made, message = BAD_DATA[case]
    with pytest.raises(UserDatasetError) as refused:
        TargetDataset(made, "my.data").check()
    assert str(refused.value).startswith(message), str(refused.value)


def test_good_data_passes_the_heads_check() -> None:
    from runner.zoo.userdata import TargetDataset

    TargetDataset(lambda: (pairs(), pairs(8)), "my.data").check()
    TargetDataset(lambda: (MapRows(*pairs(), num_classes=3),
                           MapRows(*pairs(8), num_classes=3)), "my.data").check()


def test_bad_data_is_one_line_of_validation() -> None:
    cfg = compose(["dataset._target_=tests.test_user_code.data_with_a_negative_label",
                   "model=mlp", "strategy=data", "grid.pr=1", "grid.pc=1"])
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    assert refused.value.problems == [
        "dataset._target_=tests.test_user_code.data_with_a_negative_label: the train set's "
        "row 5: target -1 is outside [0, 3) classes"]


def data_with_a_negative_label() -> tuple[object, object]:
    x, y = pairs()
    return (x, y - 1), pairs(8)


# -- a user's bad row, met on a rank ---------------------------------------------------------

BAD_ROW = 200  # not among the rows the head reads of 400 (`sampled_rows`)
BAD_ROWS = {"target": (None, 10), "bool target": (None, torch.tensor(True)),
            "complex input": (torch.full((8,), 1 + 2j), None),
            "nan input": (torch.tensor([0.0] * 7 + [float("nan")]), None)}


def rows_with(kind: str = "none", rows: int = 400,
              length: int | None = None) -> tuple[object, object]:
    """A map-style dataset of `rows` rows of 8 features and 10 classes whose row `BAD_ROW`
    holds `BAD_ROWS[kind]` in place of its input or its target (None: its own), and whose
    `__len__` says `length` (None: `rows`)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=generator)
    y = torch.randint(0, 10, (rows,), generator=generator)
    odd: dict[int, tuple[object, object] | Exception] = {}
    if kind == "missing row":
        odd[BAD_ROW] = IndexError(f"record {BAD_ROW} is missing")
    if kind in BAD_ROWS:
        bad_x, bad_y = BAD_ROWS[kind]
        odd[BAD_ROW] = (x[BAD_ROW] if bad_x is None else bad_x,
                        y[BAD_ROW] if bad_y is None else bad_y)
    return MapRows(x, y, 10, odd, length), MapRows(x[:64], y[:64], 10)


def frozen_mlp(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A model whose every parameter is frozen: nothing to train."""
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(math.prod(input_shape),
                                                                    num_classes))
    model.requires_grad_(False)
    return model


def exits_at_build(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A model function that ends its process: on the head, while it checks the config."""
    sys.exit(5)


def exits_in_forward(input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """A model whose forward ends its process (`raise SystemExit`): the head runs it on two
    samples to check it fits the data."""
    class Quits(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise SystemExit(3)

    return Quits()


BAD_ROW_LINES = {
    "target": "the train set's row 200: target 10 is outside [0, 10) classes",
    "bool target": "the train set's row 200: target True is a torch.bool, not a class index",
    "complex input": "the train set's row 200: input (1+2j) is a torch.complex64",
    "nan input": "the train set's row 200: input value nan is not finite",
    "missing row": "the train set's row 200 cannot be read (IndexError: record 200 is missing): "
                   "its __len__ says 400 rows",
}


@pytest.fixture(scope="module")
def bad_row_runs(tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, tuple[subprocess.CompletedProcess[str], Path, float]]:
    """One 2-rank run per kind of bad row, all at once: row 200 of 400 is read by one rank
    in the first two steps (batches of 200), never by the head (`sampled_rows`)."""
    import time

    from tests.conftest import run_cli_together

    root = tmp_path_factory.mktemp("bad_rows")
    kinds = list(BAD_ROW_LINES)
    started = time.monotonic()
    results = run_cli_together(*[
        ["dataset._target_=tests.test_user_code.rows_with", f"dataset.kind={kind}",
         "strategy=data", "grid.pr=1", "grid.pc=2", "trainer.steps=4",
         "trainer.batch_size=200", "trainer.eval_every=null",
         f"hydra.run.dir={root / kind.replace(' ', '_')}"] for kind in kinds])
    elapsed = time.monotonic() - started
    return {kind: (result, root / kind.replace(" ", "_"), elapsed)
            for kind, result in zip(kinds, results, strict=True)}


@pytest.mark.parametrize("kind", BAD_ROW_LINES)
def test_a_bad_row_met_on_a_rank_ends_the_job_in_one_line_naming_it(
        kind: str, bad_row_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path,
                                                 float]]) -> None:
    result, run_dir, elapsed = bad_row_runs[kind]
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the 2-rank job failed on rank") and BAD_ROW_LINES[kind] in last
    assert BAD_ROW_LINES[kind] in read_summary(run_dir)["error"]
    assert elapsed < 120, f"the jobs took {elapsed:.0f} s to end"


@pytest.mark.parametrize("kind", BAD_ROW_LINES)
def test_a_bad_row_met_on_a_rank_prints_no_traceback(
        kind: str, bad_row_runs: dict[str, tuple[subprocess.CompletedProcess[str], Path,
                                                 float]]) -> None:
    result, _, _ = bad_row_runs[kind]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("args,message", [
    (["dataset._target_=tests.test_user_code.rows_with", "dataset.length=401"],
     "the train set's row 400 cannot be read (IndexError: index 400 is out of bounds for "
     "dimension 0 with size 400): its __len__ says 401 rows"),
    (["model._target_=tests.test_user_code.frozen_mlp"],
     "Sequential has no trainable parameters (every one has requires_grad=False)"),
    (["optimizer._target_=torch.optim.SparseAdam"],
     "optimizer._target_=torch.optim.SparseAdam takes only row-sparse gradients"),
    (["model._target_=tests.test_user_code.exits_at_build"],
     "model._target_=tests.test_user_code.exits_at_build: the user's code exited with code 5 "
     "(sys.exit in the user's code at tests/test_user_code.py:"),
    (["model._target_=tests.test_user_code.exits_in_forward"],
     "the user's code exited with code 3 (raise SystemExit in the user's code at "
     "tests/test_user_code.py:"),
])
def test_what_every_rank_would_fail_on_is_refused_by_the_head(
        args: list[str], message: str, tmp_path: Path) -> None:
    """Exit 2, one line naming it, no run directory: no rank was started."""
    from tests.conftest import run_cli

    run_dir = tmp_path / "run"
    result = run_cli(*args, "strategy=data", "grid.pr=1", "grid.pc=2",
                     f"hydra.run.dir={run_dir}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not run_dir.exists()
