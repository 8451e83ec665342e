"""Which GPU each rank takes, and whether ranks share one, for every way a site binds GPUs.

No GPU needed: torch.cuda's answers come from a stand-in (`FakeCuda`, the UUIDs a rank sees),
and the ranks of a job are threads of this process that all-gather through a stand-in
communicator (`FakeComm`). tests/test_gpu.py places ranks on a real GPU.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from runner.config.schema import RunConfig, parse
from runner.core import DevicePaths
from runner.training.devices import Placement, device_paths, place_on_node, place_rank


class _Table:
    """What the ranks of one stand-in communicator put on the table."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=20)


class FakeComm:
    """An MPI communicator's size, rank and allgather, for ranks run as threads."""

    def __init__(self, table: _Table, rank: int) -> None:
        self.table, self.rank = table, rank

    def Get_size(self) -> int:  # mpi4py's names
        return self.table.size

    def Get_rank(self) -> int:
        return self.rank

    def allgather(self, obj: Any) -> list[Any]:
        self.table.values[self.rank] = obj
        self.table.barrier.wait()
        gathered = list(self.table.values)
        self.table.barrier.wait()  # nobody writes the next round before all have read
        return gathered


class FakeCuda:
    """torch.cuda as a rank bound to `visible` (GPU UUIDs, by device index) sees it."""

    def __init__(self, visible: list[str]) -> None:
        self._visible = visible
        self.current: int | None = None

    def visible(self) -> list[str]:
        return list(self._visible)

    def set_device(self, index: int) -> None:
        self.current = index


def run_config(backend: str = "torch", device: str = "cuda",
               cuda_aware: str = "false") -> RunConfig:
    return parse({"model": {"name": "mlp"}, "dataset": {"name": "digits"},
                  "strategy": {"name": "data"}, "optimizer": {"name": "sgd"},
                  "trainer": {"device": device},
                  "comm": {"backend": backend, "cuda_aware": cuda_aware}})


def simulate(nodes: list[list[list[str]]],
             run: RunConfig | None = None) -> list[tuple[Placement, DevicePaths] | Exception]:
    """Each node's ranks, each given the GPUs it sees, placed and their paths decided: every
    rank's (placement, paths), or what it raised."""
    run = run or run_config()
    bindings = [(n, local, visible) for n, node in enumerate(nodes)
                for local, visible in enumerate(node)]
    job, per_node = _Table(len(bindings)), [_Table(len(node)) for node in nodes]
    results: list[tuple[Placement, DevicePaths] | Exception] = [
        RuntimeError("did not finish")] * len(bindings)

    def rank(r: int) -> None:
        n, local, visible = bindings[r]
        node_comm = FakeComm(per_node[n], local) if len(bindings) > 1 else None
        try:
            placement = place_on_node(run.trainer.device, node_comm, FakeCuda(visible), f"node{n}")
            results[r] = (placement, device_paths(run, placement, FakeComm(job, r)))
        except Exception as exc:  # what a rank would raise
            results[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(bindings))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def placed(nodes: list[list[list[str]]], run: RunConfig | None = None
           ) -> tuple[list[Placement], list[DevicePaths]]:
    results = simulate(nodes, run)
    for result in results:
        if isinstance(result, Exception):
            raise result
    pairs = [result for result in results if not isinstance(result, Exception)]
    return [p for p, _ in pairs], [d for _, d in pairs]


def test_every_rank_seeing_every_gpu_takes_local_rank_mod_count() -> None:
    gpus = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    placements, paths = placed([[gpus] * 4])
    assert [p.device for p in placements] == [torch.device("cuda", i) for i in range(4)]
    assert [p.uuid for p in placements] == gpus
    assert all(d == DevicePaths("cuda", direct=True) for d in paths)
    assert paths[0].describe("torch", 4) == "direct (NCCL)"


def test_one_gpu_visible_per_rank_is_one_rank_per_gpu() -> None:
    """Slurm's --gpus-per-task=1 or a CUDA_VISIBLE_DEVICES per rank: each rank counts one GPU
    against four local ranks, and still has a GPU of its own."""
    placements, paths = placed([[["GPU-a"], ["GPU-b"], ["GPU-c"], ["GPU-d"]]])
    assert all(p.device == torch.device("cuda", 0) and p.gpus == 1 for p in placements)
    assert all(p.local_size == 4 for p in placements)
    assert all(d.direct and not d.staged and not d.shared for d in paths)


@pytest.mark.parametrize("binding", [
    [["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"], ["GPU-c", "GPU-d"]],
    # interleaved: local rank % count alone would put ranks 0 and 2 on GPU-a
    [["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"], ["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]],
])
def test_a_subset_of_gpus_per_rank_spreads_the_ranks_that_see_it(
        binding: list[list[str]]) -> None:
    placements, paths = placed([binding])
    assert sorted(p.uuid or "" for p in placements) == ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]
    assert all(p.gpus == 2 for p in placements)
    assert all(d.direct for d in paths)


def test_nodes_are_told_apart_by_their_gpus_not_their_counts() -> None:
    placements, paths = placed([[["GPU-a0", "GPU-a1"]] * 2, [["GPU-b0", "GPU-b1"]] * 2])
    assert [p.device.index for p in placements] == [0, 1, 0, 1]
    assert [p.node for p in placements] == ["node0", "node0", "node1", "node1"]
    assert all(d.direct for d in paths)


def test_ranks_sharing_a_gpu_are_staged_and_said_so_in_one_warning(
        capsys: pytest.CaptureFixture[str]) -> None:
    placements, paths = placed([[["GPU-a", "GPU-b"]] * 4])
    assert [p.uuid for p in placements] == ["GPU-a", "GPU-b", "GPU-a", "GPU-b"]
    shared = (("GPU-a on node0", (0, 2)), ("GPU-b on node0", (1, 3)))
    assert all(d == DevicePaths("cuda", direct=False, shared=shared) for d in paths)
    assert paths[0].describe("torch", 4) == (
        "staged through host buffers (gloo); 2 ranks share GPU-a on node0 (ranks 0, 2); "
        "2 ranks share GPU-b on node0 (ranks 1, 3)")
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1, warnings  # rank 0's, once
    assert "2 ranks share GPU-a on node0" in warnings[0] and "gloo" in warnings[0]


def test_one_visible_gpu_that_every_rank_sees_is_shared() -> None:
    _, paths = placed([[["GPU-a"]] * 3])
    assert paths[0].shared == (("GPU-a on node0", (0, 1, 2)),) and paths[0].staged


@pytest.mark.parametrize("aware,direct,how", [
    ("false", False, "staged through host buffers (MPI)"),
    ("true", True, "direct (CUDA-aware MPI)"),  # a CUDA-aware MPI reads a shared GPU's memory
])
def test_under_mpi_sharing_is_said_and_cuda_awareness_decides(aware: str, direct: bool,
                                                              how: str) -> None:
    _, paths = placed([[["GPU-a"]] * 2], run_config("mpi", cuda_aware=aware))
    assert paths[0].direct is direct
    assert paths[1].describe("mpi", 2) == f"{how}; 2 ranks share GPU-a on node0 (ranks 0, 1)"


def test_auto_without_any_gpu_runs_on_the_host_and_with_some_is_refused_everywhere() -> None:
    placements, paths = placed([[[], []]], run_config(device="auto"))
    assert all(p.device.type == "cpu" for p in placements)
    assert all(d == DevicePaths("cpu") for d in paths)
    results = simulate([[["GPU-a"], []]], run_config(device="auto"))
    assert all(isinstance(r, RuntimeError) and "ranks 1 see no GPU" in str(r) for r in results)


def test_cuda_without_a_visible_gpu_is_refused() -> None:
    with pytest.raises(RuntimeError, match="sees no GPU"):
        place_on_node("cuda", None, FakeCuda([]), "node0")


def test_the_cpu_asks_torch_cuda_nothing() -> None:
    class Untouchable:
        def visible(self) -> list[str]:
            raise AssertionError("torch.cuda asked under trainer.device=cpu")

        def set_device(self, index: int) -> None:
            raise AssertionError("torch.cuda asked under trainer.device=cpu")

    placement = place_rank("cpu", None, Untouchable())
    assert placement.device == torch.device("cpu") and placement.uuid is None
    assert device_paths(run_config(device="cpu"), placement, None) == DevicePaths("cpu")
    assert not torch.cuda.is_initialized()


def test_the_summary_names_what_ran_at_one_rank() -> None:
    """At P = 1 no process group is built and no collective runs, whatever the backend."""
    placements, paths = placed([[["GPU-a"]]])
    assert placements[0].device == torch.device("cuda", 0) and paths[0].direct
    for backend in ("torch", "mpi"):
        assert paths[0].describe(backend, 1) == "none: one rank"
        assert DevicePaths("cpu", stage_host=True).describe(backend, 1) == "none: one rank"
