"""The `sequence` style of a parallel plan by module name (`strategies.plans.module_plan`):
Megatron-LM's sequence parallelism. Modules acting token by token (norms, dropout with p=0) run
on this rank's piece of the sequence, the activation's dim -2 (`Partition(T, Pr)`, even pieces
only: a length that does not divide is refused by name).

The region. The transformers library's models compute the causal mask, position ids and rotary
tables from the embedding output's length in the base model's own forward, so the sequence is
split inside the *blocks* only: a block is the smallest module (not the model) holding a
`sequence` module and a `rowwise` projection (`model.layers.0`); a `sequence` module in no block
(a final norm) runs on the whole sequence after the region. The hidden states (a block's first
positional argument, or its `hidden_states`) are split at the entry of the first block of a run
(`take_piece`: this rank's piece; adjoint: the piece placed in zeros, a replicated tensor's
gradient being partial on each rank) and gathered at the exit of the last (`all_gather`, adjoint
`reduce_scatter`). Consecutive blocks form one run where one's output is the next one's input
and nothing runs between them.

Inside a block every colwise/rowwise stretch sees the whole sequence: its input is gathered
along the sequence (forward all-gather, backward reduce-scatter) at the entry of the stretch's
owner (the smallest module holding it, below the block: an attention module, which reads its
length from its input), or, where the block itself owns it, at its colwise projections' input
(gathered once for the projections reading the same tensor); its rowwise projection
reduce-scatters its partial sums along the sequence instead of all-reducing them (forward
reduce-scatter, backward all-gather). The two carry the bytes of the all-reduce they replace.
Anything else a block runs on the split sequence must be a `sequence` module, or a module
without parameters that does not mix positions (dropout with p=0, activations); anything else
is refused by name. The `sequence` modules' weights are whole on every rank and their gradients
(each rank saw its tokens) summed over every rank, as a replicated layer's.

Under `strategy=domain` no weight is split (`domain_layout`): a block is the smallest module (not
the model) holding a `sequence` module, split and gathered as above. In it the `sequence`
modules (a norm, or a whole MLP of Linears and activations) and the modules without parameters
that do not mix positions run on this rank's piece; every other module (the attention) runs on
the whole sequence: its hidden states gathered at its entry (`all_gather`, adjoint
`reduce_scatter`), this rank's piece of its output taken at its exit (`take_piece`, adjoint
`place_piece`), so its masks and positions are the whole sequence's. Each rank computes that
module whole, redundantly; what the split saves is the token-wise modules' compute and
activations, divided by Pr. Every gradient is partial on each rank (its positions' share) and
summed over every rank.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from runner.core import CountedComm, Partition
from runner.core.primitives import all_gather, reduce_scatter, take_piece
from runner.cost.collectives import CommOp
from strategies.plans.styles import PlanStyle, RowwiseProjection, mixing_problem
from strategies.probe import sample_dtype

SEQUENCE = "sequence"
OPENING = ("colwise", "fused_qkv", "kv_replicated")  # their outputs stay split
CLOSING = "rowwise"
STREAM_KEYWORD = "hidden_states"  # the transformers library's name for the hidden states


def stream_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, Any] | None:
    """Where a call's hidden states are: its first positional argument, else `hidden_states`."""
    if args:
        return 0, args[0]
    if STREAM_KEYWORD in kwargs:
        return STREAM_KEYWORD, kwargs[STREAM_KEYWORD]
    return None


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], where: int | str,
              value: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if where == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, STREAM_KEYWORD: value}


def first_tensor(output: Any) -> torch.Tensor | None:
    """A block's hidden states in what it returns: the tensor, or a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


class SequenceShards:
    """The exchanges of one model group's sequence region, along the activations' dim -2: this
    rank's piece of a whole tensor, the whole from the pieces (a tensor gathered once for every
    module reading it), and the sum of partial wholes, scattered."""

    def __init__(self, comm: CountedComm, length: int) -> None:
        self.comm, self.part = comm, Partition(length, comm.size)
        # the last gathered tensor and its input, held weakly: q, k and v read one input
        self._last: tuple[Any, int, Any] | None = None

    def take(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return take_piece(x, self.comm, x.dim() - 2, self.part, label)

    def gather(self, x: torch.Tensor, label: str) -> torch.Tensor:
        if self._last is not None:
            source, version, gathered = self._last
            if source() is x and x._version == version and gathered() is not None:
                out: torch.Tensor = gathered()
                return out
        out = self._gather(x, label)
        self._last = (weakref.ref(x), x._version, weakref.ref(out))
        return out

    def _gather(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return all_gather(x, self.comm, x.dim() - 2, self.part, label=label)

    def reduce_scatter(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return reduce_scatter(x, self.comm, x.dim() - 2, self.part, label=label)


class OneRankShards(SequenceShards):
    """Rank 0's shapes of the same exchanges, in one process (the plan's shape check): the
    pieces are copies of its own."""

    def __init__(self, length: int, pr: int) -> None:
        self.part, self.pr, self._last = Partition(length, pr), pr, None

    def _piece_of_whole(self, x: torch.Tensor, what: str) -> torch.Tensor:
        if x.shape[-2] != self.part.total:
            raise ValueError(f"{what}: its sequence has {x.shape[-2]} positions, the region's "
                             f"{self.part.total}")
        return x.narrow(x.dim() - 2, 0, self.part.sizes[0])

    def take(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return self._piece_of_whole(x, label)

    def _gather(self, x: torch.Tensor, label: str) -> torch.Tensor:
        if x.shape[-2] != self.part.sizes[0]:
            raise ValueError(f"{label}: gathers a piece of {self.part.sizes[0]} positions, got "
                             f"{x.shape[-2]}")
        return torch.cat([x] * self.pr, dim=x.dim() - 2)

    def reduce_scatter(self, x: torch.Tensor, label: str) -> torch.Tensor:
        return self._piece_of_whole(x, label)


@dataclass
class SequenceLayout:
    """Where a plan's sequence region splits, gathers and scatters the hidden states (module
    paths), and rank 0's elements per sample of each exchange (for the predicted bytes)."""

    length: int  # the region's positions
    entries: list[str] = field(default_factory=list)  # blocks whose input is split
    exits: dict[str, int] = field(default_factory=dict)  # blocks whose output is gathered
    gathers: list[str] = field(default_factory=list)  # modules whose input is gathered
    gathered_elements: list[int] = field(default_factory=list)  # one per tensor gathered
    rowwise: dict[str, int] = field(default_factory=dict)  # reduce-scattered: output elements
    sharded: set[str] = field(default_factory=set)  # sequence modules run on the pieces
    # strategy=domain: modules run whole on the gathered sequence, their outputs' pieces taken
    takes: list[str] = field(default_factory=list)
    # strategy=domain: every module whose calls run on the pieces, blocks included (pricing)
    on_pieces: set[str] = field(default_factory=set)

    def ops(self, rows: int, pr: int, itemsize: int) -> list[CommOp]:
        """The region's collectives of one forward and backward (a rowwise projection's in
        place of its all-reduces), for `rows` rows of `itemsize` bytes."""
        if pr == 1:
            return []
        ops: list[CommOp] = []
        for path, elements in self.rowwise.items():
            n = rows * elements * itemsize
            ops += [CommOp("reduce_scatter", "model", pr, n, path),
                    CommOp("allgather", "model", pr, n, path)]
        gathered = [(f"{path} out", e) for path, e in self.exits.items()]
        gathered += [("sequence in", e) for e in self.gathered_elements]
        for label, elements in gathered:
            n = rows * elements * itemsize
            ops += [CommOp("allgather", "model", pr, n, label),
                    CommOp("reduce_scatter", "model", pr, n, label)]
        return ops


def _ancestors(path: str) -> Iterator[str]:
    """`path`'s enclosing module paths, innermost first, the model itself left out."""
    while "." in path:
        path = path.rpartition(".")[0]
        yield path


def _inside(path: str, owner: str) -> bool:
    return path.startswith(owner + ".")


def _common_owner(paths: list[str]) -> str:
    parts = [p.split(".") for p in paths]
    common = []
    for names in zip(*parts, strict=False):
        if len(set(names)) > 1:
            break
        common.append(names[0])
    owner = ".".join(common)
    return owner if owner not in paths else owner.rpartition(".")[0]


@dataclass(eq=False)
class _Call:
    """One module call of a recorded forward."""

    path: str
    module: nn.Module
    stream: Any  # the hidden states it was given (see `stream_of`), or None
    output: Any = None
    inner: list[_Call] = field(default_factory=list)  # the calls it made, in order

    def leaves(self) -> Iterator[_Call]:
        if not any(True for _ in self.module.children()):
            yield self
        for call in self.inner:
            yield from call.leaves()


def _record(model: nn.Module, sample_shape: tuple[int, ...]) -> list[_Call]:
    """The model's module calls, as a tree, from one forward of one sample (as `probe`)."""
    top: list[_Call] = []
    stack: list[_Call] = []
    paths = {id(m): p for p, m in model.named_modules()}

    def enter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        found = stream_of(args, kwargs)
        call = _Call(paths.get(id(module), ""), module, found[1] if found else None)
        (stack[-1].inner if stack else top).append(call)
        stack.append(call)

    def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any) -> None:
        if stack and stack[-1].module is module:
            stack.pop().output = output

    handles = [h for _, m in model.named_modules() if m is not model
               for h in (m.register_forward_pre_hook(enter, with_kwargs=True),
                         m.register_forward_hook(leave, with_kwargs=True))]
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    modes = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(torch.zeros(1, *sample_shape, device=device, dtype=sample_dtype(model)))
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.train(mode)
    return top


def _flatten(calls: list[_Call]) -> Iterator[_Call]:
    for call in calls:
        yield call
        yield from _flatten(call.inner)


def _name(path: str, module: nn.Module) -> str:
    return f"{path} ({type(module).__name__})"


def sequence_layout(styles: dict[str, PlanStyle], model: nn.Module,
                    sample_shape: tuple[int, ...], pr: int
                    ) -> tuple[SequenceLayout | None, list[str]]:
    """The plan's sequence region (None: it marks no module `sequence`), or why it cannot be
    split (one line each, naming the module)."""
    marked = [p for p, s in styles.items() if s.name == SEQUENCE]
    if not marked:
        return None, []
    problems = []
    for path in marked:
        planned = [p for p, s in styles.items() if _inside(p, path) and s.name != "replicate"]
        if planned:
            problems.append(f"{_name(path, model.get_submodule(path))}: sequence runs a module "
                            f"whole on a rank's positions, but it holds the planned "
                            f"{', '.join(planned)}")
    closing = [p for p, s in styles.items() if s.name == CLOSING]
    held = {path: next((a for a in _ancestors(path) if any(_inside(r, a) for r in closing)),
                       None) for path in marked}
    blocks = {b for b in held.values() if b is not None}
    blocks = {b for b in blocks if not any(_inside(o, b) for o in blocks)}
    if not blocks:
        return None, [
            *problems,
            f"{', '.join(marked)}: sequence splits the positions of a block holding a "
            f"colwise/rowwise pair of the plan (whose projections gather the sequence), and "
            f"no module holding {'it' if len(marked) == 1 else 'them'} has one"]
    if problems:
        return None, problems
    return _region(model, sample_shape, pr, blocks,
                   lambda call, layout, calls: _block(call, styles, layout))


BlockVisit = Callable[[_Call, SequenceLayout, list[_Call]], list[str]]


def _region(model: nn.Module, sample_shape: tuple[int, ...], pr: int, blocks: set[str],
            visit: BlockVisit) -> tuple[SequenceLayout | None, list[str]]:
    """The region of `blocks` from one recorded forward: each block runs once, on hidden states
    of one length that divides over `pr`; consecutive blocks form one run (split at its first
    block's entry, gathered at its last one's exit); `visit` places each block's own
    exchanges, or says why it cannot."""
    problems = []
    calls = list(_flatten(_record(model, sample_shape)))
    block_calls = [c for c in calls if c.path in blocks]
    for block in sorted(blocks):
        count = sum(1 for c in block_calls if c.path == block)
        if count != 1:
            problems.append(f"{_name(block, model.get_submodule(block))}: a block of the "
                            f"sequence region runs once a forward, this one {count} times")
    lengths = set()
    for call in block_calls:
        stream, out = call.stream, first_tensor(call.output)
        if (not isinstance(stream, torch.Tensor) or not stream.is_floating_point()
                or stream.dim() < 3 or out is None or out.shape != stream.shape):
            problems.append(f"{_name(call.path, call.module)}: a block of the sequence region "
                            f"takes its hidden states (batch, sequence, features) first or as "
                            f"`{STREAM_KEYWORD}`, and returns them (or a tuple starting with "
                            f"them) in the same shape")
            continue
        lengths.add(stream.shape[-2])
    if problems:
        return None, problems
    if len(lengths) > 1:
        return None, [f"{', '.join(sorted(blocks))}: the blocks of the sequence region see "
                      f"sequences of {sorted(lengths)} positions; sequence needs one length"]
    (length,) = lengths
    if length % pr:
        return None, [f"{_name(block_calls[0].path, block_calls[0].module)}: its sequence of "
                      f"{length} positions does not divide over grid.pr={pr} ranks (sequence "
                      f"splits it evenly)"]
    layout = SequenceLayout(length)
    for i, call in enumerate(block_calls):
        earlier = block_calls[i - 1] if i else None
        chained = (earlier is not None and first_tensor(earlier.output) is call.stream
                   and calls.index(call) == calls.index(earlier) + 1 + _size(earlier))
        if not chained:
            if earlier is not None:
                layout.exits[earlier.path] = first_tensor(earlier.output).numel()  # type: ignore[union-attr]
            layout.entries.append(call.path)
        problems += visit(call, layout, calls)
    last = block_calls[-1]
    layout.exits[last.path] = first_tensor(last.output).numel()  # type: ignore[union-attr]
    return (None, problems) if problems else (layout, [])


def _size(call: _Call) -> int:
    """How many calls `call` made, at any depth."""
    return sum(1 + _size(c) for c in call.inner)


def _covered(path: str, styles: dict[str, PlanStyle]) -> bool:
    """Whether `path` or a module holding it is marked `sequence`."""
    return any(styles.get(p) is not None and styles[p].name == SEQUENCE
               for p in (path, *_ancestors(path)))


def _block(block: _Call, styles: dict[str, PlanStyle], layout: SequenceLayout) -> list[str]:
    """The gathers and scatters of one block's call, or why its modules cannot run in the
    region."""
    leaves = list(block.leaves())
    stretches, unclosed = _stretches(leaves, styles)
    whole, split_features, problems = _place_stretches(block, leaves, stretches, layout)
    problems += _leaf_problems(block, leaves, styles, layout, whole, split_features)
    if unclosed:
        problems.append(f"{', '.join(c.path for c in unclosed)}: split features leave the "
                        f"block {block.path} of the sequence region unsummed")
    return problems


def _stretches(leaves: list[_Call], styles: dict[str, PlanStyle]
               ) -> tuple[list[list[_Call]], list[_Call]]:
    """The block's colwise/rowwise stretches, each its opening projections then the closing
    one, and the opening projections no rowwise one closes."""
    stretches: list[list[_Call]] = []
    opened: list[_Call] = []
    for leaf in leaves:
        name = styles[leaf.path].name if leaf.path in styles else None
        if name in OPENING:
            opened.append(leaf)
        elif name == CLOSING and opened:
            stretches.append([*opened, leaf])
            opened = []
    return stretches, opened


def _place_stretches(block: _Call, leaves: list[_Call], stretches: list[list[_Call]],
                     layout: SequenceLayout) -> tuple[set[int], set[int], list[str]]:
    """Where each stretch gathers the sequence (at its owner's entry, or at its opening
    projections) and reduce-scatters it: the leaves that then run on the whole sequence, those
    between a stretch's ends (on split features), by id, and why a stretch cannot."""
    owners = [_common_owner([c.path for c in s]) for s in stretches]
    shared = {o for o in owners if owners.count(o) > 1}
    whole: set[int] = set()
    split_features: set[int] = set()
    problems = []
    inputs: list[Any] = []  # the distinct tensors a block gathers at its projections
    for stretch, owner in zip(stretches, owners, strict=True):
        *openers, closer = stretch
        layout.rowwise[closer.path] = closer.output.numel()
        first, end = leaves.index(openers[0]), leaves.index(closer)
        split_features.update(id(c) for c in leaves[first + 1:end] if c not in openers)
        if _inside(owner, block.path) and owner not in shared:
            owner_call = next(c for c in _flatten(block.inner) if c.path == owner)
            if not isinstance(owner_call.stream, torch.Tensor):
                problems.append(f"{_name(owner, owner_call.module)}: sequence gathers its "
                                f"hidden states, its first argument or `{STREAM_KEYWORD}`; it "
                                f"has none")
                continue
            layout.gathers.append(owner)
            layout.gathered_elements.append(owner_call.stream.numel())
            mine = list(owner_call.leaves())
            whole.update(id(c) for c in mine[:mine.index(closer) + 1])
            continue
        for opener in openers:
            layout.gathers.append(opener.path)
            if not any(opener.stream is seen for seen in inputs):
                inputs.append(opener.stream)
                layout.gathered_elements.append(opener.stream.numel())
        whole.update(id(c) for c in stretch)
    return whole, split_features, problems


def _leaf_problems(block: _Call, leaves: list[_Call], styles: dict[str, PlanStyle],
                   layout: SequenceLayout, whole: set[int], split_features: set[int]
                   ) -> list[str]:
    """The block's other leaves run on this rank's piece of the sequence: a `sequence` one is
    sharded, one that mixes positions or has parameters unmarked is refused, as is a `sequence`
    one on split features."""
    problems = []
    for leaf in leaves:
        if id(leaf) in split_features:
            if _covered(leaf.path, styles):
                problems.append(f"{_name(leaf.path, leaf.module)} is sequence but runs on "
                                f"features split over the model group (between a colwise and "
                                f"a rowwise projection)")
            continue
        if id(leaf) in whole:
            continue
        if _covered(leaf.path, styles):
            layout.sharded.add(leaf.path)
            continue
        why = mixing_problem(leaf.module)
        if why is None and any(True for _ in leaf.module.parameters(recurse=False)):
            why = ("it runs on a rank's piece of the sequence in the region but is not marked: "
                   "mark it sequence if it acts token by token, or plan it")
        if why is not None:
            problems.append(f"{_name(leaf.path, leaf.module)} in {block.path}: {why}")
    return problems


NO_SEQUENCE = ("strategy.plan marks no module sequence: strategy=domain splits each sample's "
               "sequence over grid.pr in the blocks holding sequence modules; mark the modules "
               "acting token by token (norms, MLPs) sequence")


def domain_layout(styles: dict[str, PlanStyle], model: nn.Module,
                  sample_shape: tuple[int, ...], pr: int
                  ) -> tuple[SequenceLayout | None, list[str]]:
    """The sequence region of a plan whose weights all stay whole (`strategy=domain`), or why
    it cannot be split (one line each, naming the module): a block is the smallest module (not
    the model) holding a `sequence` module; in it the `sequence` modules, and the modules
    without parameters that do not mix positions, run on this rank's piece, and every other
    module (the attention) on the whole sequence: its input gathered at its entry, this rank's
    piece of its output taken at its exit."""
    marked = [p for p, s in styles.items() if s.name == SEQUENCE]
    if not marked:
        return None, [NO_SEQUENCE]
    outermost = [p for p in marked if not any(_inside(p, m) for m in marked)]
    blocks = {b for b in (next(_ancestors(p), None) for p in outermost) if b is not None}
    blocks = {b for b in blocks if not any(_inside(o, b) for o in blocks)}
    if not blocks:
        return None, [f"{', '.join(marked)}: sequence splits the positions inside a block (a "
                      f"module holding sequence modules, not the model), and the model itself "
                      f"holds {'it' if len(marked) == 1 else 'them'}"]
    return _region(model, sample_shape, pr, blocks,
                   lambda call, layout, calls: _domain_block(call, marked, layout, calls))


def _draw_problem(call: _Call) -> str | None:
    """Why a call, or one it makes, draws random masks in the region (None: none does)."""
    for inner in _flatten([call]):
        module = inner.module
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return (f"{_name(inner.path, module)}: {type(module).__name__} with p={module.p} in "
                    f"the sequence region: each rank would draw its own masks, and gridrun "
                    f"runs one process's draws; use p=0")
    return None


def _domain_block(block: _Call, marked: list[str], layout: SequenceLayout,
                  calls: list[_Call]) -> list[str]:
    """The gathers and takes of one block's call under `strategy=domain`, or why its modules
    cannot run in the region."""
    problems: list[str] = []

    def on_pieces(call: _Call) -> None:  # `call` runs on this rank's piece of the sequence
        layout.on_pieces.add(call.path)
        for inner in call.inner:
            if any(inner.path == m or _inside(inner.path, m) for m in marked):
                layout.on_pieces.update(c.path for c in _flatten([inner]))
                layout.sharded.update(c.path for c in inner.leaves())
                continue
            why = _draw_problem(inner)
            if why is not None:
                problems.append(f"{why} (in {block.path})")
            elif any(_inside(m, inner.path) for m in marked):
                on_pieces(inner)  # its own forward between its sequence modules, on pieces
            elif (any(True for _ in inner.module.parameters())
                  or mixing_problem(inner.module) is not None):
                problems.extend(_whole(inner, block.path, layout, calls))
            else:
                layout.on_pieces.update(c.path for c in _flatten([inner]))

    on_pieces(block)
    return problems


def _whole(call: _Call, block: str, layout: SequenceLayout, calls: list[_Call]) -> list[str]:
    """Run `call`'s module on the whole sequence: gather its hidden states at its entry, take
    this rank's piece of its output at its exit (or say why it cannot)."""
    length, shown = layout.length, _name(call.path, call.module)
    stream, out = call.stream, first_tensor(call.output)
    if (not isinstance(stream, torch.Tensor) or stream.dim() < 3
            or stream.shape[-2] != length):
        return [f"{shown} in {block}: strategy=domain runs it on the whole sequence, gathering "
                f"its hidden states (batch, sequence, features), its first argument or "
                f"`{STREAM_KEYWORD}`; it has none of {length} positions"]
    if out is None or out.dim() < 3 or out.shape[-2] != length:
        return [f"{shown} in {block}: strategy=domain runs it on the whole sequence and takes "
                f"this rank's positions of what it returns (a tensor of {length} positions, or "
                f"a tuple starting with one); it returns none"]
    count = sum(1 for c in calls if c.path == call.path)
    if count != 1:
        return [f"{shown} in {block}: a module run on the whole sequence in the region runs "
                f"once a forward, this one {count} times"]
    layout.gathers.append(call.path)
    layout.gathered_elements.append(stream.numel())
    layout.takes.append(call.path)
    return []


def install_sequence(model: nn.Module, layout: SequenceLayout, shards: SequenceShards,
                     rowwise_by_hook: bool = False) -> list[Any]:
    """Split, gather and scatter the hidden states of `model` (whose rowwise projections were
    built) where `layout` says; `rowwise_by_hook`: the rowwise modules are plain stand-ins,
    their outputs scattered after them (the shape check). Returns the hooks' handles."""

    def at_input(change: Callable[[torch.Tensor, str], torch.Tensor], label: str
                 ) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            found = stream_of(args, kwargs)
            if found is None or not isinstance(found[1], torch.Tensor):
                return None
            return _replaced(args, kwargs, found[0], change(found[1], label))
        return hook

    def at_output(change: Callable[[torch.Tensor, str], torch.Tensor], label: str
                  ) -> Callable[..., Any]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if isinstance(output, torch.Tensor):
                return change(output, label)
            return (change(output[0], label), *output[1:])
        return hook

    handles = []
    for path in layout.entries:
        handles.append(model.get_submodule(path).register_forward_pre_hook(
            at_input(shards.take, path + " in"), with_kwargs=True))
    for path in layout.exits:
        handles.append(model.get_submodule(path).register_forward_hook(
            at_output(shards.gather, path + " out")))
    for path in dict.fromkeys(layout.gathers):
        handles.append(model.get_submodule(path).register_forward_pre_hook(
            at_input(shards.gather, "sequence in"), with_kwargs=True))
    for path in dict.fromkeys(layout.takes):
        handles.append(model.get_submodule(path).register_forward_hook(
            at_output(shards.take, path + " out")))
    for path in layout.rowwise:
        module = model.get_submodule(path)
        if rowwise_by_hook:
            handles.append(module.register_forward_hook(at_output(shards.reduce_scatter, path)))
        else:
            assert isinstance(module, RowwiseProjection), path
            module.sequence = shards
    return handles
