"""The distributed-tensor core: process grid, partitions, counted communication.

Knows nothing of Hydra, configs, strategies or training (see docs/design.md, "Layout").
Communication goes through mpi4py (`runner.core.mpi_transport`) or torch.distributed
(`runner.core.torch_transport`, imported only by a grid with backend "torch").
"""

from runner.core.cartesian import (
    CartesianPartition,
    moves_data,
    redistribute,
    redistribute_adjoint_op,
    redistribute_op,
    redistribute_recv_bytes,
    redistribute_send_bytes,
)
from runner.core.comm import CommCounter, CommRecord, CountedComm, PendingOp
from runner.core.grid import DevicePaths, GridShape, ProcessGrid
from runner.core.mpi_transport import BACKENDS, Backend
from runner.core.partition import Partition, balanced_sizes, balanced_slice
from runner.core.watchdog import CommWatchdog, describe_timeout

__all__ = [
    "BACKENDS",
    "Backend",
    "CartesianPartition",
    "CommCounter",
    "CommRecord",
    "CommWatchdog",
    "CountedComm",
    "DevicePaths",
    "GridShape",
    "Partition",
    "PendingOp",
    "ProcessGrid",
    "balanced_sizes",
    "balanced_slice",
    "describe_timeout",
    "moves_data",
    "redistribute",
    "redistribute_adjoint_op",
    "redistribute_op",
    "redistribute_recv_bytes",
    "redistribute_send_bytes",
]
