"""What every strategy provides, and the row contract every parallel model keeps.

Rows of a global batch of B samples:
- input: each rank is fed the rows of its batch group (`Partition(B, pc)`, piece `batch_index`),
  the same rows on every rank of a model group;
- output: each rank returns the logits of its own sub-shard of those rows
  (`Partition(rows of the batch group, pr)`, piece `model_index`).
So every sample's loss is computed on exactly one rank. Each rank's loss is (P/B) × the sum of its
samples' losses, so the mean over all P ranks is the global mean loss, whatever the shard sizes
(a rank may even have none); gradient exchanges scale by 1/P accordingly.

A target is a class per sample, or (next-token objective) a token id per position: the loss is
then per target, each rank's (P/(B·T)) × the sum over its targets. A model that keeps the
contract differently (a sequence split over the model group scores its own positions; a
vocabulary split scores its rows from every rank's piece of the logits) says which targets its
output rows are (`output_rows`) and how it scores them (`score`); still each target is scored
on exactly one rank.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from runner.core import CountedComm, GridShape, Partition, ProcessGrid
from runner.cost.collectives import (
    DEFAULT_COSTS,
    CommOp,
    MachineCosts,
    comm_seconds,
    loss_op,
    step_bytes,
    wait_seconds,
)
from runner.cost.compute import DEFAULT_RATES, ComputeRates
from runner.cost.layers import layer_seconds, loss_seconds, operator_seconds
from strategies.exchange.buckets import GradientBuckets
from strategies.exchange.sparse_gradients import SparseGradientExchange
from strategies.probe import operator_calls, probe

MB = 1 << 20


class GradientExchange(Protocol):
    """What a parallel model runs after backward (dense buckets, sparse tables)."""

    def finish(self) -> None: ...

    def zero_(self) -> None: ...

    def refresh(self) -> None:
        """Collective: bring copies left stale by the exchange up to date."""

    def report(self) -> dict[str, Any]:
        """What the exchange chose, per parameter group (empty: nothing to say)."""


@dataclass
class Score:
    """What a rank's outputs make of its targets."""

    loss_sum: torch.Tensor  # the sum of its targets' cross-entropy (differentiable)
    count: int  # how many targets it scored
    correct: torch.Tensor | None = None  # how many of them the arg-max predicts (if asked)


def cross_entropy_score(output: torch.Tensor, targets: torch.Tensor,
                        correct: bool = False) -> Score:
    """Whole logits (rows, [positions,] classes) against targets (rows, [positions])."""
    logits = output.reshape(-1, output.shape[-1])
    flat = targets.reshape(-1)
    loss = F.cross_entropy(logits, flat, reduction="sum")
    right = (logits.argmax(dim=1) == flat).sum() if correct else None
    return Score(loss, flat.numel(), right)


@dataclass(frozen=True)
class MicroBatch:
    """One of a step's micro-batches (`trainer.accumulate_steps`) on this rank: rows of the
    global batch's sample order, its inputs (this rank's batch group's piece) and the targets
    of its outputs. Each piece is, to the model, a global batch of `global_rows` rows."""

    index: int
    count: int
    inputs: slice
    outputs: slice
    global_rows: int

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


@dataclass(frozen=True)
class PricingContext:
    """What the runner knows of the machine and the data, for the choices a strategy makes
    from the cost model and for its predicted step times (never a config option)."""

    # the machine's α–β costs
    costs: MachineCosts = DEFAULT_COSTS
    # the expected number of distinct rows of an embedding table a given number of samples
    # touches (None: no token data)
    rows_touched: Callable[[int], float] | None = None
    # trainer.precision's autocast type (None: fp32): the dtype of the activations the
    # strategy moves (`strategies.layers.split.output_itemsizes`)
    compute_dtype: torch.dtype | None = None
    # this machine's compute rates
    rates: ComputeRates = DEFAULT_RATES
    # the global batch (a layout chosen by time depends on it; None: not known)
    global_batch: int | None = None
    # how much slower a rank computes than the rates say (ranks sharing cores:
    # `runner.cost.compute.oversubscription`)
    slowdown: float = 1.0
    # the optimizer's name (`optimizer.name`, or a `_target_`'s class in lower case): its
    # update's passes over the parameters (`update_passes`)
    optimizer: str = "sgd"
    # trainer.accumulate_steps: the micro-batches of a step (what a strategy keeps between them)
    accumulate_steps: int = 1
    # trainer.activation_checkpointing: the modules recomputed in backward (what a strategy
    # gathers again for them)
    activation_checkpointing: str = "none"


DEFAULT_PRICING = PricingContext()


class ParallelModel(nn.Module):
    """This rank's part of the model, and the gradient exchanges that make its steps agree."""

    def __init__(self, grid: ProcessGrid) -> None:
        super().__init__()
        self.grid = grid
        self.reducers: list[GradientExchange] = []
        # Parameters every rank of a model group holds whole (batch-parallel layers): a replica
        # optimizer must keep these copies equal.
        self.replicated_in_model_group: list[nn.Parameter] = []
        # The runner's own hooks on the tensors autograd saves (its activation meter), for a
        # model that installs hooks of its own inside its forward, which would hide the
        # runner's: it passes on to these whatever it does not keep itself.
        self.outer_saved_hooks: tuple[Callable[[torch.Tensor], Any],
                                      Callable[[Any], torch.Tensor]] | None = None
        # The micro-batch the next training forward runs (None: the whole step's rows at once).
        self.micro: MicroBatch | None = None
        # trainer.activation_checkpointing: the modules recomputed, and those a strategy
        # rebuilt (None: nothing asked for)
        self.recomputed: dict[str, list[str]] | None = None
        # trainer.compile: what runs compiled, and what eagerly (None: nothing asked for)
        self.compiled: Any = None

    @property
    def loss_comm(self) -> CountedComm:
        """The ranks whose local losses make up the global loss: all of them."""
        return self.grid.world

    def input_rows(self, global_rows: int) -> slice:
        return Partition(global_rows, self.grid.pc).slice(self.grid.batch_index)

    def output_rows(self, global_rows: int) -> slice:
        group = self.input_rows(global_rows)
        own = self.own_rows(group.stop - group.start)
        return slice(group.start + own.start, group.start + own.stop)

    def own_rows(self, group_rows: int) -> slice:
        """Which of its model group's rows this rank's outputs are: its sub-shard, or (a model
        that scores its targets from the whole group's rows, `score`) all of them."""
        return Partition(group_rows, self.grid.pr).slice(self.grid.model_index)

    def score(self, output: torch.Tensor, targets: torch.Tensor,
              correct: bool = False) -> Score:
        """The loss of this rank's `output` against the targets of its `output_rows`."""
        return cross_entropy_score(output, targets, correct)

    def micro_batches(self, global_rows: int, count: int) -> list[MicroBatch]:
        """This rank's rows of a global batch as `count` consecutive micro-batches: piece k of
        every batch group's rows makes a global batch of `global_rows / count` rows, which the
        model splits by the row contract as it would any batch (`count` must divide the batch
        group's rows: validation says so)."""
        group = self.input_rows(global_rows)
        if count == 1:
            return [MicroBatch(0, 1, group, self.output_rows(global_rows), global_rows)]
        piece_rows = global_rows // count
        piece = self.input_rows(piece_rows)  # the last call: a model may keep the batch's size
        own = self.output_rows(piece_rows)
        size = piece.stop - piece.start
        batches = []
        for k in range(count):
            start = group.start + k * size
            batches.append(MicroBatch(
                k, count, slice(start, start + size),
                slice(start + own.start - piece.start, start + own.stop - piece.start),
                piece_rows))
        return batches

    @contextlib.contextmanager
    def feeding(self, micro: MicroBatch) -> Iterator[None]:
        """The forwards and backward of `micro`: before its last, the gradient exchanges wait
        (gradients only accumulate, as DDP's `no_sync`)."""
        self.micro = micro
        deferred = [r for r in self.reducers if isinstance(r, GradientBuckets)]
        for reducer in deferred:
            reducer.deferred = not micro.last
        try:
            yield
        finally:
            self.micro = None
            for reducer in deferred:
                reducer.deferred = False

    def recompute_contexts(self) -> tuple[contextlib.AbstractContextManager[None],
                                          contextlib.AbstractContextManager[None]]:
        """What a checkpointed module's forward and its recomputation in backward run inside
        (`torch.utils.checkpoint`'s `context_fn`): the same modes, so that the recomputation
        draws and normalizes as the forward did."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def recomputed_forward(self, module: nn.Module) -> Callable[..., Any]:
        """What recomputing `module` runs (`strategies.recompute`): its own forward. A model
        that prepares a module around its forward (gathers its parameters) moves that inside,
        so that the recomputation prepares it again."""
        return module.forward

    def unit_names(self) -> list[str] | None:
        """The plain model's modules this model handles as units, by name (fsdp's sharded
        units): what `trainer.compile=blocks` compiles. None: it has none of its own (the
        model's repeated blocks are compiled)."""
        return None

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Gradients may be views into communication buckets: zero them, never drop them. A
        # sparse gradient is dropped: autograd would append the next one to it; so is the
        # gradient a sparse exchange hands on.
        # The dense ones are zeroed in one call per device and dtype, not one per parameter
        # (a GPT-2's 148 tensors: 32 against 140 us of host time a step on 2 cores; on a GPU
        # each call is also a kernel launch).
        for reducer in self.reducers:
            reducer.zero_()
        dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self.parameters():
            if p.grad is not None:
                if p.grad.is_sparse:
                    p.grad = None
                else:
                    dense.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        for grads in dense.values():
            torch._foreach_zero_(grads)

    def finish_gradient_sync(self) -> None:
        """Complete every gradient exchange started during backward."""
        for reducer in self.reducers:
            reducer.finish()

    def refresh_copies(self) -> None:
        """Collective: bring every rank's copy of every parameter up to date (after training;
        a parameter-server exchange leaves rows a rank does not own stale until it reads them)."""
        for reducer in self.reducers:
            reducer.refresh()

    def refresh_state_copies(self,
                             states: Mapping[str, Sequence[torch.Tensor | None]]) -> None:
        """Collective: what `refresh_copies` does for the weights, for tensors shaped like them
        (an optimizer's per-parameter state, `param_states()`: per kind, one tensor per
        parameter in `parameters()` order, None where there is none). A parameter-server
        exchange leaves a rank's state of the rows it does not own stale, as it leaves their
        weights: the owners' rows are copied in, in place, so every rank holds the owners'
        state (before a checkpoint keeps it). A no-op for parameters no such exchange holds."""
        by_param = {kind: dict(zip(map(id, self.parameters()), tensors, strict=True))
                    for kind, tensors in states.items()}
        for reducer in self.reducers:
            if isinstance(reducer, SparseGradientExchange):
                reducer.refresh_states(by_param)

    def exchange_report(self) -> dict[str, Any]:
        """Per sparse table: the mode and density of the last exchange (empty: none)."""
        report: dict[str, Any] = {}
        for reducer in self.reducers:
            report.update(reducer.report())
        return report

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def gathered_peak_bytes(self) -> int:
        """The most bytes of whole parameters a sharded model held at once since it was built
        (0: it gathers none)."""
        return 0

    def whole_gradient_peak_bytes(self) -> int:
        """The most bytes of whole gradients a sharded model kept at once before scattering
        them (ZeRO stage 1; 0: none)."""
        return 0


class Strategy:
    """A registered parallel strategy. Options come from the `strategy` config group."""

    name: ClassVar[str] = ""

    # Whether the strategy needs gradients summed over every replica (a replica optimizer
    # of the EASGD family cannot run with it).
    synchronous_only: ClassVar[bool] = False

    # Keyword arguments the runner passes itself (never config options).
    CONTEXT_ARGUMENTS: ClassVar[tuple[str, ...]] = ("pricing",)

    def __init__(self, bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0, *,
                 pricing: PricingContext = DEFAULT_PRICING) -> None:
        # Gradient buckets: the first one small so the first all-reduce starts early.
        self.bucket_cap_bytes = int(bucket_cap_mb * MB)
        self.first_bucket_bytes = int(first_bucket_mb * MB)
        self.pricing = pricing

    def check(self, grid: GridShape, global_batch: int) -> list[str]:
        """Every reason this strategy cannot run `global_batch` samples on `grid` (empty: fine)."""
        if self.bucket_cap_bytes <= 0 or self.first_bucket_bytes <= 0:
            return ["strategy.bucket_cap_mb and strategy.first_bucket_mb must be > 0"]
        if global_batch < grid.pc:
            return [f"trainer.batch_size={global_batch} is smaller than the {grid.pc} ranks that "
                    f"split the batch (grid.pc): each needs at least one sample"]
        if global_batch % grid.pc:
            return [f"trainer.batch_size={global_batch} is not divisible by the {grid.pc} ranks "
                    f"that split the batch (grid.pc)"]
        return []

    def check_model(self, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape) -> list[str]:
        """Every reason this strategy cannot transform `model` (built on the meta device) for
        samples of `sample_shape` on `grid`."""
        return []

    def reproduces_random_draws(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape) -> bool:
        """Whether a training forward on `grid` draws what one process draws (dropout masks,
        stochastic depth): on one rank it does; where ranks hold parts of the batch's rows or
        features, each draws for its part, unless the strategy makes it draw the whole."""
        return grid.size == 1

    def draws_rows_alike(self, model: nn.Module, sample_shape: tuple[int, ...],
                         grid: GridShape) -> bool:
        """Whether a training forward draws each row's masks by the row's place in the global
        batch, so that a step cut into micro-batches draws what the whole batch draws."""
        return False

    def recompute_problem(self, model: nn.Module, targets: list[str],
                          grid: GridShape) -> str | None:
        """Why recomputing the modules `targets` names in `model` in backward
        (`trainer.activation_checkpointing`) would not step as the run without it does, on
        `grid` (None: it would). Where the model group splits modules, their forward's
        collectives would run again in backward, which the predicted bytes do not hold."""
        if grid.pr > 1:
            return (f"strategy={self.name} on grid.pr={grid.pr} runs collectives in the forward "
                    f"of the modules it splits, which recomputation would run again in "
                    f"backward; recompute under grid.pr=1")
        return None

    def splits_parameters(self, grid: GridShape) -> bool:
        """Whether a rank holds only part of some parameter on `grid` (the model group splits
        weights): an optimizer whose update reads a whole parameter cannot run on the parts."""
        return grid.pr > 1

    def parallelize(self, model: nn.Module, sample_shape: tuple[int, ...], grid: ProcessGrid,
                    sync_replica_gradients: bool = True) -> ParallelModel:
        """Turn the sequential `model` (same seed on every rank), fed samples of `sample_shape`,
        into this rank's part.

        `sync_replica_gradients=False` leaves the batch replicas' gradients unsynchronised, for
        replica optimizers (the EASGD family) that let replicas agree by other means.
        """
        raise NotImplementedError

    def predict_ops(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                    global_batch: int) -> list[CommOp]:
        """The collectives rank 0 issues in one training step (the loss all-reduce excluded),
        from shapes alone: `model` may live on the meta device."""
        raise NotImplementedError

    def predicted_comm_bytes_per_step(self, model: nn.Module, sample_shape: tuple[int, ...],
                                      grid: GridShape, global_batch: int) -> int:
        return step_bytes(self.predict_ops(model, sample_shape, grid, global_batch))

    def predict_param_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                            grid: GridShape) -> int:
        """Parameter bytes rank 0 holds (every rank holds at most one row more per split layer)."""
        raise NotImplementedError

    def predict_memory(self, model: nn.Module, sample_shape: tuple[int, ...], grid: GridShape,
                       state_copies: int) -> dict[str, int]:
        """Rank 0's bytes held for the model in a step, by what holds them: its parameters,
        their gradients (one copy of each trained one), the optimizer's state
        (`state_copies` parameter-shaped tensors per parameter: momentum, Adam's moments) and
        the whole parameters a step gathers at once (a sharded strategy's; 0 here)."""
        params = self.predict_param_bytes(model, sample_shape, grid)
        return {"parameters": params, "gradients": params,
                "optimizer state": state_copies * params, "gathered parameters": 0}

    def predict_activation_bytes(self, model: nn.Module, sample_shape: tuple[int, ...],
                                 grid: GridShape, global_batch: int) -> int:
        """Bytes of layer outputs rank 0 keeps for backward in one step (an estimate: autograd's
        own saved tensors are not counted separately)."""
        raise NotImplementedError

    def predict_compute_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                                grid: GridShape, global_batch: int) -> float:
        """Rank 0's forward and backward compute per step, at this machine's rates: by
        default every layer's work shared evenly by the P ranks (each works on its piece of
        the rows, features or height); a strategy that knows its local shapes says better."""
        rows = -(-global_batch // grid.size)  # rank 0 holds the largest piece
        rates = self.pricing.rates
        return (sum(layer_seconds(layer, (rows, *shape), rates, input_grad=grad)
                    for layer, shape, grad in leaf_inputs(model, sample_shape)[0])
                + operators_seconds(model, sample_shape, rows, rates))

    def predict_step_seconds(self, model: nn.Module, sample_shape: tuple[int, ...],
                             grid: GridShape, global_batch: int) -> float:
        """Predicted seconds of a training step: compute (slowed where ranks share cores),
        the α–β time of every collective rank 0 issues (the loss's included), the optimizer's
        passes over this rank's parameters."""
        return predict_step(self, model, sample_shape, grid, global_batch).total_s

    @property
    def bucket_caps(self) -> tuple[int, int]:
        return self.bucket_cap_bytes, self.first_bucket_bytes

    def exchanged_once(self, op: CommOp) -> bool:
        """Whether `op` (of `predict_ops`) is issued once per step however many micro-batches
        it has (a gradient exchange), rather than by every micro-batch's forward and backward
        (an activation's collective): the gradient buckets' all-reduces are."""
        return op.op == "iallreduce"


@dataclass(frozen=True)
class StepPrediction:
    """A training step's predicted seconds, by part."""

    compute_s: float  # forward, backward, loss and update, slowed where ranks share cores
    comm_s: float  # rank 0's collectives: α–β and the runner's cost of each call
    wait_s: float  # what they wait for peers sharing cores (0 with a core per rank)
    total_s: float


# An optimizer's update reads and writes a parameter's tensors a few times (weights, gradient,
# momentum): passes over the parameter bytes, as SGD with momentum makes them.
UPDATE_PASSES = 5
UPDATE_CALLS = 4  # and operator calls per parameter tensor (gradient scaling, momentum, step)
# Passes beyond those of an optimizer that keeps more state: Adam's two moments, the square
# root and the division (torch's per-tensor kernels, one core: Adam 4.1 ms, AdamW 4.6 ms against
# SGD with momentum's 1.1 ms on 6.9 MB of parameters at 13 GB/s).
EXTRA_UPDATE_PASSES = {"adam": 5.7, "adamw": 6.6}


def update_passes(optimizer: str) -> float:
    """Passes over the parameter bytes of a training step's update by `optimizer`."""
    return UPDATE_PASSES + EXTRA_UPDATE_PASSES.get(optimizer, 0.0)


def predict_rank_bytes(strategy: Strategy, model: nn.Module, sample_shape: tuple[int, ...],
                       grid: GridShape, global_batch: int, state_copies: int) -> int:
    """Rank 0's bytes for the model in a step: what `Strategy.predict_memory` holds, and the
    outputs kept for backward with their gradients (twice the activation bytes)."""
    held = strategy.predict_memory(model, sample_shape, grid, state_copies)
    return sum(held.values()) + 2 * strategy.predict_activation_bytes(
        model, sample_shape, grid, global_batch)


def predict_step(strategy: Strategy, model: nn.Module, sample_shape: tuple[int, ...],
                 grid: GridShape, global_batch: int) -> StepPrediction:
    ops = strategy.predict_ops(model, sample_shape, grid, global_batch)
    ops += loss_op(grid.size, 4)
    context = strategy.pricing
    comm = comm_seconds(ops, context.costs)
    rates = context.rates
    compute = strategy.predict_compute_seconds(model, sample_shape, grid, global_batch)
    # the loss on rank 0's output rows (the row contract: the largest piece over all P)
    rows = Partition(Partition(global_batch, grid.pc).sizes[0], grid.pr).sizes[0]
    classes = math.prod(leaf_inputs(model, sample_shape)[1])
    tensors = sum(1 for _ in model.parameters())
    update = (rates.elementwise_seconds(
        update_passes(context.optimizer)
        * strategy.predict_param_bytes(model, sample_shape, grid))
        + UPDATE_CALLS * tensors * rates.dispatch)
    compute = ((compute + loss_seconds(rows, classes, rates) + update + rates.step_overhead)
               * context.slowdown)
    wait = wait_seconds(ops, context.costs, context.slowdown)
    return StepPrediction(compute, comm, wait, compute + comm + wait)


def operators_seconds(model: nn.Module, sample_shape: tuple[int, ...], rows: int,
                      rates: ComputeRates,
                      share: Callable[[nn.Module], float] | None = None) -> float:
    """Forward + backward seconds of the operators the modules' own `forward`s run between
    their leaf modules (`strategies.probe.operator_calls`), on `rows` samples; `share` gives the
    part of each operator's work a rank runs, by the module that runs it (1: all)."""
    with torch.random.fork_rng(devices=[]):
        calls = operator_calls(model, sample_shape)
    return sum(operator_seconds(c.call, rows, rates, share(c.owner) if share else 1.0)
               for c in calls)


def leaf_inputs(model: nn.Module, sample_shape: tuple[int, ...]
                ) -> tuple[list[tuple[nn.Module, tuple[int, ...], bool]], tuple[int, ...]]:
    """Each leaf module a sample passes through, with the per-sample shape of its input and
    whether that input has a gradient (a parameter came before it), in the order they run;
    and the per-sample shape of the model's output (one forward: `strategies.probe`)."""
    seen = probe(model, sample_shape)
    return [(c.module, c.input_shape, c.input_grad) for c in seen.calls], seen.output_shape


def split_model_exchanges(grid: ProcessGrid, split: list[nn.Parameter],
                          replicated: list[nn.Parameter], sync_replica_gradients: bool,
                          bucket_cap_bytes: int, first_bucket_bytes: int
                          ) -> list[GradientExchange]:
    """The gradient exchanges of a model split over the model group: a split parameter's
    gradient summed over its batch group, a replicated one's over every rank, both scaled by
    1/P (the losses of all P ranks make the global mean). Without replica synchronisation (the
    EASGD family) each model group is a replica on its own: its loss is the mean over its Pr
    ranks, split gradients stay as they are and replicated ones are summed over the group."""
    if sync_replica_gradients:
        split_comm, replicated_comm, scale = grid.batch, grid.world, 1.0 / grid.size
    else:
        split_comm = CountedComm(None, grid.counter, "self")
        replicated_comm, scale = grid.model, 1.0 / grid.pr
    caps = (bucket_cap_bytes, first_bucket_bytes)
    return (gradient_exchange(split, split_comm, scale, *caps)
            + gradient_exchange(replicated, replicated_comm, scale, *caps))


def gradient_exchange(params: list[nn.Parameter], comm: CountedComm, scale: float,
                      bucket_cap_bytes: int, first_bucket_bytes: int) -> list[GradientExchange]:
    """Sum `params`' gradients over `comm` and scale them; nothing when there is nothing to do."""
    if not params or (comm.size == 1 and scale == 1.0):
        return []
    return [GradientBuckets(params, comm, scale, bucket_cap_bytes, first_bucket_bytes)]



def accumulated_ops(strategy: Strategy, model: nn.Module, sample_shape: tuple[int, ...],
                    grid: GridShape, global_batch: int, micro_batches: int) -> list[CommOp]:
    """The collectives rank 0 issues in a step of `micro_batches` micro-batches
    (`trainer.accumulate_steps`): each micro-batch's activation collectives, for a global batch
    of `global_batch / micro_batches` rows, and the gradient exchanges once, of the whole
    step's gradients."""
    whole = strategy.predict_ops(model, sample_shape, grid, global_batch)
    if micro_batches == 1:
        return whole
    piece = strategy.predict_ops(model, sample_shape, grid, global_batch // micro_batches)
    return ([op for op in piece if not strategy.exchanged_once(op)] * micro_batches
            + [op for op in whole if strategy.exchanged_once(op)])
