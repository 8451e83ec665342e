"""The elastic averaging SGD family (EASGD; Zhang, Choromanska, LeCun 2015; redesigned for HPC
by You, Buluç, Demmel, SC17).

Each batch replica (a model group of `Pr` ranks) trains its own weights Wᵢ; an elastic force of
strength ρ pulls them towards a centre variable W̄, which moves towards them in turn. With
learning rate η and moving rate α = ηρ, every τ-th step of a worker is

    d  = α (Wᵢ − W̄)                    (W̄ as this worker reads it)
    W̄ ← W̄ + d                          (centre update)
    Wᵢ ← Wᵢ − η∇ᵢ − d

and the other steps are plain local SGD steps. With momentum μ (`momentum`, `async_measgd`'s
default) the local step is one of two forms, named by `nesterov`:

- heavy-ball (`nesterov=false`, SC17's MEASGD): Vᵢ ← μVᵢ − η∇ᵢ;  Wᵢ ← Wᵢ + Vᵢ − d, the gradient
  and d both taken at Wᵢ;
- Nesterov (`nesterov=true`, the EAMSGD of Zhang, Choromanska & LeCun, Algorithm 2): the gradient
  is taken at the look-ahead point Wᵢ + μVᵢ; Vᵢ ← μVᵢ − η∇ᵢ(Wᵢ + μVᵢ);  Wᵢ ← Wᵢ + Vᵢ, and every τ
  steps the elastic move d = α(Wᵢ − W̄) follows the update (Algorithm 2 moves at the start of
  the next iteration: the same thing). The model holds the look-ahead point, as torch's
  Nesterov SGD does, so the forward pass needs no second copy; Wᵢ itself is recovered as
  look-ahead − μVᵢ when it meets the centre.

The centre update is a contraction (the centre cannot overshoot the replicas' mean) only for
Pc·α < 1, which the configuration check demands (`grid_problems`). The methods differ in how
the centre is shared:

| optimizer       | centre                   | how workers meet it                           |
| `sync_easgd`    | a copy on every worker   | all at once: one all-reduce of the Wᵢ         |
| `easgd`         | one-sided windows        | one at a time, in fixed rank order            |
| `async_easgd`   | one-sided windows        | when ready; each piece first come first served |
| `async_measgd`  | one-sided windows        | as `async_easgd`, momentum on the workers     |
| `hogwild_easgd` | one-sided windows        | when ready, concurrently, no lock             |

The centre is sharded like the parameters: the ranks holding the same parameter shard (a batch
group) share that shard's centre, each owning a 1/Pc piece of it in its window. Parameters that
every rank of a model group holds (batch-parallel convolutions under `grid`/`domain`) have their
centre in the batch group of model rank 0 and are broadcast to the rest of the group after each
exchange, so a replica's copies never drift apart.

Devices: the one-sided windows (and the buffers that meet them: the flattened weights, the
differences, the centre as read) are host memory and stay there whatever device the model is
on; each exchange copies the device weights to the host in one transfer and the differences
back in one. `sync_easgd`, which has no window, keeps its centre on the parameters' device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from runner.config.registry import register_optimizer
from runner.core import ProcessGrid
from runner.core.rma import OneSidedVector
from runner.optim.sync import ReplicaOptimizer
from strategies import ParallelModel

DEFAULT_BETA = 0.9  # the EASGD paper's choice of Pc·α for the synchronous method


def resolve_moving_rate(lr: float, rho: float | None, moving_rate: float | None,
                        replicas: int) -> float:
    """α: given directly, or ηρ, or by default 0.9/Pc (so that Pc·α = 0.9)."""
    if moving_rate is not None:
        return moving_rate
    if rho is not None:
        return lr * rho
    return DEFAULT_BETA / replicas


def _pieces(params: Sequence[torch.Tensor],
            flat: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each parameter with its piece of `flat` (the parameters laid end to end), shaped like it."""
    offset = 0
    for p in params:
        yield p, flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def _flatten_into(params: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """`out` ← the parameters laid end to end; one transfer when `out` lies on another device
    (the host windows of a model on a GPU), not one per parameter."""
    if params and params[0].device != out.device:
        return out.copy_(torch.cat([p.detach().reshape(-1) for p in params]))
    for p, piece in _pieces(params, out):
        piece.copy_(p.detach())
    return out


@contextmanager
def holding(params: Sequence[torch.Tensor], load: Callable[[], None]) -> Iterator[None]:
    """`load()` puts other weights (a centre, a server's) into `params` for the block; their
    own come back after it."""
    saved = [p.detach().clone() for p in params]
    load()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, value in zip(params, saved, strict=True):
                p.copy_(value)


class ElasticAveraging(ReplicaOptimizer):
    """The shared update rule; subclasses choose how workers meet the centre (`_differences`)."""

    syncs_gradients = False
    has_centre = True
    per_replica = True
    elementwise = True  # the elastic rule moves each element by its own difference
    # The centre and the buffers that meet it on the host (the one-sided windows are host
    # memory), rather than on the parameters' device.
    host_centre: ClassVar[bool] = True

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.2, rho: float | None = None, moving_rate: float | None = None,
                 period: int = 1, momentum: float = 0.0, nesterov: bool = False) -> None:
        self.grid, self.base_lr, self.period = grid, lr, period
        self.alpha = resolve_moving_rate(lr, rho, moving_rate, grid.pc)
        self.momentum, self.nesterov = momentum, nesterov
        in_group = {id(p) for p in model.replicated_in_model_group}
        params = list(model.parameters())
        # This rank's share of the centre: its shard, plus the group-replicated parameters on
        # model rank 0 only (the others receive them by broadcast).
        self.owned = [p for p in params if id(p) not in in_group or grid.model_index == 0]
        self.group_replicated = [p for p in params if id(p) in in_group] if grid.pr > 1 else []
        self.params = params
        self.velocity = [torch.zeros_like(p) for p in params] if momentum else []
        numel = sum(p.numel() for p in self.owned)
        dtype = params[0].dtype if params else torch.float32
        self.device = params[0].device if params else torch.device("cpu")
        buffers = torch.device("cpu") if self.host_centre else self.device
        self.flat = torch.empty(numel, dtype=dtype, device=buffers)
        self.differences = torch.empty(numel, dtype=dtype, device=buffers)
        self.exchanges = 0
        self._init_centre(_flatten_into(self.owned, self.flat))

    @staticmethod
    def check(lr: float, rho: float | None, moving_rate: float | None, period: int,
              momentum: float, nesterov: bool = False) -> list[str]:
        errors = []
        if not lr > 0:
            errors.append(f"optimizer.lr must be > 0, got {lr}")
        # 0: the replicas never move toward the centre, nor it toward them (P runs of SGD)
        if rho is not None and not rho > 0:
            errors.append(f"optimizer.rho (the elastic coefficient) must be > 0, got {rho}")
        if moving_rate is not None and not 0 < moving_rate < 1:
            errors.append(f"optimizer.moving_rate (alpha = lr * rho) must be in (0, 1), "
                          f"got {moving_rate}")
        if rho is not None and moving_rate is not None:
            errors.append("set optimizer.rho or optimizer.moving_rate, not both "
                          "(moving_rate = lr * rho)")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            errors.append(f"optimizer.period (tau, steps between exchanges) must be an integer "
                          f">= 1, got {period}")
        if not 0 <= momentum < 1:
            errors.append(f"optimizer.momentum must be in [0, 1), got {momentum}")
        if nesterov and not momentum > 0:
            errors.append(f"optimizer.nesterov=true needs optimizer.momentum > 0, got "
                          f"{momentum}")
        return errors

    @classmethod
    def grid_problems(cls, options: Mapping[str, Any], pr: int, pc: int) -> list[str]:
        """The centre update W̄ ← W̄ + α Σᵢ (Wᵢ − W̄) is a contraction only for Pc·α < 1 (the
        EASGD paper's β = Pc·α; 0.9 by default)."""
        lr, rho, moving_rate = options["lr"], options["rho"], options["moving_rate"]
        alpha = resolve_moving_rate(lr, rho, moving_rate, pc)
        if pc * alpha < 1:
            return []
        given = (f"optimizer.moving_rate={moving_rate}" if moving_rate is not None else
                 f"optimizer.lr={lr} × optimizer.rho={rho} = moving rate {alpha:g}")
        return [f"{given} with grid.pc={pc}: Pc·α = {pc * alpha:g}, but the centre update is a "
                f"contraction only for Pc·α < 1; lower the moving rate below {1 / pc:g}"]

    # -- the update -----------------------------------------------------------------------------

    def _init_centre(self, initial: torch.Tensor) -> None:
        raise NotImplementedError

    def _differences(self, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` ← α(Wᵢ − W̄) for this rank's share, having moved the centre by it."""
        raise NotImplementedError

    def centre(self, out: torch.Tensor) -> torch.Tensor:
        """This rank's share of the centre variable, as it is now."""
        raise NotImplementedError

    def meets_replicas(self, step: int) -> bool:
        """Synchronous methods meet on exchange steps only (every τ-th)."""
        return not self.asynchronous and self._exchanges_at(step)

    def logged_loss(self) -> str:
        if self.asynchronous or self.period == 1:
            return super().logged_loss()
        return (f"global batch on exchange steps (every {self.period}th), replica 0 on the "
                f"others")

    def _exchanges_at(self, step: int) -> bool:
        return (step + 1) % self.period == 0

    def step(self, step: int) -> None:
        if self.nesterov:
            self._nesterov_step(step)
            return
        exchange = self._exchanges_at(step)
        if exchange:  # with the weights the gradient was taken at
            self._differences(_flatten_into(self.owned, self.flat), self.differences)
            self.exchanges += 1
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                if self.velocity:
                    self.velocity[i].mul_(self.momentum).add_(p.grad, alpha=-self.base_lr)
                    p.add_(self.velocity[i])
                else:
                    p.add_(p.grad, alpha=-self.base_lr)
            if exchange:  # one transfer to the parameters' device (none when already there)
                differences = self.differences.to(self.device)
                for weight, difference in _pieces(self.owned, differences):
                    weight.sub_(difference)
        if exchange:
            self._broadcast_group_replicated()

    def _nesterov_step(self, step: int) -> None:
        """EAMSGD (Algorithm 2): the model holds the look-ahead point Y = W + μV, where the
        gradient was taken. V' = μV − η∇ and W' = W + V' give Y' = Y + (1 + μ)V' − μV; then, on
        an exchange step, W' meets the centre and Y' moves by the same elastic difference."""
        mu = self.momentum
        with torch.no_grad():
            for p, velocity in zip(self.params, self.velocity, strict=True):
                if p.grad is None:
                    continue
                p.sub_(velocity, alpha=mu)
                velocity.mul_(mu).add_(p.grad, alpha=-self.base_lr)
                p.add_(velocity, alpha=1 + mu)
        if not self._exchanges_at(step):
            return
        velocity_of = {id(p): v for p, v in zip(self.params, self.velocity, strict=True)}
        weights = _flatten_into(self.owned, self.flat)  # the look-ahead points Y
        velocities = _flatten_into([velocity_of[id(p)] for p in self.owned], self.differences)
        weights.sub_(velocities, alpha=mu)  # W = Y − μV
        self._differences(weights, self.differences)
        self.exchanges += 1
        with torch.no_grad():
            differences = self.differences.to(self.device)
            for weight, difference in _pieces(self.owned, differences):
                weight.sub_(difference)
        self._broadcast_group_replicated()

    def _broadcast_group_replicated(self) -> None:
        for p in self.group_replicated:
            self.grid.model.bcast_(p.data, root=0, label="elastic")

    @contextmanager
    def centre_weights(self) -> Iterator[None]:
        """The model holds the centre variable inside the block, its own weights after."""
        with holding(self.params, self._load_centre):
            yield

    def _load_centre(self) -> None:
        centre = self.centre(torch.empty_like(self.flat)).to(self.device)
        with torch.no_grad():
            for p, value in _pieces(self.owned, centre):
                p.copy_(value)
        self._broadcast_group_replicated()

    @property
    def lr(self) -> float:
        return self.base_lr

    def state_kinds(self) -> tuple[str, ...]:
        return ("velocity",) if self.velocity else ()

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        return {"velocity": list(self.velocity)} if self.velocity else {}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        for mine, saved in zip(self.velocity, states.get("velocity", []), strict=False):
            if saved is not None:
                mine.copy_(saved)


@register_optimizer("sync_easgd")
class SyncEASGD(ElasticAveraging):
    """Every worker every τ steps; the centre, replicated on each worker, moves by the sum of
    the workers' differences, computed by one all-reduce over the batch group (a tree/ring
    reduction, not rank by rank). Deterministic. The centre lives on the parameters' device."""

    asynchronous = False
    host_centre = False

    def _init_centre(self, initial: torch.Tensor) -> None:
        self._centre = initial.clone()
        self._sum = torch.empty_like(initial)

    def _differences(self, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        total = self.grid.batch.allreduce(weights, self._sum, label="elastic")
        torch.sub(weights, self._centre, out=out).mul_(self.alpha)
        # W̄ ← W̄ + α Σᵢ (Wᵢ − W̄) = W̄ + α (Σᵢ Wᵢ − Pc W̄)
        self._centre.add_(total.sub_(self._centre, alpha=self.grid.pc), alpha=self.alpha)
        return out

    def centre(self, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(self._centre)


class SharedCentre(ElasticAveraging):
    """The centre in one-sided windows, each worker exchanging with it piece by piece."""

    asynchronous = True
    locks_pieces: ClassVar[bool] = True

    def _init_centre(self, initial: torch.Tensor) -> None:
        self.shared = OneSidedVector(self.grid.batch, initial, label="centre")
        self._read = torch.empty_like(initial)

    def _exchange_piece(self, owner: int, weights: torch.Tensor, out: torch.Tensor) -> None:
        piece = self.shared.piece(owner)
        if self.locks_pieces:
            self.shared.acquire(owner)
        centre = self.shared.read(owner, self._read[piece])
        torch.sub(weights[piece], centre, out=out[piece]).mul_(self.alpha)
        self.shared.add(owner, out[piece])
        if self.locks_pieces:
            self.shared.release(owner)

    def _differences(self, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Start at our own piece so that workers spread over the owners instead of queueing
        # at the same one.
        size = self.grid.pc
        for k in range(size):
            self._exchange_piece((self.grid.batch_index + k) % size, weights, out)
        return out

    def centre(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared.read_all(out)

    def close(self) -> None:
        self.shared.close()


@register_optimizer("async_easgd")
class AsyncEASGD(SharedCentre):
    """Workers meet the centre whenever they are ready; each piece serves them first come,
    first served (a ticket lock). No worker waits for another worker's step."""


@register_optimizer("async_measgd")
class AsyncMEASGD(SharedCentre):
    """`async_easgd` with momentum on the workers (the centre has none): heavy-ball as in
    SC17 by default, Nesterov (Zhang et al.'s EAMSGD) with `nesterov=true`."""

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.05, rho: float | None = None, moving_rate: float | None = None,
                 period: int = 1, momentum: float = 0.9, nesterov: bool = False) -> None:
        super().__init__(model, grid, total_steps, lr, rho, moving_rate, period, momentum,
                         nesterov)


@register_optimizer("hogwild_easgd")
class HogwildEASGD(SharedCentre):
    """Workers update the centre concurrently without any lock (Hogwild!): each element's read
    and addition are atomic, a worker's read of the whole piece is not."""

    locks_pieces = False


@register_optimizer("easgd")
class RoundRobinEASGD(SharedCentre):
    """The original EASGD: the centre serves one worker at a time in fixed rank order, so every
    worker waits for all the ones before it (the baseline the SC17 redesign improves on)."""

    asynchronous = False
    locks_pieces = False  # the turn already excludes everyone else

    def _differences(self, weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        self.shared.wait_turn(self.exchanges * self.grid.pc + self.grid.batch_index)
        for owner in range(self.grid.pc):
            self._exchange_piece(owner, weights, out)
        self.shared.next_turn()
        return out
