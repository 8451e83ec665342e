"""Bad input: one clear line on stderr, exit code 2, no traceback, no run directory, no MPI job."""

from __future__ import annotations

import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import run_cli

CASES = {
    "zero_ranks": (["grid.pc=0"], ["grid.pc=0: must be >= 1"]),
    "data_with_model_split": (["strategy=data", "grid.pr=3"], ["strategy=data",
                                                                "needs grid.pr=1"]),
    "model_with_batch_split": (["strategy=model", "grid.pr=2", "grid.pc=2"],
                               ["strategy=model", "needs grid.pc=1"]),
    "batch_not_divisible": (["strategy=data", "grid.pr=1", "grid.pc=4", "trainer.batch_size=30"],
                            ["trainer.batch_size=30", "not divisible by the 4"]),
    "data_batch_below_ranks": (["strategy=data", "grid.pr=1", "grid.pc=4",
                                "trainer.batch_size=2"], ["smaller than the 4 ranks",
                                                          "strategy=domain"]),
    "domain_slab_without_rows": (["strategy=domain", "model=cnn", "grid.pr=4", "grid.pc=1"],
                                 ["grid.pr=4", "outputs height 2", "every rank needs a row"]),
    "domain_needs_images": (["strategy=domain", "model=mlp"], ["strategy=domain",
                                                               "convolutions or pooling"]),
    "batch_smaller_than_ranks": (["strategy=data", "grid.pr=1", "grid.pc=8",
                                  "trainer.batch_size=4"], ["smaller than the 8 ranks"]),
    "unknown_model": (["model=transformer9"], ["unknown model 'transformer9'",
                                              "cnn, cnn_large, gpt"]),
    "unknown_strategy": (["strategy=pipeline"], ["unknown strategy 'pipeline'", "data"]),
    "unknown_dataset": (["dataset=imagenet"], ["unknown dataset 'imagenet'", "digits"]),
    "unknown_optimizer": (["optimizer=lamb"], ["unknown optimizer 'lamb'", "sgd"]),
    "missing_value": (["trainer.steps=???"], ["missing required value: trainer.steps"]),
    "unknown_option": (["+model.depth=3"], ["model.depth", "valid: activation, hidden"]),
    "model_does_not_fit_data": (["model=cnn", "dataset=synthetic"], ["model=cnn", "(64,)"]),
    "easgd_negative_rho_and_period_below_one": (
        ["optimizer=async_easgd", "optimizer.rho=-0.5", "optimizer.period=0"],
        ["optimizer.rho", "must be > 0, got -0.5", "optimizer.period", ">= 1, got 0"]),
    "measgd_momentum_one": (["optimizer=async_measgd", "optimizer.momentum=1.0"],
                            ["optimizer.momentum must be in [0, 1), got 1.0"]),
    "easgd_rho_and_moving_rate": (["optimizer=hogwild_easgd", "optimizer.rho=1",
                                   "optimizer.moving_rate=0.1"], ["not both"]),
    "slow_rank_outside_job": (["debug.slow_rank=9", "debug.slow_seconds=0.1"],
                              ["debug.slow_rank=9 is not a rank of a 4-rank job"]),
    "unknown_sparse_mode": (["model=bag_classifier", "dataset=tokens", "strategy=data",
                             "grid.pr=1", "grid.pc=4", "strategy.sparse=compressed"],
                            ["strategy.sparse=compressed", "auto, dense, allgather, sharded"]),
    "embedding_model_on_images": (["model=bag_classifier", "dataset=digits"],
                                  ["model=bag_classifier", "dataset=tokens"]),
    "image_model_on_tokens": (["model=mlp", "dataset=tokens"],
                              ["model=mlp", "model=bag_classifier"]),
    "embedding_table_under_grid": (["model=bag_classifier", "dataset=tokens", "strategy=grid"],
                                   ["strategy=grid", "EmbeddingBag", "strategy=data"]),
    "resume_from_nothing": (["trainer.resume=/no/such/checkpoint"],
                            ["trainer.resume=/no/such/checkpoint", "no complete checkpoint"]),
    "checkpointing_matches_nothing": (["trainer.activation_checkpointing=nosuch.*"],
                                      ["trainer.activation_checkpointing=nosuch.*",
                                       "matches no module"]),
    "bad_watchdog_timeout": (["trainer.comm_timeout_s=-1"], ["trainer.comm_timeout_s=-1"]),
    "bad_failure_mode": (["debug.fail_mode=explode"], ["debug.fail_mode=explode"]),
    "every_problem_named": (["grid.pc=0", "optimizer.momentum=1.5", "trainer.steps=0"],
                            ["grid.pc=0", "optimizer.momentum", "trainer.steps=0"]),
    # the schema: wrong types and unknown keys, in the engine's sections and in a plugin's options
    # (typed by its signature), every one named
    "wrong_types_and_added_key": (["optimizer.lr=abc", "+trainer.foo=1", "model.hidden=[a]"],
                                  ["optimizer.lr=abc: must be a number", "trainer.foo",
                                   "model.hidden=[a]: must be a list of integers"]),
    "steps_not_an_integer": (["trainer.steps=1.5"], ["trainer.steps=1.5: must be an integer"]),
    "misspelt_key": (["trainer.stepz=5"], ["trainer.stepz: unknown key",
                                           "did you mean trainer.steps?"]),
    # once a traceback, a torch warning above the line, an accepted NaN and seed
    "unresolved_interpolation": (["trainer.steps=${nothere}"], ["trainer.steps",
                                                                 "nothere"]),
    "zero_channels": (["model=cnn", "model.channels=[0]"], ["model=cnn", "channels=[0]"]),
    "nan_learning_rate": (["optimizer.lr=nan", "seed=99999999999999999999"],
                          ["optimizer.lr=nan: must be a finite number", "seed="]),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bad")
    recorder = tmp / "fake_mpiexec"  # proves no MPI job was started: it leaves a mark if run
    recorder.write_text(f"#!/bin/sh\ntouch {tmp}/mpi_job_started\n")
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)

    def run(name: str) -> tuple[str, subprocess.CompletedProcess[str], Path]:
        args, _ = CASES[name]
        run_dir = tmp / name
        return name, run_cli(*args, f"launcher.command={recorder}",
                             f"hydra.run.dir={run_dir}", timeout=120), run_dir

    with ThreadPoolExecutor(max_workers=2) as pool:
        found = {name: (result, run_dir) for name, result, run_dir in pool.map(run, THROUGH_CLI)}
    return {"cases": found, "marker": tmp / "mpi_job_started"}


# Through the real command line (a process each, ~2 s): a sample of every kind of problem; the
# others through the head's own check in this process (`precheck`, what the command runs first).
THROUGH_CLI = ("zero_ranks", "unknown_model", "every_problem_named", "wrong_types_and_added_key",
               "unresolved_interpolation", "nan_learning_rate", "model_does_not_fit_data",
               "resume_from_nothing", "embedding_table_under_grid")


@pytest.mark.parametrize("name", sorted(set(CASES) - set(THROUGH_CLI)))
def test_bad_input_is_one_line_in_the_heads_check(name: str, tmp_path: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    from runner.cli.app import precheck
    from runner.records.rundir import release_run_dirs

    args, expected = CASES[name]
    run_dir = tmp_path / "run"
    try:
        problem = precheck([*args, f"hydra.run.dir={run_dir}"])
    finally:
        release_run_dirs()
    assert problem is not None and "\n" not in problem, problem
    for fragment in expected:
        assert fragment in problem, (fragment, problem)
    assert not run_dir.exists(), "a refused config must not leave a run directory"
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == "", printed


@pytest.mark.parametrize("name", THROUGH_CLI)
def test_bad_input_is_one_line_and_exit_2(results: dict, name: str) -> None:
    result, run_dir = results["cases"][name]
    _, expected = CASES[name]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for fragment in expected:
        assert fragment in lines[0], (fragment, lines[0])
    assert not run_dir.exists(), "a refused config must not leave a run directory"
    assert not results["marker"].exists(), "an MPI job was started for a bad config"
