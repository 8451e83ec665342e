"""The owners-only exchange's choices from the cost model, on one process: how many ranks own a
table's rows (`strategy.sparse_partitions=auto`), which rows are replicated (hot rows), and the
rows a rank then holds, as the planner predicts them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.core import GridShape
from runner.core.row_sparse import BlockRows
from runner.cost.collectives import (
    MachineCosts,
    RowOwners,
    TableRows,
    choose_hot_rows,
    choose_partitions,
    hot_row_gain,
    node_push_seconds,
    partition_seconds,
    sharded_rows_per_rank,
    sparse_exchange_ops,
)
from strategies import PricingContext
from strategies.data import DataParallel

COSTS = MachineCosts(alpha=5e-6, beta=2.5e-10, table_pass=1e-10, sparse_row=1.5e-9)


def test_few_rows_a_step_take_few_owners_and_many_rows_take_all() -> None:
    # a handful of rows: the messages (4 per owner) dominate, one owner is cheapest
    assert choose_partitions(8, 1_000_000, 256, 2, COSTS) == 1
    # thousands of rows: the owners' bytes and work dominate, every rank owns a block
    assert choose_partitions(8, 1_000_000, 256, 5_000, COSTS) == 8
    # in between, a K strictly between: the minimum of the modelled time, found by hand
    times = {k: partition_seconds(k, 8, 256, 40, COSTS) for k in range(1, 9)}
    chosen = choose_partitions(8, 1_000_000, 256, 40, COSTS)
    assert 1 < chosen < 8 and times[chosen] == min(times.values()), times
    # messages cost nothing: the most owners, whatever the rows
    free = MachineCosts(alpha=0.0, beta=2.5e-10, table_pass=1e-10, sparse_row=1.5e-9)
    assert choose_partitions(8, 1_000_000, 256, 2, free) == 8


def test_memory_caps_the_block_an_owner_holds() -> None:
    # one owner would be cheapest, but its block (the whole table) does not fit
    assert choose_partitions(8, 1_000_000, 256, 2, COSTS, memory_bytes=1e9) == 1
    capped = choose_partitions(8, 1_000_000, 256, 2, COSTS, memory_bytes=100e6)
    assert capped == 3 and -(-1_000_000 // capped) * 256 <= 100e6  # the fewest that fit
    assert choose_partitions(8, 1_000_000, 256, 2, COSTS, memory_bytes=1.0) == 8


def test_fewer_owners_move_more_of_the_owner_s_rows() -> None:
    """Rank 0, an owner: it sends the rows other owners own, and answers the rows of its block
    that the other ranks ask for ((p−1)/K of a rank's rows)."""
    every = sparse_exchange_ops("sharded", "world", 4, TableRows(1000, 64, 12, 48))
    two = sparse_exchange_ops("sharded", "world", 4, TableRows(1000, 64, 12, 48),
                              owners=RowOwners(parts=2))
    assert [o.nbytes for o in every] == [32, 72, 576, 32, 72, 576]  # (3/4)·12 rows
    assert [o.nbytes for o in two] == [32, 48, 384, 32, 48, 1152]  # 12/2 sent; 12·3/2 answered
    hot = sparse_exchange_ops("sharded", "world", 4, TableRows(1000, 64, 12, 48),
                              owners=RowOwners(hot_rows=5))
    assert hot[0].op == "allreduce" and hot[0].nbytes == 5 * 64 and hot[1:] == every


def test_hot_rows_are_the_most_widely_read_that_pay() -> None:
    # rows read by every rank pay for their all-reduce; a row read by one rank of 8 does not
    assert hot_row_gain(8, 8, 256, COSTS) > 0 > hot_row_gain(0.5, 8, 256, COSTS)
    ids, readers = [7, 3, 9, 1, 4], [2, 4, 4, 1, 3]
    assert choose_hot_rows(ids, readers, 3, 4, 256, COSTS) == [3, 4, 9]  # 3, 9 (4), then 4 (3)
    assert choose_hot_rows(ids, readers, 2, 4, 256, COSTS) == [3, 9]  # ties: the lower id first
    assert choose_hot_rows(ids, readers, 0, 4, 256, COSTS) == []
    costly = MachineCosts(alpha=5e-6, beta=1e-6, table_pass=1e-6, sparse_row=0.0)
    assert choose_hot_rows(ids, readers, 5, 4, 256, costly) == []  # none worth an all-reduce


def test_blocks_and_the_rows_a_rank_holds() -> None:
    rows = BlockRows(10, 3)
    assert [rows.block(k) for k in range(4)] == [slice(0, 4), slice(4, 7), slice(7, 10),
                                                 slice(10, 10)]  # rank 3 owns nothing
    ids = torch.arange(10)
    assert rows.owner(ids).tolist() == [0] * 4 + [1] * 3 + [2] * 3
    assert rows.local(ids).tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert sharded_rows_per_rank(10, 3, 2) == 4 + 2


@pytest.mark.parametrize("parts,expected", [(4, 250 + 64), (3, 334 + 64), ("auto", None)])
def test_the_planner_s_rows_per_rank(parts: int | str, expected: int | None) -> None:
    table = nn.EmbeddingBag(1000, 16, sparse=True)
    strategy = DataParallel(sparse="sharded", sparse_partitions=parts, sparse_hot_rows=64,
                            pricing=PricingContext(COSTS, rows_touched=lambda samples: 40.0,
                                                   global_batch=64))
    if expected is None:  # auto: the cost model's K for 40 rows a rank
        expected = -(-1000 // choose_partitions(4, 1000, 64, 40.0, COSTS)) + 64
    assert strategy.table_rows_per_rank(table.weight, 4) == expected
    model = nn.Sequential(table, nn.Linear(16, 2))
    assert strategy.predict_param_bytes(model, (8,), GridShape(1, 4)) == \
        expected * 16 * 4 + (16 * 2 + 2) * 4


@pytest.mark.parametrize("option,value", [("sparse_partitions", 5), ("sparse_partitions", 0),
                                          ("sparse_partitions", "many"),
                                          ("sparse_hot_rows", -1), ("sparse_hot_rows", 1.5)])
def test_bad_values_are_one_line_naming_them(option: str, value: object) -> None:
    problems = DataParallel(**{option: value}).check(GridShape(1, 4), 64)  # type: ignore[arg-type]
    assert len(problems) == 1 and f"strategy.{option}={value}" in problems[0], problems


# between nodes: a network (1 GB/s, 20 µs a message), not shared memory
NETWORK = MachineCosts(alpha=2e-5, beta=1e-9, table_pass=1e-10, sparse_row=1.5e-9)


def test_a_node_s_sums_pay_when_its_ranks_share_rows_or_messages_are_dear() -> None:
    # 8 ranks in 2 nodes of 4, 2000 rows a rank: when the node's ranks read the same rows (a
    # node touches 2400 distinct rows, not 8000) the rows crossing between nodes shrink ~3x
    direct, through = node_push_seconds(8, 4, 256, 2000, 2400, NETWORK)
    assert through < direct
    # no row shared: the same rows cross, plus a step inside the node: direct wins
    direct, through = node_push_seconds(8, 4, 256, 2000, None, NETWORK)
    assert direct < through
    # shared rows but a cheap network (shared memory's β): not worth three more operations
    direct, through = node_push_seconds(8, 4, 256, 50, 60, COSTS)
    assert direct < through
    # ... unless messages are dear: N−1 across instead of p−1
    dear = MachineCosts(alpha=1e-3, beta=2.5e-10, table_pass=1e-10, sparse_row=1.5e-9)
    direct, through = node_push_seconds(8, 4, 256, 500, None, dear)
    assert through < direct


def test_the_strategy_sums_inside_nodes_only_where_it_pays() -> None:
    table = nn.EmbeddingBag(1_000_000, 64, sparse=True)
    # a rank's 16 samples touch 2000 rows, a node's 64 only 3200 (not 8000): rows shared
    shared = DataParallel(sparse="sharded", ranks_per_node=4, pricing=PricingContext(
        NETWORK, rows_touched=lambda samples: 1600.0 + 25 * samples, global_batch=128))
    two_nodes = [rank // 4 for rank in range(8)]
    assert shared.node_push_pays(table.weight, 8, two_nodes)
    assert not shared.node_push_pays(table.weight, 8, [0] * 8)  # one node: nothing across
    assert not shared.node_push_pays(table.weight, 8, list(range(8)))  # a rank a node
    assert not shared.node_push_pays(table.weight, 8, [0, 0, 0, 1, 1, 1, 1, 1])  # unequal
    ops = shared.predict_sparse_ops("t", table.weight, 8, 16)
    assert [o.layer for o in ops if o.layer.endswith("counts")] == [
        "t push node counts", "t push counts", "t pull counts"]
    across = next(o for o in ops if o.layer == "t push rows")
    assert across.nbytes == round(3200 * 1 / 8 * 256)  # the delegate's share of the node's
    alone = DataParallel(sparse="sharded", ranks_per_node=4,
                         pricing=PricingContext(NETWORK))  # no model of rows
    assert not alone.node_push_pays(table.weight, 8, two_nodes)
