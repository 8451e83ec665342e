"""One assembly: a run's parts built from a parsed config, for every tool that needs them.

dataset → its spec → the plain model (on the CPU, or on the meta device for checks and plans)
→ the strategy (given the machine's costs at construction) → the replica optimizer's class.
Training (`runner.training.loop`), validation before any process starts (`runner.cli.validation`),
the run-directory checks (`runner.cli.preflight`), the planner and the benchmarks all build through
here, so a change to how a run is put together is made once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from runner.config.registry import (
    DATASETS,
    MODELS,
    OPTIMIZERS,
    UserCodeError,
    import_modules,
    load_plugins,
    resolve,
)
from runner.config.schema import Plugin, RunConfig
from runner.core.compute import DEFAULT_RATES, ComputeRates
from runner.core.cost import DEFAULT_COSTS, MachineCosts
from runner.optim.sync import ReplicaOptimizer
from runner.training.precision import HALF_TYPES
from runner.zoo.datasets import DatasetSpec
from runner.zoo.userdata import TargetDataset
from strategies import STRATEGIES, Strategy
from strategies.base import DEFAULT_PRICING, PricingContext
from strategies.probe import reads_tokens

TOKEN_INPUTS = "vocab_size"  # the argument a model that embeds token ids takes
# What a model factory is given besides its config options (not options a user sets).
MODEL_INPUTS = ("input_shape", "num_classes", "vocab_size", "padding_idx")
# What a replica optimizer is built with besides its config options.
OPTIMIZER_INPUTS = ("model", "grid", "total_steps")


def _accepted(factory: Callable[..., Any]) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: it takes only options
        return {}


def dataset_arguments(factory: Callable[..., nn.Module], spec: DatasetSpec) -> dict[str, Any]:
    """What the dataset (its `DatasetSpec`) tells `factory` besides shapes: the vocabulary of
    a token dataset and its padding id. Raises ValueError when the model cannot take the
    dataset's inputs at all."""
    accepted = _accepted(factory)
    embeds = TOKEN_INPUTS in accepted
    if spec.vocab_size is not None and not embeds:
        raise ValueError("the dataset gives token ids, which this model cannot read; choose a "
                         "model that embeds them (model=bag_classifier)")
    if spec.vocab_size is None and embeds:
        raise ValueError("the model embeds token ids; choose a token dataset (dataset=tokens)")
    if not embeds:
        return {}
    extra: dict[str, Any] = {TOKEN_INPUTS: spec.vocab_size}
    if spec.padding_id is not None and "padding_idx" in accepted:
        extra["padding_idx"] = spec.padding_id
    return extra


def import_plugins(run: RunConfig) -> None:
    """The built-in plugins and the modules the run's `plugins` list names (every rank, before
    it builds anything: a model registered in the user's module is then known everywhere)."""
    import_modules(run.plugins)


def dataset_factory(plugin: Plugin) -> Callable[..., Any]:
    """What the dataset plugin is built with: a registered dataset class, or the user's
    function (`_target_`) wrapped so that it answers like one."""
    factory = resolve(DATASETS, plugin.name, plugin.target)
    if plugin.target is None:
        return cast(Callable[..., Any], factory)
    if not callable(factory):
        raise UserCodeError(f"{plugin.target} is not callable")
    return functools.partial(TargetDataset, factory, plugin.target)


OBJECTIVES = ("classify", "next_token")


def objective_of(model: Plugin) -> str:
    """What the model learns: `classify` (a class per sample), or `next_token` (a language
    model: the token that follows each position) where the model's factory says so with an
    `objective` attribute (`model=gpt`; a user's class or function may carry one too)."""
    try:
        factory = model_factory(model)
    except Exception:  # an unknown model: validation names it
        return "classify"
    objective = getattr(factory, "objective", "classify")
    return objective if objective in OBJECTIVES else "classify"


def build_dataset(plugin: Plugin, objective: str = "classify") -> Any:
    """The dataset plugin (nothing loaded yet: `spec()` is cheap, `load()` reads the data);
    for a `next_token` objective its next-token form (`dataset.next_token()`), which a token
    dataset offers (`kjv`, `tokens`)."""
    dataset = dataset_factory(plugin)(**plugin.options)
    if objective == "next_token":
        form = getattr(dataset, "next_token", None)
        if form is None:
            raise ValueError("it has no next-token form, which a language model trains on: "
                             "choose a token dataset (dataset=kjv or dataset=tokens)")
        return form()
    return dataset


def model_factory(plugin: Plugin) -> Callable[..., nn.Module]:
    factory = resolve(MODELS, plugin.name, plugin.target)
    if not callable(factory):
        raise UserCodeError(f"{plugin.target} is not callable")
    return cast(Callable[..., nn.Module], factory)


def build_model(plugin: Plugin, input_shape: Sequence[int], num_classes: int,
                extra: Mapping[str, Any], dtype: torch.dtype = torch.float32,
                device: str | None = None) -> nn.Module:
    """The plain model, built in float32 from the current seed and then converted (the same
    initial values in either dtype); `device="meta"`: shapes only, no memory. The dataset's
    shapes are given to the arguments the factory has of those names (a user's class may have
    none of them)."""
    factory = model_factory(plugin)
    accepted = _accepted(factory)
    inputs = {"input_shape": tuple(input_shape), "num_classes": num_classes, **extra}
    given = {k: v for k, v in inputs.items() if k in accepted and k not in plugin.options}
    with torch.device(device) if device else contextlib.nullcontext():
        model = factory(**given, **plugin.options)
    if not isinstance(model, nn.Module):
        made = type(model).__name__
        raise UserCodeError(f"{plugin.name} returned a {made}, not a torch.nn.Module")
    return model.to(dtype)


def model_for(plugin: Plugin, spec: DatasetSpec, dtype: torch.dtype = torch.float32,
              device: str | None = None) -> nn.Module:
    """The plain model for the dataset described by `spec` (declared to read token ids where
    the dataset gives them: every shape probe then feeds it int64 samples)."""
    extra = dataset_arguments(model_factory(plugin), spec)
    model = build_model(plugin, spec.input_shape, spec.num_classes, extra, dtype, device)
    if spec.vocab_size is not None:
        reads_tokens(model)
    return model


# A model with more parameter bytes than this is probed for shapes on the meta device, whose
# kernels cost 1-2 s to load the first time (they import torch._dynamo and sympy); a smaller
# one is built on the CPU, where a forward of a sample costs milliseconds.
SMALL_MODEL_BYTES = 256 << 20


def probe_model(plugin: Plugin, spec: DatasetSpec, dtype: torch.dtype = torch.float32
                ) -> nn.Module:
    """The plain model for working out shapes (a forward of a sample, the planner's counts):
    real on the CPU when it is small, on the meta device when it is large, and for real where
    the meta device cannot build it. Built from a forked RNG: the caller's random state is left
    as it was."""
    with warnings.catch_warnings():  # torch's words for zero-size layers: validation names them
        warnings.simplefilter("ignore")
        try:
            meta: nn.Module | None = model_for(plugin, spec, dtype, device="meta")
        except Exception:  # a constructor that reads or copies its tensors (or a real error,
            meta = None  # which the real build below raises again): built for real, once
        if meta is not None and (sum(p.numel() * p.element_size() for p in meta.parameters())
                                 > SMALL_MODEL_BYTES):
            return meta
        with torch.random.fork_rng(devices=[]):
            return model_for(plugin, spec, dtype)


def build_strategy(plugin: Plugin, pricing: PricingContext = DEFAULT_PRICING) -> Strategy:
    """The strategy with its options and what the runner knows for its cost model: the
    machine's costs, the data's rows, the autocast type, the compute rates, the global batch
    and how much ranks sharing cores slow each other (`PricingContext`)."""
    load_plugins()  # the built-in strategies; a user's come with the run's `plugins`
    return STRATEGIES.get(plugin.name)(**plugin.options, pricing=pricing)


def optimizer_class(plugin: Plugin) -> type[ReplicaOptimizer]:
    """The replica optimizer: registered by name, or by `_target_` a `torch.optim` class (run
    synchronously: gradients averaged over the replicas, then its own update) or a gridrun
    `ReplicaOptimizer` of the user's."""
    found = resolve(OPTIMIZERS, plugin.name, plugin.target)
    if isinstance(found, type) and issubclass(found, ReplicaOptimizer):
        return found
    if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
        from runner.optim.sync import wrap_torch_optimizer

        return wrap_torch_optimizer(found)
    raise UserCodeError(f"{plugin.name} is neither a torch.optim.Optimizer class nor a "
                        f"gridrun ReplicaOptimizer")


def rows_touched(dataset: Any) -> Callable[[int], float] | None:
    """Distinct rows of an embedding table that a number of samples touch (token datasets)."""
    return getattr(dataset, "expected_unique_tokens", None)


def dtype_of(run: RunConfig) -> torch.dtype:
    dtype = getattr(torch, run.trainer.dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


@dataclass(frozen=True)
class RunParts:
    """What a run is made of, before any communication: the same on every rank."""

    dataset: Any
    spec: DatasetSpec
    model: nn.Module  # the plain model (this rank's strategy makes the distributed one)
    strategy: Strategy
    optimizer_cls: type[ReplicaOptimizer]


def assemble(run: RunConfig, costs: MachineCosts = DEFAULT_COSTS,
             device: str | None = None, rates: ComputeRates = DEFAULT_RATES,
             slowdown: float = 1.0) -> RunParts:
    """Every part of `run`. On the CPU the model's weights come from the current torch seed;
    on `device="meta"` it has shapes only (planning, preflight)."""
    import_plugins(run)
    dataset = build_dataset(run.dataset, objective_of(run.model))
    spec = dataset.spec()
    return RunParts(dataset, spec, model_for(run.model, spec, dtype_of(run), device),
                    build_strategy(run.strategy, PricingContext(
                        costs, rows_touched(dataset), HALF_TYPES.get(run.trainer.precision),
                        rates, run.trainer.batch_size, slowdown)),
                    optimizer_class(run.optimizer))
