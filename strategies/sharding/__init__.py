"""Sharded data parallelism's machinery (`strategy=fsdp`, whose strategy is `strategies/fsdp.py`),
in three parts: `units.py` the units (which modules' parameters are gathered together), each
parameter split by rows over the ranks, and a unit's gather; `runtime.py` `ShardedModel`, the
hooks that gather and free the units during a step (prefetch, backward's regathers,
recomputation); `memory.py` the memory model, what a rank holds at most, predicted from one
forward of rank 0's part.
"""
