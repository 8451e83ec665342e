"""What one forward of the real model says about it, for models nobody here wrote.

A model's `children()` need not form a chain (a torchvision or transformers model registers its
modules in any order and calls them as it likes), and its input need not be a float tensor
(token ids are int64). So shapes, sizes and the work of every layer are learned from one
forward of the model itself, on one sample of the dataset's own dtype, with hooks on its leaf
modules: on the meta device for a large model (shapes only, no memory), on its own device
otherwise. And what a model returns need not be a tensor: `logits_of` finds the scores in a
tuple, a dict or a model-output object (the transformers library's `.logits`).

A training forward says what couples the rows of a batch (`training_calls`): the modules whose
code draws random numbers, seen by a `TorchFunctionMode` as they call torch (and, for a model
that draws, every random operator as a `TorchDispatchMode` sees it, also inside composite
functions), and the `F.batch_norm` calls with batch statistics. Two of them, of 2 and 3
samples, tell which draws are over the batch's rows (`draw_plan`): those whose dim 0 grows with
the samples.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from runner.cost.layers import OperatorCall

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def logits_of(output: Any) -> torch.Tensor:
    """The scores in what a model returns: the tensor itself; a mapping's or an object's
    `logits` (the transformers library's model outputs, a user's dataclass); a tuple's or a
    list's first element (`(logits, aux)`). Raises TypeError for anything else."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "logits" in output:
        return logits_of(output["logits"])
    logits = getattr(output, "logits", None)
    if logits is not None and not isinstance(output, (tuple, list)):
        return logits_of(logits)
    if isinstance(output, (tuple, list)) and output:
        return logits_of(output[0])
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        first = dataclasses.fields(output)[0].name if dataclasses.fields(output) else None
        if first is not None:
            return logits_of(getattr(output, first))
    raise TypeError(f"it returns a {type(output).__name__}; gridrun needs a tensor of scores, "
                    f"or a tuple, dict or output object holding one (as `logits`, or first)")


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of `model` without children, by name, in the order they were registered."""
    return [(name, m) for name, m in model.named_modules() if not any(True for _ in m.children())]


# What the dataset says each model reads (`reads_tokens`), by model: a model's own code cannot
# tell token ids from floats.
_TOKEN_MODELS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def reads_tokens(model: nn.Module) -> None:
    """Declare that `model` reads token ids (int64): the assembly says so of a model it builds
    for a token dataset."""
    _TOKEN_MODELS.add(model)


def sample_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the samples `model` reads: int64 token ids where the dataset said so
    (`reads_tokens`) or, for a model built elsewhere, where its first leaf with weights is an
    embedding table; else its parameters' dtype."""
    if model in _TOKEN_MODELS:
        return torch.long
    first = next((m for _, m in leaves(model) if any(True for _ in m.parameters())), None)
    if isinstance(first, EMBEDDINGS):
        return torch.long
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


@dataclass(frozen=True)
class LeafCall:
    """One call of a leaf module during the probe's forward."""

    module: nn.Module
    input_shape: tuple[int, ...]  # per sample: the first tensor argument's shape without dim 0
    input_grad: bool  # whether that input has a gradient (a parameter ran before it)
    output_elements: int  # per sample: the elements of every tensor it returned


@dataclass(frozen=True)
class Probe:
    """What one forward of one sample showed."""

    calls: list[LeafCall]  # every leaf call with a tensor input, in the order they ran
    output_shape: tuple[int, ...]  # per sample: the logits' shape

    @property
    def activation_elements(self) -> int:
        """Elements per sample of every leaf's output: what autograd keeps for backward, about
        (a module's own temporaries and saved inputs are not counted apart)."""
        return sum(call.output_elements for call in self.calls)


def _elements(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        return sum(_elements(v) for v in value)
    if isinstance(value, Mapping):
        return sum(_elements(v) for v in value.values())
    return 0


@contextlib.contextmanager
def one_sample(model: nn.Module, sample_shape: tuple[int, ...] | list[int],
               handles: list[Any], dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
    """One sample of `sample_shape` (zeros of `dtype`, by default `sample_dtype`'s: token ids
    where the model reads them, on the model's own device), the
    model in evaluation mode (a BatchNorm then neither needs two samples nor moves its running
    statistics, a Dropout draws nothing); on leaving, its modes are restored and the hooks of
    `handles` removed, whatever the model's forward raised."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        yield torch.zeros(1, *sample_shape, device=device, dtype=dtype or sample_dtype(model))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)


def probe(model: nn.Module, sample_shape: tuple[int, ...] | list[int]) -> Probe:
    """One sample of `sample_shape` (zeros of `sample_dtype`) through `model` in evaluation
    mode on its own device (a BatchNorm then neither needs two samples nor moves its running
    statistics, a Dropout draws nothing), every leaf call recorded. The model's modes are
    restored; exceptions of the model's forward pass through."""
    calls: list[LeafCall] = []
    seen_params = [False]

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            calls.append(LeafCall(module, tuple(x.shape[1:]), seen_params[0], 0))
        if any(True for _ in module.parameters(recurse=False)):
            seen_params[0] = True

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if calls and calls[-1].module is module:
            calls[-1] = dataclasses.replace(calls[-1], output_elements=_elements(output))

    handles = []
    for _, module in leaves(model):
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    with one_sample(model, sample_shape, handles) as sample, torch.no_grad():
        out = logits_of(model(sample))
    return Probe(calls, tuple(out.shape[1:]))


@dataclass(frozen=True)
class OwnedCall:
    """An operator a module's own `forward` ran between its leaf modules, and that module."""

    owner: nn.Module
    call: OperatorCall


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


# Torch functions as the operators they come down to, for pricing (`OperatorCall.name`).
_FUNCTION_OPERATORS = {"__getitem__": "slice", "contiguous": "view", "linear": "mm"}


def _as_operator(name: str, inputs: list[torch.Tensor], nbytes: int,
                 backward: bool) -> OperatorCall:
    """A torch function call as the operator `runner.cost.compute.operator_seconds` prices: a
    matrix product (`matmul`, `@`, `F.linear`) as the `mm` or `bmm` it comes down to, with the
    sample's rows folded into its rows or its batch; anything else by its name."""
    name = name.strip("_") if name.startswith("__") and name not in _FUNCTION_OPERATORS else name
    name = _FUNCTION_OPERATORS.get(name, name)
    shapes = tuple(tuple(t.shape) for t in inputs)
    if name in ("matmul", "rmatmul", "mm") and len(inputs) >= 2:
        a, b = (inputs[1], inputs[0]) if name == "rmatmul" else (inputs[0], inputs[1])
        if name == "mm" and b.dim() == 2 and a.shape[-1] != b.shape[0]:  # F.linear: (out, in)
            b = b.t()
        if a.dim() >= 1 and b.dim() == 2:
            rows = a.shape[:-1].numel()
            return OperatorCall("mm", ((rows, a.shape[-1]), tuple(b.shape)), nbytes, backward)
        if a.dim() >= 3 and b.dim() >= 3:
            batch = a.shape[:-2].numel()
            return OperatorCall("bmm", ((batch, *a.shape[-2:]), (batch, *b.shape[-2:])),
                                nbytes, backward)
    return OperatorCall(name, shapes, nbytes, backward)


class _OwnedOperatorRecorder(TorchFunctionMode):
    """Every torch function a module's own `forward` calls while no leaf module runs (a
    function's own inner calls are its own), with the innermost module running. A function
    mode, not a dispatch mode: the first dispatch mode of a process imports about a second of
    torch's tracing machinery."""

    def __init__(self, owners: list[nn.Module], leaf_depth: list[int],
                 found: list[OwnedCall]) -> None:
        super().__init__()
        self.owners, self.leaf_depth, self.found = owners, leaf_depth, found

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        results = _tensors(out)
        if self.leaf_depth[0] == 0 and self.owners and results:
            inputs = _tensors(list(args)) + _tensors(list((kwargs or {}).values()))
            nbytes = sum(t.numel() * t.element_size() for t in inputs + results)
            backward = any(t.requires_grad and t.is_floating_point() for t in inputs)
            self.found.append(OwnedCall(self.owners[-1], _as_operator(
                getattr(func, "__name__", str(func)), inputs, nbytes, backward)))
        return out


def operator_calls(model: nn.Module, sample_shape: tuple[int, ...] | list[int]
                   ) -> list[OwnedCall]:
    """The operators the modules' own `forward`s run between their leaf modules (what the
    leaves' prices leave out: attention's products, softmax, rotary embeddings, residual sums),
    from one sample's forward in evaluation mode with gradients recorded (so each operator
    says whether it has a backward), on the model's own device; a leaf's own operators are the
    leaf's. The model's modes are restored."""
    owners: list[nn.Module] = []
    leaf_depth = [0]
    found: list[OwnedCall] = []

    def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
        owners.append(module)
        if not any(True for _ in module.children()):
            leaf_depth[0] += 1

    def leave(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        owners.pop()
        if not any(True for _ in module.children()):
            leaf_depth[0] -= 1

    handles = []
    for module in model.modules():
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    with (one_sample(model, sample_shape, handles) as sample, torch.enable_grad(),
          _OwnedOperatorRecorder(owners, leaf_depth, found)):
        model(sample)
    return found


# Functions whose random draws a name says better than the aten operation that makes them.
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
             F.feature_alpha_dropout}
# Every torch function that draws, as a model's code calls it (a `TorchFunctionMode` sees these
# without the start-up cost of a dispatch mode, which is paid only by a model that draws).
_RANDOM_FUNCTIONS = {
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.bernoulli, torch.normal,
    torch.multinomial, torch.poisson, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.Tensor.bernoulli_, torch.Tensor.bernoulli, torch.Tensor.uniform_,
    torch.Tensor.normal_, torch.Tensor.exponential_, torch.Tensor.random_,
    torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_,
    torch.Tensor.multinomial, F.gumbel_softmax, F.fractional_max_pool2d,
    F.fractional_max_pool3d}
# Random operations at the operator level (what every draw of a forward comes down to, also
# inside composite functions such as `F.multi_head_attention_forward` or attention kernels).
_ATEN_DRAWS = {"bernoulli", "uniform", "normal", "rand", "randn", "randint", "randperm",
               "multinomial", "exponential", "geometric", "cauchy", "log_normal", "random",
               "native_dropout"}


def is_random_op(func: Any) -> bool:
    """Whether an aten operator draws random numbers (in place or not, `_like` or not)."""
    name = str(func).split(".")[1] if str(func).startswith("aten.") else ""
    return name.removesuffix("_like").rstrip("_") in _ATEN_DRAWS


# Random operators that `whole_batch.GlobalDraws` can make draw for the global batch.
CUTTABLE = {"bernoulli_", "uniform_", "normal_", "exponential_", "geometric_", "cauchy_",
            "log_normal_", "random_", "native_dropout", "bernoulli", "rand_like", "randn_like",
            "rand", "randn"}


def op_name(func: Any) -> str:
    """`bernoulli_` for `aten.bernoulli_.float`."""
    return str(func).split(".")[1] if str(func).startswith("aten.") else str(func)


@dataclass(frozen=True)
class DrawCall:
    """One random operator of a training forward."""

    module: str  # the path of the module whose code made it
    op: str  # the aten operator (`bernoulli_`)
    shape: tuple[int, ...]  # of the tensor it draws into (its first tensor argument, or result)


@dataclass
class TrainingCalls:
    """What a training forward does that couples the rows of a batch, by module path."""

    draws: dict[str, str] = dataclasses.field(default_factory=dict)  # path: what it draws
    batch_norms: list[str] = dataclasses.field(default_factory=list)  # F.batch_norm callers
    uncut: dict[str, str] = dataclasses.field(default_factory=dict)  # draws inside a kernel
    ops: list[DrawCall] = dataclasses.field(default_factory=list)  # every random operator

    def named(self, modules: Mapping[str, nn.Module]) -> list[str]:
        return [f"{name or 'the model'} ({type(modules[name]).__name__}): {what}"
                for name, what in self.draws.items()]


class _FunctionRecorder(TorchFunctionMode):
    def __init__(self, calls: TrainingCalls, stack: list[str]) -> None:
        super().__init__()
        self.calls, self.stack = calls, stack

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        where = self.stack[-1] if self.stack else ""
        if func in _DROPOUTS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and p > 0:
                self.calls.draws.setdefault(where, f"{func.__name__}(p={p})")
        elif func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            self.calls.draws.setdefault(where, f"attention dropout (p={kwargs['dropout_p']})")
        elif func is F.multi_head_attention_forward:
            p = args[10] if len(args) > 10 else kwargs.get("dropout_p", 0.0)
            if p > 0 and (args[13] if len(args) > 13 else kwargs.get("training", True)):
                self.calls.draws.setdefault(where, f"attention dropout (p={p})")
        elif func in _RANDOM_FUNCTIONS:
            self.calls.draws.setdefault(where, getattr(func, "__name__", str(func)))
        elif func is F.rrelu and (args[3] if len(args) > 3 else kwargs.get("training", False)):
            what = "rrelu's slopes, drawn inside one kernel"
            self.calls.draws.setdefault(where, what)
            self.calls.uncut.setdefault(where, what)
        elif func is F.batch_norm:
            training = args[5] if len(args) > 5 else kwargs.get("training", False)
            if training:
                self.calls.batch_norms.append(where)
        return func(*args, **kwargs)


class _OperatorRecorder(TorchDispatchMode):
    def __init__(self, calls: TrainingCalls, stack: list[str]) -> None:
        super().__init__()
        self.calls, self.stack = calls, stack

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_random_op(func):
            where = self.stack[-1] if self.stack else ""
            self.calls.draws.setdefault(where, op_name(func))
            first = args[0] if args and isinstance(args[0], torch.Tensor) else out
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else ()
            self.calls.ops.append(DrawCall(where, op_name(func), shape))
        return out


@dataclass(frozen=True)
class DrawPlan:
    """How each random operator of a training forward (in the order they run) is drawn for the
    global batch: `cuts[i]` is how many entries of its dim 0 each row of the batch has (B·H
    when heads are folded into it: H), None for a draw of a fixed shape (the same on every
    rank, and the one process's); `problems` names the draws no rank can cut."""

    cuts: tuple[int | None, ...]
    problems: tuple[str, ...]
    # each draw's dims after dim 0 in one process (a split model's rank draws a piece of them)
    shapes: tuple[tuple[int, ...], ...] = ()


@contextlib.contextmanager
def math_attention() -> Iterator[None]:
    """`F.scaled_dot_product_attention` by torch's math attention: its dropout is then an
    operator of its own, which row draws can cut (a fused GPU kernel draws its mask inside
    itself). The planning forwards and the forwards that draw by rows run under it alike."""
    # imported here: torch.nn.attention is newer than the oldest torch pyproject.toml allows
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        yield


def draw_plan(model: nn.Module, sample_shape: tuple[int, ...] | list[int]) -> DrawPlan:
    """The draws of a training forward of 2 samples against one of 3: a dim 0 that grows with
    them is made of the batch's rows."""
    two = training_calls(model, sample_shape, 2, operators=True)
    three = training_calls(model, sample_shape, 3, operators=True)
    modules = dict(model.named_modules())

    def named(path: str) -> str:
        return f"{path or 'the model'} ({type(modules[path]).__name__})"

    problems = [f"{named(path)}: {what}" for path, what in two.uncut.items()]
    if [c.op for c in two.ops] != [c.op for c in three.ops]:
        return DrawPlan((), (*problems, f"{named('')}: its random draws change with the batch "
                                       f"size"))
    cuts: list[int | None] = []
    shapes = tuple(tuple(a.shape[1:]) for a in two.ops)
    for a, b in zip(two.ops, three.ops, strict=True):
        rows_made = (len(a.shape) == len(b.shape) > 0 and a.shape[1:] == b.shape[1:]
                     and a.shape[0] % 2 == 0 and b.shape[0] == a.shape[0] // 2 * 3)
        if a.shape == b.shape:
            cuts.append(None)
        elif rows_made and a.op in CUTTABLE:
            cuts.append(a.shape[0] // 2)
        else:
            cuts.append(None)
            where = ("its batch is not dim 0" if not rows_made else "an operator no rank can "
                     "cut into rows")
            problems.append(f"{named(a.module)}: {a.op} over a tensor of shape {b.shape} for 3 "
                            f"samples ({where})")
    return DrawPlan(tuple(cuts), tuple(dict.fromkeys(problems)), shapes)


def training_calls(model: nn.Module, sample_shape: tuple[int, ...] | list[int],
                   rows: int = 2, operators: bool = False) -> TrainingCalls:
    """One training forward of `rows` samples, recording each module whose code draws random
    numbers (dropout, stochastic depth, attention dropout) or calls `F.batch_norm` with batch
    statistics; with `operators`, also every random operator (`TrainingCalls.ops`, also inside
    composite functions). The caller's random state and the model's buffers and modes are left
    as they were."""
    calls, stack = TrainingCalls(), []

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            stack.append(name)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        stack.pop()

    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    try:
        model.train()
        with (torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
              torch.no_grad(), _FunctionRecorder(calls, stack),
              _OperatorRecorder(calls, stack) if operators else contextlib.nullcontext(),
              math_attention() if operators else contextlib.nullcontext()):
            model(torch.zeros(rows, *sample_shape, device=device, dtype=sample_dtype(model)))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.device.type != "meta":
                    b.copy_(buffers[name])
    return calls


def random_draws(model: nn.Module, sample_shape: tuple[int, ...] | list[int]) -> list[str]:
    """Each module whose training forward draws random numbers, as "path (Type): what"."""
    return training_calls(model, sample_shape).named(dict(model.named_modules()))
