"""Cartesian partitions of a tensor over a process grid, and the redistribution between any two.

A `CartesianPartition` says which piece of a global tensor every rank of a grid holds: each
tensor dim is split over a (possibly empty) sequence of grid dims, outer first and nested, and
the grid dims no split uses hold replicas. It generalises the one-dim `Partition` (which is the
partition of a 1-D tensor over a grid of one dim) and gridrun's row contract: rows split over
the batch group, then each group's rows over the model group (`splits=((0, 1), ...)` on the
grid `(pc, pr)`).

`redistribute` moves a tensor from one Cartesian partition to another on the same grid — split
to split along other dims, nested splits reversed, split to replicated (an all-gather),
replicated to split (local), ... — as one sparse all-to-all-v, with its adjoint written out
(DistDL's view: a partition is an object, a data movement a set of box intersections).

Source rule. When the source is replicated over some grid dims, the data of rank q's
destination piece that lies in source box A_s is read from rank s only if s has q's own
coordinates on every source replica dim. Among the source ranks with those coordinates the
boxes cover the tensor exactly once, so the operator is well defined, and what a rank already
holds stays local (replicated → split along the replica dim copies nothing between ranks).

Adjoint. Every destination piece's data goes back to the source rank it was read from and is
summed there; a source copy nobody read from gets zeros. So destination replicas' gradients
are summed (as all-gather's adjoint, reduce-scatter, does), and each copy of a replicated
source receives the gradient of what was read from it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from runner.core.comm import CountedComm
from runner.core.partition import balanced_slice
from runner.core.primitives import _operator, _scratch

Interval = tuple[int, int]  # [start, stop) of one tensor dim
Box = tuple[slice, ...]


@dataclass(frozen=True)
class CartesianPartition:
    """A tensor of global `shape` over a process grid of `grid` sizes.

    Ranks map to grid coordinates row-major, the last grid dim fastest: on `ProcessGrid` the
    grid is `(pc, pr)`, grid dim 0 the batch index and grid dim 1 the model index, and world
    rank = batch_index · pr + model_index.

    `splits[d]` lists the grid dims tensor dim `d` is split over, outer first and nested: over
    `(a, b)` means balanced pieces over grid dim `a`, each of them split again into balanced
    pieces over `b` (not one flat partition over a·b ranks). A grid dim is used by at most one
    tensor dim; the grid dims no split uses hold replicas (`replica_dims`). Pieces may be
    uneven and empty.
    """

    shape: tuple[int, ...]
    grid: tuple[int, ...]
    splits: tuple[tuple[int, ...], ...]

    def __init__(self, shape: Sequence[int], grid: Sequence[int],
                 splits: Sequence[Sequence[int]] | None = None) -> None:
        # Tuples whatever the caller passed: the partition is a key of plan caches.
        object.__setattr__(self, "shape", tuple(int(n) for n in shape))
        object.__setattr__(self, "grid", tuple(int(n) for n in grid))
        object.__setattr__(self, "splits", tuple(tuple(int(g) for g in dims) for dims in (
            splits if splits is not None else [() for _ in self.shape])))
        self._validate()

    def _validate(self) -> None:
        if any(n < 0 for n in self.shape):
            raise ValueError(f"tensor sizes must be >= 0, got shape {self.shape}")
        if any(n < 1 for n in self.grid):
            raise ValueError(f"grid sizes must be >= 1, got grid {self.grid}")
        if len(self.splits) != len(self.shape):
            raise ValueError(f"one split per tensor dim: shape {self.shape} has "
                             f"{len(self.shape)} dims, splits {self.splits} has "
                             f"{len(self.splits)}")
        used: dict[int, int] = {}
        for dim, grid_dims in enumerate(self.splits):
            for g in grid_dims:
                if not 0 <= g < len(self.grid):
                    raise ValueError(f"tensor dim {dim} is split over grid dim {g}, outside "
                                     f"0..{len(self.grid) - 1} of grid {self.grid}")
                if g in used:
                    raise ValueError(f"grid dim {g} splits tensor dim {used[g]} and tensor "
                                     f"dim {dim}: a grid dim splits at most one, once")
                used[g] = dim

    # -- ranks and coordinates -------------------------------------------------------------

    @property
    def size(self) -> int:
        """The number of ranks of the grid."""
        return math.prod(self.grid)

    def coords(self, rank: int) -> tuple[int, ...]:
        """Grid coordinates of `rank` (row-major: the last grid dim fastest)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside 0..{self.size - 1} of grid {self.grid}")
        coords = []
        for n in reversed(self.grid):
            rank, c = divmod(rank, n)
            coords.append(c)
        return tuple(reversed(coords))

    def rank_of(self, coords: Sequence[int]) -> int:
        """The rank at grid coordinates `coords`."""
        if len(coords) != len(self.grid) or any(
                not 0 <= c < n for c, n in zip(coords, self.grid, strict=True)):
            raise ValueError(f"coordinates {tuple(coords)} outside grid {self.grid}")
        rank = 0
        for c, n in zip(coords, self.grid, strict=True):
            rank = rank * n + c
        return rank

    @property
    def replica_dims(self) -> tuple[int, ...]:
        """The grid dims no tensor dim is split over: ranks differing only there hold copies."""
        used = {g for grid_dims in self.splits for g in grid_dims}
        return tuple(g for g in range(len(self.grid)) if g not in used)

    # -- pieces ----------------------------------------------------------------------------

    def interval(self, dim: int, coords: Sequence[int]) -> Interval:
        """[start, stop) along tensor dim `dim` of the piece at `coords` (nested balanced
        pieces over the grid dims of `splits[dim]`, outer first)."""
        start, stop = 0, self.shape[dim]
        for g in self.splits[dim]:
            sub = balanced_slice(stop - start, self.grid[g], coords[g])
            start, stop = start + sub.start, start + sub.stop
        return start, stop

    def intervals(self, coords: Sequence[int]) -> tuple[Interval, ...]:
        return tuple(self.interval(d, coords) for d in range(len(self.shape)))

    def box(self, coords: Sequence[int]) -> Box:
        """The global index box of the piece the rank at `coords` holds (maybe empty)."""
        return tuple(slice(a, b) for a, b in self.intervals(coords))

    def local_shape(self, coords: Sequence[int]) -> tuple[int, ...]:
        """The shape of the piece the rank at `coords` holds."""
        return tuple(b - a for a, b in self.intervals(coords))

    # -- sub-groups ------------------------------------------------------------------------

    def fix(self, grid_dim: int, coord: int) -> CartesianPartition:
        """The piece at `grid_dim = coord` as a partition over the remaining grid dims: its
        shape that piece's extent, the grid without `grid_dim`, the splits without it.

        A movement whose source and destination both fix the same grid dim at the rank's own
        coordinate runs inside the sub-group of the other grid dims (the model group, say)
        and gives the same pieces as the movement over the whole grid. Only an unused grid dim
        (a replica dim) or the outermost of its tensor dim's split can be fixed: an inner one
        does not make the ranks sharing its coordinate hold one box."""
        if not 0 <= grid_dim < len(self.grid):
            raise ValueError(f"grid dim {grid_dim} outside 0..{len(self.grid) - 1} of grid "
                             f"{self.grid}")
        if not 0 <= coord < self.grid[grid_dim]:
            raise ValueError(f"coordinate {coord} outside 0..{self.grid[grid_dim] - 1} of grid "
                             f"dim {grid_dim}")
        shape = list(self.shape)
        for dim, grid_dims in enumerate(self.splits):
            if grid_dim in grid_dims:
                if grid_dims[0] != grid_dim:
                    raise ValueError(f"cannot fix grid dim {grid_dim} of {self.describe()}: it "
                                     f"is nested inside grid dim {grid_dims[0]} in the split "
                                     f"of tensor dim {dim}")
                piece = balanced_slice(self.shape[dim], self.grid[grid_dim], coord)
                shape[dim] = piece.stop - piece.start

        def renumber(g: int) -> int:
            return g - 1 if g > grid_dim else g

        grid = self.grid[:grid_dim] + self.grid[grid_dim + 1:]
        splits = [tuple(renumber(g) for g in grid_dims if g != grid_dim)
                  for grid_dims in self.splits]
        return CartesianPartition(shape, grid, splits)

    # -- text ------------------------------------------------------------------------------

    def describe(self) -> str:
        """E.g. "(8 over [0], 5 whole) on 2x3, replicas over [1]"."""
        dims = ", ".join(f"{n} over {list(grid_dims)}" if grid_dims else f"{n} whole"
                         for n, grid_dims in zip(self.shape, self.splits, strict=True))
        grid = "x".join(str(n) for n in self.grid) or "1"
        replicas = self.replica_dims
        return (f"({dims}) on {grid}"
                + (f", replicas over {list(replicas)}" if replicas else ""))

    def __repr__(self) -> str:
        return f"CartesianPartition{self.describe()}"


# -- the movement plan --------------------------------------------------------------------------


def _check_pair(src: CartesianPartition, dst: CartesianPartition) -> None:
    if src.shape != dst.shape:
        raise ValueError(f"redistribute between different shapes: {src} and {dst}")
    if src.grid != dst.grid:
        raise ValueError(f"redistribute between different grids: {src} and {dst}")


def _overlap(a: Interval, b: Interval) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _volume(intervals: Sequence[Interval]) -> int:
    return math.prod(b - a for a, b in intervals)


def _common(a: Sequence[Interval], b: Sequence[Interval]) -> tuple[Interval, ...] | None:
    """The intersection of two boxes, None when empty."""
    common = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in common) else common


def _local(box: Sequence[Interval], origin: Sequence[Interval]) -> Box:
    """`box` (global) as slices of the piece whose global intervals are `origin`."""
    return tuple(slice(lo - o[0], hi - o[0]) for (lo, hi), o in zip(box, origin, strict=True))


def _product(axes: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not axes:
        yield ()
        return
    for head in axes[0]:
        for tail in _product(axes[1:]):
            yield (head, *tail)


@dataclass(frozen=True)
class Block:
    """One block of a movement: the piece of `peer`'s data at `box` of this rank's tensor."""

    peer: int
    box: Box
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RedistributionPlan:
    """What one rank moves in a redistribution, worked out once per (src, dst, rank).

    `sends`: the blocks of this rank's source piece that other ranks read (box in the source
    piece); `recvs`: the blocks of this rank's destination piece read from other ranks (box in
    the destination piece); `local`: the block it reads from itself (source box, destination
    box), if any. Blocks are in peer order, as all-to-all-v lays them out. `collective`: whether
    any rank of the grid moves data to another, i.e. whether every rank makes the (collective)
    call."""

    src_shape: tuple[int, ...]
    dst_shape: tuple[int, ...]
    sends: tuple[Block, ...]
    recvs: tuple[Block, ...]
    local: tuple[Box, Box] | None
    collective: bool
    send_counts: tuple[int, ...]  # elements per peer, 0 for this rank itself
    recv_counts: tuple[int, ...]


@lru_cache(maxsize=1024)
def redistribution_plan(src: CartesianPartition, dst: CartesianPartition,
                        rank: int) -> RedistributionPlan:
    """The plan of `rank` moving a tensor from `src` to `dst` (cached: a model builds it once
    and uses it every step). O(P) box intersections."""
    _check_pair(src, dst)
    me = src.coords(rank)
    mine_src, mine_dst = src.intervals(me), dst.intervals(me)
    replicas = src.replica_dims
    sends: list[Block] = []
    recvs: list[Block] = []
    local: tuple[Box, Box] | None = None
    for peer in range(src.size):
        theirs = src.coords(peer)
        # I send to `peer` what its destination piece needs from my source piece, if `peer`
        # reads from me: it has my coordinates on the source's replica dims.
        if all(theirs[g] == me[g] for g in replicas):
            common = _common(mine_src, dst.intervals(theirs))
            if common is not None and peer == rank:
                local = (_local(common, mine_src), _local(common, mine_dst))
            elif common is not None:
                box = _local(common, mine_src)
                sends.append(Block(peer, box, tuple(s.stop - s.start for s in box)))
            if peer == rank:
                continue
            # The same agreement makes me read from `peer` (it is symmetric).
            common = _common(src.intervals(theirs), mine_dst)
            if common is not None:
                box = _local(common, mine_dst)
                recvs.append(Block(peer, box, tuple(s.stop - s.start for s in box)))
    send_counts, recv_counts = [0] * src.size, [0] * src.size
    for block in sends:
        send_counts[block.peer] = block.numel
    for block in recvs:
        recv_counts[block.peer] = block.numel
    return RedistributionPlan(
        tuple(b - a for a, b in mine_src), tuple(b - a for a, b in mine_dst), tuple(sends),
        tuple(recvs), local, moves_data(src, dst), tuple(send_counts), tuple(recv_counts))


@lru_cache(maxsize=1024)
def moves_data(src: CartesianPartition, dst: CartesianPartition) -> bool:
    """Whether any rank sends data to another rank in the redistribution `src` → `dst`.

    Rank q reads from itself all of its destination piece that lies in its own source piece,
    and the rest from others (the source boxes q reads from cover the tensor exactly once). So
    nothing moves iff every nonempty destination piece lies inside its rank's source piece:
    one box test per rank, O(P)."""
    _check_pair(src, dst)
    for rank in range(src.size):
        coords = src.coords(rank)
        wanted = dst.intervals(coords)
        held = src.intervals(coords)
        if _volume(wanted) and any(w[0] < h[0] or w[1] > h[1]
                                   for w, h in zip(wanted, held, strict=True)):
            return True
    return False


def redistribute_send_bytes(src: CartesianPartition, dst: CartesianPartition, rank: int,
                            itemsize: int) -> tuple[int, bool]:
    """(bytes `rank` sends to other ranks, whether the collective happens at all) in the
    forward redistribution `src` → `dst`: exactly the payload the counted communicator records
    (op "alltoallv") — or no record at all when the flag is False. A rank that sends nothing
    while others do still makes the call and records 0 bytes.

    The adjoint sends back what the forward received: `redistribute_recv_bytes`.

    Cost: per tensor dim, a sum of interval overlaps over the coordinates of the destination's
    grid dims for that tensor dim (the rank's own on the source's replica dims); the sum over
    all readers is the product of these per-dim sums — O(P) at most, no box tests between
    pairs of ranks."""
    if not moves_data(src, dst):
        return 0, False
    me = src.coords(rank)
    mine = src.intervals(me)
    replicas = set(src.replica_dims)
    # The readers of my piece: every rank with my coordinates on the source replica dims.
    # A free grid dim no destination split uses multiplies the readers without changing what
    # they read.
    dst_used = {g for grid_dims in dst.splits for g in grid_dims}
    readers_per_piece = math.prod(n for g, n in enumerate(dst.grid)
                                  if g not in replicas and g not in dst_used)
    total = readers_per_piece
    for dim, grid_dims in enumerate(dst.splits):
        axes = [range(me[g], me[g] + 1) if g in replicas else range(dst.grid[g])
                for g in grid_dims]
        coords = list(me)
        per_dim = 0
        for combo in _product(axes):
            for g, c in zip(grid_dims, combo, strict=True):
                coords[g] = c
            per_dim += _overlap(mine[dim], dst.interval(dim, coords))
        total *= per_dim
    own = _common(mine, dst.intervals(me))
    sent = total - (_volume(own) if own is not None else 0)
    return sent * itemsize, True


def redistribute_recv_bytes(src: CartesianPartition, dst: CartesianPartition, rank: int,
                            itemsize: int) -> tuple[int, bool]:
    """(bytes `rank` receives from other ranks, whether the collective happens at all) in the
    forward `src` → `dst`: what the adjoint's call records for `rank`. The source pieces a rank
    reads from cover the tensor once, so it receives all of its destination piece but the part
    inside its own source piece: O(1)."""
    if not moves_data(src, dst):
        return 0, False
    me = src.coords(rank)
    wanted = dst.intervals(me)
    own = _common(src.intervals(me), wanted)
    return (_volume(wanted) - (_volume(own) if own is not None else 0)) * itemsize, True


# -- the operator and its adjoint -----------------------------------------------------------------


def _plan_for(x: torch.Tensor, comm: CountedComm, src: CartesianPartition,
              dst: CartesianPartition, expected: Callable[[RedistributionPlan],
                                                          tuple[int, ...]],
              what: str) -> RedistributionPlan:
    if comm.size != src.size:
        raise ValueError(f"redistribute over grid {src.grid} ({src.size} ranks) on a group of "
                         f"{comm.size}")
    plan = redistribution_plan(src, dst, comm.rank)
    if tuple(x.shape) != expected(plan):
        raise ValueError(f"rank {comm.rank} holds {tuple(x.shape)}, its {what} piece of "
                         f"{src if what == 'source' else dst} is {expected(plan)}")
    return plan


def _exchange(comm: CountedComm, x: torch.Tensor, plan: RedistributionPlan, label: str,
              adjoint: bool) -> torch.Tensor:
    """Pack the blocks of `x` this rank sends in peer order, run the all-to-all-v, and return
    the receive buffer (the blocks it receives, in peer order): the plan's sends and receives,
    or for the `adjoint` the other way round."""
    if adjoint:  # what the forward received goes back to where it came from
        outgoing, send_counts, recv_counts = plan.recvs, plan.recv_counts, plan.send_counts
    else:
        outgoing, send_counts, recv_counts = plan.sends, plan.send_counts, plan.recv_counts
    tag = "redistribute.adjoint" if adjoint else "redistribute"
    send = _scratch(comm, f"{tag}.send", (sum(send_counts),), x.dtype, x.device)
    offset = 0
    for block in outgoing:
        send[offset:offset + block.numel].view(block.shape).copy_(x[block.box])
        offset += block.numel
    recv = _scratch(comm, f"{tag}.recv", (sum(recv_counts),), x.dtype, x.device)
    comm.alltoallv_(send, list(send_counts), recv, list(recv_counts), label, op="alltoallv")
    return recv


def redistribute_op(x: torch.Tensor, comm: CountedComm, src: CartesianPartition,
                    dst: CartesianPartition, label: str = "") -> torch.Tensor:
    """This rank's piece of `dst`, from `x`, this rank's piece of `src` (same global shape,
    same grid; `comm` the grid's group, rank ↔ coordinates as `CartesianPartition.coords`).

    Replicated sources follow the source rule (module docstring). One all-to-all-v with blocks
    for other ranks only (its payload: the bytes this rank sends them); no call when no rank
    of the grid sends anything to another."""
    plan = _plan_for(x, comm, src, dst, lambda p: p.src_shape, "source")
    x = x.detach()
    out = torch.empty(plan.dst_shape, dtype=x.dtype, device=x.device)
    if plan.local is not None:
        src_box, dst_box = plan.local
        out[dst_box] = x[src_box]
    if plan.collective:
        recv = _exchange(comm, x, plan, label, adjoint=False)
        offset = 0
        for block in plan.recvs:
            out[block.box] = recv[offset:offset + block.numel].view(block.shape)
            offset += block.numel
    return out


def redistribute_adjoint_op(y: torch.Tensor, comm: CountedComm, src: CartesianPartition,
                            dst: CartesianPartition, label: str = "") -> torch.Tensor:
    """The adjoint of `redistribute_op(·, comm, src, dst)`: `y` is this rank's piece of `dst`;
    every block of it goes back to the source rank it was read from and is summed into that
    rank's piece of `src` (zeros where nobody read)."""
    plan = _plan_for(y, comm, src, dst, lambda p: p.dst_shape, "destination")
    y = y.detach()
    out = torch.zeros(plan.src_shape, dtype=y.dtype, device=y.device)
    if plan.local is not None:
        src_box, dst_box = plan.local
        out[src_box] += y[dst_box]
    if plan.collective:
        recv = _exchange(comm, y, plan, label, adjoint=True)
        offset = 0
        for block in plan.sends:
            out[block.box] += recv[offset:offset + block.numel].view(block.shape)
            offset += block.numel
    return out


redistribute: Callable[..., torch.Tensor] = _operator(
    "Redistribute", redistribute_op, redistribute_adjoint_op)
