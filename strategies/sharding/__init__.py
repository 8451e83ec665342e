"""Sharded data parallelism's machinery (`strategy=fsdp`, `strategies/fsdp.py`): the units and
their gathers, the runtime hooks, and the memory model.
"""
