"""One assembly: a run's parts built from a parsed config, for every tool that needs them.

dataset → its spec → the plain model (on the CPU, or on the meta device for checks and plans)
→ the strategy (given the machine's costs at construction) → the replica optimizer's class.
Training (`runner.training.loop`: `assemble`), validation before any process starts
(`runner.cli.validation`: `check_parts`, which builds what it can and names why the rest does not,
and hands its parts on to the machine's checks in `runner.cli.preflight`), the planner and the
benchmarks all build through here, so a change to how a run is put together is made once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from runner.config.options import option_problems, with_defaults
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
from runner.core.registry import UnknownPluginError
from runner.cost.collectives import DEFAULT_COSTS, MachineCosts
from runner.cost.compute import DEFAULT_RATES, ComputeRates
from runner.optim.sync import ReplicaOptimizer
from runner.training.precision import HALF_TYPES
from runner.zoo.datasets import DatasetSpec
from runner.zoo.models import built_from_config, configured_model
from runner.zoo.pretrained import (
    CONFIG_FILE,
    PretrainedConfigError,
    architecture,
    pretrained_model,
)
from runner.zoo.userdata import TargetDataset
from strategies import STRATEGIES, Strategy
from strategies.base import DEFAULT_PRICING, PricingContext
from strategies.probe import logits_of, reads_tokens

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
    if TOKEN_INPUTS in getattr(factory, "fixed_inputs", ()):
        _fits_pretrained(accepted, spec)
        return {}
    extra: dict[str, Any] = {TOKEN_INPUTS: spec.vocab_size}
    if spec.padding_id is not None and "padding_idx" in accepted:
        extra["padding_idx"] = spec.padding_id
    return extra


def _fits_pretrained(accepted: Mapping[str, inspect.Parameter], spec: DatasetSpec) -> None:
    """A dataset with more token ids than a pretrained model's fixed vocabulary: ValueError
    naming both (other classes than its labels: the model's output check names them)."""
    vocab = accepted[TOKEN_INPUTS].default
    if spec.vocab_size is not None and isinstance(vocab, int) and spec.vocab_size > vocab:
        raise ValueError(f"the dataset has {spec.vocab_size} token ids and the weights' "
                         f"vocabulary {vocab} (dataset.vocab_size={vocab} fits it)")


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
PRETRAINED = "pretrained"  # model=pretrained: the model of a weights directory's config.json


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
                             "choose a token dataset (dataset=token_file, dataset=text, "
                             "dataset=kjv or dataset=tokens)")
        return form()
    return dataset


def model_factory(plugin: Plugin) -> Callable[..., nn.Module]:
    """The registered model, or the user's class or function (`_target_`); a class built from
    a configuration object (the transformers library's) as a factory of its fields, those of
    the weights' config.json where `model.weights` is a transformers directory; `model=
    pretrained`: the class that config.json names."""
    if plugin.target is None and plugin.name == PRETRAINED:
        if plugin.weights is None:
            raise PretrainedConfigError("give the weights' directory: model.weights=DIR")
        return pretrained_model(architecture(plugin.weights), plugin.weights)
    factory = resolve(MODELS, plugin.name, plugin.target)
    if not callable(factory):
        raise UserCodeError(f"{plugin.target} is not callable")
    if isinstance(factory, type) and built_from_config(factory):
        if plugin.weights is not None and (Path(plugin.weights) / CONFIG_FILE).is_file():
            return pretrained_model(factory, plugin.weights)
        return configured_model(factory)
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
    fixed = getattr(factory, "fixed_inputs", ())  # pretrained: the weights' vocabulary, labels
    given = {k: v for k, v in inputs.items()
             if k in accepted and k not in plugin.options and k not in fixed}
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


def optimizer_kind(plugin: Plugin) -> str:
    """The optimizer's name for pricing its update: a registered one's name, a `_target_`'s
    class name in lower case (`torch.optim.AdamW`: "adamw")."""
    return plugin.target.rsplit(".", 1)[-1].lower() if plugin.target else plugin.name


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
                        rates, run.trainer.batch_size, slowdown,
                        optimizer_kind(run.optimizer), run.trainer.accumulate_steps,
                        run.trainer.activation_checkpointing)),
                    optimizer_class(run.optimizer))


# -- the parts as far as they build, and why the rest do not -----------------------------------


@dataclass
class CheckedParts:
    """A run's parts as validation builds them before any process starts: each one that could
    be built (the model is `probe_model`'s, on the CPU when small, else on the meta device),
    and every reason one could not. The machine's checks (`runner.cli.preflight`) read the
    same parts, so a config is built once on its way to the ranks."""

    dataset: Any = None
    spec: DatasetSpec | None = None
    model: nn.Module | None = None
    strategy: Strategy | None = None
    optimizer_cls: type[ReplicaOptimizer] | None = None
    optimizer_options: dict[str, Any] = field(default_factory=dict)  # with its defaults
    problems: list[str] = field(default_factory=list)


def check_parts(run: RunConfig) -> CheckedParts:
    """Every part of `run` that builds, each plugin's options checked against its signature
    first, the model pushed through two of the dataset's samples."""
    parts = CheckedParts()
    problems = parts.problems
    try:
        import_modules(run.plugins)
    except UserCodeError as exc:
        problems.append(str(exc))
    load_plugins()

    def lookup(key: str, find: Callable[[Plugin], Any], plugin: Plugin) -> Any:
        try:
            return find(plugin)
        except (UnknownPluginError, UserCodeError, PretrainedConfigError) as exc:
            problems.append(f"{plugin.shown(key)}: {exc}")
        return None

    # the registered class, or the user's own function (what the options are arguments of)
    dataset_cls = lookup("dataset", lambda p: resolve(DATASETS, p.name, p.target), run.dataset)
    factory = lookup("model", model_factory, run.model)
    optimizer_cls = lookup("optimizer", optimizer_class, run.optimizer)
    strategy_cls = lookup("strategy", lambda p: STRATEGIES.get(p.name), run.strategy)
    if dataset_cls is not None and not _add(problems, _options_problems("dataset", run.dataset,
                                                                        dataset_cls)):
        try:
            parts.dataset = build_dataset(run.dataset, objective_of(run.model))
            parts.spec = parts.dataset.spec()
            check = getattr(parts.dataset, "check", None)  # a user's data: checked here, once
            if check is not None:
                check()
        except (TypeError, ValueError) as exc:
            parts.spec = None
            problems.append(f"{run.dataset.shown('dataset')}: {exc}")
        except SystemExit as exc:  # the user's code ended the head's check: named, not silent
            parts.spec = None
            problems.append(_exit_problem(run.dataset.shown("dataset"), exc))
    if factory is not None and not _add(problems, _options_problems(
            "model", run.model, factory, MODEL_INPUTS)) and parts.spec is not None:
        parts.model = _model_on_samples(run.model, parts.spec, dtype_of(run), problems)
    if optimizer_cls is not None and not _add(problems, _options_problems(
            "optimizer", run.optimizer, optimizer_cls, OPTIMIZER_INPUTS)):
        options = with_defaults(optimizer_cls, run.optimizer.options, OPTIMIZER_INPUTS)
        if not _add(problems, optimizer_cls.check(**options)):
            parts.optimizer_cls, parts.optimizer_options = optimizer_cls, options
    if strategy_cls is not None and not _add(problems, option_problems(
            "strategy", strategy_cls, run.strategy.options, Strategy.CONTEXT_ARGUMENTS)):
        parts.strategy = build_strategy(run.strategy, PricingContext(
            compute_dtype=HALF_TYPES.get(run.trainer.precision),
            global_batch=run.trainer.batch_size,
            accumulate_steps=run.trainer.accumulate_steps,
            activation_checkpointing=run.trainer.activation_checkpointing))
    return parts


def _add(problems: list[str], found: list[str]) -> bool:
    """`found` added to `problems`; whether there were any."""
    problems += found
    return bool(found)


def _options_problems(key: str, plugin: Plugin, factory: Any,
                      reserved: tuple[str, ...] = ()) -> list[str]:
    """`option_problems`, also for a user's callable whose signature cannot be read."""
    label = plugin.shown(key) if plugin.target else key
    try:
        return option_problems(key, factory, plugin.options, reserved, label)
    except (TypeError, ValueError):
        return []  # no signature (a builtin): its own call will say what is wrong


def _exit_problem(shown: str, exc: SystemExit) -> str:
    """The line for the user's code calling `sys.exit` while the head builds or runs it to check
    the config (which would end the head, or a whole sweep, with nothing said)."""
    from runner.records.process import exit_words

    return f"{shown}: the user's code {exit_words(exc)[1]} while the head checked the config"


def _options_shown(plugin: Plugin) -> str:
    return f"model options: {', '.join(f'{k}={v}' for k, v in plugin.options.items())}"


def _model_on_samples(plugin: Plugin, spec: DatasetSpec, dtype: torch.dtype,
                      problems: list[str]) -> nn.Module | None:
    """The probe model (`probe_model`) with two samples pushed through it, or None (and the
    reason in `problems`) when it cannot be built or does not fit the dataset."""
    try:
        net = probe_model(plugin, spec, dtype)
    except ValueError as exc:  # the dataset's inputs are not what the model reads
        problems.append(f"{plugin.shown('model')}: {exc}")
        return None
    except SystemExit as exc:  # the user's code ended the head's check: named, not silent
        problems.append(_exit_problem(plugin.shown("model"), exc))
        return None
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "negative dimension" in first:  # torch's words for a width below 0
            problems.append(f"{plugin.shown('model')}: every width and channel count must be "
                            f">= 1 ({_options_shown(plugin)})")
        else:
            problems.append(f"{plugin.shown('model')} cannot be built for the dataset's inputs "
                            f"of shape {tuple(spec.input_shape)}: {first}")
        return None
    empty = [(name, tuple(p.shape)) for name, p in net.named_parameters() if p.numel() == 0]
    if empty:
        name, shape = empty[0]
        layer = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
        problems.append(f"{plugin.shown('model')}: {name} ({type(layer).__name__}) would have "
                        f"shape {shape}: every width and channel count must be >= 1 "
                        f"({_options_shown(plugin)})")
        return None
    input_dtype = torch.long if spec.vocab_size is not None else dtype
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    try:
        with torch.no_grad():
            out = net(torch.zeros(2, *spec.input_shape, dtype=input_dtype, device=device))
    except SystemExit as exc:
        problems.append(_exit_problem(plugin.shown("model"), exc))
        return None
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        problems.append(f"{plugin.shown('model')} does not fit the dataset's inputs of shape "
                        f"{tuple(spec.input_shape)}: {first}")
        return None
    try:
        out = logits_of(out)
    except TypeError as exc:  # an output without a tensor of scores
        problems.append(f"{plugin.shown('model')}: {exc}")
        return None
    expected = (2, *spec.target_shape, spec.num_classes)
    if tuple(out.shape) != expected:
        what = (f"the dataset has {spec.num_classes} classes" if not spec.target_shape else
                f"next-token targets need logits of shape {expected[1:]} (a score per "
                f"position and token id)")
        problems.append(f"{plugin.shown('model')} gives outputs of shape {tuple(out.shape[1:])}, "
                        f"{what}")
        return None
    return net
