"""`trainer.compile` (`strategies.compiled`): compiled steps equal eager ones, with every
collective outside the graphs.

Through the real command line, with inductor's C++ backend on the CPU: a GPT and a user's
planned language model trained compiled under data, fsdp stage 3 (its blocks recomputed), the
GPT's tensor parallelism and grid with a parallel plan (two micro-batches a step) repeat one
eager process's losses to float64 rounding and move the bytes the planner predicts; bf16
compiled trains what bf16 eager trains within bf16's rounding; a resumed compiled run repeats
the uninterrupted one and finds its graphs in the compile cache. Without MPI: which modules
`blocks` and `model` compile, a collective breaking a graph (the module compiled around, the
collective run and counted eagerly), modules of one class and many shapes, and validation's
refusal.

Cold compiles cost the most (inductor's C++, ~15 s a graph on 2 cores): every run shares one
compile cache, the eager references run first, and each compiled configuration once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from runner.core.comm import CommCounter, CountedComm
from strategies.base import ParallelModel
from strategies.compiled import MODEL, compile_modules, compile_targets
from tests.conftest import assert_ok, read_summary, run_cli, run_cli_together, train_losses

# Small runs, one thread a rank (the suite's other worker shares the cores), validated on a
# few samples at the end (eagerly, on either side)
SMALL = ["trainer.threads=1", "trainer.eval_every=null", "trainer.eval_samples=32", "seed=2"]
GPT = ["model=gpt", "model.width=32", "model.layers=2", "dataset=tokens", "dataset.vocab_size=64",
       "dataset.seq_len=16", "dataset.samples=512", "trainer.batch_size=8", "trainer.steps=4",
       "trainer.dtype=float64", *SMALL]
PLANNED = ["model._target_=tests.plan_models.UserBlockLM", "dataset=tokens",
           "dataset.vocab_size=64", "dataset.seq_len=16", "dataset.samples=512",
           "trainer.batch_size=8", "trainer.steps=4", "trainer.dtype=float64", *SMALL]
MLP_BF16 = ["model=mlp", "trainer.precision=bf16", "trainer.steps=6", "trainer.batch_size=32",
            *SMALL]
ONE = ["strategy=data", "grid.pr=1", "grid.pc=1"]
BLOCKS = ["trainer.compile=blocks"]
GPT_DATA = [*GPT, "strategy=data", "grid.pr=1", "grid.pc=2", *BLOCKS]
# name: (the eager reference's name, overrides), run in this order: gpt_data's first two steps
# compile its graphs, which its resumed run and fsdp's (the same blocks, whole while they run)
# then find in the cache
COMPILED = {
    "gpt_data": ("gpt_one", [*GPT_DATA, "trainer.steps=2", "trainer.checkpoint_every=2"]),
    "gpt_fsdp": ("gpt_one", [*GPT, "strategy=fsdp", "grid.pr=1", "grid.pc=2", *BLOCKS,
                             "trainer.activation_checkpointing=units"]),
    "gpt_tensor_parallel": ("gpt_one", [*GPT, "strategy=grid", "grid.pr=2", "grid.pc=1",
                                        *BLOCKS]),
    "planned_grid": ("planned_one", [*PLANNED, "strategy=grid", "grid.pr=2", "grid.pc=1",
                                     "strategy.plan={blocks.*.fc1: colwise, "
                                     "blocks.*.fc2: rowwise}", *BLOCKS,
                                     "trainer.accumulate_steps=2"]),
    "mlp_bf16": ("mlp_bf16_one", [*MLP_BF16, *ONE, "trainer.compile=model"]),
}
EAGER = {"gpt_one": [*GPT, *ONE], "planned_one": [*PLANNED, *ONE],
         "mlp_bf16_one": [*MLP_BF16, *ONE]}
RESUMED = [*GPT_DATA, "trainer.resume=auto"]  # gpt_data's run directory, to step 4


@pytest.fixture(scope="module")
def compiled_runs(session_tmp: Path) -> dict[str, Path]:
    root = session_tmp / "compiled"
    cache = f"trainer.compile_cache={root / 'cache'}"
    dirs = {name: root / name for name in [*EAGER, *COMPILED]}
    for result in run_cli_together(*[[*overrides, f"hydra.run.dir={dirs[name]}"]
                                     for name, overrides in EAGER.items()]):
        assert_ok(result)
    for name, (_, overrides) in COMPILED.items():
        assert_ok(run_cli(*overrides, cache, f"hydra.run.dir={dirs[name]}"))
        if name == "gpt_data":
            first = read_summary(dirs[name])
            assert_ok(run_cli(*RESUMED, cache, f"hydra.run.dir={dirs[name]}"))
            dirs["gpt_data_first"] = dirs[name] / "first_summary.json"
            dirs["gpt_data_first"].write_text(json.dumps(first))
    return dirs


def _gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", [name for name in COMPILED if name != "mlp_bf16"])
def test_compiled_runs_repeat_one_eager_process(compiled_runs: dict[str, Path],
                                                name: str) -> None:
    reference, _ = COMPILED[name]
    assert _gap(train_losses(compiled_runs[name]), train_losses(compiled_runs[reference])) <= 1e-9
    summary = read_summary(compiled_runs[name])
    assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"]
    compiled = summary["compile"]
    assert compiled["mode"] == "blocks" and compiled["compiled"]
    assert compiled["compile_s"] > 0 and compiled["graphs"] >= 1


def test_a_resumed_compiled_run_finds_its_graphs_in_the_cache(
        compiled_runs: dict[str, Path]) -> None:
    first = json.loads(compiled_runs["gpt_data_first"].read_text())["compile"]
    resumed = read_summary(compiled_runs["gpt_data"])
    assert resumed["resumed_from"]["step"] == 2
    assert len(train_losses(compiled_runs["gpt_data"])) == 4  # its losses: 1-2, then 3-4
    assert first["cache"]["misses"] > 0  # a fresh cache: compiled, forward and backward
    assert resumed["compile"]["cache"] == {"hits": first["cache"]["misses"], "misses": 0}
    # fsdp's blocks, whole while they run, are the same graphs
    assert read_summary(compiled_runs["gpt_fsdp"])["compile"]["cache"]["misses"] == 0


def test_bf16_compiled_trains_what_bf16_eager_trains(compiled_runs: dict[str, Path]) -> None:
    compiled = read_summary(compiled_runs["mlp_bf16"])["compile"]
    assert compiled["compiled"] == [MODEL] and compiled["eager"] == {}
    assert _gap(train_losses(compiled_runs["mlp_bf16"]),
                train_losses(compiled_runs["mlp_bf16_one"])) <= 2e-2


def test_what_each_strategy_compiles(compiled_runs: dict[str, Path]) -> None:
    def compiled(name: str) -> dict:
        return read_summary(compiled_runs[name])["compile"]

    # whole blocks where no collective runs inside them
    for name in ("gpt_data", "gpt_fsdp"):
        assert compiled(name)["compiled"] == ["blocks.0", "blocks.1"]
        assert compiled(name)["compiled_around"] == {} and compiled(name)["eager"] == {}
    # the row-parallel projections all-reduce their outputs: they run eagerly, the blocks
    # and attention around them compiled around, everything else compiled
    split = compiled("gpt_tensor_parallel")
    assert set(split["eager"]) == {f"blocks.{i}.{p}.proj" for i in (0, 1) for p in ("attn", "mlp")}
    assert all(reason.startswith("collective CountedComm.") for reason in split["eager"].values())
    assert set(split["compiled_around"]) == {f"blocks.{i}{p}" for i in (0, 1)
                                             for p in ("", ".attn", ".mlp")}
    assert {"blocks.0.ln1", "blocks.0.attn.core", "blocks.1.mlp.act"} <= set(split["compiled"])
    planned = compiled("planned_grid")
    assert {"blocks.0.fc2", "blocks.1.fc2"} <= set(planned["eager"])


# -- without MPI --------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self, comm: CountedComm | None = None) -> None:
        super().__init__()
        self.inner, self.outer, self.comm = nn.Linear(4, 4), nn.Linear(4, 4), comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.comm is not None:
            self.comm.allreduce_(y, label="block")
        return self.outer(torch.relu(y))


class _Net(nn.Module):
    def __init__(self, comm: CountedComm | None = None) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([_Block(comm), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


class _Wrapped(ParallelModel):
    """A parallel model holding the plain one whole (what `strategy=data` makes)."""

    def __init__(self, plain: nn.Module) -> None:
        super().__init__(grid=None)  # type: ignore[arg-type]
        self.net = plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def _train_step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_blocks_and_model_name_their_targets() -> None:
    plain = _Net()
    wrapped = _Wrapped(plain)
    assert compile_targets(wrapped, plain, "none") == ({}, None)
    targets, problem = compile_targets(wrapped, plain, "blocks")
    assert problem is None and list(targets) == ["blocks.0", "blocks.1"]
    assert compile_targets(wrapped, plain, "model") == ({MODEL: wrapped}, None)
    flat = nn.Sequential(nn.Linear(2, 2))
    assert "Sequential has no nn.ModuleList" in str(compile_targets(_Wrapped(flat), flat,
                                                                    "blocks")[1])


def test_a_collective_inside_a_module_is_compiled_around_and_still_runs() -> None:
    counter = CommCounter()
    comm = CountedComm(None, counter)  # a group of one: the call returns at once, uncounted
    calls = []
    original = CountedComm.allreduce_

    torch.manual_seed(0)
    plain = _Net(comm)
    eager = _Net(comm)
    eager.load_state_dict(plain.state_dict())
    wrapped = _Wrapped(plain)
    targets, _ = compile_targets(wrapped, plain, "model")
    record = compile_modules(wrapped, plain, targets, "model", backend="eager")
    counting = CountedComm.allreduce_  # marked never to be traced now

    def spy(self: CountedComm, tensor: torch.Tensor, label: str = "") -> torch.Tensor:
        calls.append(label)
        return counting(self, tensor, label)

    x = torch.randn(3, 4)
    try:
        CountedComm.allreduce_ = spy  # type: ignore[method-assign]
        for _ in range(2):
            assert all(torch.equal(a, b)
                       for a, b in zip(_train_step(wrapped, x), _train_step(eager, x),
                                       strict=True))
    finally:
        CountedComm.allreduce_ = counting  # type: ignore[method-assign]
    assert original is not counting and getattr(counting, "_gridrun_outside_graphs", False)
    # every collective ran, once per forward of each model, eagerly
    assert calls == ["block"] * 4
    # the parallel model, the plain one it holds and the block holding the collective are
    # compiled around; what they call is compiled, the collective's own block's children too
    assert set(record.around) == {MODEL, "net", "blocks.0"}
    assert all("collective CountedComm.allreduce_" in why for why in record.around.values())
    assert sorted(record.compiled) == ["blocks.0.inner", "blocks.0.outer", "blocks.1", "stem"]
    assert record.eager == {}


def test_evaluation_runs_the_eager_modules() -> None:
    plain = _Net()
    wrapped = _Wrapped(plain)
    targets, _ = compile_targets(wrapped, plain, "blocks")
    record = compile_modules(wrapped, plain, targets, "blocks", backend="eager")
    with torch.no_grad():
        wrapped(torch.randn(2, 4))
    assert record.compiled == []  # nothing tried: a no-grad forward does not compile
    _train_step(wrapped, torch.randn(2, 4))
    assert record.compiled == ["blocks.0", "blocks.1"]


def test_compile_blocks_without_blocks_or_an_unwritable_cache_is_refused_before_ranks_start(
        tmp_path: Path) -> None:
    result = run_cli("trainer.compile=blocks", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: trainer.compile=blocks: Sequential has no nn.ModuleList of repeated blocks; "
        "compile the whole model instead (trainer.compile=model)")
    blocked = tmp_path / "a file"
    blocked.write_text("")
    result = run_cli("model=gpt", "dataset=tokens", "trainer.compile=blocks",
                     f"trainer.compile_cache={blocked / 'cache'}",
                     f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: trainer.compile_cache={blocked / 'cache'}: the compile cache "
        f"{blocked / 'cache'} cannot be written (Not a directory)")


class _Widening(nn.Module):
    """Twelve Linear layers of twelve shapes, an all-reduce between them: each Linear is
    compiled on its own, the twelve sharing nn.Linear's forward (one code object) in dynamo."""

    def __init__(self, comm: CountedComm) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2 + i, 3 + i) for i in range(12))
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
            self.comm.allreduce_(x, label="between")
        return x


def test_modules_of_one_class_and_many_shapes_all_compile() -> None:
    plain = _Widening(CountedComm(None, CommCounter()))
    wrapped = _Wrapped(plain)
    targets, _ = compile_targets(wrapped, plain, "model")
    record = compile_modules(wrapped, plain, targets, "model", backend="eager")
    _train_step(wrapped, torch.randn(3, 2))  # past dynamo's default 8 graphs of one frame
    assert sorted(record.compiled) == sorted(f"layers.{i}" for i in range(12))
    assert set(record.around) == {MODEL, "net"} and record.eager == {}


class _Holder(nn.Module):
    def __init__(self, layer: nn.Linear, comm: CountedComm) -> None:
        super().__init__()
        self.layer, self.comm = layer, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer(x)
        self.comm.allreduce_(x, label="held")
        return x


class _Shared(nn.Module):
    """One Linear held by two modules, each compiled around its all-reduce."""

    def __init__(self, comm: CountedComm) -> None:
        super().__init__()
        layer = nn.Linear(4, 4)
        self.a, self.b = _Holder(layer, comm), _Holder(layer, comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_module_held_twice_is_compiled_once() -> None:
    torch.manual_seed(0)
    plain = _Shared(CountedComm(None, CommCounter()))
    eager = _Shared(CountedComm(None, CommCounter()))
    eager.load_state_dict(plain.state_dict())
    wrapped = _Wrapped(plain)
    targets, _ = compile_targets(wrapped, plain, "model")
    record = compile_modules(wrapped, plain, targets, "model", backend="eager")
    x = torch.randn(3, 4)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(_train_step(wrapped, x),
                                                     _train_step(eager, x), strict=True))
    assert record.compiled == ["a.layer"] and set(record.around) == {MODEL, "net", "a", "b"}
