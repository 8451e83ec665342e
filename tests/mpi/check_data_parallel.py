"""Checks that need real ranks, run as one MPI launch: `mpiexec -n 4 python THIS` (with the
checks of `check_sparse.py`, which it imports).

Prints `ok <name>` per passed check; any failure prints its traceback and aborts the job.
The reference for every gradient is computed independently: each rank also computes the
full-batch gradient sequentially and compares.
"""

from __future__ import annotations

import check_sparse  # noqa: F401
import torch
import torch.nn.functional as F
from harness import BACKEND, check, run_checks
from mpi4py import MPI
from torch import nn

from runner.core import CommCounter, ProcessGrid, balanced_slice
from strategies.data import DataParallel

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()



def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 5))


def global_batch(batch: int = 8 * SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(42)
    return torch.randn(batch, 12, generator=gen), torch.randint(0, 5, (batch,), generator=gen)


def reference_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    F.cross_entropy(ref(x), y).backward()
    return [p.grad.clone() for p in ref.parameters()]


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (g - w).abs().max().item()
        assert err <= 1e-6 * max(1.0, w.abs().max().item()), f"{what}: parameter {i} off by {err}"


def data_parallel_step(bucket_mb: float, steps: int = 2) -> tuple[nn.Module, CommCounter]:
    grid = ProcessGrid(1, SIZE, COMM, counter=CommCounter(keep_records=True),
                       backend=BACKEND)
    strategy = DataParallel(bucket_cap_mb=bucket_mb, first_bucket_mb=bucket_mb)
    pmodel = strategy.parallelize(make_model(), (12,), grid)
    x, y = global_batch()
    rows = balanced_slice(len(x), SIZE, RANK)
    for step in range(steps):  # buckets must reset between steps
        pmodel.zero_grad()
        F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
        pmodel.finish_gradient_sync()
        assert_close([p.grad for p in pmodel.parameters()],
                     reference_grads(pmodel.module, x, y), f"step {step}")
        with torch.no_grad():
            for p in pmodel.parameters():
                p -= 0.1 * p.grad
    return pmodel, grid.counter


@check
def averaged_gradients_equal_the_full_batch_gradient() -> None:
    data_parallel_step(bucket_mb=25.0)


@check
def one_bucket_per_parameter_still_launches_in_order() -> None:
    pmodel, counter = data_parallel_step(bucket_mb=1e-6, steps=1)
    grads = [r for r in counter.records if r.label == "grad"]
    params = list(pmodel.parameters())
    assert len(grads) == len(params), (len(grads), len(params))
    # Reverse registration order: the last layer's bias is exchanged first.
    assert [r.nbytes for r in grads] == [p.numel() * 4 for p in reversed(params)]
    assert all(r.op == "iallreduce" and r.group == "world" and r.group_size == SIZE
               for r in grads)


@check
def all_reduces_start_while_backward_is_still_running() -> None:
    grid = ProcessGrid(1, SIZE, COMM, backend=BACKEND)
    strategy = DataParallel(bucket_cap_mb=1e-6, first_bucket_mb=1e-6)
    pmodel = strategy.parallelize(make_model(), (12,), grid)
    (reducer,) = pmodel.reducers
    launched_when_first_layer_ready = []
    first_weight = pmodel.module[0].weight  # its gradient is the last one backward produces
    first_weight.register_hook(lambda g: launched_when_first_layer_ready.append(
        reducer._next_launch))
    x, y = global_batch()
    rows = balanced_slice(len(x), SIZE, RANK)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    # Before the first layer's gradient existed, the later layers' buckets were already sent.
    assert launched_when_first_layer_ready[0] >= 4, launched_when_first_layer_ready
    assert reducer._next_launch == len(reducer.buckets)  # all started before finish()
    pmodel.finish_gradient_sync()


@check
def counted_bytes_equal_the_parameter_bytes() -> None:
    pmodel, counter = data_parallel_step(bucket_mb=25.0, steps=1)
    param_bytes = sum(p.numel() * p.element_size() for p in pmodel.parameters())
    assert counter.totals.nbytes == param_bytes, (counter.totals.nbytes, param_bytes)
    predicted = DataParallel().predicted_comm_bytes_per_step(
        pmodel.module, (12,), ProcessGrid(1, SIZE, COMM, backend=BACKEND).shape, 32)
    assert predicted == param_bytes


class ResidualNet(nn.Module):
    """A user's module tree with BatchNorm and a residual addition (not a Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        out = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(h)))))
        return self.head(self.relu2(out + h))


@check
def batch_norm_over_ranks_is_the_single_process_batch_norm() -> None:
    """Each rank normalizes its rows by every rank's statistics: the same outputs, gradients
    and running statistics as one process on the whole batch (float64, uneven rows), and the
    bytes the planner predicts."""
    from runner.core.placement import place_whole
    from strategies.layers.norm import batch_norm_ops

    torch.manual_seed(3)
    model = ResidualNet().double()
    reference = ResidualNet().double()
    reference.load_state_dict(model.state_dict())
    place_whole(model)
    grid = ProcessGrid(1, SIZE, COMM, counter=CommCounter(keep_records=True), backend=BACKEND)
    pmodel = DataParallel().parallelize(model, (2, 6, 6), grid)
    gen = torch.Generator().manual_seed(5)
    for step in range(2):
        batch = 8 * SIZE
        x = torch.randn(batch, 2, 6, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 3, (batch,), generator=gen)
        rows = balanced_slice(batch, SIZE, RANK)
        before = len(grid.counter.records)
        pmodel.zero_grad()
        F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
        pmodel.finish_gradient_sync()
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        want = [p.grad for p in reference.parameters()]
        got = [p.grad for p in pmodel.parameters()]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.allclose(g, w, rtol=1e-10, atol=1e-12), (step, i, (g - w).abs().max())
        for got_buffer, want_buffer in zip(model.buffers(), reference.buffers(), strict=True):
            assert torch.allclose(got_buffer.double(), want_buffer.double(), rtol=1e-12), step
        with torch.no_grad():
            for p, q in zip(pmodel.parameters(), reference.parameters(), strict=True):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
        moved = [r for r in grid.counter.records[before:] if r.label.startswith("bn:")]
        predicted = batch_norm_ops(reference, "world", SIZE, 8)
        assert sorted((r.op, r.label, r.nbytes) for r in moved) == sorted(
            (o.op, o.layer, o.nbytes) for o in predicted), (moved, predicted)
    pmodel.eval()
    x = torch.randn(5, 2, 6, 6, generator=gen, dtype=torch.float64)
    reference.eval()
    assert torch.allclose(pmodel(x), reference(x), rtol=1e-10, atol=1e-12)


@check
def an_unused_parameter_does_not_hang_the_exchange() -> None:
    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = make_model()
            self.extra = nn.Linear(3, 3)  # never used in forward: its hook never fires

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    model = WithUnused()
    grid = ProcessGrid(1, SIZE, COMM, backend=BACKEND)
    pmodel = DataParallel(bucket_cap_mb=1e-6, first_bucket_mb=1e-6).parallelize(model, (12,), grid)
    x, y = global_batch()
    rows = balanced_slice(len(x), SIZE, RANK)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    pmodel.finish_gradient_sync()
    assert torch.count_nonzero(model.extra.weight.grad) == 0


@check
def a_replaced_grad_is_put_back_into_its_bucket() -> None:
    grid = ProcessGrid(1, SIZE, COMM, backend=BACKEND)
    pmodel = DataParallel().parallelize(make_model(), (12,), grid)
    for p in pmodel.parameters():
        p.grad = None  # what optimizer.zero_grad(set_to_none=True) does
    x, y = global_batch()
    rows = balanced_slice(len(x), SIZE, RANK)
    F.cross_entropy(pmodel(x[rows]), y[rows]).backward()
    pmodel.finish_gradient_sync()
    assert_close([p.grad for p in pmodel.parameters()], reference_grads(pmodel.module, x, y),
                 "after set_to_none")


@check
def grid_groups_follow_the_named_dimensions() -> None:
    if SIZE != 4:
        return
    grid = ProcessGrid(2, 2, COMM, backend=BACKEND)
    assert (grid.batch_index, grid.model_index) == divmod(RANK, 2)
    model_peers = grid.model.allgather_object(RANK)
    batch_peers = grid.batch.allgather_object(RANK)
    assert model_peers == [2 * (RANK // 2), 2 * (RANK // 2) + 1], model_peers
    assert batch_peers == [RANK % 2, RANK % 2 + 2], batch_peers
    x = torch.tensor([float(RANK)])
    grid.model.allreduce_(x)
    assert x.item() == sum(model_peers)


@check
def every_group_moves_through_the_backend_asked_for() -> None:
    from runner.core.torchdist import init_torch_distributed, torch_distributed_ready

    grid = ProcessGrid(2, 2, COMM, backend=BACKEND) if SIZE == 4 else ProcessGrid(
        1, SIZE, COMM, backend=BACKEND)
    assert [c.backend for c in (grid.world, grid.model, grid.batch)] == [BACKEND] * 3, grid
    if BACKEND == "mpi":  # torch.distributed was never started: a torch grid says what to do
        assert not torch_distributed_ready()
        try:
            ProcessGrid(1, SIZE, COMM, backend="torch")
        except RuntimeError as exc:
            assert "init_torch_distributed(MPI.COMM_WORLD) on every rank first" in str(exc), exc
        else:
            raise AssertionError("a torch grid without torch.distributed was built")
    else:
        init_torch_distributed(COMM)  # once per process: a second call does nothing
        assert torch_distributed_ready()
        x = torch.tensor([float(RANK)])
        assert grid.world.allreduce_(x).item() == SIZE * (SIZE - 1) / 2


if __name__ == "__main__":
    run_checks()
