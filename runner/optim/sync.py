"""Replica optimizers: how the batch replicas (the `Pc` dimension) agree.

`sgd` is the synchronous baseline: the strategy averages gradients over the replicas every step,
then every rank applies the same SGD update to its shard, so replicas stay identical. Any
`torch.optim` class runs the same way (`wrap_torch_optimizer`; registered: `adam`, `adamw`). The
elastic averaging family lives in `easgd.py`.

Devices: state shaped like a parameter lives on the parameter's device (created like it, and
moved there when restored from a checkpoint, whose tensors are on the host); one-value state is
placed as `torch.optim` places it (`_placed_state`).
"""

from __future__ import annotations

import functools
import inspect
import math
import types
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.optim.optimizer import required
from torch.optim.sgd import sgd

from runner.config.options import shown
from runner.config.registry import register_optimizer
from runner.core import ProcessGrid
from strategies import ParallelModel

SCHEDULES = ("constant", "cosine")

# The torch.optim classes whose update of a parameter element depends on that element's own
# gradient and state alone: the same whether the parameter is whole or split over ranks. The one
# list; any other class (LBFGS, SparseAdam, Adafactor, Muon, a user's own) is assumed not to be.
ELEMENTWISE_TORCH_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
    torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop})
# The classes that take only row-sparse gradients; every other one is given dense gradients.
SPARSE_ONLY_TORCH_OPTIMIZERS: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SparseAdam})


def scheduled_lr(base_lr: float, step: int, total_steps: int, schedule: str,
                 warmup_steps: int) -> float:
    """Learning rate for 0-based `step`: linear warm-up, then constant or cosine decay to 0."""
    if warmup_steps and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        return 0.5 * base_lr * (1 + math.cos(math.pi * (step - warmup_steps) / span))
    return base_lr


def schedule_problems(schedule: str, warmup_steps: int) -> list[str]:
    """What is wrong with gridrun's own learning-rate options (`scheduled_lr`)."""
    errors = []
    if schedule not in SCHEDULES:
        errors.append(f"optimizer.schedule must be one of {', '.join(SCHEDULES)}, got "
                      f"'{schedule}'")
    if warmup_steps < 0:
        errors.append(f"optimizer.warmup_steps must be >= 0, got {warmup_steps}")
    return errors


class ReplicaOptimizer:
    """Base of the `optimizer` config group. Built with the parallel model, the grid and the
    number of steps; `step(i)` runs after the backward of 0-based step i."""

    syncs_gradients: ClassVar[bool] = True  # the strategy all-reduces replica gradients
    # Replicas never wait for each other: the training loop must not add a collective over
    # replicas to a step (the logged loss is then replica 0's).
    asynchronous: ClassVar[bool] = False
    has_centre: ClassVar[bool] = False  # evaluation also scores a centre variable
    # Replicas' weights differ (the EASGD family): a checkpoint keeps each replica's own.
    per_replica: ClassVar[bool] = False
    # The update of each parameter element depends on that element's own history alone, so it
    # is the same whether a parameter is whole or split over ranks: a strategy that splits
    # parameters may run it. False (the safe answer) unless the optimizer says otherwise.
    elementwise: ClassVar[bool] = False

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 **options: Any) -> None:
        """Subclasses take their options as keyword arguments with defaults: their signature
        is their schema (`runner.config.options`)."""

    @staticmethod
    def check(*args: Any, **options: Any) -> list[str]:
        """Every problem with these options, given whole (the constructor's defaults filled in
        for the ones the config leaves out: the defaults live in `__init__` alone)."""
        return []

    @classmethod
    def grid_problems(cls, options: Mapping[str, Any], pr: int, pc: int) -> list[str]:
        """Every problem with these options (given whole, as for `check`) on a `pr` × `pc`
        grid: what depends on the number of replicas."""
        return []

    def step(self, step: int) -> None:
        raise NotImplementedError

    def meets_replicas(self, step: int) -> bool:
        """Whether 0-based step `step` has the replicas meet (an exchange across them): the
        training loop then reduces the logged loss and the stop request over the world; on a
        step where they do not meet, over the replica alone, so no replica waits for another.
        Synchronous optimizers meet every step, asynchronous ones never as a group."""
        return not self.asynchronous

    def logged_loss(self) -> str:
        """Whose rows the logged training loss is the mean over (the summary's
        `logged_loss`), as `meets_replicas` decides it."""
        return "replica 0" if self.asynchronous else "global batch"

    @property
    def lr(self) -> float:
        raise NotImplementedError

    @contextmanager
    def centre_weights(self) -> Iterator[None]:
        """Inside the block the model holds the centre variable (when `has_centre`)."""
        raise NotImplementedError
        yield

    def close(self) -> None:
        """Collective over all ranks: release what the optimizer holds (MPI windows)."""

    # -- what a checkpoint keeps ------------------------------------------------------------

    @classmethod
    def state_copies(cls, options: Mapping[str, Any]) -> int:
        """How many parameter-shaped tensors of state per parameter the optimizer keeps with
        these config options, known before anything is built (preflight sizes memory and
        checkpoints by it). Here: one when an option `momentum` is > 0 (SGD's momentum,
        MEASGD's velocity); an optimizer that keeps other state says so."""
        return int(float(options.get("momentum") or 0) > 0)

    def state_kinds(self) -> tuple[str, ...]:
        """The kinds of per-parameter state this optimizer keeps shaped like its parameter
        (momentum, velocity, Adam's exp_avg): a checkpoint stores them by rows, re-sharded on
        load."""
        return ()

    def scalar_kinds(self) -> tuple[str, ...]:
        """The kinds of per-parameter state that are one value, not shaped like the parameter
        (Adam's step count): a checkpoint stores one per parameter name, whole, and every shard
        of that parameter gets it on load."""
        return ()

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        """Per kind (`state_kinds` and `scalar_kinds`), one tensor per model parameter, in
        `model.parameters()` order (None where there is none yet); a scalar kind's are 0-d."""
        return {}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        """Restore what `param_states` returned (re-sharded to this rank's parameters): every
        kind the checkpoint has, in one call (a kind it lacks is not in `states`)."""


@register_optimizer("sgd")
class SynchronousSGD(ReplicaOptimizer):
    """Synchronous SGD with optional momentum, Nesterov and weight decay: PyTorch's SGD rule,
    through its functional form (`torch.optim.sgd.sgd`). The `torch.optim.SGD` class would add
    nothing but its wrapper, whose first use imports torch._dynamo and sympy: 1-2 s of every
    rank's start-up."""

    elementwise = True

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int,
                 lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, schedule: str = "constant",
                 warmup_steps: int = 0) -> None:
        self.base_lr, self.current_lr, self.total_steps = lr, lr, total_steps
        self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
        self.schedule, self.warmup_steps = schedule, warmup_steps
        self.params = list(model.parameters())
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)
        # Momentum and weight decay move every row of an embedding table every step: its
        # row-sparse gradient (after a sparse exchange) is then applied densely. PyTorch's own
        # sparse momentum would concatenate rows without end and slow down step after step.
        self.dense_update = momentum > 0 or weight_decay > 0

    @staticmethod
    def check(lr: float, momentum: float, weight_decay: float, nesterov: bool, schedule: str,
              warmup_steps: int) -> list[str]:
        errors = []
        if not lr > 0:
            errors.append(f"optimizer.lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            errors.append(f"optimizer.momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            errors.append(f"optimizer.weight_decay must be >= 0, got {weight_decay}")
        if nesterov and momentum == 0:
            errors.append("optimizer.nesterov needs optimizer.momentum > 0")
        return errors + schedule_problems(schedule, warmup_steps)

    def step(self, step: int) -> None:
        self.current_lr = scheduled_lr(self.base_lr, step, self.total_steps, self.schedule,
                                       self.warmup_steps)
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        grads = []
        for i in with_grad:
            grad = self.params[i].grad
            assert grad is not None
            grads.append(grad.to_dense() if self.dense_update and grad.is_sparse else grad)
        buffers = [self.momentum_buffers[i] for i in with_grad]
        with torch.no_grad():
            sgd([self.params[i] for i in with_grad], grads, buffers,
                has_sparse_grad=any(g.is_sparse for g in grads), foreach=None,
                weight_decay=self.weight_decay, momentum=self.momentum, lr=self.current_lr,
                dampening=0.0, nesterov=self.nesterov, maximize=False)
        for i, buffer in zip(with_grad, buffers, strict=True):
            self.momentum_buffers[i] = buffer

    @property
    def lr(self) -> float:
        return float(self.current_lr)

    def state_kinds(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        return {"momentum": list(self.momentum_buffers)} if self.momentum else {}

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        for i, buffer in enumerate(states.get("momentum", [])[:len(self.params)]):
            if buffer is not None:
                self.momentum_buffers[i] = _placed_state(buffer, self.params[i], "momentum", {})


# -- any torch.optim class, run synchronously -------------------------------------------------

GRIDRUN_OPTIONS = ("schedule", "warmup_steps")  # the wrapper's own, beside the class's options
_INPUTS = ("model", "grid", "total_steps")  # what every replica optimizer is built with


class UnsavableState(ValueError):
    """Optimizer state a checkpoint cannot keep: neither shaped like its parameter nor one
    value (Adafactor's factored rows and columns)."""


def torch_name(torch_class: type) -> str:
    """`torch.optim.Adam` rather than `torch.optim.adam.Adam`: the name a user writes."""
    if getattr(torch.optim, torch_class.__name__, None) is torch_class:
        return f"torch.optim.{torch_class.__name__}"
    return f"{torch_class.__module__}.{torch_class.__qualname__}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _config_annotation(annotation: Any) -> Any:
    """`annotation` as a config value can meet it. torch takes a tensor for `lr` or a beta; a
    YAML file holds none, so `float | Tensor` reads `float` (and a wrong value is told "must be
    a number", not "... or Tensor"). A string annotation that did not resolve checks nothing."""
    if isinstance(annotation, str):
        return inspect.Parameter.empty
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kept = [_config_annotation(a) for a in args if a is not torch.Tensor]
        return functools.reduce(lambda a, b: a | b, kept) if kept else annotation
    if origin in (tuple, list) and args:
        return origin[tuple(a if a is Ellipsis else _config_annotation(a) for a in args)]
    return annotation


def _replica_signature(torch_class: type[torch.optim.Optimizer]) -> inspect.Signature:
    """`(model, grid, total_steps, *, <the class's options>, schedule, warmup_steps)`: the
    schema `runner.config.options` reads (`inspect.signature` of the wrapped class), the class's
    defaults and annotations kept, its `required` marker read as "no default"."""
    try:
        source = inspect.signature(torch_class, eval_str=True)
    except Exception:  # a user's annotations that do not resolve: left unchecked
        source = inspect.signature(torch_class)
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
              for name in _INPUTS]
    any_keyword = []
    for param in list(source.parameters.values())[1:]:  # the first takes the parameters
        if param.name in GRIDRUN_OPTIONS or param.name in _INPUTS:
            raise TypeError(f"{torch_name(torch_class)} has an option '{param.name}', which "
                            f"gridrun's replica optimizers take themselves")
        if param.kind is param.VAR_KEYWORD:
            any_keyword.append(param.replace(annotation=inspect.Parameter.empty))
        elif param.kind is not param.VAR_POSITIONAL:
            default = inspect.Parameter.empty if param.default is required else param.default
            params.append(param.replace(kind=keyword, default=default,
                                        annotation=_config_annotation(param.annotation)))
    params += [inspect.Parameter("schedule", keyword, default="constant", annotation=str),
               inspect.Parameter("warmup_steps", keyword, default=0, annotation=int)]
    return inspect.Signature([*params, *any_keyword])


def _torch_arguments(options: Mapping[str, Any]) -> dict[str, Any]:
    """The class's own options among a config's: gridrun's left out, lists as tuples (YAML has
    no tuples; torch keeps `betas` as it is given)."""
    return {key: tuple(value) if isinstance(value, list) else value
            for key, value in options.items() if key not in GRIDRUN_OPTIONS}


@dataclass(frozen=True)
class StateLayout:
    """What a torch optimizer keeps per parameter (its `state[param]` keys), by how a
    checkpoint stores it."""

    tensors: tuple[str, ...]  # shaped like the parameter: stored by rows, re-sharded
    scalars: tuple[str, ...]  # one value (a 0-d tensor or a number): one per parameter name
    numbers: frozenset[str]  # of the scalars, those kept as Python numbers
    other: tuple[str, ...]  # anything else: not checkpointed (`UnsavableState`)


def _layout(state: Mapping[str, Any], param: torch.Tensor) -> StateLayout:
    tensors, scalars, numbers, other = [], [], set(), []
    for kind, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == param.shape:
            tensors.append(kind)
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            scalars.append(kind)
        elif isinstance(value, (bool, int, float)):
            scalars.append(kind)
            numbers.add(kind)
        elif value is not None:  # None: nothing kept (SGD without momentum)
            other.append(kind)
    return StateLayout(tuple(tensors), tuple(scalars), frozenset(numbers), tuple(other))


def _probe(torch_class: type[torch.optim.Optimizer], arguments: Mapping[str, Any]
           ) -> StateLayout:
    """One step of `torch_class` on a small 2 x 3 parameter (not square, so that state shaped
    like it is told from a factored one): its constructor's checks, its step's, and the state
    it keeps. Raises what they raise. The caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        # host: a probe of the class's state layout, never the model's parameters
        param = torch.nn.Parameter(torch.linspace(0.1, 0.6, 6).view(2, 3))
        optimizer = torch_class([param], **arguments)
        grad = torch.full_like(param, 0.5)
        param.grad = grad.to_sparse() if torch_class in SPARSE_ONLY_TORCH_OPTIMIZERS else grad
        optimizer.step()
        return _layout(optimizer.state.get(param, {}), param)


_LAYOUTS: dict[tuple[type, str], StateLayout] = {}


def state_layout(torch_class: type[torch.optim.Optimizer], arguments: Mapping[str, Any]
                 ) -> StateLayout:
    """The state `torch_class` keeps with these options (which decide some of it: `amsgrad`,
    RMSprop's `momentum`), probed once per class and options."""
    key = (torch_class, repr(sorted(arguments.items())))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = _probe(torch_class, arguments)
    return _LAYOUTS[key]


def _needs_closure(torch_class: type[torch.optim.Optimizer]) -> bool:
    """Its `step` must re-evaluate the model (LBFGS's line search): gridrun's step cannot."""
    try:
        closure = inspect.signature(torch_class.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _value_problems(options: Mapping[str, Any]) -> list[str]:
    """gridrun's reading of the options most torch optimizers share, in `sgd`'s words: a
    learning rate > 0, betas in [0, 1), eps > 0, weight_decay >= 0."""
    def number(key: str) -> float | None:
        value = options.get(key)
        return value if isinstance(value, (int, float)) else None

    errors = []
    lr, eps, decay, betas = number("lr"), number("eps"), number("weight_decay"), options.get(
        "betas")
    if lr is not None and not lr > 0:
        errors.append(f"optimizer.lr must be > 0, got {lr}")
    if betas is not None and not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(
            isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)):
        errors.append(f"optimizer.betas must be two numbers in [0, 1), got {shown(betas)}")
    if eps is not None and not eps > 0:
        errors.append(f"optimizer.eps must be > 0, got {eps}")
    if decay is not None and decay < 0:
        errors.append(f"optimizer.weight_decay must be >= 0, got {decay}")
    return errors


def _torch_problem(torch_class: type[torch.optim.Optimizer], arguments: Mapping[str, Any],
                   defaults: Mapping[str, Any]) -> str | None:
    """Why `torch_class` refuses these options, in its own words (its constructor's checks,
    or its first step's); the option to blame is the one whose default makes it go."""
    try:
        state_layout(torch_class, arguments)
        return None
    except Exception as exc:  # the class's own checks: whatever they raise is the answer
        reason = _first_line(exc)
    name = torch_name(torch_class)
    for key, value in arguments.items():
        default = defaults.get(key, inspect.Parameter.empty)
        if default is inspect.Parameter.empty or value == default:
            continue
        try:
            _probe(torch_class, {**arguments, key: default})
        except Exception:  # not this one alone
            continue
        return f"optimizer.{key}={shown(value)}: {name} refuses it: {reason}"
    return f"optimizer: {name} refuses these options: {reason}"


def fused_by_default(torch_class: type[torch.optim.Optimizer], arguments: Mapping[str, Any],
                     devices: set[str]) -> bool:
    """Whether `torch_class` runs its fused kernels (one launch for every parameter: AdamW,
    Adam, SGD, Adagrad take `fused`) where the user chose no implementation: on CUDA, where
    they are the fast path and torch still defaults to foreach."""
    if devices != {"cuda"} or "fused" in arguments or "foreach" in arguments:
        return False
    try:
        return "fused" in inspect.signature(torch_class).parameters
    except (TypeError, ValueError):
        return False


class TorchOptimizer(ReplicaOptimizer):
    """A `torch.optim` class run as a synchronous replica optimizer (`wrap_torch_optimizer`
    makes one per class): the strategy averages the replicas' gradients exactly as for `sgd`,
    then the class's own `step` updates this rank's parameters (its shards). gridrun's
    `schedule` and `warmup_steps` set every param group's lr before each step.

    Its options are the class's constructor keywords (its signature is the schema) plus those
    two. On CUDA a class with fused kernels runs them unless the options choose (`fused`,
    `foreach`). Its state is checkpointed by kind (`StateLayout`): tensors shaped like the parameter
    by rows, one-value state (Adam's `step`) once per parameter name."""

    torch_class: ClassVar[type[torch.optim.Optimizer]] = torch.optim.Optimizer

    def __init__(self, model: ParallelModel, grid: ProcessGrid, total_steps: int, *,
                 schedule: str = "constant", warmup_steps: int = 0, **options: Any) -> None:
        self.total_steps, self.schedule, self.warmup_steps = total_steps, schedule, warmup_steps
        self.params = list(model.parameters())
        arguments = _torch_arguments(options)
        if self.params and fused_by_default(self.torch_class, arguments,
                                            {p.device.type for p in self.params}):
            arguments["fused"] = True
        self.optimizer = self.torch_class(self.params, **arguments)
        self.base_lrs = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.layout = state_layout(self.torch_class, arguments)
        # A row-sparse gradient (an embedding table's) is made dense for a class that does not
        # take only sparse ones: densifying changes no value, and every class takes dense.
        self.densify = self.torch_class not in SPARSE_ONLY_TORCH_OPTIMIZERS

    @classmethod
    def check(cls, *args: Any, **options: Any) -> list[str]:
        """gridrun's checks of the common options, then the class's own, on a small parameter
        (only when gridrun's pass: one line per problem, never two for one)."""
        errors = _value_problems(options) + schedule_problems(
            options.get("schedule", "constant"), options.get("warmup_steps", 0))
        name = torch_name(cls.torch_class)
        if _needs_closure(cls.torch_class):
            errors.append(f"optimizer: {name} needs a closure that evaluates the model again "
                          f"in its step (a line search); gridrun's step has none: choose "
                          f"another optimizer")
        if errors:
            return errors
        defaults = {key: param.default for key, param in
                    inspect.signature(cls.torch_class).parameters.items()}
        problem = _torch_problem(cls.torch_class, _torch_arguments(options), defaults)
        return [problem] if problem else []

    @classmethod
    def state_copies(cls, options: Mapping[str, Any]) -> int:
        return len(state_layout(cls.torch_class, _torch_arguments(options)).tensors)

    def step(self, step: int) -> None:
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = scheduled_lr(base_lr, step, self.total_steps, self.schedule,
                                       self.warmup_steps)
        if self.densify:
            for param in self.params:
                if param.grad is not None and param.grad.is_sparse:
                    param.grad = param.grad.to_dense()
        self.optimizer.step()

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_kinds(self) -> tuple[str, ...]:
        return self.layout.tensors

    def scalar_kinds(self) -> tuple[str, ...]:
        return self.layout.scalars

    def param_states(self) -> dict[str, list[torch.Tensor | None]]:
        kinds = self.layout.tensors + self.layout.scalars
        # What the probe did not see (state a class adds later, or for some parameters only)
        # would be lost without a word: refused like state of the wrong shape.
        unseen = {kind for state in self.optimizer.state.values()
                  for kind, value in state.items() if value is not None} - set(kinds)
        if self.layout.other or unseen:
            raise UnsavableState(
                f"{torch_name(self.torch_class)} keeps state a checkpoint cannot hold (neither "
                f"shaped like its parameter nor one value): "
                f"{', '.join(sorted({*self.layout.other, *unseen}))}")
        return {kind: [self._state_value(param, kind) for param in self.params]
                for kind in kinds}

    def _state_value(self, param: torch.Tensor, kind: str) -> torch.Tensor | None:
        value = self.optimizer.state.get(param, {}).get(kind)
        # host: a Python number kept as one value, for the checkpoint (which holds host tensors)
        return value if value is None or isinstance(value, torch.Tensor) else torch.tensor(value)

    def load_param_states(self, states: dict[str, list[torch.Tensor | None]]) -> None:
        """A parameter's state is restored whole or not at all (a class whose state lacks a
        key it expects fails at its next step): a parameter missing any kind starts afresh."""
        kinds = self.layout.tensors + self.layout.scalars
        groups = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        for i, param in enumerate(self.params):
            values = [states[kind][i] if kind in states else None for kind in kinds]
            if not kinds or any(value is None for value in values):
                continue
            group = groups.get(id(param), {})
            self.optimizer.state[param] = {
                kind: (value.item() if kind in self.layout.numbers
                       else _placed_state(value, param, kind, group))
                for kind, value in zip(kinds, values, strict=True) if value is not None}


def _placed_state(value: torch.Tensor, param: torch.Tensor, kind: str,
                  group: Mapping[str, Any]) -> torch.Tensor:
    """A restored state tensor where `torch.optim`'s own `load_state_dict` puts it
    (`Optimizer._process_value_according_to_param_policy`): `step` stays on the host unless its
    group is capturable or fused (then float32 on the parameter's device); anything else goes to
    the parameter's device, in the parameter's dtype when that is a floating one."""
    if kind == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)


_WRAPPED: dict[type[torch.optim.Optimizer], type[ReplicaOptimizer]] = {}


def wrap_torch_optimizer(torch_class: type[torch.optim.Optimizer]) -> type[ReplicaOptimizer]:
    """The synchronous replica optimizer that runs `torch_class` (`TorchOptimizer`), with the
    signature `(model, grid, total_steps, *, <its options>, schedule, warmup_steps)`. One class
    per torch class: the same object every time it is asked for (a config that names the torch
    class by `_target_` is checked and built with the class the registry would give)."""
    if not (isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer)):
        raise TypeError(f"{torch_class!r} is not a torch.optim.Optimizer class")
    if torch_class not in _WRAPPED:
        name = f"Torch{torch_class.__name__}"
        namespace = {"__module__": __name__, "__qualname__": name,
                     "__doc__": f"{torch_name(torch_class)}, run synchronously "
                                f"(TorchOptimizer).",
                     "__signature__": _replica_signature(torch_class),
                     "torch_class": torch_class,
                     "elementwise": torch_class in ELEMENTWISE_TORCH_OPTIMIZERS}
        _WRAPPED[torch_class] = typing.cast("type[ReplicaOptimizer]",
                                            type(name, (TorchOptimizer,), namespace))
    return _WRAPPED[torch_class]


TorchAdam = register_optimizer("adam")(wrap_torch_optimizer(torch.optim.Adam))
TorchAdamW = register_optimizer("adamw")(wrap_torch_optimizer(torch.optim.AdamW))
