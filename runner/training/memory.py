"""The activation memory of a training step: the bytes of the tensors autograd keeps for
backward, live and at their peak.

Every tensor an operator saves for its backward passes through `saved_tensors_hooks` (the
pack hook); it stays alive until backward has used it and the graph lets it go (the packed
handle is then dropped). A tensor is counted by its storage, once however many operators save
it or views of it, and a parameter's storage not at all (it lives without the step). A
checkpointed module (`trainer.activation_checkpointing`) saves through torch's own hooks
instead: what it keeps is its inputs, which the module before it saved already when it is
itself checkpointed, or else are counted where an operator saves them; nothing inside it is
kept, which is the point.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from runner.optim.sync import ReplicaOptimizer
from strategies.base import ParallelModel


class _Saved:
    """A saved tensor on its way through backward; its storage's bytes leave the count when
    the graph lets it go."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: SavedTensorMeter, tensor: torch.Tensor, key: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:
        self.meter.release(self.key)


def _storage(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(key, bytes) of `tensor`'s storage; None for a tensor without one (sparse, nested)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return storage.data_ptr(), storage.nbytes()


class SavedTensorMeter:
    """Counts the bytes of the tensors saved for backward inside `step()`: `live` now, `peak`
    since the step began."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self.live = 0
        self.peak = 0
        self._held: dict[int, list[int]] = {}  # storage key -> [bytes, handles alive]
        self._parameters = {key for p in parameters
                            if (key := self._key_of(p)) is not None}
        self._anonymous = -1  # keys for tensors without a storage: counted each alone
        self.active = False  # inside `step()` (a model's own hooks pass tensors on to these)

    @staticmethod
    def _key_of(tensor: torch.Tensor) -> int | None:
        found = _storage(tensor)
        return None if found is None else found[0]

    def pack(self, tensor: torch.Tensor) -> object:
        if not self.active:
            return tensor
        found = _storage(tensor)
        if found is None:
            key, nbytes = self._anonymous, tensor.numel() * tensor.element_size()
            self._anonymous -= 1
        else:
            key, nbytes = found
            if key in self._parameters or nbytes == 0:
                return tensor
        held = self._held.get(key)
        if held is None:
            self._held[key] = [nbytes, 1]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            held[1] += 1
        return _Saved(self, tensor, key)

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[return-value]

    def release(self, key: int) -> None:
        held = self._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            self.live -= held[0]
            del self._held[key]

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One step's forwards and backwards: its peak starts from what is live now."""
        self.peak = self.live
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self.active = False


def held_memory(model: ParallelModel, optimizer: ReplicaOptimizer) -> dict[str, int | None]:
    """The bytes this rank holds for the model, counted from the tensors themselves, by what
    holds them (as `Strategy.predict_memory` predicts them): its parameters, their gradients
    (and a sharded model's whole gradients at their peak), the optimizer's per-parameter state
    and the most whole parameters a sharded model held at once. The state of an optimizer
    whose replicas exchange by other means than summed gradients is not counted (None): its
    state may live in other ranks' windows, which reading would take part in their exchange."""
    def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    state: int | None = None
    if optimizer.syncs_gradients:
        states = optimizer.param_states()
        state = sum(nbytes(states[kind]) for kind in optimizer.state_kinds() if kind in states)
    return {"parameters": nbytes(model.parameters()),
            "gradients": nbytes(p.grad for p in model.parameters())
            + model.whole_gradient_peak_bytes(),
            "optimizer state": state,
            "gathered parameters": model.gathered_peak_bytes()}
