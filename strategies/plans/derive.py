"""A parallel plan derived from the module structure, for a model that neither the user nor
the model itself gives one (`strategies.plans.module_plan` decides which plan applies).

One forward of the model (`strategies.probe`) gives its leaf calls in order with their shapes;
from them, candidate groups of modules:

- an MLP: a Linear (or Conv1D) from width d to h ≠ d, then only parameter-free leaves (the
  activation, a dropout) or more projections d → h (a gated MLP's gate and up), then a
  projection h → d that restores the width: the d → h ones colwise, the last rowwise;
- an attention: three projections of one input (q, k, v) then, after parameter-free leaves
  only, one from q's width back to d (colwise ×3, rowwise); or one projection to three equal
  chunks then one from a chunk's width back to d (fused_qkv, rowwise);
- an `nn.Embedding` that reads the model's input (the token ids): vocab.

Shapes alone do not prove a split right: an attention may reshape by the width it was given
(`x.reshape(b, n, c)`), a fused projection may interleave its heads, an intermediate value may
go somewhere besides the next projection. So each candidate group (but an embedding, exact by
construction) is tried in one process before it is kept: the smallest module holding the group
(its owner) is copied with seeded random weights in float64, run whole on seeded inputs of the
shapes its real call had, then once per rank of the model group with that rank's split modules
and divided attention attributes; a rowwise module there checks that its input is its rank's
slice of the whole one's and hands on the whole output (what the sum over the group gives).
The group is kept only where every rank's output equals the whole one's. What the owner
returns besides its first tensor (attention weights, keys and values for a cache) is per head
and is not compared: training reads none of it. Weights and inputs never come from the model,
so a model on the meta device gets the plan a real one gets; an owner holding a buffer that is
not floating point (a mask the check could not make up) is left out.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from strategies.plans.styles import STYLES, Colwise, ColwiseProjection, Projection
from strategies.probe import EMBEDDINGS, LeafCall, logits_of, probe, sample_dtype

# relative tolerance of the trial in float64: far above rounding, far below any wrong split
TRIAL_TOLERANCE = 1e-9


@dataclass
class CandidateGroup:
    """Modules that split together (module path → style), held by `owner`."""

    kind: str  # "mlp", "attention" or "vocab"
    styles: dict[str, str]
    owner: str = ""

    def rowwise(self) -> list[str]:
        return [p for p, s in self.styles.items() if s == "rowwise"]


@dataclass
class _Call:
    path: str
    module: nn.Module
    projection: Projection | None
    input_width: int | None
    parameter_free: bool


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _calls(model: nn.Module, calls: list[LeafCall]) -> list[_Call]:
    paths: dict[int, str] = {}
    for path, module in model.named_modules():
        paths.setdefault(id(module), path)
    return [_Call(paths[id(c.module)], c.module, Projection.of(c.module),
                  c.input_shape[-1] if c.input_shape else None, not _has_params(c.module))
            for c in calls if id(c.module) in paths]


def _common_owner(paths: list[str]) -> str:
    parts = [p.split(".")[:-1] for p in paths]
    common: list[str] = []
    for names in zip(*parts, strict=False):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    return ".".join(common)


def _next_projection(calls: list[_Call], start: int) -> int | None:
    """The first projection from `start` on, after parameter-free leaves only."""
    for j in range(start, len(calls)):
        if calls[j].projection is not None:
            return j
        if not calls[j].parameter_free:
            return None
    return None


def _attention(calls: list[_Call], i: int, free: Callable[[str], bool]
               ) -> tuple[CandidateGroup, int] | None:
    q = calls[i].projection
    assert q is not None
    d = q.in_features
    j = _next_projection(calls, i + 1)
    if j is None:
        return None
    nxt = calls[j].projection
    assert nxt is not None
    # one projection to three equal chunks, back to d from one chunk's width
    if (q.out_features % 3 == 0 and nxt.in_features == q.out_features // 3
            and nxt.out_features == d and free(calls[j].path)):
        return CandidateGroup("attention", {calls[i].path: "fused_qkv",
                                            calls[j].path: "rowwise"}), j
    # q, k and v of one input, in one module, then back to d from q's width
    if j != i + 1 or j + 1 >= len(calls):
        return None
    k, v = calls[j], calls[j + 1]
    parent = calls[i].path.rpartition(".")[0]
    if not all(c.projection is not None and c.projection.in_features == d
               and c.path.rpartition(".")[0] == parent and free(c.path) for c in (k, v)):
        return None
    o_at = _next_projection(calls, j + 2)
    if o_at is None:
        return None
    o = calls[o_at].projection
    assert o is not None
    if o.in_features != q.out_features or o.out_features != d or not free(calls[o_at].path):
        return None
    return CandidateGroup("attention", {calls[i].path: "colwise", k.path: "colwise",
                                        v.path: "colwise", calls[o_at].path: "rowwise"}), o_at


def _mlp(calls: list[_Call], i: int, free: Callable[[str], bool]
         ) -> tuple[CandidateGroup, int] | None:
    a = calls[i].projection
    assert a is not None
    d, h = a.in_features, a.out_features
    if h == d:
        return None
    styles = {calls[i].path: "colwise"}
    for j in range(i + 1, len(calls)):
        call = calls[j]
        p = call.projection
        if p is not None and p.in_features == d and p.out_features == h and free(call.path):
            styles[call.path] = "colwise"  # a gated MLP's other input projection
        elif p is not None and p.in_features == h and p.out_features == d and free(call.path):
            styles[call.path] = "rowwise"
            return CandidateGroup("mlp", styles), j
        elif not (call.parameter_free and call.input_width in (h, d)):
            return None
    return None


def candidate_groups(model: nn.Module, sample_shape: tuple[int, ...]) -> list[CandidateGroup]:
    """The groups of modules the structure suggests, in the order a forward meets them (each
    module in one group at most; a module called more than once in none)."""
    with torch.random.fork_rng(devices=[]):
        seen = probe(model, sample_shape).calls
    calls = _calls(model, seen)
    counts: dict[str, int] = {}
    for call in calls:
        counts[call.path] = counts.get(call.path, 0) + 1
    taken: set[str] = set()

    def free(path: str) -> bool:
        return counts[path] == 1 and path not in taken

    groups: list[CandidateGroup] = []
    i = 0
    while i < len(calls):
        call = calls[i]
        if call.projection is not None and free(call.path):
            found = _attention(calls, i, free) or _mlp(calls, i, free)
            if found is not None:
                group, last = found
                group.owner = _common_owner(list(group.styles))
                taken.update(group.styles)
                groups.append(group)
                i = last + 1
                continue
        i += 1
    reads_input = _embeddings_of_input(model, sample_shape)
    groups += [CandidateGroup("vocab", {path: "vocab"}, path.rpartition(".")[0])
               for path in reads_input if counts.get(path) == 1
               and STYLES["vocab"].fits(model.get_submodule(path)) is None]
    return groups


def _embeddings_of_input(model: nn.Module, sample_shape: tuple[int, ...]) -> list[str]:
    """The embedding tables a forward looks the model's own input up in."""
    found: list[str] = []
    handles = []
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    sample = torch.zeros(1, *sample_shape, device=device, dtype=sample_dtype(model))
    for path, module in model.named_modules():
        if isinstance(module, EMBEDDINGS):
            def hook(module: nn.Module, args: tuple[Any, ...], path: str = path) -> None:
                if args and args[0] is sample and path not in found:
                    found.append(path)
            handles.append(module.register_forward_pre_hook(hook))
    _quiet_forward(model, lambda: model(sample), handles)
    return found


def _quiet_forward(model: nn.Module, run: Callable[[], Any], handles: list[Any]) -> None:
    """`run` in evaluation mode without gradients, the model's modes and the caller's random
    state restored and `handles` removed afterwards."""
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            run()
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)


# -- the trial in one process ---------------------------------------------------------------------


@dataclass
class OwnerCall:
    """What an owner was called with (its tensors stand for their shapes and dtypes only)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def owner_calls(model: nn.Module, sample_shape: tuple[int, ...],
                owners: set[str]) -> dict[str, OwnerCall]:
    """Each owner's first call during one forward, copied as it was made (a cache object it
    fills later is not seen filled)."""
    found: dict[str, OwnerCall] = {}
    handles = []
    for path, module in model.named_modules():
        if path in owners:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                     path: str = path) -> None:
                if path not in found:
                    found[path] = OwnerCall(copy.deepcopy(args), copy.deepcopy(kwargs))
            handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    sample = torch.zeros(1, *sample_shape, device=device, dtype=sample_dtype(model))
    _quiet_forward(model, lambda: model(sample), handles)
    return found


class _Unfit(Exception):
    """What the trial cannot stand in for (the group is then left out)."""


def _made_up(value: Any, generator: torch.Generator) -> Any:
    """`value` with each tensor replaced by a seeded one of its shape on the CPU: floating
    point drawn, integers zero, booleans true."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            return torch.randn(value.shape, generator=generator,  # host: the trial's CPU copy
                               dtype=torch.float64)
        if value.dtype == torch.bool:
            return torch.ones(value.shape, dtype=torch.bool)  # host: the trial's CPU copy
        if value.is_complex():
            raise _Unfit("a complex input")
        return torch.zeros(value.shape, dtype=value.dtype)  # host: the trial's CPU copy
    if isinstance(value, tuple):
        return tuple(_made_up(v, generator) for v in value)
    if isinstance(value, list):
        return [_made_up(v, generator) for v in value]
    if isinstance(value, dict):
        return {k: _made_up(v, generator) for k, v in value.items()}
    return copy.deepcopy(value)


def _random_copy(module: nn.Module, seed: int) -> nn.Module:
    """A CPU float64 copy of `module` with seeded weights and floating-point buffers."""
    twin = copy.deepcopy(module)
    tensors = [*twin.parameters(), *twin.buffers()]
    if any(not t.is_floating_point() for t in twin.buffers()):
        raise _Unfit("a buffer that is not floating point")
    if any(t.is_meta for t in tensors):
        twin = twin.to_empty(device="cpu")
    twin = twin.to(device="cpu", dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*twin.parameters(), *twin.buffers()]:
            tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator,  # host: CPU copy
                                           dtype=tensor.dtype))
    return twin.eval()


class _RowwiseStandIn(nn.Module):
    """A rowwise module on one rank of the trial: checks that each call's input is this rank's
    slice of the whole module's, and returns the whole output (what the sum gives)."""

    def __init__(self, cols: slice, inputs: list[torch.Tensor],
                 outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.cols, self.inputs, self.outputs = cols, inputs, outputs
        self.calls = 0
        self.matched = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calls >= len(self.inputs):
            raise _Unfit("called more often than the whole module")
        want = self.inputs[self.calls][..., self.cols]
        self.matched = self.matched and _close(x, want)
        out = self.outputs[self.calls]
        self.calls += 1
        return out


def _close(got: Any, want: Any) -> bool:
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return False
    if got.shape != want.shape or not bool(torch.isfinite(want).all()):
        return False
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    return bool(((got - want).abs() <= TRIAL_TOLERANCE * scale).all())


def _relative(path: str, owner: str) -> str:
    if not owner:
        return path
    return path[len(owner) + 1:] if path != owner else ""


def trial(model: nn.Module, group: CandidateGroup, call: OwnerCall, pr: int,
          adjusted: list[tuple[str, str, int]], seed: int = 0) -> bool:
    """Whether every rank of a model group of `pr` computes the owner's output of the whole
    model with `group` split and the attributes `adjusted` ((module path, name, value))
    divided (see the module docstring)."""
    try:
        return _trial(model, group, call, pr, adjusted, seed)
    except Exception:  # anything the split copy cannot run: the group is left out
        return False


def _trial(model: nn.Module, group: CandidateGroup, call: OwnerCall, pr: int,
           adjusted: list[tuple[str, str, int]], seed: int) -> bool:
    whole = _random_copy(model.get_submodule(group.owner), seed)
    generator = torch.Generator().manual_seed(seed + 1)
    args, kwargs = _made_up(call.args, generator), _made_up(call.kwargs, generator)
    rowwise = {_relative(p, group.owner): p for p in group.rowwise()}
    seen: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {
        r: ([], []) for r in rowwise}
    handles = []
    for rel in rowwise:
        def record(module: nn.Module, inputs: tuple[Any, ...], output: Any,
                   rel: str = rel) -> None:
            seen[rel][0].append(inputs[0].detach().clone())
            seen[rel][1].append(output.detach().clone())
        handles.append(whole.get_submodule(rel).register_forward_hook(record))
    with torch.no_grad():
        try:
            want = logits_of(whole(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
        finally:
            for handle in handles:
                handle.remove()
    for rank in range(pr):
        local = copy.deepcopy(whole)
        stand_ins: list[_RowwiseStandIn] = []
        for path, style_name in group.styles.items():
            rel = _relative(path, group.owner)
            module = local.get_submodule(rel)
            projection = Projection.of(module)
            assert projection is not None
            style = STYLES[style_name]
            if isinstance(style, Colwise):
                chunks = style.chunk_slices(projection.out_features, pr, rank)
                local.set_submodule(rel, ColwiseProjection(module, chunks, projection.transposed,
                                                           None, path))
            else:
                cols = slice(projection.in_features * rank // pr,
                             projection.in_features * (rank + 1) // pr)
                stand_in = _RowwiseStandIn(cols, *seen[rel])
                stand_ins.append(stand_in)
                local.set_submodule(rel, stand_in)
        for owner, name, value in adjusted:
            setattr(local.get_submodule(_relative(owner, group.owner)), name, value)
        with torch.no_grad():
            got = logits_of(local(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
        if not _close(got, want) or not all(s.matched and s.calls == len(s.inputs)
                                            for s in stand_ins):
            return False
    return True


def signature(model: nn.Module, group: CandidateGroup) -> tuple[object, ...]:
    """What decides a trial's outcome: the owner's classes, shapes and integer attributes, the
    group's styles relative to it (the blocks of a deep model share one)."""
    owner = model.get_submodule(group.owner)
    modules = tuple(
        (path, type(m).__qualname__,
         tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters(recurse=False)),
         tuple(sorted((k, v) for k, v in vars(m).items()
                      if isinstance(v, (int, float, str, bool)) and not k.startswith("_"))))
        for path, m in owner.named_modules())
    return (modules, tuple(sorted((_relative(p, group.owner), s)
                                  for p, s in group.styles.items())))
