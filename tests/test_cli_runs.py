"""End to end through the real command line, with real MPI ranks.

Each launch costs interpreter and torch start-up on every rank, so runs are made once (cached
per session) and several tests read the same run directory.
"""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import (
    RunCache,
    assert_ok,
    read_metrics,
    read_summary,
    run_cli,
    run_cli_together,
    train_losses,
)

STEPS = 50
COMMON = [f"trainer.steps={STEPS}", "trainer.eval_every=25", "seed=1"]
DATA = ["strategy=data", "grid.pr=1"]
BATCH2 = ["trainer.batch_size=2", "trainer.dtype=float64", "optimizer.lr=0.02"]
TOKENS = ["model=bag_classifier", "dataset=tokens", "optimizer.lr=0.5"]
RUNS: dict[str, tuple[list[str], int | None]] = {
    # name: (overrides, ranks of a user-started mpiexec, or None for the runner's own launch)
    "mlp_p1": ([*DATA, "grid.pc=1"], None),
    "mlp_p1_again": ([*DATA, "grid.pc=1"], None),
    "grid_default_2x2": ([], None),  # the default strategy and grid
    # Through launcher.command (a wrapper that records its arguments, then runs the bundled
    # mpiexec): the site-launcher path a cluster user takes.
    "mlp_p2": ([*DATA, "grid.pc=2", "launcher.command=tests/recording_mpiexec.sh",
                "launcher.args=[-genv,GRIDRUN_TEST_MARK,1]"], None),
    "mlp_p4": ([*DATA, "grid.pc=4"], None),
    "mlp_p4_again": ([*DATA, "grid.pc=4"], None),
    "mlp_p4_isolated": ([*DATA, "grid.pc=4", "debug.isolate_comm=true"], None),
    "cnn_p1": ([*DATA, "model=cnn", "grid.pc=1"], None),
    "cnn_p2_user_mpiexec": ([*DATA, "model=cnn", "grid.pc=2"], 2),
    # A global batch of 2 on 4 ranks: only domain parallelism can (float64: see check_domain.py)
    "cnn_batch2_p1": (["model=cnn", "grid.pr=1", "grid.pc=1", *BATCH2], None),
    "cnn_batch2_domain_2x2": (["model=cnn", "strategy=domain", "grid.pr=2", "grid.pc=2",
                               *BATCH2], None),
    "tokens_p1": ([*DATA, "grid.pc=1", *TOKENS], None),
    "tokens_p4_auto": ([*DATA, "grid.pc=4", *TOKENS, "strategy.sparse=auto"], None),
    # comm.backend=torch: torch.distributed (gloo) process groups over the same grid
    "grid_default_2x2_torch": (["comm.backend=torch"], None),
    "auto_2x2_torch": (["strategy=auto", "comm.backend=torch"], None),
    "cnn_batch2_domain_2x2_torch": (["model=cnn", "strategy=domain", "grid.pr=2", "grid.pc=2",
                                     *BATCH2, "comm.backend=torch"], None),
    "tokens_p4_auto_torch": ([*DATA, "grid.pc=4", *TOKENS, "strategy.sparse=auto",
                              "comm.backend=torch"], None),
    # The path GPU tensors take through an MPI without CUDA support, on host tensors
    "grid_default_2x2_staged": (["debug.stage_host_tensors=true"], None),
    # Mixed precision: bf16 activations between the model group's ranks (MPI sums them in
    # float32); fp16 with loss scaling through gloo
    "grid_2x1_bf16": (["grid.pr=2", "grid.pc=1", "trainer.precision=bf16"], None),
    "mlp_p2_fp16_torch": ([*DATA, "grid.pc=2", "trainer.precision=fp16",
                           "comm.backend=torch"], None),
}


Runs = RunCache


@pytest.fixture(scope="session")
def runs(session_tmp: Path) -> Runs:
    return RunCache(session_tmp, RUNS, COMMON)


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert a and len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["mlp_p2", "mlp_p4", "grid_default_2x2"])
def test_parallel_runs_reproduce_single_process_losses(runs: Runs, name: str) -> None:
    losses = train_losses(runs(name))
    assert len(losses) == STEPS
    assert _relative_gap(train_losses(runs("mlp_p1")), losses) <= 1e-5


def test_embedding_model_exchanges_sparse_rows_and_reproduces_single_process(runs: Runs) -> None:
    parallel = runs("tokens_p4_auto")
    assert _relative_gap(train_losses(parallel), train_losses(runs("tokens_p1"))) < 1e-5
    lines = [m for m in read_metrics(parallel) if "split" not in m]
    modes = {m["sparse"]["0"]["mode"] for m in lines}
    assert modes <= {"allgather", "sharded"}, modes  # a batch touches ~4% of the rows
    assert all(0 < m["sparse"]["0"]["density"] < 0.1 for m in lines)
    summary = read_summary(parallel)
    table_bytes = 10000 * 64 * 4
    assert summary["comm_bytes_per_step"] < table_bytes / 3, summary["comm_bytes_per_step"]
    predicted = summary["predicted_comm_bytes_per_step"]
    assert abs(predicted / summary["comm_bytes_per_step"] - 1) < 0.1, predicted
    assert sum(summary["sparse_exchange"]["0"]["steps_by_mode"].values()) == STEPS


def test_domain_trains_a_batch_smaller_than_the_ranks(runs: Runs) -> None:
    run_dir = runs("cnn_batch2_domain_2x2")
    summary = read_summary(run_dir)
    assert summary["strategy"] == "domain" and summary["world_size"] == 4
    assert _relative_gap(train_losses(runs("cnn_batch2_p1")), train_losses(run_dir)) <= 1e-9
    predicted = summary["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in read_metrics(run_dir) if "split" not in m)


def test_site_launcher_command_and_args_are_used(runs: Runs) -> None:
    run_dir = runs("mlp_p2")
    recorded = (run_dir / "launcher_args.txt").read_text().split()
    assert recorded[:4] == ["-n", "2", "-genv", "GRIDRUN_TEST_MARK"]
    assert recorded[-3:] == ["-m", "runner.cli.worker", str(run_dir)]


def test_cnn_in_a_user_started_mpi_job_reproduces_single_process(runs: Runs) -> None:
    run_dir = runs("cnn_p2_user_mpiexec")
    assert _relative_gap(train_losses(runs("cnn_p1")), train_losses(run_dir)) <= 1e-5
    # Rank 0 made the one directory; every rank wrote its log there.
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert read_summary(run_dir)["world_size"] == 2


@pytest.mark.parametrize("first,second", [("mlp_p1", "mlp_p1_again"), ("mlp_p4", "mlp_p4_again")])
def test_same_command_twice_gives_identical_losses(runs: Runs, first: str, second: str) -> None:
    assert train_losses(runs(first)) == train_losses(runs(second))


def test_run_directory_contract(runs: Runs) -> None:
    run_dir = runs("mlp_p4")
    for name in ("config.yaml", "metrics.jsonl", "summary.json", ".hydra/config.yaml",
                 ".hydra/overrides.yaml", ".hydra/hydra.yaml"):
        assert (run_dir / name).is_file(), name
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == [f"rank{k}.log"
                                                                    for k in range(4)]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["grid"] == {"pr": 1, "pc": 4} and config["trainer"]["steps"] == STEPS
    assert "${" not in (run_dir / "config.yaml").read_text(), "config.yaml must be resolved"

    metrics = read_metrics(run_dir)
    train = [m for m in metrics if "split" not in m]
    val = [m for m in metrics if m.get("split") == "val"]
    assert [m["step"] for m in train] == list(range(1, STEPS + 1))
    for m in train:
        assert set(m) == {"step", "time_s", "loss", "lr", "step_time_s", "comm_time_s",
                          "comm_bytes", "comm_share", "samples_per_s"}
        assert m["comm_share"] == m["comm_time_s"] / m["step_time_s"]
    assert all(a["time_s"] < b["time_s"] for a, b in itertools.pairwise(train))
    assert [m["step"] for m in val] == [25, 50]
    assert all(set(m) == {"step", "split", "time_s", "loss", "accuracy"} for m in val)

    summary = read_summary(run_dir)
    for key in ("strategy", "optimizer", "grid", "world_size", "steps", "final_loss",
                "val_accuracy", "wall_time_s", "mean_step_time_s", "comm_bytes_per_step",
                "predicted_comm_bytes_per_step", "seed", "versions", "git_commit",
                "param_bytes_per_rank", "comm_time_share"):
        assert key in summary, key
    assert summary["grid"] == {"pr": 1, "pc": 4} and summary["world_size"] == 4
    assert summary["final_loss"] == train[-1]["loss"]
    assert set(summary["versions"]) == {"python", "torch", "mpi4py", "mpi"}
    assert "MPICH" in summary["versions"]["mpi"]
    assert 0.0 <= summary["comm_time_share"] <= 1.0


def test_measured_bytes_equal_predicted_every_step(runs: Runs) -> None:
    run_dir = runs("mlp_p4")
    summary = read_summary(run_dir)
    # 64 -> 128 -> 128 -> 10 MLP on 8x8 digits: weights+biases in float32, plus the loss and
    # the stop flag (4 bytes each).
    params = (64 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)
    assert summary["param_bytes_per_rank"] == 4 * params
    assert summary["predicted_comm_bytes_per_step"] == 4 * params + 8
    for m in read_metrics(run_dir):
        if "split" not in m:
            assert m["comm_bytes"] == summary["predicted_comm_bytes_per_step"], m
    assert read_summary(runs("mlp_p1"))["comm_bytes_per_step"] == 0


def test_default_grid_run_splits_the_weights(runs: Runs) -> None:
    summary = read_summary(runs("grid_default_2x2"))
    assert summary["strategy"] == "grid" and summary["grid"] == {"pr": 2, "pc": 2}
    whole = read_summary(runs("mlp_p1"))["param_bytes_per_rank"]
    assert whole / 2 <= summary["param_bytes_per_rank"] <= whole / 2 + 4 * (64 + 128 + 128 + 3)
    predicted = summary["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in read_metrics(runs("grid_default_2x2"))
               if "split" not in m)


def test_isolating_collectives_changes_timing_only(runs: Runs) -> None:
    """debug.isolate_comm (a barrier before each collective, no overlap) is for measuring the
    cost model: same losses, same operations and bytes."""
    isolated = runs("mlp_p4_isolated")
    assert train_losses(isolated) == train_losses(runs("mlp_p4"))
    predicted = read_summary(isolated)["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in read_metrics(isolated) if "split" not in m)


def test_training_learns_digits(runs: Runs) -> None:
    assert read_summary(runs("mlp_p4"))["val_accuracy"] > 0.8  # 50 steps; chance is 0.1


def test_a_failing_rank_ends_the_job_with_its_traceback(session_tmp: Path) -> None:
    run_dir = session_tmp / "failing"
    result = run_cli(*COMMON, *DATA, "grid.pc=4", "debug.fail_at_step=3", "debug.fail_on_rank=2",
                     f"hydra.run.dir={run_dir}", timeout=120)  # a hang would hit the timeout
    assert result.returncode not in (0, 2), result.returncode
    assert "[rank 2] failed" in result.stderr and "InjectedFailure" in result.stderr
    assert "Traceback" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "failed on rank 2" in last and "InjectedFailure" in last
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["failed_rank"] == 2
    assert "rank 2 failed" in (run_dir / "logs" / "rank2.log").read_text()


def test_user_mpi_job_of_the_wrong_size_is_refused(session_tmp: Path) -> None:
    run_dir = session_tmp / "wrong_size"
    result = run_cli("grid.pr=2", "grid.pc=2", f"hydra.run.dir={run_dir}", mpi_ranks=2,
                     timeout=120)
    assert result.returncode == 2
    assert "error: grid.pr*grid.pc=4 but the MPI job has 2 ranks" in result.stderr
    assert "Traceback" not in result.stderr and not run_dir.exists()


def test_multirun_gives_each_job_its_own_mpi_job_and_a_sweep_table(session_tmp: Path) -> None:
    sweep = session_tmp / "sweep"
    result = run_cli("-m", "grid.pr=1,2", "grid.pc=1", "dataset=synthetic", "trainer.steps=10",
                     "trainer.batch_size=32", f"hydra.sweep.dir={sweep}")
    assert_ok(result)
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert [r["overrides"] for r in rows] == [
        "grid.pr=1 grid.pc=1 dataset=synthetic trainer.steps=10 trainer.batch_size=32",
        "grid.pr=2 grid.pc=1 dataset=synthetic trainer.steps=10 trainer.batch_size=32"]
    assert all(r["status"] == "completed" for r in rows)
    for job, ranks in ((0, 1), (1, 2)):
        summary = read_summary(sweep / str(job))
        assert summary["world_size"] == ranks and summary["run_dir"] == str(sweep / str(job))
        assert summary["strategy"] == "grid"
        assert (sweep / str(job) / ".hydra" / "overrides.yaml").is_file()
    losses = [train_losses(sweep / str(job)) for job in (0, 1)]
    assert len(losses[0]) == 10 and _relative_gap(*losses) <= 1e-5
    assert "sweep" in result.stdout and "final loss" in result.stdout
    # predicted next to measured, bytes and time, for every job (zero on one rank)
    assert "comm ms/step (predicted)" in result.stdout
    for row in rows:
        assert float(row["comm_bytes_per_step"]) == float(row["predicted_comm_bytes_per_step"])
        assert row["comm_time_s_per_step"] != "" and row["predicted_comm_time_s_per_step"] != ""
    assert float(rows[1]["predicted_comm_time_s_per_step"]) > 0.0


def test_replica_optimizers_run_from_a_multirun(session_tmp: Path) -> None:
    """One rank (the centre a local tensor, no MPI) and two (one-sided windows), synchronous
    and asynchronous, each job its own MPI job."""
    sweep = session_tmp / "easgd_sweep"
    result = run_cli("-m", "optimizer=sync_easgd,hogwild_easgd", "grid.pc=1,2", *DATA,
                     "trainer.steps=60", "trainer.eval_every=20", f"hydra.sweep.dir={sweep}")
    assert_ok(result)
    rows = list(csv.DictReader((sweep / "sweep_summary.csv").open()))
    assert len(rows) == 4 and all(r["status"] == "completed" for r in rows)
    for job in range(4):
        summary = read_summary(sweep / str(job))
        assert summary["optimizer"] in ("sync_easgd", "hogwild_easgd")
        assert summary["val_accuracy"] > 0.5 and summary["workers_val_accuracy"] > 0.5
        assert len(summary["steps_per_s_by_rank"]) == summary["world_size"]
        assert summary["predicted_comm_bytes_per_step"] is None  # not modelled: not claimed
        lines = read_metrics(sweep / str(job))
        assert all(0 <= m["comm_share"] <= 1 for m in lines if "split" not in m)
        assert [m["step"] for m in lines if m.get("split") == "val"] == [20, 40, 60]
    assert "workers' mean val accuracy" in result.stdout


def test_experiment_configs_compose_and_validate(tmp_path: Path) -> None:
    from runner.cli.app import precheck
    from runner.records.rundir import release_run_dirs

    for experiment in ("digits_cnn", "synthetic_mlp", "easgd_digits", "tokens_bag",
                       "kjv_bag"):
        run_dir = tmp_path / experiment
        try:
            assert precheck([f"experiment={experiment}", f"hydra.run.dir={run_dir}"]) is None
        finally:
            release_run_dirs()
        assert not run_dir.exists()  # checked and locked, never run: nothing left behind
    assert json.dumps(precheck(["experiment=nope"])).startswith('"unknown experiment')


@pytest.mark.parametrize("name,reference,gap", [
    ("grid_default_2x2_torch", "mlp_p1", 1e-5),
    ("auto_2x2_torch", "mlp_p1", 1e-5),
    ("cnn_batch2_domain_2x2_torch", "cnn_batch2_p1", 1e-9),
    ("tokens_p4_auto_torch", "tokens_p1", 1e-5),
])
def test_the_torch_backend_reproduces_one_process_and_moves_the_predicted_bytes(
        runs: Runs, name: str, reference: str, gap: float) -> None:
    """Every strategy's communication through torch.distributed (gloo) instead of mpi4py: the
    same mathematics, and the counted bytes are the planner's (the sparse exchange's choice
    depends on timings, so its prediction is the 10% band of the MPI test above)."""
    run_dir = runs(name)
    summary = read_summary(run_dir)
    assert summary["comm_backend"] == "torch"
    assert _relative_gap(train_losses(runs(reference)), train_losses(run_dir)) <= gap
    predicted = summary["predicted_comm_bytes_per_step"]
    if name.startswith("tokens"):
        assert abs(predicted / summary["comm_bytes_per_step"] - 1) < 0.1, predicted
    else:
        assert all(m["comm_bytes"] == predicted for m in read_metrics(run_dir)
                   if "split" not in m)


def test_staged_host_buffers_change_nothing_but_the_copies(runs: Runs) -> None:
    """debug.stage_host_tensors sends every buffer through the host staging GPU tensors take
    under an MPI without CUDA support: the same losses bit for bit, the same counted bytes."""
    staged, plain = runs("grid_default_2x2_staged"), runs("grid_default_2x2")
    assert read_summary(staged)["device_buffers"] == "staged through host buffers (MPI)"
    assert train_losses(staged) == train_losses(plain)
    predicted = read_summary(staged)["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in read_metrics(staged) if "split" not in m)


@pytest.mark.parametrize("name,precision", [("grid_2x1_bf16", "bf16"),
                                            ("mlp_p2_fp16_torch", "fp16")])
def test_half_precision_learns_like_fp32_and_moves_the_predicted_bytes(
        runs: Runs, name: str, precision: str) -> None:
    """bf16 and fp16 autocast train digits to fp32's accuracy band; the bytes counted are the
    planner's, activations in the half type (bf16 at 2x1 moves half of fp32's)."""
    run_dir = runs(name)
    summary, reference = read_summary(run_dir), read_summary(runs("mlp_p1"))
    assert summary["precision"]["name"] == precision and summary["devices"] == ["cpu"] * 2
    assert abs(summary["val_accuracy"] - reference["val_accuracy"]) <= 0.03
    assert _relative_gap(train_losses(runs("mlp_p1")), train_losses(run_dir)) <= 0.05
    predicted = summary["predicted_comm_bytes_per_step"]
    assert all(m["comm_bytes"] == predicted for m in read_metrics(run_dir) if "split" not in m)
    if precision == "fp16":
        assert summary["precision"]["skipped_steps"] == 0  # digits never overflow at 2^16


RESNET = ["model=resnet", "model.widths=[4,8]", "model.blocks=[1,1]", "trainer.steps=20",
          "trainer.dtype=float64", "trainer.eval_every=null"]


def test_a_resnet_checkpoint_resumes_on_other_grids_and_strategies(session_tmp: Path) -> None:
    """A ResNet written at grid 2x2 (convolutions and BatchNorm batch-parallel, statistics over
    the world), resumed under model 4x1 (every convolution and BatchNorm split by channel, the
    running statistics re-sharded) and data 1x4: the continued losses and the final validation
    (which reads the running statistics) equal the uninterrupted run's."""
    first = session_tmp / "resnet_grid_2x2"
    assert_ok(run_cli(*RESNET, "trainer.batch_size=32", "strategy=grid", "grid.pr=2",
                      "grid.pc=2", "trainer.checkpoint_every=10", f"hydra.run.dir={first}"))
    checkpoint = first / "checkpoints" / "step-00000010"
    whole = read_metrics(first)
    grids = (("model", 4, 1), ("data", 1, 4))
    dirs = [session_tmp / f"resnet_{strategy}_{pr}x{pc}_resumed" for strategy, pr, pc in grids]
    for result in run_cli_together(*[
            [*RESNET, "trainer.batch_size=32", f"strategy={strategy}", f"grid.pr={pr}",
             f"grid.pc={pc}", f"trainer.resume={checkpoint}", f"hydra.run.dir={resumed}"]
            for (strategy, pr, pc), resumed in zip(grids, dirs, strict=True)]):
        assert_ok(result)
    for resumed in dirs:
        later = [m for m in read_metrics(resumed) if "split" not in m]
        assert [m["step"] for m in later] == list(range(11, 21))
        before = {m["step"]: m["loss"] for m in whole if "split" not in m}
        assert max(abs(m["loss"] - before[m["step"]]) / before[m["step"]] for m in later) <= 1e-9
        summary = read_summary(resumed)
        assert abs(summary["val_loss"] - read_summary(first)["val_loss"]) <= 1e-9
        assert all(m["comm_bytes"] == summary["predicted_comm_bytes_per_step"] for m in later)


# Micro-batches (trainer.accumulate_steps) and recomputation (trainer.activation_checkpointing)
# against the same steps without: one process's model, to float64 rounding. VGG's dropouts are
# recomputed under data 1x2 (the same masks drawn again); the MLP split by grid 2x2 moves its
# activations per micro-batch.
ACCUMULATION = ["trainer.steps=4", "trainer.eval_every=null", "trainer.dtype=float64",
                "trainer.batch_size=16", "seed=3"]
VGG_DATA2 = ["model=vgg", "dataset=digits", *DATA, "grid.pc=2"]
GRID_2X2 = ["strategy=grid", "grid.pr=2", "grid.pc=2"]
ACCUMULATION_RUNS = {
    "vgg_data2": VGG_DATA2,
    "vgg_data2_micro_recomputed": [*VGG_DATA2, "trainer.accumulate_steps=2",
                                   "trainer.activation_checkpointing='1[0-6]'"],
    "mlp_grid2x2": GRID_2X2,
    "mlp_grid2x2_micro4": [*GRID_2X2, "trainer.accumulate_steps=4"],
}


@pytest.fixture(scope="module")
def accumulation_runs(session_tmp: Path) -> dict[str, Path]:
    dirs = {name: session_tmp / "accumulation" / name for name in ACCUMULATION_RUNS}
    for result in run_cli_together(*[[*ACCUMULATION, *overrides, f"hydra.run.dir={dirs[name]}"]
                                     for name, overrides in ACCUMULATION_RUNS.items()]):
        assert_ok(result)
    return dirs


@pytest.mark.parametrize("whole,micro", [("vgg_data2", "vgg_data2_micro_recomputed"),
                                         ("mlp_grid2x2", "mlp_grid2x2_micro4")])
def test_micro_batches_and_recomputation_train_what_the_whole_batch_trains(
        accumulation_runs: dict[str, Path], whole: str, micro: str) -> None:
    assert _relative_gap(train_losses(accumulation_runs[whole]),
                         train_losses(accumulation_runs[micro])) <= 1e-9
    before, after = (read_summary(accumulation_runs[name]) for name in (whole, micro))
    # the gradients are exchanged once a step; activations move per micro-batch, as predicted
    assert after["comm_bytes_per_step"] == before["comm_bytes_per_step"]
    for summary in (before, after):
        assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"]


def test_micro_batches_keep_a_share_of_the_activations(
        accumulation_runs: dict[str, Path]) -> None:
    whole = read_summary(accumulation_runs["mlp_grid2x2"])
    micro = read_summary(accumulation_runs["mlp_grid2x2_micro4"])
    assert micro["accumulate_steps"] == 4
    assert 0.2 < micro["activation_bytes_peak"] / whole["activation_bytes_peak"] < 0.3
    recomputed = read_summary(accumulation_runs["vgg_data2_micro_recomputed"])
    assert recomputed["activation_checkpointing"] == {
        "modules": [str(k) for k in range(10, 17)], "rebuilt": []}
