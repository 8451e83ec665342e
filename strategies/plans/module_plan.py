"""A parallel plan by module name: glob patterns over `named_modules()` mapped to a style
(`strategies.plans.styles`), applied by swapping those modules for their split forms, so the
model's own `forward` runs unchanged, under `strategy=model` and `strategy=grid`.

Where a plan comes from, in order: the user's `strategy.plan`; the model's declared plan (the
transformers library's `config.base_model_tp_plan`, whose patterns are relative to the base
model and are resolved under the wrapper's `base_model_prefix`, with the wrapper class's own
`_tp_plan` for its head); otherwise, for a model group of more than one rank, one derived from
the module structure (`strategies.plans.derive`: MLP pairs, attention blocks and vocabulary
tables, each tried in one process before it is kept), where that finds anything; otherwise
none, and the strategy splits the model as it always has.

On the grid the plan splits over the model group (`Pr`), the batch over the batch groups
(`Pc`): split parameters' gradients are summed over the batch group, replicated ones over the
world (`split_model_exchanges`). Every rank of a model group runs its group's rows; the model's
output, where its last module is colwise, is gathered over the model group (adjoint:
reduce-scatter) so the loss sees whole logits, and each rank keeps its own sub-shard of the
rows (the row contract of `strategies.base`). Where the model's output projection is `vocab`
(its vocabulary or classes split), its logits stay split and are scored split, never gathered
(`strategies.layers.vocab_head`): a `vocab` projection whose output is not the model's is refused.

An attention module whose heads follow from a colwise projection runs on its rank's heads
unchanged where it reshapes with -1 or by the head size. Where it reads a head count or width
from an attribute, the plan divides the attributes it knows (`DIVIDED_ATTRIBUTES`) on the module
that owns the split projections, and reports each adjustment; an integer attribute naming heads
that it does not know refuses the plan by name.
"""

from __future__ import annotations

import fnmatch
import math
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.cost.collectives import CommOp
from strategies.base import split_model_exchanges
from strategies.exchange.buckets import predict_gradient_ops
from strategies.layers.norm import (
    batch_norm_ops,
    batch_norm_problem,
    distribute_batch_norms,
    is_plain_batch_norm,
)
from strategies.layers.split import activation_itemsize
from strategies.layers.vocab_head import SplitLogitsScoring, returns_logits_of
from strategies.layers.whole_batch import RowDrawingModel
from strategies.plans.checks import pairing_problems, shape_problems
from strategies.plans.derive import candidate_groups, owner_calls, signature, trial
from strategies.plans.sequence_parallel import (
    SequenceLayout,
    SequenceShards,
    domain_layout,
    install_sequence,
    sequence_layout,
)
from strategies.plans.styles import (
    STYLES,
    PlanStyle,
    Projection,
    ReplicatedKeyValue,
    Rowwise,
)
from strategies.plans.ties import (
    share_table,
    splits_rows_as_a_table,
    table_of,
    tied_holders,
    tied_tables,
)
from strategies.probe import (
    EMBEDDINGS,
    draw_plan,
    logits_of,
    probe,
)

USER_SOURCE = "strategy.plan"
WHOLE_MODEL = "(the model)"  # how an adjustment names the root module as its owner
DECLARED_SOURCE = "the model's declared plan"
DERIVED_SOURCE = "derived from the module structure"

# The transformers library's style names, as gridrun runs them (a colwise head is gathered
# wherever it is the model's output); docs/strategies.md lists the library's others, refused
# by name.
DECLARED_STYLES = {"colwise": "colwise", "colwise_gather_output": "colwise_gather_output",
                   "colwise_rep": "colwise_gather_output", "rowwise": "rowwise",
                   "rowwise_split_input": "rowwise_split_input",
                   "rowwise_rep": "rowwise_split_input", "embedding_rowwise": "vocab",
                   "replicated_with_grad_allreduce": "replicate", "replicate": "replicate"}

# Integer attributes of an attention module that count its heads, or the width of its heads
# together: divided by Pr on the module owning split projections.
DIVIDED_ATTRIBUTES = ("num_heads", "num_attention_heads", "heads", "n_head", "n_heads",
                      "num_key_value_heads", "num_kv_heads", "split_size", "embed_dim",
                      "all_head_size", "inner_dim")
# Integer attributes that name heads but stay as they are: one head's width, heads per group.
KEPT_ATTRIBUTES = ("head_dim", "head_size", "attention_head_size", "num_key_value_groups",
                   "dim_head")
# The width of one head, where the owner says it: a split must keep whole heads.
HEAD_WIDTH_ATTRIBUTES = ("head_dim", "attention_head_size", "head_size", "dim_head")


@dataclass(frozen=True)
class Adjustment:
    """An attribute of an attention module divided over the model group."""

    owner: str
    attribute: str
    old: int
    new: int

    def __str__(self) -> str:
        return f"adjusted {self.owner}.{self.attribute} {self.old} → {self.new}"


@dataclass
class ModulePlan:
    """The plan for one model: each styled module's path and style, in `named_modules` order,
    and what was wrong with the plan as given (unknown styles, patterns without a module)."""

    source: str
    styles: dict[str, PlanStyle] = field(default_factory=dict)
    given_problems: list[str] = field(default_factory=list)
    # strategy=domain: every weight whole, the blocks' modules other than the sequence ones
    # run on the gathered sequence (`strategies.plans.sequence_parallel.domain_layout`)
    whole_weights: bool = False

    @property
    def layouts(self) -> dict[str, str]:
        """Module path → style name (the summary's `layouts`)."""
        return {path: style.name for path, style in self.styles.items()}

    def splits(self) -> dict[str, PlanStyle]:
        return {p: s for p, s in self.styles.items() if s.name != "replicate"}


def declared_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan, its patterns resolved from the root (empty: none)."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", None)
    under = ""
    if isinstance(prefix, str) and prefix and isinstance(getattr(model, prefix, None),
                                                         nn.Module):
        under = prefix + "."
    plan = {under + str(k): str(v) for k, v in dict(base).items()}
    head = getattr(type(model), "_tp_plan", None) or {}
    if base or head:
        plan.update({str(k): str(v) for k, v in dict(head).items()})
    return plan


def module_plan(model: nn.Module, user_plan: Mapping[str, str],
                sample_shape: tuple[int, ...] | None = None, pr: int | None = None
                ) -> ModulePlan | None:
    """The plan for `model`: the user's if given, else the model's declared one, else (given
    the samples' shape and the model group's size) one derived from its structure, else
    None."""
    if user_plan:
        return replicated_key_values(
            _with_tied_tables(match_plan(model, dict(user_plan), USER_SOURCE), model), model, pr)
    declared = declared_plan(model)
    if declared:
        return replicated_key_values(
            _with_tied_tables(match_plan(model, declared, DECLARED_SOURCE), model), model, pr)
    if sample_shape is not None and pr is not None:
        return derived_plan(model, sample_shape, pr)
    return None


# Derived plans by model, then by (its modules, sample shape, pr): the strategy asks for the
# same plan to check, predict and build; the modules' text changes once the model is split.
_DERIVED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[object, ...], ModulePlan | None]] = (
    weakref.WeakKeyDictionary())


def derived_plan(model: nn.Module, sample_shape: tuple[int, ...], pr: int
                 ) -> ModulePlan | None:
    """The plan derived from `model`'s structure for `pr` ranks (None: nothing is split
    safely, there is no more than one rank, or a BatchNorm would see a batch group's rows
    only). Only groups that pass their trial in one process, and only a plan that
    `plan_problems` accepts."""
    key = (repr(model), tuple(sample_shape), pr)
    known = _DERIVED.setdefault(model, {})
    if key not in known:
        known[key] = _derive(model, tuple(sample_shape), pr)
    return known[key]


def _derive(model: nn.Module, sample_shape: tuple[int, ...], pr: int) -> ModulePlan | None:
    if pr < 2 or any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return None
    groups = candidate_groups(model, sample_shape)
    calls = owner_calls(model, sample_shape, {g.owner for g in groups if g.kind != "vocab"})
    holders = tied_holders(model)
    tried: dict[tuple[object, ...], bool] = {}
    styles: dict[str, str] = {}
    for group in groups:
        trial_plan = ModulePlan(DERIVED_SOURCE, {p: STYLES[s] for p, s in group.styles.items()})
        problems = [p for path, style in trial_plan.styles.items()
                    for p in style.problems(path, model.get_submodule(path), pr)]
        shared = any(len(holders[id(param)]) > 1 for path in group.styles
                     for param in model.get_submodule(path).parameters(recurse=False))
        if problems or shared:
            continue
        if group.kind != "vocab":
            changes, why = adjustments(trial_plan, model, pr, None)
            if why or group.owner not in calls:
                continue
            key = (signature(model, group), pr)
            if key not in tried:
                tried[key] = trial(model, group, calls[group.owner], pr,
                                   [("" if c.owner == "(the model)" else c.owner, c.attribute,
                                     c.new) for c in changes])
            if not tried[key]:
                continue
        styles.update(group.styles)
    if not styles:
        return None
    plan = ModulePlan(DERIVED_SOURCE, {p: STYLES[styles[p]] for p, _ in model.named_modules()
                                       if p in styles})
    return None if plan_problems(plan, model, sample_shape, pr) else plan


DOMAIN_STYLES = ("sequence", "replicate")  # the styles that keep every weight whole


def domain_plan(model: nn.Module, user_plan: Mapping[str, str]) -> ModulePlan | None:
    """The user's plan for `strategy=domain` (None: none given): its weights all whole, each
    sample's sequence split over the model group in the blocks of its `sequence` modules."""
    if not user_plan:
        return None
    plan = match_plan(model, dict(user_plan), USER_SOURCE)
    plan.whole_weights = True
    return plan


def plan_region(plan: ModulePlan, model: nn.Module, sample_shape: tuple[int, ...],
                pr: int) -> tuple[SequenceLayout | None, list[str]]:
    """The plan's sequence region (None: it has none), or why it cannot be split."""
    if plan.whole_weights:
        return domain_layout(plan.styles, model, sample_shape, pr)
    return sequence_layout(plan.styles, model, sample_shape, pr)


def replicated_key_values(plan: ModulePlan, model: nn.Module, pr: int | None) -> ModulePlan:
    """`plan` with the `colwise` key and value projections of grouped-query attention whose
    heads do not divide over `pr` ranks held whole instead (`ReplicatedKeyValue`, as Megatron
    does), where there are more ranks than key/value heads and each rank's query heads read one
    of them: the owner's `num_key_value_groups` says the attention groups its heads, and it is
    then adjusted to the query heads of one rank (`adjustments`)."""
    if pr is None or pr < 2:
        return plan
    for owner, projections in _owners(plan, None).items():
        module = model.get_submodule(owner)
        groups = getattr(module, "num_key_value_groups", None)
        width = next((getattr(module, n) for n in HEAD_WIDTH_ATTRIBUTES
                      if isinstance(getattr(module, n, None), int)), None)
        if not isinstance(groups, int) or groups < 2 or not width:
            continue
        widths = {path: _out_features(model.get_submodule(path)) for path in projections}
        query_heads = max(widths.values()) // width
        for path, out in widths.items():
            heads = out // width
            if (plan.styles[path].name != "colwise" or heads * groups != query_heads
                    or heads % pr == 0 or pr % heads or query_heads % pr
                    or groups % (query_heads // pr)):
                continue
            plan.styles[path] = ReplicatedKeyValue(heads, width)
    return plan


def _out_features(module: nn.Module) -> int:
    projection = Projection.of(module)
    return projection.out_features if projection is not None else 0


def _with_tied_tables(plan: ModulePlan, model: nn.Module) -> ModulePlan:
    plan.styles = tied_tables(plan.styles, model)
    return plan


def match_plan(model: nn.Module, patterns: dict[str, str], source: str) -> ModulePlan:
    """Each module of `model` matched by a pattern (`fnmatch`: `*` matches any run of
    characters, dots included), with its style."""
    plan = ModulePlan(source)
    named: dict[str, str] = {}
    for pattern, given in patterns.items():
        style = DECLARED_STYLES.get(given) if source == DECLARED_SOURCE else given
        if style not in STYLES:
            plan.given_problems.append(
                f"{source}: {pattern}: {given} is not a style gridrun runs (one of "
                f"{', '.join(STYLES)})" + ("; give strategy.plan instead"
                                           if source == DECLARED_SOURCE else ""))
            continue
        named[pattern] = style
    matched = set()
    for path, _ in model.named_modules():
        hits = [p for p in named if path and fnmatch.fnmatchcase(path, p)]
        matched.update(hits)
        styles = {named[p] for p in hits}
        if len(styles) > 1:
            plan.given_problems.append(
                f"{source}: {path} is matched by {', '.join(hits)}, with different styles")
        elif styles:
            plan.styles[path] = STYLES[styles.pop()]
    if source == USER_SOURCE:  # a declared plan may name modules a variant leaves out
        plan.given_problems += [f"{source}: {p} matches no module of the model"
                                for p in named if p not in matched]
    return plan


def output_module(model: nn.Module, sample_shape: tuple[int, ...]) -> nn.Module | None:
    """The last leaf module a forward runs: what gives the model's output."""
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    return calls[-1].module if calls else None


def gathered_path(plan: ModulePlan, model: nn.Module,
                  sample_shape: tuple[int, ...]) -> str | None:
    """The styled module whose split output is the model's output (gathered), if any."""
    last = output_module(model, sample_shape)
    for path, style in plan.styles.items():
        if style.splits_output and model.get_submodule(path) is last:
            return path
    return None


def vocab_heads(plan: ModulePlan, model: nn.Module) -> list[str]:
    """The projections styled `vocab` (a checked plan has at most one: the model's output)."""
    return [path for path, style in plan.styles.items()
            if style.name == "vocab" and Projection.of(model.get_submodule(path)) is not None]


def vocab_head_problems(plan: ModulePlan, model: nn.Module,
                        sample_shape: tuple[int, ...]) -> list[str]:
    """A `vocab` projection whose output is not the model's (its logits, nothing after)."""
    problems = []
    for path in vocab_heads(plan, model):
        module = model.get_submodule(path)
        if not returns_logits_of(model, module, sample_shape):
            problems.append(f"{path} ({type(module).__name__}): vocab splits a projection only "
                            f"where its output is the model's output (its logits are scored "
                            f"split); plan it colwise")
    return problems


def _owners(plan: ModulePlan, gathered: str | None) -> dict[str, list[str]]:
    """Owner path → its child projections whose outputs stay split (the attention's)."""
    owners: dict[str, list[str]] = {}
    for path, style in plan.styles.items():
        if style.splits_output and path != gathered:
            owners.setdefault(path.rpartition(".")[0], []).append(path)
    return owners


def _int_attributes(module: nn.Module) -> Iterator[tuple[str, int]]:
    for name, value in vars(module).items():
        if isinstance(value, int) and not isinstance(value, bool):
            yield name, value


def adjustments(plan: ModulePlan, model: nn.Module, pr: int, gathered: str | None
                ) -> tuple[list[Adjustment], list[str]]:
    """The attributes divided over `pr` ranks, and why some attention cannot be adjusted."""
    found: list[Adjustment] = []
    problems: list[str] = []
    for owner, projections in _owners(plan, gathered).items():
        module = model.get_submodule(owner)
        shown = owner or WHOLE_MODEL
        attributes = dict(_int_attributes(module))
        for name, value in attributes.items():
            if name in DIVIDED_ATTRIBUTES:
                if value % pr:
                    problems.append(f"{shown} ({type(module).__name__}): its {name}={value} "
                                    f"does not divide over grid.pr={pr} ranks")
                elif pr > 1:
                    found.append(Adjustment(shown, name, value, value // pr))
            elif "head" in name and name not in KEPT_ATTRIBUTES:
                problems.append(f"{shown} ({type(module).__name__}): cannot adjust its "
                                f"{name}={value} to the heads of one rank (gridrun divides "
                                f"{', '.join(DIVIDED_ATTRIBUTES)})")
        replicated = [style for p, style in plan.styles.items()
                      if p.rpartition(".")[0] == owner and isinstance(style, ReplicatedKeyValue)]
        groups = attributes.get("num_key_value_groups")
        if replicated and groups is not None and pr > 1:
            # each rank's query heads read the one key/value head it computes
            found.append(Adjustment(shown, "num_key_value_groups", groups,
                                    groups * replicated[0].heads // pr))
        width = next((attributes[n] for n in HEAD_WIDTH_ATTRIBUTES if n in attributes), None)
        if width:
            for path in projections:
                problems += _whole_heads(plan.styles[path], path, model.get_submodule(path),
                                         width, pr)
    return found, problems


def _whole_heads(style: PlanStyle, path: str, module: nn.Module, width: int,
                 pr: int) -> list[str]:
    out = getattr(module, "out_features", None)
    weight = getattr(module, "weight", None)
    if out is None and isinstance(weight, torch.Tensor) and weight.dim() == 2:
        out = weight.shape[1]  # a Conv1D: (in, out)
    chunks = getattr(style, "chunks", 1)
    if not isinstance(out, int) or out % chunks or (out // chunks) % width:
        return []  # its own checks say what is wrong with its features
    heads = out // chunks // width
    if heads % pr:
        kind = "key/value heads" if path.endswith(("k_proj", "v_proj", "key", "value")) \
            else "heads"
        return [f"{path} ({type(module).__name__}): its {heads} {kind} of {width} features "
                f"do not divide over grid.pr={pr} ranks"]
    return []


def plan_problems(plan: ModulePlan, model: nn.Module, sample_shape: tuple[int, ...],
                  pr: int, pc: int = 1) -> list[str]:
    """Every reason the plan cannot split `model` over `pr` ranks (the batch over `pc`), one
    line each."""
    problems = list(plan.given_problems) + batch_norm_problems(model, pc)
    splitting = [f"{path} ({type(model.get_submodule(path)).__name__}): {style.name} splits "
                 f"weights; strategy=domain keeps every weight whole (its styles: "
                 f"{', '.join(DOMAIN_STYLES)}): use strategy=grid"
                 for path, style in plan.styles.items()
                 if plan.whole_weights and style.name not in DOMAIN_STYLES]
    if splitting:
        return problems + splitting
    holders = tied_holders(model)
    for path, style in plan.splits().items():
        module = model.get_submodule(path)
        found = style.problems(path, module, pr)
        problems += found
        if found or style.name == "sequence":  # whole weights: a tie is no matter
            continue
        for param in module.parameters(recurse=False):
            others = [p for p in holders[id(param)] if p != path]
            if others and not all(splits_rows_as_a_table(plan.styles.get(p),
                                                          model.get_submodule(p))
                                  for p in [path, *others]):
                problems.append(f"{path} ({type(module).__name__}): its weights are shared "
                                f"with {', '.join(others)} (tied): a plan splits a tied weight "
                                f"only by its vocabulary rows, an embedding (vocab) and a "
                                f"projection (colwise, colwise_gather_output or vocab) together")
                break
    if problems:
        return problems
    problems = vocab_head_problems(plan, model, sample_shape)
    if problems:
        return problems
    gathered = gathered_path(plan, model, sample_shape)
    changes, problems = adjustments(plan, model, pr, gathered)
    if problems:
        return problems
    # the pieces must be summed before anything reads them whole, and the user's forward
    # must run on one rank's shapes (`strategies.plans.checks`)
    problems = pairing_problems(plan.styles, model, sample_shape, gathered)
    if problems:
        return problems
    # the sequence region: where the hidden states are split, gathered and scattered
    # (`strategies.plans.sequence_parallel`)
    sequence, problems = plan_region(plan, model, sample_shape, pr)
    if problems:
        return problems
    owners = [("" if c.owner == WHOLE_MODEL else c.owner, c.attribute, c.new) for c in changes]
    return shape_problems(plan.styles, model, sample_shape, pr, gathered, owners, sequence)


def batch_norm_problems(model: nn.Module, pc: int) -> list[str]:
    """A BatchNorm under a plan takes its statistics over the batch group (every rank of a
    model group runs the group's rows): one torch runs as a `DistributedBatchNorm`; a subclass
    with a forward of its own would normalise by a batch group's rows only, where `pc` > 1."""
    problems = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        # a plain one is replaced; a subclass runs as it is, exact only on the whole batch
        problem = batch_norm_problem(module, replaced=False)
        if problem is None and pc > 1 and not is_plain_batch_norm(module):
            problem = (f"a BatchNorm with a forward of its own would normalise by one batch "
                       f"group's rows, not the batch's (grid.pc={pc}): use grid.pc=1 or "
                       f"strategy=data")
        if problem is not None:
            problems.append(f"{path} ({type(module).__name__}): {problem}")
    return problems


# -- the parallel model ---------------------------------------------------------------------------


class PlannedModel(RowDrawingModel):
    """The user's model with its planned modules swapped for their split forms (its own
    forward runs them); every rank of a model group runs the group's rows, and keeps its own
    sub-shard of the (whole) output. Its random draws are one process's (`RowDrawingModel`)."""

    def __init__(self, grid: ProcessGrid, module: nn.Module, layouts: dict[str, str],
                 adjusted: list[str]) -> None:
        super().__init__(grid)
        self.module = module
        self.layouts = layouts
        self.plan_adjustments = adjusted
        self.plan_source: str | None = None  # where the plan came from (`ModulePlan.source`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = logits_of(self.run_module(x))
        return out[Partition(out.shape[0], self.grid.pr).slice(self.grid.model_index)]


class VocabScoredModel(SplitLogitsScoring, PlannedModel):
    """A planned model whose output projection is split by vocabulary (or classes): it outputs
    its piece of the logits of every row of its group, and scores its own sub-shard of the rows
    from the group's pieces (`strategies.layers.vocab_head`), never gathering them."""

    def __init__(self, grid: ProcessGrid, module: nn.Module, layouts: dict[str, str],
                 adjusted: list[str], vocab_start: int) -> None:
        super().__init__(grid, module, layouts, adjusted)
        self.vocab_start = vocab_start  # this rank's first row of the head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return logits_of(self.run_module(x))



def _vocab_start(plan: ModulePlan, model: nn.Module, grid: ProcessGrid) -> int | None:
    """This rank's first row of the `vocab` output projection (None: there is none)."""
    heads = vocab_heads(plan, model)
    if not heads:
        return None
    (head,) = heads
    projection = Projection.of(model.get_submodule(head))
    assert projection is not None
    first: int = Partition(projection.out_features, grid.pr).offsets[grid.model_index]
    return first


def build_planned_model(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                        grid: ProcessGrid, sync_replica_gradients: bool,
                        bucket_cap_bytes: int, first_bucket_bytes: int) -> PlannedModel:
    """This rank's part of `model`, whose planned modules it swaps in place (replicated
    parameters are the model's own objects)."""
    gathered = gathered_path(plan, model, sample_shape)
    changes, problems = adjustments(plan, model, grid.pr, gathered)
    if problems:
        raise ValueError("; ".join(problems))
    # the draws one process makes, from the whole model (a rank then draws its pieces)
    draws = draw_plan(model, sample_shape)
    vocab_start = _vocab_start(plan, model, grid)
    sequence, problems = plan_region(plan, model, sample_shape, grid.pr)
    if problems:
        raise ValueError("; ".join(problems))
    split_ids: set[int] = set()
    shards: dict[int, nn.Parameter] = {}  # a tied table's piece, by the whole weight's id
    for path, style in plan.splits().items():
        module = model.get_submodule(path)
        whole = getattr(module, "weight", None)
        built, split = style.build(module, path, grid.model, grid.model_index, path == gathered)
        if isinstance(whole, torch.Tensor) and splits_rows_as_a_table(style, module):
            share_table(built, shards.setdefault(id(whole), table_of(built)))
        model.set_submodule(path, built)
        split_ids.update(id(p) for p in split)
    for change in changes:
        owner = model if change.owner == WHOLE_MODEL else model.get_submodule(change.owner)
        setattr(owner, change.attribute, change.new)
    if sequence is not None and grid.pr > 1:
        install_sequence(model, sequence, SequenceShards(grid.model, sequence.length))
    # a model group's ranks hold the same rows: the batch's statistics come from the batch
    # group (an EASGD replica normalises by its own rows)
    distribute_batch_norms(model, grid.batch if sync_replica_gradients
                           else CountedComm(None, grid.counter, "self"))
    params = list(model.parameters())
    split_params = [p for p in params if id(p) in split_ids]
    replicated = [p for p in params if id(p) not in split_ids]
    adjusted = [str(c) for c in changes]
    pmodel = (PlannedModel(grid, model, plan.layouts, adjusted) if vocab_start is None
              else VocabScoredModel(grid, model, plan.layouts, adjusted, vocab_start))
    pmodel.plan_source = plan.source
    pmodel.draws = draws if draws.cuts else None  # None: it draws nothing
    pmodel.replicated_in_model_group = replicated
    pmodel.reducers = split_model_exchanges(grid, split_params, replicated,
                                            sync_replica_gradients, bucket_cap_bytes,
                                            first_bucket_bytes)
    return pmodel


# -- predictions --------------------------------------------------------------------------------

Items = list[tuple[str, list[tuple[int, torch.dtype]]]]  # (label, [(bytes, dtype)])


def plan_param_items(model: nn.Module, plan: ModulePlan, pr: int,
                     trainable_only: bool = True) -> tuple[Items, Items]:
    """Rank 0's (label, [(bytes, dtype)]) of its split and its replicated parameters, in the
    parallel model's `parameters()` order (one parameter an item, as the buckets see them)."""
    split: Items = []
    whole: Items = []
    seen_modules: set[int] = set()
    seen_params: set[int] = set()

    def visit(path: str, module: nn.Module) -> None:
        if id(module) in seen_modules:
            return
        seen_modules.add(id(module))
        style = plan.styles.get(path)
        if style is not None and style.name != "replicate":
            locals_ = style.local_params(module, pr)
            weight = getattr(module, "weight", None)
            if isinstance(weight, torch.Tensor) and splits_rows_as_a_table(style, module):
                if id(weight) in seen_params:  # a tied table's piece: counted where first seen
                    locals_ = locals_[1:]
                seen_params.add(id(weight))
            for local in locals_:
                if local.trainable or not trainable_only:
                    item = (path, [(local.elements * local.dtype.itemsize, local.dtype)])
                    (split if local.split else whole).append(item)
            # a rowwise bias is the module's own: counted once, wherever it is seen again
            seen_params.update(id(p) for p in module.parameters(recurse=False)
                               if isinstance(style, Rowwise) and p.dim() == 1)
            return
        for _, param in module.named_parameters(recurse=False):
            if id(param) in seen_params:
                continue
            seen_params.add(id(param))
            if param.requires_grad or not trainable_only:
                whole.append((path, [(param.numel() * param.element_size(), param.dtype)]))
        for name, child in module.named_children():
            visit(f"{path}.{name}" if path else name, child)

    visit("", model)
    return split, whole


def predict_plan_ops(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                     grid: GridShape, global_batch: int, caps: tuple[int, int],
                     compute_dtype: torch.dtype | None = None) -> list[CommOp]:
    """Rank 0's collectives per training step: each styled module's over the model group (in
    the order a forward meets them), split parameters' gradients over the batch group,
    replicated ones' over the world."""
    rows = Partition(global_batch, grid.pc).sizes[0]
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    gathered = gathered_path(plan, model, sample_shape)
    styled = {id(model.get_submodule(p)): (p, s) for p, s in plan.splits().items()}
    act = activation_itemsize([model], compute_dtype)  # a projection's output
    table = activation_itemsize([model])  # an embedding's output: the table's dtype
    sequence, _ = plan_region(plan, model, sample_shape, grid.pr)
    ops: list[CommOp] = [] if sequence is None else sequence.ops(rows, grid.pr, act)
    for call in calls:
        if id(call.module) not in styled:
            continue
        path, style = styled[id(call.module)]
        if sequence is not None and path in sequence.rowwise:
            continue  # a reduce-scatter and an all-gather instead (the region's)
        itemsize = table if isinstance(call.module, EMBEDDINGS) else act
        ops += style.ops(call.module, path, rows * call.output_elements, grid.pr, itemsize,
                         path == gathered)
    ops += batch_norm_ops(model, "batch", grid.pc, activation_itemsize([model]))
    split, whole = plan_param_items(model, plan, grid.pr)
    return (ops + predict_gradient_ops(split, "batch", grid.pc, *caps)
            + predict_gradient_ops(whole, "world", grid.size, *caps))


def plan_param_bytes(model: nn.Module, plan: ModulePlan, pr: int) -> int:
    """Parameter bytes rank 0 holds."""
    split, whole = plan_param_items(model, plan, pr, trainable_only=False)
    return sum(nbytes for _, items in split + whole for nbytes, _ in items)


def plan_activation_bytes(model: nn.Module, plan: ModulePlan, sample_shape: tuple[int, ...],
                          grid: GridShape, global_batch: int,
                          compute_dtype: torch.dtype | None = None) -> int:
    """An estimate of what rank 0 keeps for backward: every leaf's output for its group's
    rows, a split output's piece only."""
    rows = Partition(global_batch, grid.pc).sizes[0]
    with torch.random.fork_rng(devices=[]):
        calls = probe(model, sample_shape).calls
    gathered = gathered_path(plan, model, sample_shape)
    split = {id(model.get_submodule(p)) for p, s in plan.styles.items()
             if s.splits_output and p != gathered}
    split |= {id(model.get_submodule(p)) for p in vocab_heads(plan, model)}
    if plan.whole_weights:  # the sequence region's modules on a rank's positions
        region, _ = plan_region(plan, model, sample_shape, grid.pr)
        split = {id(model.get_submodule(p)) for p in (region.on_pieces if region else ())}
    elements = sum(math.ceil(c.output_elements / grid.pr) if id(c.module) in split
                   else c.output_elements for c in calls)
    return rows * elements * activation_itemsize([model], compute_dtype)
