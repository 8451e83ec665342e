"""What one forward of the real model says about it, for models nobody here wrote.

A model's `children()` need not form a chain (a torchvision or transformers model registers its
modules in any order and calls them as it likes), and its input need not be a float tensor
(token ids are int64). So shapes, sizes and the work of every layer are learned from one
forward of the model itself, on one sample of the dataset's own dtype, with hooks on its leaf
modules: on the meta device for a large model (shapes only, no memory), on its own device
otherwise. And what a model returns need not be a tensor: `logits_of` finds the scores in a
tuple, a dict or a model-output object (the transformers library's `.logits`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

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


def sample_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the samples `model` reads: int64 token ids when the first leaf with weights
    is an embedding table (a language model, a token classifier), else its parameters' dtype."""
    first = next((m for _, m in leaves(model) if any(True for _ in m.parameters())), None)
    if isinstance(first, EMBEDDINGS):
        return torch.long
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


@dataclass(frozen=True)
class LeafCall:
    """One call of a leaf module during the probe's forward."""

    name: str
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


def probe(model: nn.Module, sample_shape: tuple[int, ...] | list[int]) -> Probe:
    """One sample of `sample_shape` (zeros of `sample_dtype`) through `model` in evaluation
    mode on its own device (a BatchNorm then neither needs two samples nor moves its running
    statistics, a Dropout draws nothing), every leaf call recorded. The model's modes are
    restored; exceptions of the model's forward pass through."""
    calls: list[LeafCall] = []
    seen_params = [False]
    names = {id(m): name for name, m in leaves(model)}

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            calls.append(LeafCall(names[id(module)], module, tuple(x.shape[1:]), seen_params[0],
                                  0))
        if any(True for _ in module.parameters(recurse=False)):
            seen_params[0] = True

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if calls and calls[-1].module is module:
            calls[-1] = dataclasses.replace(calls[-1], output_elements=_elements(output))

    handles = []
    for _, module in leaves(model):
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            out = logits_of(model(torch.zeros(1, *sample_shape, device=device,
                                              dtype=sample_dtype(model))))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)
    return Probe(calls, tuple(out.shape[1:]))


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
             F.feature_alpha_dropout}
_DRAWS = {torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
          torch.Tensor.exponential_, torch.Tensor.random_, torch.bernoulli, torch.rand,
          torch.randn, torch.rand_like, torch.randn_like, torch.randint, torch.randperm,
          torch.multinomial, torch.normal}


class _DrawRecorder(TorchFunctionMode):
    """Notes each random draw of a training forward, by the module whose code made it."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.found: dict[str, str] = {}

    def __torch_function__(self, func: Callable[..., Any], types: Any,
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        what = None
        if func in _DROPOUTS:
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and p > 0:
                what = f"{func.__name__}(p={p})"
        elif func is F.scaled_dot_product_attention and kwargs.get("dropout_p", 0.0) > 0:
            what = f"attention dropout (p={kwargs['dropout_p']})"
        elif func in _DRAWS:
            what = getattr(func, "__name__", str(func))
        if what is not None:
            self.found.setdefault(self.stack[-1] if self.stack else "", what)
        return func(*args, **kwargs)


def random_draws(model: nn.Module, sample_shape: tuple[int, ...] | list[int]) -> list[str]:
    """Each module whose training forward draws random numbers (dropout, stochastic depth),
    as "path (Type): what", from one training forward of two samples (the caller's random
    state and the model's buffers are left as they were)."""
    recorder = _DrawRecorder()
    modules = dict(model.named_modules())

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            recorder.stack.append(name)
        return hook

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        recorder.stack.pop()

    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    try:
        model.train()
        with torch.random.fork_rng(devices=[]), torch.no_grad(), recorder:
            model(torch.zeros(2, *sample_shape, device=device, dtype=sample_dtype(model)))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers and b.device.type != "meta":
                    b.copy_(buffers[name])
    return [f"{name or 'the model'} ({type(modules[name]).__name__}): {what}"
            for name, what in recorder.found.items()]
