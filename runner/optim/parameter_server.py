"""SC17's asynchronous baselines: SGD against a parameter server held in one-sided windows.

You, Buluç & Demmel (SC17) measure their EASGD redesign against the asynchronous methods an HPC
user would otherwise run: asynchronous SGD and momentum SGD with a parameter server, and
Hogwild!. Here the server is the same `OneSidedVector` that holds the EASGD centre, so the
three differ from the EASGD family (`runner/optim/easgd.py`) only in the rule. Each replica (a model
group), after its backward, pushes its gradient ∇ᵢ to the server's weights W and pulls W back;
its own weights are W as it last read them. For each piece of W, with learning rate η:

| optimizer     | the server's update, then the pull                | exclusion                    |
| `async_sgd`   | W ← W − η∇ᵢ;  read W                              | the piece's ticket lock      |
| `async_msgd`  | V ← μV − η∇ᵢ;  W ← W + V;  read W                 | the piece's ticket lock      |
| `hogwild_sgd` | W ← W − η∇ᵢ;  read W                              | none                         |

`async_msgd`'s momentum is heavy-ball (Polyak): the gradient is taken at W as pulled, not at a
look-ahead point; with one replica it is torch's SGD with momentum μ (buf ← μ·buf + ∇,
W ← W − η·buf: V = −η·buf). The velocity V lives on the server, beside W, and both are
read-modify-written inside the piece's critical section: V is read, V ← μV − η∇ᵢ written back
(a replacing write, not an addition, so that an update made outside the lock would be lost and
seen), then added to W. Under Hogwild! the additions are atomic per element, a piece's read is
not: a replica may pull a piece that other replicas' additions are passing through.

Unlike the EASGD family there is no elastic force and no second set of weights: every gradient
reaches W at once, and a replica's weights are only a stale copy of it. Nobody waits for another
replica's step, only (under the lock) for those that reached the same piece first.

The server is laid out as EASGD's centre: W is sharded like the parameters, the ranks of a batch
group each owning a 1/Pc piece of their shard's W; parameters every rank of a model group holds
(batch-parallel convolutions under `grid`/`domain`) are served to model rank 0 only and
broadcast within the model group after each pull. A replica visits the pieces starting at its
own, so that replicas spread over the owners. The windows and the buffers that meet them are
host memory: a step copies the gradients to the host in one transfer and the pulled weights
back in one.

Checkpoints: W is what a checkpoint keeps as the centre (`centre_weights`), each replica's
pulled weights its own (`per_replica`). `async_msgd`'s V is the state kind `server_velocity`:
every replica saves it whole, read from the windows at the checkpoint step (where the replicas
meet, so all read the same V), and on resume each rank writes back the piece it owns.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from runner.config.registry import register_optimizer
from runner.core import ProcessGrid
from runner.core.rma import OneSidedVector
from runner.optim.easgd import _flatten_into, _pieces, holding
from runner.optim.sync import ReplicaOptimizer
from strategies import ParallelModel

SERVER_VELOCITY = "server_velocity"  # the checkpoint's name for async_msgd's V


class ParameterServer(ReplicaOptimizer):
    """Push −η∇ to each piece of the server, pull the piece back (`_serve`), then the model
    holds what was pulled."""

    asynchronous = True
    syncs_gradients = False
    has_centre = True
    per_replica = True  # each replica's pulled copy is stale by a different amount
    elementwise = True  # every element moves by its own gradient (and velocity)
    locks_pieces: ClassVar[bool] = True

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.1) -> None:
        self.grid, self.base_lr = grid, lr
        in_group = {id(p) for p in model.replicated_in_model_group}
        params = list(model.parameters())
        # This rank's share of the server: its shard, plus the group-replicated parameters on
        # model rank 0 only (the others receive them by broadcast).
        self.owned = [p for p in params if id(p) not in in_group or grid.model_index == 0]
        self.group_replicated = [p for p in params if id(p) in in_group] if grid.pr > 1 else []
        self.params = params
        numel = sum(p.numel() for p in self.owned)
        dtype = params[0].dtype if params else torch.float32
        self.device = params[0].device if params else torch.device("cpu")
        host = torch.device("cpu")  # the windows are host memory
        self.pushed = torch.empty(numel, dtype=dtype, device=host)  # −η∇ of this rank's share
        self.pulled = torch.empty(numel, dtype=dtype, device=host)  # W as this rank read it
        self.weights = OneSidedVector(grid.batch, _flatten_into(self.owned, self.pulled),
                                      label="server")

    @staticmethod
    def check(lr: float, momentum: float = 0.0) -> list[str]:
        errors = [] if lr > 0 else [f"optimizer.lr must be > 0, got {lr}"]
        if not 0 <= momentum < 1:
            errors.append(f"optimizer.momentum must be in [0, 1), got {momentum}")
        return errors

    # -- the update -----------------------------------------------------------------------------

    def _serve(self, owner: int) -> None:
        """`owner`'s piece of W takes this rank's push, and `pulled` its value after it."""
        piece = self.weights.piece(owner)
        if self.locks_pieces:
            self.weights.acquire(owner)
        self.weights.add(owner, self.pushed[piece])
        self.weights.read(owner, self.pulled[piece])
        if self.locks_pieces:
            self.weights.release(owner)

    def step(self, step: int) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.owned]
        grads = [g.to_dense() if g.is_sparse else g for g in grads]
        _flatten_into(grads, self.pushed).mul_(-self.base_lr)  # one transfer to the host
        # Start at our own piece so that replicas spread over the owners instead of queueing
        # at the same one.
        size = self.grid.pc
        for k in range(size):
            self._serve((self.grid.batch_index + k) % size)
        self._load(self.pulled)

    def _load(self, flat: torch.Tensor) -> None:
        """The model ← `flat` (this rank's share of W): one transfer to the parameters' device,
        then the group-replicated parameters from model rank 0."""
        values = flat.to(self.device)
        with torch.no_grad():
            for p, value in _pieces(self.owned, values):
                p.copy_(value)
        for p in self.group_replicated:
            self.grid.model.bcast_(p.data, root=0, label="server")

    def centre(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's share of the server's weights W, as they are now."""
        return self.weights.read_all(out)

    @contextmanager
    def centre_weights(self) -> Iterator[None]:
        """The model holds the server's weights inside the block, its own pulled copy after."""
        with holding(self.params, lambda: self._load(self.centre(torch.empty_like(self.pulled)))):
            yield

    @property
    def lr(self) -> float:
        return self.base_lr

    def close(self) -> None:
        self.weights.close()


@register_optimizer("async_sgd")
class AsyncSGD(ParameterServer):
    """Asynchronous SGD with a parameter server: each piece serves replicas first come, first
    served (a ticket lock); no replica waits for another's step."""


@register_optimizer("hogwild_sgd")
class HogwildSGD(ParameterServer):
    """Hogwild!: replicas push and pull concurrently without any lock; each element's addition
    and read are atomic, a whole piece's read is not."""

    locks_pieces = False


@register_optimizer("async_msgd")
class AsyncMSGD(ParameterServer):
    """Asynchronous momentum SGD: heavy-ball momentum on the server, V ← μV − η∇ᵢ, W ← W + V,
    both read-modify-written inside the piece's critical section."""

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.02, momentum: float = 0.9) -> None:
        super().__init__(model, grid, total_steps, lr)
        self.momentum = momentum
        self.velocity = OneSidedVector(grid.batch, torch.zeros_like(self.pulled), label="server")
        self._velocity_read = torch.empty_like(self.pulled)

    @classmethod
    def state_copies(cls, options: Mapping[str, Any]) -> int:
        return 1  # V, whatever μ (with μ = 0 it still holds −η∇)

    def _serve(self, owner: int) -> None:
        piece = self.weights.piece(owner)
        # One lock (W's) guards both vectors' pieces: V and W change together.
        self.weights.acquire(owner)
        velocity = self.velocity.read(owner, self._velocity_read[piece])
        velocity.mul_(self.momentum).add_(self.pushed[piece])  # μV − η∇
        self.velocity.write(owner, velocity)
        self.weights.add(owner, velocity)
        self.weights.read(owner, self.pulled[piece])
        self.weights.release(owner)

    def server_velocity(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's share of the server's velocity V, as it is now."""
        return self.velocity.read_all(out)

    def state_kinds(self) -> tuple[str, ...]:
        return (SERVER_VELOCITY,)

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        """V, shaped like the parameters this rank serves (None for the group-replicated ones
        on model ranks other than 0: model rank 0 holds theirs)."""
        flat = self.server_velocity(torch.empty_like(self.pulled))
        served = {id(p): value for p, value in _pieces(self.owned, flat)}
        return {SERVER_VELOCITY: [served.get(id(p)) for p in self.params]}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        """Collective over the batch group: each rank writes the piece of V it owns, and no
        replica pushes before every piece holds its saved value."""
        saved = states.get(SERVER_VELOCITY)
        if saved is None:
            return
        by_param = {id(p): value for p, value in zip(self.params, saved, strict=True)}
        flat = torch.zeros_like(self.pulled)
        for p, piece in _pieces(self.owned, flat):
            value = by_param[id(p)]
            if value is not None:
                piece.copy_(value)
        mine = self.grid.batch_index
        self.velocity.write(mine, flat[self.velocity.piece(mine)])
        self.grid.batch.barrier()

    def close(self) -> None:
        self.velocity.close()
        super().close()
