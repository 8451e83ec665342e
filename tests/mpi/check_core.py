"""Adjoint (dot-product) tests of every primitive and the halo exchange, in one launch:
`mpiexec -n 6 python THIS`.

For each grid 1x1, 1x4, 4x1, 2x2, 2x3 (carved out of the 6-rank world; ranks outside a grid sit
it out), for each of its groups (world, model, batch) and each primitive F:
    <F x, y> == <x, F* y>, relative to max(|<F x, y>|, |F x| |y|)
where F* is both the hand-written adjoint and autograd's backward of F, inner products summed
over the group's ranks, pieces uneven (and some empty), float32 to 1e-5 and float64 to 1e-12.
Forward results are also checked against the definition (e.g. the gathered tensor is the
concatenation of the pieces every rank can rebuild from the shared seed). The redistribution
between Cartesian partitions (`runner.core.cartesian`) is checked the same way over each grid's
world, and inside its model groups, with its recorded bytes against the prediction.
"""

from __future__ import annotations

import torch
from harness import COMM_TIMEOUT_S, check, make_grids, run_checks
from mpi4py import MPI

from runner.core import (
    CartesianPartition,
    CountedComm,
    Partition,
    redistribute,
    redistribute_adjoint_op,
    redistribute_op,
    redistribute_send_bytes,
)
from runner.core import halo as H
from runner.core import primitives as P
from runner.core.cartesian import redistribute_recv_bytes

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
GRIDS = [(1, 1), (1, 4), (4, 1), (2, 2), (2, 3)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}



def seeded(shape, seed: int, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def group_sum(value: float, comm: CountedComm) -> float:
    """Σ over the group (through its transport, uncounted: under "torch" an MPI call here would
    spin while peers wait in gloo)."""
    if comm.transport is None or comm.size == 1:
        return value
    total = torch.tensor([value], dtype=torch.float64)
    comm.transport.allreduce_(total)
    return float(total)


def dot_test(name: str, comm: CountedComm, forward, adjoint, x: torch.Tensor,
             y: torch.Tensor) -> None:
    """<F x, y> against <x, F* y> for the explicit adjoint and for autograd's backward."""
    tol = TOL[x.dtype]
    xg = x.clone().requires_grad_(True)
    fx = forward(xg)
    assert fx.shape == y.shape, (name, fx.shape, y.shape)
    lhs = group_sum(float((fx.detach() * y).sum()), comm)
    # Relative to the Cauchy-Schwarz bound |<Fx,y>| <= |Fx||y|: a sum of many O(1) terms can
    # land near zero, and relative to itself rounding would then look like a wrong adjoint.
    bound = (group_sum(float((fx.detach() ** 2).sum()), comm)
             * group_sum(float((y ** 2).sum()), comm)) ** 0.5
    (autograd_adjoint,) = torch.autograd.grad(fx, xg, grad_outputs=y)
    for label, fy in (("adjoint", adjoint(y)), ("autograd", autograd_adjoint)):
        rhs = group_sum(float((x * fy).sum()), comm)
        gap = abs(lhs - rhs) / max(abs(lhs), abs(rhs), bound, 1e-30)
        assert gap <= tol, f"{name} ({label}, {x.dtype}): <Fx,y>={lhs} <x,F*y>={rhs} gap {gap}"


GRID_OF = make_grids(GRIDS)


def grids():
    """(grid, groups) for every grid this rank belongs to."""
    for shape in GRIDS:
        grid = GRID_OF[shape]
        if grid is not None:
            yield grid, {"world": grid.world, "model": grid.model, "batch": grid.batch}


def cases():
    for grid, groups in grids():
        for group_name, comm in groups.items():
            for dtype in (torch.float32, torch.float64):
                yield f"{grid.pr}x{grid.pc}/{group_name}", comm, dtype


@check
def broadcast_and_sum_reduce() -> None:
    for where, comm, dtype in cases():
        root = comm.size - 1
        x = seeded((3, 5), 10 + comm.rank, dtype)
        y = seeded((3, 5), 20 + comm.rank, dtype)
        out = P.broadcast_op(x, comm, root)
        assert torch.equal(out, seeded((3, 5), 10 + root, dtype)), where
        dot_test(f"broadcast {where}", comm, lambda t, c=comm, r=root: P.broadcast(t, c, r),
                 lambda t, c=comm, r=root: P.sum_reduce_op(t, c, r), x, y)
        dot_test(f"sum_reduce {where}", comm, lambda t, c=comm, r=root: P.sum_reduce(t, c, r),
                 lambda t, c=comm, r=root: P.broadcast_op(t, c, r), x, y)


@check
def all_sum_reduce_is_self_adjoint() -> None:
    for where, comm, dtype in cases():
        x = seeded((4, 3), 30 + comm.rank, dtype)
        y = seeded((4, 3), 40 + comm.rank, dtype)
        expected = sum(seeded((4, 3), 30 + k, dtype) for k in range(comm.size))
        assert torch.allclose(P.all_sum_reduce_op(x, comm), expected), where
        dot_test(f"all_sum_reduce {where}", comm, lambda t, c=comm: P.all_sum_reduce(t, c),
                 lambda t, c=comm: P.all_sum_reduce_op(t, c), x, y)


@check
def all_gather_and_reduce_scatter_uneven() -> None:
    for where, comm, dtype in cases():
        for dim, total in ((0, 2 * comm.size + 1), (1, comm.size + 2), (2, max(comm.size - 1, 1)),
                           (1, 1)):  # the last two leave some ranks with empty pieces
            part = Partition(total, comm.size)
            shape = [3, 4, 2]
            piece_shape = list(shape)
            piece_shape[dim] = part.sizes[comm.rank]
            full_shape = list(shape)
            full_shape[dim] = total
            whole = seeded(full_shape, 50 + dim, dtype)  # every rank can rebuild it
            piece = whole.narrow(dim, part.offsets[comm.rank], part.sizes[comm.rank]).clone()
            assert torch.equal(P.all_gather_op(piece, comm, dim, part), whole), where
            x = seeded(piece_shape, 60 + comm.rank, dtype)
            y = seeded(full_shape, 70 + comm.rank, dtype)
            dot_test(f"all_gather {where} dim {dim} {part}", comm,
                     lambda t, c=comm, d=dim, p=part: P.all_gather(t, c, d, p),
                     lambda t, c=comm, d=dim, p=part: P.reduce_scatter_op(t, c, d, p), x, y)
            dot_test(f"reduce_scatter {where} dim {dim} {part}", comm,
                     lambda t, c=comm, d=dim, p=part: P.reduce_scatter(t, c, d, p),
                     lambda t, c=comm, d=dim, p=part: P.all_gather_op(t, c, d, p), y, x)


@check
def nonblocking_all_gather_equals_the_blocking_one() -> None:
    """The all-gather issued without waiting (`iallgatherv_`, `all_gather_start`): the same
    result and the same record as the blocking one (under either backend, a group of one's
    transport included), and its differentiable end (`all_gather_wait`) the same adjoint."""
    for grid, groups in grids():
        keep = grid.counter.keep_records
        grid.counter.keep_records = True
        for group_name, comm in groups.items():
            for dtype in (torch.float32, torch.bfloat16):
                # uneven pieces (gloo: an all-to-all), then even ones (gloo's own all-gather)
                part = Partition(comm.size + 1 if dtype == torch.float32 else 2 * comm.size,
                                 comm.size)
                whole = seeded((part.total, 3), 210, torch.float32).to(dtype)
                piece = whole[part.slice(comm.rank)].clone()
                if comm.transport is not None:  # the communicator's own calls, a group of one too
                    counts = part.counts(3)
                    blocking = torch.empty_like(whole)
                    comm.allgatherv_(piece, blocking, counts, "blocking")
                    started = torch.full_like(whole, -1)
                    pending = comm.iallgatherv_(piece, started, counts, "started")
                    pending.wait()
                    assert torch.equal(started, blocking) and torch.equal(blocking, whole), (
                        group_name, dtype)
                    both = [(r.op, r.group, r.group_size, r.nbytes) for r in grid.counter.records
                            if r.label in ("blocking", "started")]
                    assert both[0] == both[1] == ("allgather", comm.name, comm.size,
                                                  whole.numel() * whole.element_size()), both
                    grid.counter.records.clear()
            for dim, total in ((0, 2 * comm.size + 1), (1, max(comm.size - 1, 1))):
                dtype = torch.float64
                part = Partition(total, comm.size)
                full_shape = [3, 4, 2]
                full_shape[dim] = total
                whole = seeded(full_shape, 220 + dim, dtype)
                piece = whole.narrow(dim, part.offsets[comm.rank], part.sizes[comm.rank])
                started = P.all_gather_start(piece, comm, dim, part, "started")  # a view
                blocking = P.all_gather_op(piece, comm, dim, part, "blocking")
                assert torch.equal(started.wait(), blocking) and torch.equal(blocking, whole)
                assert started.done and started.wait() is started.wait()
                records = [(r.op, r.nbytes) for r in grid.counter.records
                           if r.label in ("blocking", "started")]
                assert records == ([] if comm.size == 1 else
                                   [("allgather", whole.numel() * 8)] * 2), records
                grid.counter.records.clear()
                x = seeded(piece.shape, 230 + comm.rank, dtype)
                y = seeded(full_shape, 240 + comm.rank, dtype)
                dot_test(f"all_gather_wait {group_name} dim {dim} {part}", comm,
                         lambda t, c=comm, d=dim, p=part: P.all_gather_wait(
                             t, P.all_gather_start(t, c, d, p)),
                         lambda t, c=comm, d=dim, p=part: P.reduce_scatter_op(t, c, d, p), x, y)
        grid.counter.keep_records = keep
        grid.counter.records.clear()


@check
def native_collectives_equal_the_host_path() -> None:
    """The calls CUDA tensors take under NCCL where host tensors take others
    (`TorchTransport.native_on_host`: the all-gather of uneven pieces padded to the longest and
    cut, blocking and not, and the reduce-scatter, padded where blocks are uneven), run here on
    gloo: the host path's results and records. Under "mpi" one path against itself. And under
    "torch" every group was made with the process groups' timeout."""
    from runner.core.torchdist import process_group_timeout

    for grid, groups in grids():
        keep = grid.counter.keep_records
        grid.counter.keep_records = True
        for group_name, comm in groups.items():
            transport = comm.transport
            if transport is None:
                continue
            if hasattr(transport, "groups"):
                for backend in transport.groups.backends.values():
                    assert backend.options._timeout == process_group_timeout(COMM_TIMEOUT_S)
            for dtype, total in ((torch.float32, 2 * comm.size + 1),
                                 (torch.float32, max(comm.size - 1, 1)),  # some pieces empty
                                 (torch.float32, 2 * comm.size),  # even
                                 (torch.bfloat16, comm.size + 1)):
                part = Partition(total, comm.size)
                counts = part.counts(3)
                # whole numbers: sums exact in any order, bf16 included
                whole = (seeded((total, 3), 250, torch.float32) * 8).round().to(dtype)
                full = (seeded((total, 3), 260 + comm.rank, torch.float32) * 8).round().to(dtype)
                piece = whole[part.slice(comm.rank)].clone()
                paths = []
                for native in (False, True):
                    if hasattr(transport, "native_on_host"):
                        transport.native_on_host = native
                    gathered = torch.full_like(whole, -1)
                    comm.allgatherv_(piece, gathered, counts, "native")
                    started = torch.full_like(whole, -1)
                    comm.iallgatherv_(piece, started, counts, "native").wait()
                    scattered = torch.full((part.sizes[comm.rank], 3), -1, dtype=dtype)
                    comm.reduce_scatter_(full, scattered, counts, "native")
                    records = [(r.op, r.group, r.group_size, r.nbytes)
                               for r in grid.counter.records if r.label == "native"]
                    grid.counter.records.clear()
                    paths.append((gathered, started, scattered, records))
                if hasattr(transport, "native_on_host"):
                    transport.native_on_host = False
                (host, *_), (native_out, *_) = paths
                assert torch.equal(host, whole) and torch.equal(native_out, whole), group_name
                for a, b in zip(paths[0], paths[1], strict=True):
                    assert (a == b) if isinstance(a, list) else torch.equal(a, b), (
                        group_name, dtype, total, a, b)
                nbytes = whole.numel() * whole.element_size()
                assert paths[1][3] == [("allgather", comm.name, comm.size, nbytes)] * 2 + [
                    ("reduce_scatter", comm.name, comm.size, nbytes)], paths[1][3]
        grid.counter.keep_records = keep
        grid.counter.records.clear()


@check
def take_piece_and_place_piece_uneven() -> None:
    for where, comm, dtype in cases():
        for dim, total in ((1, comm.size + 2), (0, max(comm.size - 1, 1))):
            part = Partition(total, comm.size)
            full_shape, piece_shape = [3, 4], [3, 4]
            full_shape[dim], piece_shape[dim] = total, part.sizes[comm.rank]
            whole = seeded(full_shape, 80 + dim, dtype)
            own = whole.narrow(dim, part.offsets[comm.rank], part.sizes[comm.rank])
            assert torch.equal(P.take_piece_op(whole, comm, dim, part), own), where
            x = seeded(full_shape, 90 + comm.rank, dtype)
            y = seeded(piece_shape, 100 + comm.rank, dtype)
            dot_test(f"take_piece {where} dim {dim} {part}", comm,
                     lambda t, c=comm, d=dim, p=part: P.take_piece(t, c, d, p),
                     lambda t, c=comm, d=dim, p=part: P.place_piece_op(t, c, d, p), x, y)
            dot_test(f"place_piece {where} dim {dim} {part}", comm,
                     lambda t, c=comm, d=dim, p=part: P.place_piece(t, c, d, p),
                     lambda t, c=comm, d=dim, p=part: P.take_piece_op(t, c, d, p), y, x)


@check
def repartition_and_its_reverse_uneven() -> None:
    for where, comm, dtype in cases():
        for shape, a, b in (((2 * comm.size + 1, comm.size + 3), 0, 1),
                            ((comm.size + 1, 3, 2 * comm.size - 1, 2), 2, 0),
                            ((comm.size - 1 or 1, 5), 1, 0)):
            split_a, split_b = Partition(shape[a], comm.size), Partition(shape[b], comm.size)
            whole = seeded(shape, 80 + a, dtype)
            piece_a = whole.narrow(a, split_a.offsets[comm.rank], split_a.sizes[comm.rank])
            piece_b = whole.narrow(b, split_b.offsets[comm.rank], split_b.sizes[comm.rank])
            moved = P.repartition_op(piece_a.clone(), comm, a, split_a, b, split_b)
            assert torch.equal(moved, piece_b), where
            x = seeded(piece_a.shape, 90 + comm.rank, dtype)
            y = seeded(piece_b.shape, 100 + comm.rank, dtype)
            dot_test(f"repartition {where} {a}->{b} {shape}", comm,
                     lambda t, c=comm, a=a, b=b, sa=split_a, sb=split_b:
                         P.repartition(t, c, a, sa, b, sb),
                     lambda t, c=comm, a=a, b=b, sa=split_a, sb=split_b:
                         P.repartition_op(t, c, b, sb, a, sa), x, y)


@check
def exchange_rows_and_its_reverse_uneven() -> None:
    # uneven counts, zeros among them (a rank sending nothing to one, receiving nothing from
    # another), as a mixture of experts' router makes them; every rank's counts from one table
    for where, comm, dtype in cases():
        p, me = comm.size, comm.rank
        counts = [[(3 * i + 2 * j + 1) % 4 for j in range(p)] for i in range(p)]  # i sends j
        send, recv = tuple(counts[me]), tuple(counts[i][me] for i in range(p))
        rows = [seeded((counts[i][j], 3, 2), 110 + 10 * i + j, dtype)
                for i in range(p) for j in range(p)]  # the block i sends to j
        x = torch.cat([rows[me * p + j] for j in range(p)])
        moved = P.exchange_rows_op(x, comm, send, recv)
        assert torch.equal(moved, torch.cat([rows[i * p + me] for i in range(p)])), where
        assert torch.equal(P.exchange_rows_op(moved, comm, recv, send), x), where  # and back
        y = seeded(moved.shape, 140 + me, dtype)
        dot_test(f"exchange_rows {where}", comm,
                 lambda t, c=comm, s=send, r=recv: P.exchange_rows(t, c, s, r),
                 lambda t, c=comm, s=send, r=recv: P.exchange_rows_op(t, c, r, s), x, y)


def halo_cases(group_size: int):
    """(input length, window) pairs: uneven slabs, thin slabs (halo wider than a slab)."""
    for n_in in (3 * group_size + 2, group_size + 1, 2 * group_size + 5):
        for kernel, stride, padding in ((1, 1, 0), (3, 1, 1), (3, 2, 1), (5, 1, 2), (5, 2, 0),
                                        (2, 2, 0), (3, 1, 0)):
            window = H.Window(kernel, stride, padding)
            if window.out_size(n_in) >= group_size:  # every rank keeps an output row
                yield n_in, window


@check
def halo_exchange_adjoint_1d() -> None:
    for where, comm, dtype in cases():
        for n_in, window in halo_cases(comm.size):
            plan = H.HaloPlan(n_in, window, comm.size, comm.rank)
            whole = seeded((2, 3, n_in, 4), 110, dtype)
            slab = whole.narrow(2, plan.own_rows[0], plan.own_rows[1] - plan.own_rows[0])
            got = H.halo_exchange_op(slab.clone(), comm, 2, plan)
            lo, hi = plan.window_rows
            assert torch.equal(got, whole[:, :, lo:hi]), (where, n_in, window)
            x = seeded(slab.shape, 120 + comm.rank, dtype)
            y = seeded(got.shape, 130 + comm.rank, dtype)
            dot_test(f"halo {where} n={n_in} {window}", comm,
                     lambda t, c=comm, p=plan: H.halo_exchange(t, c, 2, p),
                     lambda t, c=comm, p=plan: H.halo_accumulate_op(t, c, 2, p), x, y)


@check
def halo_exchange_adjoint_2d() -> None:
    """Height split over the model group, width over the batch group: the composition of the two
    exchanges (corners included) against the composition of the two adjoints."""
    for grid, groups in grids():
        rows, cols = groups["model"], groups["batch"]
        for dtype in (torch.float32, torch.float64):
            for (nh, wh), (nw, ww) in (((2 * rows.size + 3, H.Window(3, 1, 1)),
                                        (3 * cols.size + 1, H.Window(5, 1, 2))),
                                       ((rows.size + 2, H.Window(3, 2, 1)),
                                        (2 * cols.size + 1, H.Window(3, 1, 0)))):
                if wh.out_size(nh) < rows.size or ww.out_size(nw) < cols.size:
                    continue
                ph = H.HaloPlan(nh, wh, rows.size, rows.rank)
                pw = H.HaloPlan(nw, ww, cols.size, cols.rank)
                shape = (2, 2, ph.own_rows[1] - ph.own_rows[0], pw.own_rows[1] - pw.own_rows[0])
                x = seeded(shape, 140 + grid.rank, dtype)

                def forward(t, ph=ph, pw=pw, rows=rows, cols=cols):
                    return H.halo_exchange(H.halo_exchange(t, rows, 2, ph), cols, 3, pw)

                def adjoint(t, ph=ph, pw=pw, rows=rows, cols=cols):
                    return H.halo_accumulate_op(H.halo_accumulate_op(t, cols, 3, pw), rows, 2, ph)

                out_shape = forward(x).shape
                y = seeded(out_shape, 150 + grid.rank, dtype)
                dot_test(f"halo 2d {grid.pr}x{grid.pc} {nh}x{nw}", grid.world, forward, adjoint,
                         x, y)


@check
def halo_plans_cover_every_needed_row_once() -> None:
    for size in range(1, 7):
        for n_in, window in halo_cases(size):
            plans = [H.HaloPlan(n_in, window, size, r) for r in range(size)]
            for r, plan in enumerate(plans):
                covered = [i for _, (lo, hi) in plan.pieces for i in range(lo, hi)]
                assert covered == list(range(*plan.window_rows)), (n_in, window, r)
                # what r receives from q is exactly what q sends to r
                for q, rows in plan.pieces:
                    if q != r:
                        assert (r, rows) in plans[q].sends, (n_in, window, r, q)
            assert sum(p.send_rows for p in plans) == sum(p.recv_rows for p in plans)


@check
def every_call_is_counted_with_its_payload() -> None:
    for grid, groups in grids():
        comm = groups["world"]
        if comm.size == 1:
            continue
        grid.counter.keep_records = True
        part = Partition(2 * comm.size + 1, comm.size)
        x = torch.zeros(part.sizes[comm.rank], 3)
        P.all_gather_op(x, comm, 0, part, label="t")
        P.reduce_scatter_op(torch.zeros(part.total, 3), comm, 0, part, label="t")
        records = [r for r in grid.counter.records if r.label == "t"]
        assert [(r.op, r.nbytes, r.group_size) for r in records] == [
            ("allgather", part.total * 3 * 4, comm.size),
            ("reduce_scatter", part.total * 3 * 4, comm.size)], records


# Pairs of splits (one tuple of grid dims per tensor dim) on the grid (pc, pr): grid dim 0 is
# the batch index, 1 the model index. Shapes are made uneven, and with empty pieces, per grid.
REDISTRIBUTIONS_2D = [
    (((0,), (1,)), ((1,), (0,))),  # split ↔ split along other dims
    (((0, 1), ()), ((1, 0), ())),  # nested splits reversed
    (((0, 1), ()), ((), ())),  # split → replicated: an all-gather
    (((), ()), ((0, 1), ())),  # replicated → split: local
    (((1,), ()), ((0,), ())),  # replicated over one grid dim ↔ split over the other
    (((), (1,)), ((1,), ())),  # a repartition inside each model group
    (((0,), (1,)), ((0,), (1,))),  # identity
    (((0, 1), ()), ((0,), (1,))),  # rows → columns inside each batch group
]
REDISTRIBUTIONS_4D = [
    (((0,), (), (1,), ()), ((), (1, 0), (), ())),
    (((), (1,), (), (0,)), ((0,), (), (), (1,))),
    (((), (), (1,), ()), ((), (0,), (), ())),  # tensor dim 2 is 1 long: empty pieces
    (((), (), (), (0, 1)), ((), (), (), ())),
    (((0,), (), (1,), ()), ((0, 1), (), (), ())),
]
FLOAT64_CASES = {1, 4, 8}  # indexes into the concatenated list: the rest in float32 only


def redistribution_cases(pc: int, pr: int):
    """(index, src, dst) on the grid (pc, pr)."""
    size = pc * pr
    shape_2d, shape_4d = (2 * size + 1, pr + 1), (pc + 1, pr + 2, 1, 2 * pc + 1)
    pairs = ([(shape_2d, a, b) for a, b in REDISTRIBUTIONS_2D]
             + [(shape_4d, a, b) for a, b in REDISTRIBUTIONS_4D])
    for index, (shape, a, b) in enumerate(pairs):
        yield (index, CartesianPartition(shape, (pc, pr), a),
               CartesianPartition(shape, (pc, pr), b))


@check
def redistribute_between_cartesian_partitions() -> None:
    for grid, groups in grids():
        comm = groups["world"]
        coords = (grid.batch_index, grid.model_index)
        for index, src, dst in redistribution_cases(grid.pc, grid.pr):
            assert src.coords(comm.rank) == coords, (src, comm.rank, coords)
            whole = seeded(src.shape, 160 + index, torch.float32)  # every rank rebuilds it
            for data in (whole, whole.to(torch.bfloat16), (whole * 100).to(torch.int32)):
                # the piece as a view of the whole tensor: not contiguous
                moved = redistribute_op(data[src.box(coords)], comm, src, dst)
                assert moved.dtype == data.dtype and torch.equal(
                    moved, data[dst.box(coords)]), (src, dst, grid, data.dtype)
            for dtype in (torch.float32, torch.float64) if index in FLOAT64_CASES else (
                    torch.float32,):
                x = seeded(src.local_shape(coords), 170 + grid.rank, dtype)
                y = seeded(dst.local_shape(coords), 180 + grid.rank, dtype)
                dot_test(f"redistribute {grid.pr}x{grid.pc} {src} -> {dst}", comm,
                         lambda t, c=comm, a=src, b=dst: redistribute(t, c, a, b),
                         lambda t, c=comm, a=src, b=dst: redistribute_adjoint_op(t, c, a, b),
                         x, y)


@check
def redistribute_inside_the_model_group_and_its_bytes() -> None:
    """A movement whose source and destination split the batch grid dim alike (outermost, or
    not at all) runs inside the model group on the `fix`ed partitions, with the same pieces
    and bytes as over the world; every rank records what `redistribute_send_bytes` (forward)
    and `redistribute_recv_bytes` (adjoint) predict, and nothing when no data moves."""
    for grid, groups in grids():
        world, model = groups["world"], groups["model"]
        coords = (grid.batch_index, grid.model_index)
        keep = grid.counter.keep_records
        grid.counter.keep_records = True
        for index, src, dst in redistribution_cases(grid.pc, grid.pr):
            whole = seeded(src.shape, 190 + index, torch.float64)
            x = whole[src.box(coords)].clone()
            y = seeded(dst.local_shape(coords), 200 + grid.rank, torch.float64)
            label = f"redistribute {index}"
            out = redistribute_op(x, world, src, dst, label)
            redistribute_adjoint_op(y, world, src, dst, label + " adjoint")
            sent, moves = redistribute_send_bytes(src, dst, world.rank, 8)
            received, _ = redistribute_recv_bytes(src, dst, world.rank, 8)
            records = [(r.op, r.group, r.group_size, r.nbytes) for r in grid.counter.records
                       if r.label.startswith(label)]
            assert records == ([("alltoallv", "world", world.size, sent),
                                ("alltoallv", "world", world.size, received)]
                               if moves and world.size > 1 else []), (src, dst, records)
            grid.counter.records.clear()
            outer = outermost_split(src, 0)
            if outer != outermost_split(dst, 0) or outer == "nested":
                continue
            src_in, dst_in = src.fix(0, grid.batch_index), dst.fix(0, grid.batch_index)
            assert torch.equal(redistribute_op(x, model, src_in, dst_in, label), out), (src, dst)
            assert redistribute_send_bytes(src_in, dst_in, model.rank, 8)[0] == sent
            records = [(r.op, r.group, r.nbytes) for r in grid.counter.records]
            assert records == ([("alltoallv", "model", sent)]
                               if model.size > 1 and moves_in(src_in, dst_in) else []), records
            grid.counter.records.clear()
        grid.counter.keep_records = keep


def outermost_split(part: CartesianPartition, grid_dim: int) -> int | str | None:
    """The tensor dim `grid_dim` splits outermost, None if it splits none, "nested" if it is
    nested inside another grid dim (then `fix` refuses it)."""
    for dim, split in enumerate(part.splits):
        if grid_dim in split:
            return dim if split[0] == grid_dim else "nested"
    return None


def moves_in(src: CartesianPartition, dst: CartesianPartition) -> bool:
    return redistribute_send_bytes(src, dst, 0, 1)[1]


if __name__ == "__main__":
    run_checks()
