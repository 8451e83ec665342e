"""The distributed-tensor core: process grid, partitions, counted communication.

Knows nothing of Hydra, configs, strategies or training (see DESIGN.md, "Layout").
"""

from runner.core.comm import CommCounter, CommRecord, CountedComm, PendingOp
from runner.core.grid import GridShape, ProcessGrid
from runner.core.partition import Partition, balanced_sizes, balanced_slice

__all__ = [
    "CommCounter",
    "CommRecord",
    "CountedComm",
    "GridShape",
    "Partition",
    "PendingOp",
    "ProcessGrid",
    "balanced_sizes",
    "balanced_slice",
]
