"""Cartesian partitions and the redistribution plan, without MPI: boxes, the row contract,
`fix`, the exchange the plans describe (simulated between ranks in one process), and the O(P)
byte prediction against the O(P²) count of box intersections. The operator itself runs over
MPI in tests/mpi/check_core.py."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from runner.core import CartesianPartition, Partition
from runner.core.cartesian import (
    moves_data,
    redistribute_recv_bytes,
    redistribute_send_bytes,
    redistribution_plan,
)


def random_partition(rng: random.Random, shape: tuple[int, ...],
                     grid: tuple[int, ...]) -> CartesianPartition:
    """Each grid dim splits a random tensor dim (in a random nesting order) or holds replicas."""
    splits: list[list[int]] = [[] for _ in shape]
    grid_dims = list(range(len(grid)))
    rng.shuffle(grid_dims)
    for g in grid_dims:
        if shape and rng.random() < 0.75:
            splits[rng.randrange(len(shape))].append(g)
    return CartesianPartition(shape, grid, splits)


def random_pairs(count: int, seed: int = 0, max_ranks: int = 24):
    rng = random.Random(seed)
    while count:
        grid = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        if math.prod(grid) > max_ranks:
            continue
        shape = tuple(rng.randint(0, 7) for _ in range(rng.randint(0, 3)))
        yield random_partition(rng, shape, grid), random_partition(rng, shape, grid)
        count -= 1


def cells(box: tuple[slice, ...]) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(s.start, s.stop) for s in box)))


def volume(a: tuple[slice, ...], b: tuple[slice, ...]) -> int:
    return math.prod(max(0, min(x.stop, y.stop) - max(x.start, y.start))
                     for x, y in zip(a, b, strict=True))


def brute_force_sent(src: CartesianPartition, dst: CartesianPartition) -> list[int]:
    """Elements each rank sends to other ranks, from every pair's box intersection."""
    sent = [0] * src.size
    for s, q in itertools.product(range(src.size), repeat=2):
        cs, cq = src.coords(s), src.coords(q)
        if s != q and all(cs[g] == cq[g] for g in src.replica_dims):
            sent[s] += volume(src.box(cs), dst.box(cq))
    return sent


# -- partitions -------------------------------------------------------------------------------


def test_ranks_are_row_major_like_the_process_grid() -> None:
    pc, pr = 2, 3
    part = CartesianPartition((5,), (pc, pr), [(0,)])
    for batch_index, model_index in itertools.product(range(pc), range(pr)):
        rank = batch_index * pr + model_index
        assert part.coords(rank) == (batch_index, model_index)
        assert part.rank_of((batch_index, model_index)) == rank
    assert part.size == 6


def test_boxes_cover_the_tensor_once_per_replica_set() -> None:
    for src, _ in random_pairs(200, seed=1):
        replicas = src.replica_dims
        holders: dict[tuple[int, ...], list[set[tuple[int, ...]]]] = {}
        for rank in range(src.size):
            coords = src.coords(rank)
            box = src.box(coords)
            assert src.local_shape(coords) == tuple(s.stop - s.start for s in box)
            holders.setdefault(tuple(coords[g] for g in replicas), []).append(cells(box))
        everything = cells(tuple(slice(0, n) for n in src.shape))
        for pieces in holders.values():
            assert set().union(*pieces) == everything, src
            assert sum(len(p) for p in pieces) == len(everything), src


def test_nested_splits_are_the_row_contract() -> None:
    """Rows over (batch, model): Partition(B, pc), then each group's rows over pr."""
    for batch, pc, pr in ((10, 2, 3), (7, 3, 2), (2, 2, 3), (0, 2, 2), (13, 1, 4)):
        part = CartesianPartition((batch, 5), (pc, pr), [(0, 1), ()])
        groups = Partition(batch, pc)
        for b, m in itertools.product(range(pc), range(pr)):
            rows = Partition(groups.sizes[b], pr)
            start = groups.offsets[b] + rows.offsets[m]
            assert part.box((b, m)) == (slice(start, start + rows.sizes[m]), slice(0, 5))


def test_fix_is_the_piece_over_the_other_grid_dims() -> None:
    part = CartesianPartition((11, 4, 3), (2, 3, 2), [(0, 1), (), (2,)])
    for b in range(2):
        fixed = part.fix(0, b)
        groups = Partition(11, 2)
        assert fixed == CartesianPartition((groups.sizes[b], 4, 3), (3, 2), [(0,), (), (1,)])
        for coords in itertools.product(range(3), range(2)):
            outer = part.box((b, *coords))
            inner = fixed.box(coords)
            assert outer[0].start == groups.offsets[b] + inner[0].start
            assert outer[1:] == inner[1:]
    # a replica dim: the same tensor over the other grid dims
    replicated = CartesianPartition((6, 5), (2, 3), [(1,), ()])
    assert replicated.fix(0, 1) == CartesianPartition((6, 5), (3,), [(0,), ()])
    assert replicated.fix(1, 2) == CartesianPartition((2, 5), (2,), [(), ()])
    with pytest.raises(ValueError, match="nested inside grid dim 0"):
        part.fix(1, 0)
    with pytest.raises(ValueError, match="outside"):
        part.fix(3, 0)
    with pytest.raises(ValueError, match="coordinate 2"):
        part.fix(0, 2)


def test_constructor_refuses_bad_splits() -> None:
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        CartesianPartition((4, 4), (2, 2), [(2,), ()])
    with pytest.raises(ValueError, match="grid dim 0 splits tensor dim 0 and tensor dim 1"):
        CartesianPartition((4, 4), (2, 2), [(0,), (0,)])
    with pytest.raises(ValueError, match="at most one, once"):
        CartesianPartition((4,), (2, 2), [(1, 1)])
    with pytest.raises(ValueError, match="one split per tensor dim"):
        CartesianPartition((4, 4), (2, 2), [(0,)])
    with pytest.raises(ValueError, match="grid sizes"):
        CartesianPartition((4,), (0,), [()])
    with pytest.raises(ValueError, match="tensor sizes"):
        CartesianPartition((-1,), (2,), [()])
    with pytest.raises(ValueError, match="rank 6"):
        CartesianPartition((4,), (2, 3), [()]).coords(6)


def test_partitions_are_values_and_describe_themselves() -> None:
    a = CartesianPartition([8, 5], [2, 3], [[0], []])
    b = CartesianPartition((8, 5), (2, 3), ((0,), ()))
    assert a == b and hash(a) == hash(b)
    assert a.replica_dims == (1,)
    assert a.describe() == "(8 over [0], 5 whole) on 2x3, replicas over [1]"
    assert repr(CartesianPartition((8,), (2, 3), [(1, 0)])) == \
        "CartesianPartition(8 over [1, 0]) on 2x3"


# -- the movement -------------------------------------------------------------------------------


def simulate(src: CartesianPartition, dst: CartesianPartition,
             pieces: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's plan run in one process: sends matched to receives by peer order."""
    plans = [redistribution_plan(src, dst, r) for r in range(src.size)]
    outs = []
    for q, plan in enumerate(plans):
        out = torch.full(plan.dst_shape, float("nan"))
        if plan.local is not None:
            out[plan.local[1]] = pieces[q][plan.local[0]]
        for block in plan.recvs:
            (sent,) = [b for b in plans[block.peer].sends if b.peer == q]
            assert sent.shape == block.shape
            out[block.box] = pieces[block.peer][sent.box]
        outs.append(out)
    return outs


def test_plans_move_every_piece_where_it_belongs() -> None:
    for src, dst in random_pairs(150, seed=2):
        whole = torch.arange(math.prod(src.shape), dtype=torch.float64).reshape(src.shape)
        pieces = [whole[src.box(src.coords(r))] for r in range(src.size)]
        for r, out in enumerate(simulate(src, dst, pieces)):
            assert torch.equal(out, whole[dst.box(dst.coords(r))]), (src, dst, r)


def test_replicas_read_their_own_copy_and_local_moves_stay_local() -> None:
    whole = CartesianPartition((6, 4), (2, 3), [(), ()])
    rows_over_model = CartesianPartition((6, 4), (2, 3), [(1,), ()])
    rows_over_both = CartesianPartition((6, 4), (2, 3), [(0, 1), ()])
    assert not moves_data(whole, rows_over_model)  # replicated → split: local
    assert not moves_data(whole, rows_over_both)
    assert not moves_data(rows_over_model, rows_over_model)
    assert moves_data(rows_over_model, whole)  # an all-gather
    # replicated over the batch dim: every rank reads only from its own batch index's copies
    for r in range(6):
        plan = redistribution_plan(rows_over_model, whole, r)
        assert {whole.coords(b.peer)[0] for b in plan.recvs} == {whole.coords(r)[0]}
    assert redistribute_send_bytes(whole, rows_over_model, 0, 4) == (0, False)


def test_byte_prediction_is_the_count_of_box_intersections() -> None:
    for src, dst in random_pairs(300, seed=3):
        brute = brute_force_sent(src, dst)
        moves = any(brute)
        assert moves_data(src, dst) == moves, (src, dst)
        received = [0] * src.size
        for r in range(src.size):
            plan = redistribution_plan(src, dst, r)
            assert plan.collective == moves
            assert sum(plan.send_counts) == brute[r]
            for block in plan.sends:
                received[block.peer] += block.numel
            assert redistribute_send_bytes(src, dst, r, 4) == (4 * brute[r] if moves else 0,
                                                                moves), (src, dst, r)
        for r in range(src.size):
            assert redistribute_recv_bytes(src, dst, r, 2) == (2 * received[r] if moves else 0,
                                                                moves), (src, dst, r)
