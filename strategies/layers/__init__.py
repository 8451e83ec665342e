"""Layers split over ranks, and the layers that make a split compute what one process does:
model-parallel splits of Linear/Conv2d (`split`), module trees (`tree`), spatial slabs with
halos (`spatial`), batch norm over split batches (`norm`, `whole_batch`), the vocabulary head.
"""
