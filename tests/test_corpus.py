"""Models nobody here wrote, on the head (no ranks): every corpus model under every strategy
is accepted or refused in lines that name what to do instead, never a traceback; the memory
estimate, the planner's counts and `strategy=auto` work from one real forward of the model.
tests/mpi/check_corpus.py trains the accepted ones on real ranks against one process."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.cli.preflight import memory_estimate
from runner.cli.validation import validate, validate_parts
from runner.config.schema import ConfigError
from runner.training import assembly
from strategies import PricingContext
from strategies.probe import draw_plan, logits_of, probe, random_draws, sample_dtype
from tests import corpus_models as corpus
from tests.conftest import assert_ok, run_cli_together, train_losses

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
MODELS = [*corpus.IMAGE_MODELS, *corpus.TOKEN_MODELS,
          *[pytest.param(name, marks=pytest.mark.skipif(not HAVE_TRANSFORMERS,
                                                        reason="transformers not installed"))
            for name in corpus.TRANSFORMERS_MODELS]]


def verdict(model: str, strategy: str, pr: int, pc: int, **trainer: object) -> list[str]:
    """The head's validation problems of the run (empty: accepted)."""
    config = corpus.run_config(model, strategy, pr, pc)
    config["trainer"].update(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate(OmegaConf.create(config))
        except ConfigError as exc:
            return exc.problems
    return []


@pytest.mark.parametrize("model", MODELS)
def test_every_strategy_accepts_or_refuses_by_name(model: str) -> None:
    for strategy, pr, pc in corpus.CASES:
        problems = verdict(model, strategy, pr, pc)
        for problem in problems:
            assert "\n" not in problem, problem
            assert "strategy=" in problem, f"{model} {strategy}: {problem}"
        if strategy == "data" and model not in corpus.REFUSED_BY_DATA:
            assert problems == [], f"{model}: strategy=data refuses {problems}"


@pytest.mark.parametrize("model", MODELS)
def test_the_memory_estimate_and_the_plan_come_from_a_real_forward(model: str) -> None:
    config = corpus.run_config(model, "data", 1, 1)  # one process: what the head estimates
    run, parts = validate_parts(OmegaConf.create(config))
    spec, net = parts.spec, parts.model
    assert spec is not None and net is not None
    needs = memory_estimate(run, parts)
    assert needs["activations"] > 0 and needs["parameters"] > 0
    seen = probe(net, spec.input_shape)
    assert seen.output_shape[-1] in (spec.num_classes, 50)  # classes, or the vocabulary
    strategy = assembly.build_strategy(run.strategy, PricingContext(global_batch=8))
    assert strategy.predict_step_seconds(net, spec.input_shape, run.grid, 8) > 0


def test_outputs_are_found_in_tuples_dicts_and_dataclasses() -> None:
    logits = torch.ones(2, 3)
    assert logits_of((logits, torch.zeros(2))) is logits
    assert logits_of({"features": torch.zeros(2), "logits": logits}) is logits
    assert logits_of(corpus.ClassifierOutput(logits, torch.zeros(2))) is logits
    with pytest.raises(TypeError, match="returns a str"):
        logits_of("scores")


def test_a_batch_norm_subclass_is_refused_where_it_would_be_replaced() -> None:
    problems = verdict("ScaledBNNet", "grid", 2, 2)
    assert problems and all("ScaledBNNet" in p for p in problems)
    # in a Sequential the split layers would swap it for a plain BatchNorm: named instead
    from strategies.layers.split import unsupported_layers

    layers = [nn.Conv2d(3, 4, 3), corpus.ScaledBatchNorm(4), nn.ReLU()]
    assert any("ScaledBatchNorm subclasses BatchNorm2d" in p and "strategy=data" in p
               for p in unsupported_layers(layers))


def test_sync_batch_norm_is_a_batch_norm_to_every_strategy() -> None:
    for strategy, pr, pc in corpus.CASES:
        if strategy != "domain":  # its BatchNorm comes before any split layer there
            assert verdict("SyncBNNet", strategy, pr, pc) == [], strategy


def test_a_model_the_meta_device_cannot_build_is_built_for_real() -> None:
    assert verdict("MetaUnfriendly", "grid", 2, 2) == []


def test_random_draws_are_named_and_refused_where_ranks_draw_apart() -> None:
    net = corpus.StochasticDepth((3, 8, 8), 4)
    before = torch.random.get_rng_state()
    draws = random_draws(net, (3, 8, 8))
    assert torch.equal(before, torch.random.get_rng_state())
    assert "drop_path (DropPath): bernoulli_" in draws, draws
    assert any("(Dropout): dropout(p=0.25)" in d for d in draws), draws
    assert random_draws(corpus.SqueezeExcite((3, 8, 8), 4), (3, 8, 8)) == []
    # gridrun's VGG keeps dropout 0.5: grid 2x2 would draw each batch group's own masks
    config = corpus.run_config("SqueezeExcite", "grid", 2, 2)
    config["model"] = {"name": "vgg", "config": [4, "M", 6], "hidden": 16}
    with pytest.raises(ConfigError) as refused:
        validate(OmegaConf.create(config))
    assert "draws random numbers per rank" in str(refused.value)
    assert "(Dropout): dropout(p=0.5)" in str(refused.value)
    config["model"]["dropout"] = 0.0
    validate(OmegaConf.create(config))


def test_auto_chooses_data_for_what_nothing_splits_and_refuses_in_one_line_where_data_cannot(
        ) -> None:
    assert verdict("ShapeControlFlow", "auto", 1, 2) == []
    problems = verdict("ShapeControlFlow", "auto", 2, 2)
    assert len(problems) == 1 and problems[0].startswith(
        "strategy=auto: no strategy runs ShapeControlFlow")
    assert "strategy=data trains it whole on grid.pr=1 grid.pc=4" in problems[0]
    # a ViT's MLPs split by the plan derived from its structure: auto runs it on 2 x 2
    assert verdict("ViTTiny", "auto", 1, 2) == []
    assert verdict("ViTTiny", "auto", 2, 2) == []


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed")
def test_a_transformers_language_model_is_probed_with_token_ids() -> None:
    net = corpus.hf_gpt2(50, (8,))
    assert probe(net, (8,)).output_shape == (8, 50)
    assert any("attention dropout" in d or "dropout(p=0.1)" in d
               for d in random_draws(net, (8,)))


def test_draws_over_rows_in_another_dim_are_refused_by_module_under_data() -> None:
    problems = verdict("SeqFirstEncoder", "data", 1, 2)
    assert len(problems) == 3, problems
    assert all(p.startswith("strategy=data cannot draw one process's random numbers in "
                            "layer.dropout") and "its batch is not dim 0" in p
               for p in problems), problems
    # batch first, the same layer's draws (attention dropout included) are cut into rows
    assert verdict("TorchEncoder", "data", 1, 2) == []
    plan = draw_plan(corpus.TorchEncoder(50), (8,))
    assert plan.problems == () and len(plan.cuts) == 4 and None not in plan.cuts


def test_a_draw_of_a_fixed_shape_is_left_alone() -> None:
    class Jitter(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * (1 + 0.1 * torch.rand(1, dtype=x.dtype)) + 0.01 * torch.rand_like(x)

    plan = draw_plan(nn.Sequential(nn.Linear(4, 4), Jitter()), (4,))
    assert plan.cuts == (None, 1) and plan.problems == ()


def test_timms_batch_norm_subclass_trains_through_the_command_line_as_one_process(
        tmp_path: Path) -> None:
    """timm's BatchNormAct2d pattern end to end: the head's checks (memory estimate, preflight) of a
    model whose children are no chain, at P = 1 and under data 1 × 2, and the same losses."""
    common = ["model._target_=tests.corpus_models.BNActNet", "dataset=synthetic",
              "dataset.shape=[3,8,8]", "dataset.classes=4", "dataset.samples=64",
              "strategy=data", "grid.pr=1", "trainer.steps=3", "trainer.batch_size=8",
              "trainer.dtype=float64"]
    jobs = [[*common, f"grid.pc={pc}", f"hydra.run.dir={tmp_path / str(pc)}"] for pc in (1, 2)]
    for result in run_cli_together(*jobs):
        assert_ok(result)
    one, two = (train_losses(tmp_path / str(pc)) for pc in (1, 2))
    assert len(one) == 3
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True)) <= 1e-12


def test_a_draw_inside_one_kernel_is_refused_under_data_by_module() -> None:
    from runner.core import GridShape
    from strategies.data import DataParallel

    model = nn.Sequential(nn.Linear(4, 4), nn.RReLU())
    problems = DataParallel().check_model(model, (4,), GridShape(1, 2))
    assert problems == ["strategy=data cannot draw one process's random numbers in 1 (RReLU): "
                        "rrelu's slopes, drawn inside one kernel; set its rate to 0 (or train "
                        "on one rank)"]
    assert DataParallel().check_model(model, (4,), GridShape(1, 1)) == []
    assert sample_dtype(corpus.TokenClassifier(50, 4)) == torch.float32  # its modules can't tell


def test_dropout_and_stochastic_depth_resume_on_another_grid_as_they_ran(tmp_path: Path) -> None:
    """Every row's masks come from the run's generator (checkpointed) and the row's index: a
    run of 1 x 2 resumed on 1 x 4 draws what it would have drawn."""
    from tests.conftest import run_cli

    common = ["model._target_=tests.corpus_models.StochasticDepth", "dataset=synthetic",
              "dataset.shape=[3,8,8]", "dataset.classes=4", "dataset.samples=64",
              "strategy=data", "grid.pr=1", "trainer.steps=6", "trainer.batch_size=8",
              "trainer.dtype=float64", "trainer.eval_every=1000"]
    assert_ok(run_cli(*common, "grid.pc=2", "trainer.checkpoint_every=3",
                      f"hydra.run.dir={tmp_path / 'straight'}"))
    assert_ok(run_cli(*common, "grid.pc=4",
                      f"trainer.resume={tmp_path / 'straight' / 'checkpoints' / 'step-00000003'}",
                      f"hydra.run.dir={tmp_path / 'resumed'}"))
    straight, resumed = (train_losses(tmp_path / name) for name in ("straight", "resumed"))
    assert len(resumed) == 3
    assert max(abs(a - b) / abs(a) for a, b in zip(straight[3:], resumed, strict=True)) <= 1e-12
