"""Row-sparse data movement: the exchanges of embedding gradients that touch few rows.

A row-sparse tensor is a pair (indices, values): `values[i]` is row `indices[i]` of a
(num_rows, width) matrix that is zero elsewhere. Nothing here ever builds the dense matrix.

Three linear operators, each written with its adjoint (DistDL's discipline):

- `allgather_sum_rows`: every rank's rows, summed, on every rank. As a map from P row-sparse
  inputs to P identical outputs it is 1·1ᵀ ⊗ I, its own adjoint: the sparse twin of all-reduce.
- `push_rows`: each rank's rows sent to their owners (`BlockRows`, `CyclicRows`) and summed
  there; the parameter-server push, as an all-to-all-v.
- `pull_rows`: the rows a rank asks for, read from their owners; the parameter-server pull.
  `pull` is the adjoint of `push` for the same requested indices:
  ⟨push(x), y⟩ over owners = Σ_k ⟨x_k, pull_k(y)⟩ (the dot-product test in tests/mpi).
  An owner answers from its own rows only (`table`: the rows it owns, in `rows.local` order):
  no rank needs a copy of the whole table.

Rows a rank owns itself never leave it (under either backend), and a rank with no rows takes
part with empty buffers, so every rank issues the same collectives in the same order whatever
its batch.

Devices: indices and rows live on the device of the rows (`values`, `table`): indices given
elsewhere are moved there first, so both ends of every exchange of indices or rows lie on that
device. Only the counts (how many rows go where) are host tensors, small control messages that
are read back with `tolist()` anyway.
"""

from __future__ import annotations

import torch

from runner.core.comm import CountedComm


class CyclicRows:
    """Rows 0..num_rows−1 dealt to `parts` owners like cards: row r to owner r mod parts.

    Dealt rather than cut in blocks because token ids are ranked by frequency: the hot rows
    (the low ids) spread over every owner instead of all landing on the first. With fewer rows
    than owners some owners own nothing.
    """

    def __init__(self, num_rows: int, parts: int) -> None:
        if num_rows < 0 or parts < 1:
            raise ValueError(f"cannot deal {num_rows} rows to {parts} owners")
        self.num_rows, self.parts = num_rows, parts

    def owner(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.remainder(rows, self.parts)

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """Where each row sits among its owner's rows (`owned` order)."""
        return torch.div(rows, self.parts, rounding_mode="floor")

    def owned(self, part: int, device: torch.device | None = None) -> torch.Tensor:
        """The rows `part` owns, ascending (on `device`: the table's, to index it)."""
        return torch.arange(part, self.num_rows, self.parts, dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return f"CyclicRows({self.num_rows} rows over {self.parts})"


class BlockRows:
    """Rows 0..num_rows−1 cut into `parts` balanced contiguous blocks, block k owned by rank k
    (ranks k ≥ parts own nothing). Contiguous so that an owner's rows are one block of the
    global table, which a checkpoint records as such (`place_rows`) and reloads onto any grid;
    the load imbalance of frequency-ranked ids (hot low ids all on owner 0) is what the
    replicated hot rows of `strategy.sparse_hot_rows` take away."""

    def __init__(self, num_rows: int, parts: int) -> None:
        if num_rows < 0 or parts < 1:
            raise ValueError(f"cannot cut {num_rows} rows into {parts} blocks")
        self.num_rows, self.parts = num_rows, parts
        base, extra = divmod(num_rows, parts)
        self.sizes = [base + (k < extra) for k in range(parts)]
        self.starts = [sum(self.sizes[:k]) for k in range(parts)]
        # the first row after each block but the last: owner = how many of them are ≤ row
        self._edges = torch.tensor(  # host: control (copied to the rows' device when used)
            [s + n for s, n in zip(self.starts[:-1], self.sizes[:-1], strict=True)],
            dtype=torch.long)

    def block(self, part: int) -> slice:
        """The rows `part` owns (empty for a rank beyond the owners)."""
        if part >= self.parts:
            return slice(self.num_rows, self.num_rows)
        return slice(self.starts[part], self.starts[part] + self.sizes[part])

    def owner(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(rows, self._edges.to(rows.device), right=True)

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        starts = torch.tensor(self.starts, dtype=torch.long, device=rows.device)
        return rows - starts[self.owner(rows)]

    def owned(self, part: int, device: torch.device | None = None) -> torch.Tensor:
        block = self.block(part)
        return torch.arange(block.start, block.stop, dtype=torch.long, device=device)

    def __repr__(self) -> str:
        return f"BlockRows({self.num_rows} rows in {self.parts} blocks)"


RowOwners = CyclicRows | BlockRows


def coalesce_rows(indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Duplicate indices summed: ascending unique indices and their summed rows."""
    unique, inverse = torch.unique(indices, sorted=True, return_inverse=True)
    summed = values.new_zeros((len(unique), *values.shape[1:]))
    summed.index_add_(0, inverse, values)
    return unique, summed


def gather_counts(comm: CountedComm, count: int, label: str) -> list[int]:
    """Every rank's `count`, on every rank (one small all-gather)."""
    mine = torch.tensor([count], dtype=torch.long)  # host: control (counts, read as a list)
    every = torch.empty(comm.size, dtype=torch.long)  # host: control
    comm.allgatherv_(mine, every, [1] * comm.size, label=label)
    return every.tolist()


def _swap_counts(comm: CountedComm, send_counts: list[int], label: str) -> list[int]:
    """Tell every rank how many items it gets from this one; learn how many to expect."""
    send = torch.tensor(send_counts, dtype=torch.long)  # host: control (counts, read as a list)
    recv = torch.empty(comm.size, dtype=torch.long)  # host: control
    comm.alltoallv_(send, [1] * comm.size, recv, [1] * comm.size, label=label, op="alltoallv")
    return recv.tolist()


def allgather_sum_rows(comm: CountedComm, indices: torch.Tensor, values: torch.Tensor,
                       counts: list[int] | None = None,
                       label: str = "sparse") -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over ranks of the row-sparse (indices, values), coalesced, on every rank.

    `counts` (every rank's number of rows) when the caller has gathered them already; one
    all-gather of the indices and one of the rows follow. Traffic per rank: all the others' rows,
    so it grows with P.
    """
    indices = indices.to(values.device)
    if comm.size == 1:
        return coalesce_rows(indices, values)
    if counts is None:
        counts = gather_counts(comm, len(indices), label + " counts")
    width = values.shape[1:]
    row_elements = int(torch.Size(width).numel())
    total = sum(counts)
    all_indices = indices.new_empty(total)
    all_values = values.new_empty((total, *width))
    if total:
        comm.allgatherv_(indices.contiguous(), all_indices, counts, label=label + " indices")
        comm.allgatherv_(values.contiguous(), all_values, [c * row_elements for c in counts],
                         label=label + " rows")
    return coalesce_rows(all_indices, all_values)


def _by_owner(rows: RowOwners, indices: torch.Tensor, me: int,
              size: int) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The positions of `indices` not owned by `me`, ordered by owner, the count per rank of
    the `size` (owners may be fewer than the ranks), and the positions `me` owns."""
    owners = rows.owner(indices)
    mine = owners == me
    others = torch.nonzero(~mine).flatten()
    order = others[torch.argsort(owners[others], stable=True)]
    counts = torch.bincount(owners[order], minlength=size).tolist()
    return order, counts, torch.nonzero(mine).flatten()


class NodeRoutes:
    """Which ranks share a node (`node_of[rank]`: a node's key, the same for all its ranks) and
    the route a row takes to an owner on another node: through the rank of this node whose place
    among its node's ranks is the owner's place among its own (its delegate), so each delegate
    talks to one rank per other node, and the rows of a node for the same row meet there."""

    def __init__(self, node_of: list[int]) -> None:
        self.node_of = node_of
        nodes: dict[int, list[int]] = {}
        for rank, node in enumerate(node_of):
            nodes.setdefault(node, []).append(rank)
        self.members = nodes
        self.place = {rank: ranks.index(rank) for ranks in nodes.values() for rank in ranks}

    @property
    def nodes(self) -> int:
        return len(self.members)

    def route(self, me: int) -> torch.Tensor:
        """Per owner rank: where `me` sends a row it owns (the owner itself on this node, this
        node's delegate for it elsewhere)."""
        mine = self.members[self.node_of[me]]
        return torch.tensor([owner if self.node_of[owner] == self.node_of[me]  # host: control
                             else mine[self.place[owner] % len(mine)]
                             for owner in range(len(self.node_of))], dtype=torch.long)


def _send_rows(comm: CountedComm, dest: torch.Tensor, indices: torch.Tensor,
               values: torch.Tensor, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to rank `dest[i]` (one all-to-all-v of counts, of indices, of rows); the rows
    that stay here and those received, not summed."""
    me = dest == comm.rank
    others = torch.nonzero(~me).flatten()
    order = others[torch.argsort(dest[others], stable=True)]
    send_counts = torch.bincount(dest[order], minlength=comm.size).tolist()
    recv_counts = _swap_counts(comm, send_counts, label + " counts")
    width = values.shape[1:]
    row_elements = int(torch.Size(width).numel())
    total = sum(recv_counts)
    got_indices = indices.new_empty(total)
    got_values = values.new_empty((total, *width))
    comm.alltoallv_(indices[order].contiguous(), send_counts, got_indices, recv_counts,
                    label=label + " indices", op="alltoallv")
    comm.alltoallv_(values[order].contiguous(), [c * row_elements for c in send_counts],
                    got_values, [c * row_elements for c in recv_counts], label=label + " rows",
                    op="alltoallv")
    kept = torch.nonzero(me).flatten()
    return torch.cat([indices[kept], got_indices]), torch.cat([values[kept], got_values])


def push_rows_by_node(comm: CountedComm, rows: RowOwners, routes: NodeRoutes,
                      indices: torch.Tensor, values: torch.Tensor,
                      label: str = "sparse push") -> tuple[torch.Tensor, torch.Tensor]:
    """`push_rows` in two steps: inside each node, every row goes to its owner when the owner
    is on this node and to the node's delegate for that owner otherwise (`NodeRoutes`); the
    delegates sum the rows of the same row that their node's ranks sent, then push those sums
    across the nodes. The same sums on the owners as `push_rows`, with each row crossing
    between two nodes once per node instead of once per rank that touched it."""
    indices = indices.to(values.device)
    if comm.size == 1:
        return coalesce_rows(indices, values)
    route = routes.route(comm.rank).to(indices.device)
    here_i, here_v = _send_rows(comm, route[rows.owner(indices)], indices, values,
                                label + " node")
    final = rows.owner(here_i) == comm.rank
    onward_i, onward_v = coalesce_rows(here_i[~final], here_v[~final])  # the node's sums
    got_i, got_v = _send_rows(comm, rows.owner(onward_i), onward_i, onward_v, label)
    return coalesce_rows(torch.cat([here_i[final], got_i]), torch.cat([here_v[final], got_v]))


def push_rows(comm: CountedComm, rows: RowOwners, indices: torch.Tensor, values: torch.Tensor,
              label: str = "sparse push") -> tuple[torch.Tensor, torch.Tensor]:
    """Send each row to its owner; return the rows this rank owns that anyone sent (its own
    included), summed and coalesced. Traffic per rank: its own rows, whatever P."""
    indices = indices.to(values.device)
    if comm.size == 1:
        return coalesce_rows(indices, values)
    return coalesce_rows(*_send_rows(comm, rows.owner(indices), indices, values, label))


def pull_rows(comm: CountedComm, rows: RowOwners, wanted: torch.Tensor, table: torch.Tensor,
              label: str = "sparse pull") -> torch.Tensor:
    """The rows `wanted` (unique indices) of the table whose rows live on their owners alone: a
    request to each owner, then its answer. Rows this rank owns are read locally. `table` holds
    the rows this rank owns, in `rows.local` order (`rows.owned(rank)`)."""
    wanted = wanted.to(table.device)
    out = table.new_empty((len(wanted), *table.shape[1:]))
    if comm.size == 1:
        return out.copy_(table[rows.local(wanted)])
    order, ask_counts, own = _by_owner(rows, wanted, comm.rank, comm.size)
    out[own] = table[rows.local(wanted[own])]
    asked_counts = _swap_counts(comm, ask_counts, label + " counts")
    asked = wanted.new_empty(sum(asked_counts))
    comm.alltoallv_(wanted[order].contiguous(), ask_counts, asked, asked_counts,
                    label=label + " indices", op="alltoallv")
    row_elements = int(torch.Size(table.shape[1:]).numel())
    answers = table.new_empty((len(order), *table.shape[1:]))
    comm.alltoallv_(table[rows.local(asked)].contiguous(), [c * row_elements for c in asked_counts],
                    answers, [c * row_elements for c in ask_counts], label=label + " rows",
                    op="alltoallv")
    out[order] = answers
    return out
