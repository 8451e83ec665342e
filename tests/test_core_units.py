"""Core pieces that need no MPI: partitions, the size-1 communicator, registries, env detection."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pytest
import torch

from runner.config.options import option_problems, with_defaults
from runner.core import CommCounter, CountedComm, ProcessGrid, balanced_sizes, balanced_slice
from runner.core.registry import Registry, UnknownPluginError
from runner.training.mpienv import detect_mpi_environment

Mode = Literal["a", "b"]


@pytest.mark.parametrize("total,parts", [(10, 3), (7, 7), (3, 5), (0, 2), (1024, 4), (13, 1)])
def test_balanced_partition_covers_everything_once(total: int, parts: int) -> None:
    sizes = balanced_sizes(total, parts)
    assert sum(sizes) == total and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1
    covered = [i for k in range(parts) for i in range(total)[balanced_slice(total, parts, k)]]
    assert covered == list(range(total))


def test_partition_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        balanced_sizes(4, 0)
    with pytest.raises(ValueError):
        balanced_slice(4, 2, 2)


def test_single_process_comm_moves_and_records_nothing() -> None:
    counter = CommCounter(keep_records=True)
    comm = CountedComm(None, counter)
    x = torch.arange(4.0)
    assert comm.allreduce_(x) is x and x.tolist() == [0, 1, 2, 3]
    op = comm.iallreduce_(x)
    op.wait()
    assert op.done and counter.totals.calls == 0 and counter.records == []


def test_one_by_one_grid_needs_no_mpi() -> None:
    grid = ProcessGrid(1, 1)
    assert (grid.size, grid.rank, grid.model.size, grid.batch.size) == (1, 0, 1, 1)
    with pytest.raises(ValueError, match="needs 4 ranks"):
        ProcessGrid(2, 2)


def test_registry_names_the_registered_plugins() -> None:
    registry: Registry[object] = Registry("widget")
    registry.register("b")(object)
    registry.register("a")(int)
    with pytest.raises(UnknownPluginError, match="unknown widget 'c'; registered: a, b"):
        registry.get("c")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a")(float)


def test_plugin_options_are_checked_against_the_signature() -> None:
    def factory(input_shape: tuple[int, ...], num_classes: int, hidden: Sequence[int] = (1,),
                activation: str = "relu", rate: float | None = None,
                mode: Mode = "a", untyped=3):
        return None

    reserved = ("input_shape", "num_classes")
    assert option_problems("model", factory, {"hidden": [4, 5], "rate": 1, "untyped": "x"},
                           reserved) == []
    assert option_problems("model", factory, {"depth": 2, "input_shape": 1}, reserved) == [
        "model: unknown option(s) model.depth, model.input_shape; valid: activation, hidden, "
        "mode, rate, untyped"]
    assert option_problems("model", factory, {"hidden": [1.5], "activation": 3, "rate": "x",
                                              "mode": "c"}, reserved) == [
        "model.hidden=[1.5]: must be a list of integers",
        "model.activation=3: must be a string",
        "model.rate=x: must be null or a number",
        "model.mode=c: must be one of a, b"]
    assert with_defaults(factory, {"rate": 0.5}, reserved) == {
        "hidden": (1,), "activation": "relu", "rate": 0.5, "mode": "a", "untyped": 3}


def test_the_schema_names_every_unknown_key_and_wrong_type() -> None:
    from runner.config.schema import ConfigError, parse

    good = {"model": {"name": "mlp"}, "dataset": {"name": "digits"},
            "strategy": {"name": "grid"}, "optimizer": {"name": "sgd"}}
    run = parse({**good, "trainer": {"steps": 7}, "grid": {"pr": 1, "pc": 4}})
    assert (run.trainer.steps, run.trainer.batch_size, run.grid.size) == (7, 64, 4)
    with pytest.raises(ConfigError) as refused:
        parse({**good, "trainer": {"steps": 1.5, "stepz": 2}, "grid": {"pc": "x"},
               "debug": {"isolate_comm": "yes"}, "optimizer": None, "colour": "red"})
    assert refused.value.problems == [
        "unknown key(s) colour; valid: seed, plugins, objective, grid, trainer, launcher, logger, "
        "comm, data, debug, plan, model, dataset, strategy, optimizer",
        "grid.pc=x: must be an integer",
        "trainer: unknown key(s) trainer.stepz; valid: steps, batch_size, log_every, eval_every, "
        "eval_samples, checkpoint_every, export, keep_checkpoints, resume, comm_timeout_s, "
        "threads, dtype, device, precision, accumulate_steps, activation_checkpointing, compile, "
        "compile_cache",
        "trainer.steps=1.5: must be an integer",
        "debug.isolate_comm=yes: must be true or false",
        "optimizer: missing (choose one with optimizer=NAME)"]


@pytest.mark.parametrize("env,expected", [
    ({}, None),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),
    ({"PMI_RANK": "0", "PMI_SIZE": "1"}, None),  # a singleton is not a job of several ranks
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8"}, (3, 8)),
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0"}, (2, 4)),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "4"}, None),  # the sbatch script itself
])
def test_detect_mpi_environment(env: dict[str, str], expected: tuple[int, int] | None) -> None:
    found = detect_mpi_environment(env)
    assert (None if found is None else (found.rank, found.size)) == expected


def test_cyclic_rows_deal_every_row_to_one_owner() -> None:
    import torch

    from runner.core.row_sparse import CyclicRows, coalesce_rows

    rows = CyclicRows(10, 4)
    owned = [rows.owned(k) for k in range(4)]
    assert torch.equal(torch.sort(torch.cat(owned)).values, torch.arange(10))
    assert all(bool((rows.owner(o) == k).all()) for k, o in enumerate(owned))
    assert len(CyclicRows(3, 4).owned(3)) == 0  # fewer rows than owners
    indices, values = coalesce_rows(torch.tensor([5, 1, 5]), torch.tensor([[1.0], [2.0], [3.0]]))
    assert indices.tolist() == [1, 5] and values.flatten().tolist() == [2.0, 4.0]

