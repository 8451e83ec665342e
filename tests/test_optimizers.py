"""Users' own optimizers: any `torch.optim` class run synchronously (`wrap_torch_optimizer`;
registered: `adam`, `adamw`).

The unit tests need no MPI: the options a wrapped class takes and refuses, its update on a split
parameter, its state's round trip. The runs are few and shared (one module fixture): AdamW in
float64 on one process, on 1 x 2 (`data`) and on 2 x 1 (`grid`, every layer split) gives the same
losses, which a plain `torch.optim.AdamW` loop also gives; and a run resumed from its step-10
checkpoint repeats the uninterrupted run's losses, bit for bit on the same grid and to float64
rounding on another (Adam's moments re-sharded, its step counts restored by parameter name).
"""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from runner.checkpoint.layout import DamagedCheckpoint
from runner.checkpoint.read import Checkpoint
from runner.checkpoint.resume import parameter_shapes, verify_resume
from runner.checkpoint.space import checkpoint_bytes
from runner.config.options import option_problems, with_defaults
from runner.config.registry import OPTIMIZERS, load_plugins
from runner.optim.parameter_server import AsyncMSGD, AsyncSGD, HogwildSGD
from runner.optim.sync import (
    ELEMENTWISE_TORCH_OPTIMIZERS,
    SynchronousSGD,
    TorchAdam,
    TorchAdamW,
    UnsavableState,
    wrap_torch_optimizer,
)
from tests.conftest import assert_ok, read_metrics, run_cli_together

INPUTS = ("model", "grid", "total_steps")
STEPS = 20
# A learning rate that moves the model far enough in 20 steps for a difference to show.
ADAMW = ["optimizer=adamw", "optimizer.lr=0.01", "trainer.dtype=float64", "trainer.batch_size=32",
         "trainer.eval_every=null", "seed=3", f"trainer.steps={STEPS}"]
ONE = ["grid.pr=1", "grid.pc=1"]
DATA = ["strategy=data", "grid.pr=1", "grid.pc=2"]
SPLIT = ["strategy=grid", "grid.pr=2", "grid.pc=1"]  # every layer's rows over 2 ranks


def checked(cls: Any, **options: Any) -> list[str]:
    """What validation says of these options: their types, then the class's own `check`."""
    return (option_problems("optimizer", cls, options, INPUTS)
            or cls.check(**with_defaults(cls, options, INPUTS)))


# -- options: the class's signature is the schema ---------------------------------------------

@pytest.mark.parametrize(("options", "problem"), [
    ({"lr": 0}, "optimizer.lr must be > 0, got 0"),
    ({"lr": -0.1}, "optimizer.lr must be > 0, got -0.1"),
    ({"betas": [0.9, 1.0]}, "optimizer.betas must be two numbers in [0, 1), got [0.9,1.0]"),
    ({"betas": [-0.1, 0.9]}, "optimizer.betas must be two numbers in [0, 1), got [-0.1,0.9]"),
    ({"eps": 0}, "optimizer.eps must be > 0, got 0"),
    ({"weight_decay": -0.01}, "optimizer.weight_decay must be >= 0, got -0.01"),
    ({"schedule": "linear"}, "optimizer.schedule must be one of constant, cosine, got 'linear'"),
    ({"warmup_steps": -1}, "optimizer.warmup_steps must be >= 0, got -1"),
    ({"lr": "abc"}, "optimizer.lr=abc: must be a number"),
    ({"amsgrad": 1}, "optimizer.amsgrad=1: must be true or false"),
    ({"momentum": 0.9}, "optimizer: unknown option(s) optimizer.momentum; valid: amsgrad, "
                        "betas, capturable, differentiable, eps, foreach, fused, lr, maximize, "
                        "schedule, warmup_steps, weight_decay"),
])
def test_check_refuses_bad_values_by_name(options: dict[str, Any], problem: str) -> None:
    assert checked(TorchAdamW, **options) == [problem]


def test_every_bad_value_is_named_once() -> None:
    assert checked(TorchAdam, lr=0, eps=-1, weight_decay=-1, warmup_steps=-2) == [
        "optimizer.lr must be > 0, got 0", "optimizer.eps must be > 0, got -1",
        "optimizer.weight_decay must be >= 0, got -1",
        "optimizer.warmup_steps must be >= 0, got -2"]


def test_the_torch_class_speaks_for_what_gridrun_does_not_check() -> None:
    """Its constructor's and first step's own refusals, naming the option to blame."""
    rmsprop = wrap_torch_optimizer(torch.optim.RMSprop)
    assert checked(rmsprop, alpha=-0.5) == [
        "optimizer.alpha=-0.5: torch.optim.RMSprop refuses it: Invalid alpha value: -0.5"]
    [problem] = checked(TorchAdam, capturable=True)  # refused by its step on the CPU
    assert problem.startswith("optimizer.capturable=true: torch.optim.Adam refuses it: ")
    lbfgs = wrap_torch_optimizer(torch.optim.LBFGS)
    assert checked(lbfgs) == [
        "optimizer: torch.optim.LBFGS needs a closure that evaluates the model again in its "
        "step (a line search); gridrun's step has none: choose another optimizer"]
    assert checked(TorchAdamW) == [] and checked(rmsprop, lr=0.01, momentum=0.9) == []


def test_the_wrapped_signature_is_the_torch_class_s_plus_gridrun_s() -> None:
    signature = inspect.signature(TorchAdamW)
    params = signature.parameters
    assert list(params)[:3] == list(INPUTS)
    assert list(params)[-2:] == ["schedule", "warmup_steps"]
    assert params["lr"].default == 0.001 and params["lr"].annotation is float  # no Tensor
    assert params["betas"].default == (0.9, 0.999)
    assert params["weight_decay"].default == 0.01
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(params)[3:])
    rmsprop = wrap_torch_optimizer(torch.optim.RMSprop)
    assert rmsprop is wrap_torch_optimizer(torch.optim.RMSprop)  # one class per torch class
    assert "alpha" in inspect.signature(rmsprop).parameters
    load_plugins()
    assert OPTIMIZERS.get("adam") is TorchAdam is wrap_torch_optimizer(torch.optim.Adam)
    assert OPTIMIZERS.get("adamw") is TorchAdamW


def test_the_yaml_defaults_are_the_classes() -> None:
    """conf/optimizer/adam*.yaml write out the torch defaults (and gridrun's)."""
    import yaml

    root = Path(__file__).resolve().parents[1] / "conf" / "optimizer"
    for name, cls in (("adam", TorchAdam), ("adamw", TorchAdamW)):
        written = yaml.safe_load((root / f"{name}.yaml").read_text())
        assert written.pop("name") == name
        defaults = with_defaults(cls, {}, INPUTS)
        assert {k: tuple(v) if isinstance(v, list) else v for k, v in written.items()} == {
            k: defaults[k] for k in written}


def test_elementwise_and_state_size() -> None:
    assert TorchAdam.elementwise and TorchAdamW.elementwise and SynchronousSGD.elementwise
    assert wrap_torch_optimizer(torch.optim.RMSprop).elementwise
    for cls in (torch.optim.LBFGS, torch.optim.SparseAdam, torch.optim.Adafactor):
        assert not wrap_torch_optimizer(cls).elementwise
    assert torch.optim.Adam in ELEMENTWISE_TORCH_OPTIMIZERS
    # parameter-shaped state per parameter, for preflight's memory and disk estimates
    assert TorchAdamW.state_copies({}) == 2
    assert TorchAdam.state_copies({"amsgrad": True}) == 3
    assert SynchronousSGD.state_copies({"momentum": 0.9}) == 1
    assert SynchronousSGD.state_copies({"momentum": 0.0}) == 0


# -- the update and its state, without MPI -----------------------------------------------------

def _parameters(*tensors: torch.Tensor) -> SimpleNamespace:
    """Stands in for a parallel model: all the optimizer asks of it is its parameters."""
    params = [torch.nn.Parameter(t.clone()) for t in tensors]
    return SimpleNamespace(parameters=lambda: iter(params), params=params)


def _steps(optimizer: Any, params: list[torch.nn.Parameter],
           grads: list[list[torch.Tensor]], first: int = 0) -> None:
    """Steps `first`, `first` + 1, ...: each parameter given its gradient, then the update."""
    for step, step_grads in enumerate(grads, start=first):
        for param, grad in zip(params, step_grads, strict=True):
            param.grad = grad.clone()
        optimizer.step(step)


def test_a_split_parameter_is_updated_as_the_whole_one() -> None:
    """AdamW on a 6 x 4 parameter, and on its rows 0:2 and 2:6 as two parameters (as two ranks
    hold it): the same values, bit for bit, with a warm-up and a cosine schedule, which set the
    lr torch's own AdamW is then given."""
    torch.manual_seed(0)
    weight = torch.randn(6, 4, dtype=torch.float64)
    grads = [torch.randn(6, 4, dtype=torch.float64) for _ in range(5)]
    options = {"lr": 0.05, "weight_decay": 0.1, "schedule": "cosine", "warmup_steps": 2}
    whole, split = _parameters(weight), _parameters(weight[:2], weight[2:])
    _steps(TorchAdamW(whole, None, 5, **options), whole.params, [[g] for g in grads])
    _steps(TorchAdamW(split, None, 5, **options), split.params,
           [[g[:2], g[2:]] for g in grads])
    assert torch.equal(whole.params[0].detach(), torch.cat([p.detach() for p in split.params]))
    reference = torch.nn.Parameter(weight.clone())
    plain = torch.optim.AdamW([reference], lr=0.05, weight_decay=0.1)
    for grad, lr in zip(grads, [0.025, 0.05, 0.05, 0.05 * 0.75, 0.05 * 0.25], strict=True):
        plain.param_groups[0]["lr"] = lr
        reference.grad = grad.clone()
        plain.step()
    assert torch.allclose(reference.detach(), whole.params[0].detach(), rtol=0, atol=1e-15)


def test_state_round_trips_and_a_parameter_s_state_is_restored_whole_or_not_at_all() -> None:
    """Adam (amsgrad: three moments and the step count) for 3 steps, its state given to a new
    Adam, 3 more steps: the 6 uninterrupted steps' values."""
    torch.manual_seed(1)
    start = [torch.randn(3, 2, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    grads = [[torch.randn_like(t) for t in start] for _ in range(6)]
    straight, resumed = _parameters(*start), _parameters(*start)
    _steps(TorchAdam(straight, None, 6, lr=0.1, amsgrad=True), straight.params, grads)
    before = TorchAdam(resumed, None, 6, lr=0.1, amsgrad=True)
    _steps(before, resumed.params, grads[:3])
    assert before.state_kinds() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    assert before.scalar_kinds() == ("step",)
    states = before.param_states()
    assert [value.item() for value in states["step"]] == [3, 3]
    after = TorchAdam(resumed, None, 6, lr=0.1, amsgrad=True)
    after.load_param_states({kind: [v.clone() for v in values]
                             for kind, values in states.items()})
    _steps(after, resumed.params, grads[3:], first=3)
    for got, expected in zip(resumed.params, straight.params, strict=True):
        assert torch.equal(got, expected)
    partial = TorchAdam(resumed, None, 6, lr=0.1)
    partial.load_param_states({k: v for k, v in states.items() if k != "step"})
    assert partial.param_states()["exp_avg"] == [None, None]  # not restored: starts afresh


def test_state_a_checkpoint_cannot_hold_is_named() -> None:
    """Adafactor's factored second moments are neither rows of the parameter nor one value."""
    model = _parameters(torch.randn(4, 3))
    adafactor = wrap_torch_optimizer(torch.optim.Adafactor)(model, None, 1)
    _steps(adafactor, model.params, [[torch.randn(4, 3)]])
    with pytest.raises(UnsavableState, match=r"torch.optim.Adafactor keeps state a checkpoint "
                                             r"cannot hold .*: col_var, row_var"):
        adafactor.param_states()


def test_sparse_gradients_are_made_dense() -> None:
    """An embedding table's row-sparse gradient (model=bag_classifier): Adam takes only dense
    ones; made dense, the update is Adam's on the dense gradient."""
    torch.manual_seed(2)
    tables = [torch.nn.EmbeddingBag(10, 3, mode="mean", sparse=sparse) for sparse in (True, False)]
    tables[1].load_state_dict(tables[0].state_dict())
    tokens = torch.tensor([[1, 2, 2], [7, 1, 0]])
    for table in tables:
        adam = TorchAdam(table, None, 2, lr=0.1)
        for step in range(2):
            table.zero_grad()
            table(tokens).square().sum().backward()
            adam.step(step)
    assert tables[0].weight.grad is not None and not tables[0].weight.grad.is_sparse
    assert torch.equal(tables[0].weight, tables[1].weight)


# -- real runs: one process, 1 x 2, 2 x 1, and resumed ------------------------------------------

def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "split" not in m}


def _run_all(jobs: dict[Path, list[str]]) -> None:
    """The independent AdamW jobs at once; each must succeed."""
    for result in run_cli_together(*[[*ADAMW, *overrides, f"hydra.run.dir={run_dir}"]
                                     for run_dir, overrides in jobs.items()]):
        assert_ok(result)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """AdamW, 20 steps: on one process, on 1 x 2, and on 2 x 1 (checkpoints at 10 and 20);
    2 x 1's step-10 checkpoint resumed on 2 x 1 and on one process (the moments' rows of both
    ranks gathered, the step counts the two ranks agreed on)."""
    tmp = tmp_path_factory.mktemp("adamw")
    dirs = {name: tmp / name for name in ("one", "data", "split", "split_resumed",
                                          "one_resumed")}
    _run_all({dirs["one"]: ONE, dirs["data"]: DATA,
              dirs["split"]: [*SPLIT, "trainer.checkpoint_every=10"]})
    checkpoint = f"trainer.resume={dirs['split'] / 'checkpoints' / 'step-00000010'}"
    _run_all({dirs["split_resumed"]: [*SPLIT, checkpoint],
              dirs["one_resumed"]: [*ONE, checkpoint]})
    return dirs


def test_adamw_on_any_grid_repeats_one_process(runs: dict[str, Path]) -> None:
    one = losses(runs["one"])
    assert sorted(one) == list(range(1, STEPS + 1))
    assert one[STEPS] < 0.5 * one[1]  # it trains
    for name in ("data", "split"):
        got = losses(runs[name])
        assert sorted(got) == sorted(one)
        assert max(abs(got[s] - one[s]) for s in one) < 1e-9, name


def test_one_process_is_a_plain_torch_adamw_loop(runs: dict[str, Path]) -> None:
    """The same model, data order and loss as `python -m runner` on one process, trained by
    `torch.optim.AdamW` itself."""
    from runner.cli.compose import compose
    from runner.cli.validation import validate
    from runner.training import assembly
    from runner.training.sampling import EpochSampler

    run = validate(compose([*ADAMW, *ONE]), world_size=1)
    torch.manual_seed(run.seed)
    parts = assembly.assemble(run)
    data = parts.dataset.load()
    x, y, model = data.train_x.to(torch.float64), data.train_y, parts.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # weight_decay: its 0.01
    sampler = EpochSampler(parts.spec.train_size, run.trainer.batch_size, run.seed)
    plain = []
    for _ in range(STEPS):
        rows = sampler.next_batch()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        plain.append(loss.item())
    one = losses(runs["one"])
    assert max(abs(one[s + 1] - value) for s, value in enumerate(plain)) < 1e-12


def test_a_resumed_run_repeats_the_uninterrupted_losses(runs: dict[str, Path]) -> None:
    """From the 2 x 1 run's step-10 checkpoint (each rank held half of every parameter's rows
    and of Adam's moments): on 2 x 1 bit for bit; on one process to float64 rounding."""
    straight, one = losses(runs["split"]), losses(runs["one"])
    same_grid, other_grid = losses(runs["split_resumed"]), losses(runs["one_resumed"])
    assert sorted(same_grid) == sorted(other_grid) == list(range(11, STEPS + 1))
    assert same_grid == {s: straight[s] for s in same_grid}
    assert max(abs(other_grid[s] - one[s]) for s in other_grid) < 1e-9


def test_the_checkpoint_keeps_adam_s_step_count_by_parameter_name(runs: dict[str, Path]) -> None:
    path = runs["split"] / "checkpoints" / "step-00000010"
    checkpoint = Checkpoint(path)
    assert checkpoint.manifest["format"] == 2
    assert {s.kind for s in checkpoint.scalars} == {"step"}
    assert {e.kind for _, e in checkpoint.entries} == {"model", "exp_avg", "exp_avg_sq"}
    shard = checkpoint.rank_state(0)
    assert {shard[s.key].item() for s in checkpoint.scalars} == {10.0}
    assert len(checkpoint.scalars) == len({e.name for _, e in checkpoint.entries})


def test_checkpoint_bytes_counts_adam_s_moments(runs: dict[str, Path]) -> None:
    """preflight's estimate (`checkpoint_bytes` with the class's `state_copies`) against the
    bytes a checkpoint took: the weights and two moments, plus the RNG states and the sample
    order."""
    path = runs["split"] / "checkpoints" / "step-00000010"
    written = sum(record["bytes"] for record in Checkpoint(path).manifest["shards"].values())
    param_bytes = sum(p.numel() * 8 for p in _meta_model().parameters())
    estimate = checkpoint_bytes(param_bytes, 1, False, False, TorchAdamW.state_copies({}))
    assert estimate == 3 * param_bytes
    assert estimate < written < estimate * 1.1


def _meta_model() -> torch.nn.Module:
    from runner.cli.compose import compose
    from runner.cli.validation import validate
    from runner.training import assembly

    run = validate(compose([*ADAMW, *ONE]), world_size=1)
    spec = assembly.build_dataset(run.dataset).spec()
    return assembly.model_for(run.model, spec, assembly.dtype_of(run), device="meta")


def _copy_with_manifest(source: Path, target: Path, change: Any) -> Path:
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    change(manifest)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def test_scalars_are_checked_and_a_checkpoint_without_them_still_loads(
        runs: dict[str, Path], tmp_path: Path) -> None:
    source = runs["split"] / "checkpoints" / "step-00000010"
    model = _meta_model()
    older = _copy_with_manifest(source, tmp_path / "older", lambda m: m.pop("scalars"))
    assert verify_resume(str(older), tmp_path, model) == (older, [])
    assert not Checkpoint(older).has("step") and Checkpoint(older).has("exp_avg")

    def missing(manifest: dict[str, Any]) -> None:
        manifest["scalars"].append(["step", None, "9.weight"])

    lost = _copy_with_manifest(source, tmp_path / "lost", missing)
    with pytest.raises(DamagedCheckpoint, match=r"rank-00000.pt: no tensor scalar/step/-/9.weight"
                                                r", which the manifest lists"):
        verify_resume(str(lost), tmp_path, model)
    garbled = _copy_with_manifest(source, tmp_path / "garbled",
                                  lambda m: m.__setitem__("scalars", [["step", 5, "1.weight"]]))
    with pytest.raises(DamagedCheckpoint, match=r"scalar 1.weight: replica 5 is not one of"):
        Checkpoint(garbled)
    foreign = _copy_with_manifest(source, tmp_path / "foreign",
                                  lambda m: m["scalars"].__setitem__(0, ["step", None, "x"]))
    assert Checkpoint(foreign).model_problem(parameter_shapes(model)) == (
        "its step value for 'x' is not a parameter of this model")


# -- SC17's parameter-server baselines (runner/optim/parameter_server.py) --------------------------

PARAMETER_SERVERS = {"async_sgd": AsyncSGD, "async_msgd": AsyncMSGD, "hogwild_sgd": HogwildSGD}


def test_the_parameter_servers_are_registered_asynchronous_and_score_the_server() -> None:
    load_plugins()
    for name, cls in PARAMETER_SERVERS.items():
        assert OPTIMIZERS.get(name) is cls
        assert cls.asynchronous and cls.has_centre and cls.per_replica and cls.elementwise
        assert not cls.syncs_gradients  # no all-reduce of the replicas' gradients
    assert AsyncSGD.locks_pieces and AsyncMSGD.locks_pieces and not HogwildSGD.locks_pieces
    # the server's velocity is checkpointed, whatever μ
    assert AsyncMSGD.state_copies({"momentum": 0.0}) == 1 and AsyncSGD.state_copies({}) == 0


@pytest.mark.parametrize(("cls", "options", "problems"), [
    (AsyncSGD, {"lr": 0}, ["optimizer.lr must be > 0, got 0"]),
    (HogwildSGD, {"lr": -0.1}, ["optimizer.lr must be > 0, got -0.1"]),
    (AsyncMSGD, {"momentum": 1.0}, ["optimizer.momentum must be in [0, 1), got 1.0"]),
    (AsyncMSGD, {"lr": 0, "momentum": -0.5}, ["optimizer.lr must be > 0, got 0",
                                              "optimizer.momentum must be in [0, 1), got -0.5"]),
    (AsyncSGD, {"momentum": 0.9}, ["optimizer: unknown option(s) optimizer.momentum; valid: lr"]),
    (HogwildSGD, {"lr": "fast"}, ["optimizer.lr=fast: must be a number"]),
])
def test_parameter_server_options_are_checked_by_name(cls: Any, options: dict[str, Any],
                                                      problems: list[str]) -> None:
    assert checked(cls, **options) == problems


def test_the_parameter_server_yaml_defaults_are_the_classes() -> None:
    import yaml

    root = Path(__file__).resolve().parents[1] / "conf" / "optimizer"
    for name, cls in PARAMETER_SERVERS.items():
        written = yaml.safe_load((root / f"{name}.yaml").read_text())
        assert written.pop("name") == name
        assert written == with_defaults(cls, {}, INPUTS)
        assert checked(cls, **written) == []


def _served(*tensors: torch.Tensor) -> SimpleNamespace:
    model = _parameters(*tensors)
    model.replicated_in_model_group = []
    return model


@pytest.mark.parametrize("cls", [AsyncSGD, HogwildSGD, AsyncMSGD])
def test_one_replica_is_torch_sgd_and_the_server_velocity_round_trips(cls: Any) -> None:
    """One process (no MPI): each is torch's SGD (async_msgd with momentum μ: V = −η·buf).
    A server built afresh from the weights (a resume puts W in the model first) and given the
    saved state then steps exactly as the first one."""
    from runner.core import ProcessGrid

    grid = ProcessGrid(1, 1)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3, 4, generator=gen, dtype=torch.float64),
               torch.randn(5, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in tensors]
             for _ in range(6)]
    momentum = {"momentum": 0.9} if cls is AsyncMSGD else {}
    model = _served(*tensors)
    server = cls(model, grid, 6, lr=0.1, **momentum)
    reference = [torch.nn.Parameter(t.clone()) for t in tensors]
    plain = torch.optim.SGD(reference, lr=0.1, **momentum)
    for step_grads in grads:
        for param, grad in zip(reference, step_grads, strict=True):
            param.grad = grad.clone()
        plain.step()
    _steps(server, model.params, grads[:3])
    saved = server.param_states()
    assert list(saved) == list(server.state_kinds())
    resumed_model = _served(*[p.detach() for p in model.params])
    resumed = cls(resumed_model, grid, 6, lr=0.1, **momentum)
    resumed.load_param_states(saved)
    _steps(server, model.params, grads[3:], first=3)
    _steps(resumed, resumed_model.params, grads[3:], first=3)
    for mine, again, want in zip(model.params, resumed_model.params, reference, strict=True):
        assert torch.equal(mine, again)
        assert torch.allclose(mine, want, rtol=0, atol=1e-13), (mine - want).abs().max()
    centre = server.centre(torch.empty(17, dtype=torch.float64))
    assert torch.equal(centre, torch.cat([p.detach().reshape(-1) for p in model.params]))
    if cls is AsyncMSGD:
        velocity = server.server_velocity(torch.empty(17, dtype=torch.float64))
        buffers = torch.cat([plain.state[p]["momentum_buffer"].reshape(-1) for p in reference])
        assert torch.allclose(velocity, -0.1 * buffers, rtol=0, atol=1e-13)
    server.close()
    resumed.close()


def test_torch_optimizers_with_fused_kernels_run_them_on_cuda_unless_told() -> None:
    from runner.optim.sync import fused_by_default

    for torch_class in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):
        assert fused_by_default(torch_class, {}, {"cuda"})
        assert not fused_by_default(torch_class, {}, {"cpu"})  # torch's own default there
        assert not fused_by_default(torch_class, {}, {"cuda", "cpu"})
        assert not fused_by_default(torch_class, {"foreach": True}, {"cuda"})
        assert not fused_by_default(torch_class, {"fused": False}, {"cuda"})
    assert not fused_by_default(torch.optim.RMSprop, {}, {"cuda"})  # no fused kernels
