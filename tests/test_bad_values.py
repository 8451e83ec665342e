"""Bad values, table-driven: each is refused before any process starts, in one line naming it,
with no run directory left behind and nothing else printed. In-process through the head's own
check (`runner.cli.app.precheck`: composition, the schema, validation, the machine), which is what
`python -m runner` runs before anything else; `tests/test_cli_errors.py` proves the exit code 2
and the absence of tracebacks and MPI jobs through the real command line for a sample.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.cli.app import precheck
from runner.records.rundir import LOCK_FILE, MetricsWriter, atomic_write_text, release_run_dirs

EASGD = ["optimizer=easgd"]
SYNTH = ["dataset=synthetic"]
GPT = ["model=gpt", "dataset=tokens"]
EASGD2 = ["optimizer=easgd", "grid.pr=1", "grid.pc=2"]
DATA2 = ["strategy=data", "grid.pr=1", "grid.pc=2"]
BAG = ["model=bag_classifier", "dataset=tokens", *DATA2]
TOKENS = ["model=bag_classifier", "dataset=tokens", "strategy=data", "grid.pr=1", "grid.pc=4"]
# a user's attention block under a parallel plan by module name
PLANNED = ["model._target_=tests.plan_models.UserBlockLM", "dataset=tokens", "strategy=model",
           "grid.pr=2", "grid.pc=1"]
ATTENTION_PLAN = "strategy.plan={blocks.*.attn.qkv: fused_qkv, blocks.*.attn.out: rowwise}"

# (overrides, a fragment the one line must contain: the key or the value it names)
BAD: list[tuple[list[str], str]] = [
    (["seed=-1"], "seed=-1"),
    (["model=gpt", "dataset=digits"], "dataset=digits: it has no next-token form"),
    (["model=gpt", "dataset=tokens", "strategy=domain", "strategy.kv_exchange=tree"],
     "strategy.kv_exchange=tree"),
    (["model=gpt", "dataset=tokens", "strategy.tp_layout=rows"], "strategy.tp_layout=rows"),
    (["model=gpt", "dataset=tokens", "model.width=30", "model.heads=4"],
     "model.width=30 must be a multiple of model.heads=4"),
    (["model=gpt", "dataset=tokens", "model.context=4"], "model.context=4 is shorter"),
    (["model=gpt", "dataset=tokens", "model.sparse_embedding=true"],
     "model.sparse_embedding=true needs model.tie_weights=false"),
    (["seed=99999999999999999999"], "seed=99999999999999999999"),
    (["seed=abc"], "seed=abc"),
    (["seed=1.5"], "seed=1.5"),
    (["grid.pr=0"], "grid.pr=0"),
    (["grid.pc=-2"], "grid.pc=-2"),
    (["grid.pr=two"], "grid.pr=two"),
    (["grid.pc=1.5"], "grid.pc=1.5"),
    (["trainer.steps=0"], "trainer.steps=0"),
    (["trainer.steps=1.5"], "trainer.steps=1.5"),
    (["trainer.steps=abc"], "trainer.steps=abc"),
    (["trainer.batch_size=0"], "trainer.batch_size=0"),
    (["trainer.batch_size=-8"], "trainer.batch_size=-8"),
    (["trainer.log_every=0"], "trainer.log_every=0"),
    (["trainer.eval_every=0"], "trainer.eval_every=0"),
    (["trainer.eval_samples=0"], "trainer.eval_samples=0"),
    (["trainer.checkpoint_every=0"], "trainer.checkpoint_every=0"),
    (["trainer.keep_checkpoints=0"], "trainer.keep_checkpoints=0"),
    (["trainer.threads=0"], "trainer.threads=0"),
    (["trainer.dtype=float16"], "trainer.dtype=float16"),
    (["trainer.device=tpu"], "trainer.device=tpu"),
    (["trainer.precision=fp8"], "trainer.precision=fp8"),
    (["trainer.precision=bf16", "trainer.dtype=float64"], "trainer.precision=bf16"),
    (["comm.cuda_aware=perhaps"], "comm.cuda_aware=perhaps"),
    (["strategy=data", "grid.pr=1", "strategy.batch_norm=sometimes"],
     "strategy.batch_norm=sometimes"),
    (["model._target_=transformers.LlamaForCausalLM", "model.hiden_size=16", "dataset=tokens"],
     "unknown option(s) model.hiden_size"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "strategy.stage=4"], "strategy.stage=4"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "strategy.prefetch=maybe"],
     "strategy.prefetch=maybe"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "strategy.prefetch=2"], "strategy.prefetch=2"),
    (["strategy=fsdp", "grid.pr=2", "grid.pc=2"],
     "strategy=fsdp on grid.pr=2 shards a model split in place over the model group"),
    ([*GPT, "strategy=fsdp", "grid.pr=2", "grid.pc=1"], "grid.pc=1 shards nothing"),
    ([*GPT, "strategy=fsdp", "grid.pr=2", "grid.pc=2", "strategy.batch_norm=local"],
     "strategy.batch_norm=local: on grid.pr=2 a BatchNorm takes the statistics"),
    ([*GPT, "strategy=fsdp", "grid.pr=1", "grid.pc=2",
      "trainer.activation_checkpointing=blocks.0.mlp"],
     "blocks.0.mlp holds parameters of the fsdp unit blocks.0, gathered outside"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "strategy.units=[nothing.*]"],
     "strategy.units: nothing.* matches no module"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "optimizer=easgd"], "optimizer=easgd"),
    (["strategy=fsdp", "grid.pr=1", "grid.pc=2", "optimizer._target_=torch.optim.Adafactor"],
     "its update of a parameter depends on the whole parameter"),
    (["trainer.comm_timeout_s=-1"], "trainer.comm_timeout_s=-1"),
    (["trainer.comm_timeout_s=0"], "trainer.comm_timeout_s=0"),
    (["trainer.comm_timeout_s=nan"], "trainer.comm_timeout_s=nan"),
    (["trainer.comm_timeout_s=inf"], "trainer.comm_timeout_s=inf"),
    (["trainer.resume=/no/such/checkpoint"], "trainer.resume=/no/such/checkpoint"),
    (["trainer.stepz=5"], "trainer.stepz"),
    (["+trainer.foo=1"], "trainer.foo"),
    (["+grid.pz=2"], "grid.pz"),
    (["+colour=red"], "colour"),
    (["trainer.steps=???"], "trainer.steps"),
    (["trainer.steps=${nothere}"], "trainer.steps"),
    (["debug.fail_mode=explode"], "debug.fail_mode=explode"),
    (["debug.fail_at_step=0"], "debug.fail_at_step=0"),
    (["debug.fail_at_step=1", "debug.fail_on_rank=7"], "debug.fail_on_rank=7"),
    (["debug.slow_rank=9", "debug.slow_seconds=0.1"], "debug.slow_rank=9"),
    (["debug.slow_seconds=-1"], "debug.slow_seconds"),
    (["debug.slow_seconds=inf"], "debug.slow_seconds=inf"),
    (["debug.slow_seconds=nan"], "debug.slow_seconds=nan"),
    (["debug.isolate_comm=maybe"], "debug.isolate_comm=maybe"),
    (["logger=wandb"], "wandb"),
    (["launcher.nproc_flag=--bogus"], "launcher.nproc_flag=--bogus"),
    (["launcher.command=/nonexistent/mpiexec"], "launcher.command=/nonexistent/mpiexec"),
    (["hydra.run.dir="], "hydra.run.dir"),
    (["optimizer.lr=abc"], "optimizer.lr=abc"),
    (["optimizer.lr=nan"], "optimizer.lr=nan"),
    (["optimizer.lr=inf"], "optimizer.lr=inf"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.lr=-0.1"], "optimizer.lr"),
    (["optimizer.momentum=fast"], "optimizer.momentum=fast"),
    (["optimizer.momentum=1.5"], "optimizer.momentum"),
    (["optimizer.weight_decay=nan"], "optimizer.weight_decay=nan"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay"),
    (["optimizer.nesterov=maybe"], "optimizer.nesterov=maybe"),
    (["optimizer.schedule=step"], "optimizer.schedule"),
    (["optimizer.warmup_steps=-1"], "optimizer.warmup_steps"),
    (["optimizer.warmup_steps=1.5"], "optimizer.warmup_steps=1.5"),
    ([*EASGD, "optimizer.rho=nan"], "optimizer.rho=nan"),
    ([*EASGD, "optimizer.rho=-0.5"], "optimizer.rho"),
    ([*EASGD, "optimizer.period=0"], "optimizer.period"),
    ([*EASGD, "optimizer.moving_rate=1.5"], "optimizer.moving_rate"),
    ([*EASGD, "grid.pr=1", "grid.pc=4", "optimizer.moving_rate=0.3"],
     "optimizer.moving_rate=0.3 with grid.pc=4: Pc·α = 1.2"),
    (["optimizer=sync_easgd", "grid.pr=1", "grid.pc=2", "optimizer.rho=3"],
     "optimizer.lr=0.2 × optimizer.rho=3 = moving rate 0.6 with grid.pc=2"),
    (["optimizer=async_measgd", "optimizer.momentum=0", "optimizer.nesterov=true"],
     "optimizer.nesterov=true needs optimizer.momentum > 0"),
    (["strategy.bucket_cap_mb=big"], "strategy.bucket_cap_mb=big"),
    (["strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb"),
    (["strategy.bucket_cap_mb=nan"], "strategy.bucket_cap_mb=nan"),
    ([*TOKENS, "strategy.sparse=compressed"], "strategy.sparse=compressed"),
    (["model.hidden=[0]"], "hidden=[0]"),
    (["model.hidden=[a]"], "model.hidden=[a]"),
    (["model.hidden=5"], "model.hidden=5"),
    (["model.hidden=[100000000]"], "GiB"),
    (["model.activation=swish"], "swish"),
    (["model=cnn", "model.channels=[0]"], "channels=[0]"),
    (["model=cnn", "model.kernel_size=0"], "kernel_size=0"),
    (["+model.depth=3"], "model.depth"),
    (["model=transformer9"], "transformer9"),
    (["strategy=pipeline"], "pipeline"),
    (["strategy=auto", "+strategy.layouts.fc9=2d"], "no layer named 'fc9'"),
    (["strategy=auto", "model=cnn", "+strategy.layouts.0=2d"], "strategy.layouts.0=2d"),
    (["strategy=auto", "+strategy.layouts.1=diagonal"], "strategy.layouts.1=diagonal"),
    (["strategy=auto", *EASGD], "strategy=auto"),
    (["optimizer=lamb"], "lamb"),
    (["strategy=data", "grid.pr=3"], "grid.pr=3"),
    (["dataset.val_fraction=2"], "val_fraction"),
    (["dataset.val_fraction=nan"], "dataset.val_fraction=nan"),
    ([*SYNTH, "dataset.samples=1e11"], "dataset.samples"),
    ([*SYNTH, "dataset.samples=100000000000"], "GiB"),
    ([*SYNTH, "dataset.samples=0"], "samples"),
    ([*SYNTH, "dataset.noise=nan"], "dataset.noise=nan"),
    ([*SYNTH, "dataset.classes=0"], "classes"),
    ([*SYNTH, "dataset.shape=[0]"], "shape"),
    # every config group, the run directory and plugins
    (["trainer.steps=-1"], "trainer.steps=-1"),
    (["trainer.steps=100000000000000000000"], "trainer.steps=100000000000000000000"),
    (["trainer.batch_size=1.5"], "trainer.batch_size=1.5"),
    (["trainer.batch_size=abc"], "trainer.batch_size=abc"),
    (["trainer.log_every=-1"], "trainer.log_every=-1"),
    (["trainer.eval_every=-5"], "trainer.eval_every=-5"),
    (["trainer.eval_samples=-1"], "trainer.eval_samples=-1"),
    (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every=-1"),
    (["trainer.keep_checkpoints=-1"], "trainer.keep_checkpoints=-1"),
    (["trainer.threads=-1"], "trainer.threads=-1"),
    (["trainer.threads=100000"], "trainer.threads=100000"),
    (["trainer.threads=abc"], "trainer.threads=abc"),
    (["trainer.comm_timeout_s=abc"], "trainer.comm_timeout_s=abc"),
    (["trainer.dtype=int8"], "trainer.dtype=int8"),
    (["trainer.device=gpu"], "trainer.device=gpu"),
    (["trainer.precision=fp64"], "trainer.precision=fp64"),
    (["trainer.resume=/nonexistent/ckpt"], "trainer.resume=/nonexistent/ckpt"),
    (["grid.pr=abc"], "grid.pr=abc"),
    (["grid.pr=-1"], "grid.pr=-1"),
    (["seed=-5"], "seed=-5"),
    (["seed=[1]"], "seed=[1]"),
    (["optimizer.lr=1e308"], "optimizer.lr"),
    (["optimizer.momentum=-0.1"], "optimizer.momentum"),
    (["optimizer.momentum=1"], "optimizer.momentum"),
    (["optimizer.nesterov=true", "optimizer.momentum=0"], "optimizer.momentum"),
    (["optimizer=adam", "optimizer.betas=[0.9]"], "optimizer.betas=[0.9]"),
    (["optimizer=adam", "optimizer.betas=[1.0,0.9]"], "optimizer.betas"),
    (["optimizer=adam", "optimizer.eps=0"], "optimizer.eps"),
    (["optimizer=adam", "optimizer.eps=-1"], "optimizer.eps"),
    (["optimizer=adamw", "optimizer.weight_decay=-1"], "optimizer.weight_decay"),
    (["optimizer=adam", "optimizer.lr=1e308"], "optimizer.lr"),
    ([*EASGD2, "optimizer.rho=0"], "optimizer.rho"),
    ([*EASGD2, "optimizer.rho=-1"], "optimizer.rho"),
    ([*EASGD2, "optimizer.moving_rate=0"], "optimizer.moving_rate"),
    ([*EASGD2, "optimizer.moving_rate=1"], "optimizer.moving_rate"),
    ([*EASGD2, "optimizer.period=0"], "optimizer.period"),
    ([*EASGD2, "optimizer.period=1.5"], "optimizer.period=1.5"),
    ([*EASGD2, "optimizer.momentum=1"], "optimizer.momentum=1"),
    ([*EASGD2, "optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.schedule=foo"], "optimizer.schedule"),
    (["+optimizer.foo=1"], "optimizer.foo"),
    (["model.hidden=[-1]"], "must be >= 1 (model options: hidden=[-1]"),
    (["model.hidden=abc"], "model.hidden=abc"),
    (["model.activation=swishy"], "model.activation=swishy"),
    (["model=cnn", "model.kernel_size=-3"], "model.kernel_size=-3"),
    (["model=cnn", "model.kernel_size=1.5"], "model.kernel_size=1.5"),
    (["model=cnn", "model.channels=[-1]"], "must be >= 1 (model options: channels=[-1]"),
    ([*GPT, "model.width=0"], "model.width"),
    ([*GPT, "model.heads=0"], "model.heads"),
    ([*GPT, "model.context=0"], "model.context=0"),
    ([*GPT, "model.depth=0"], "model.depth=0"),
    ([*GPT, "model.dropout=1.5"], "model.dropout=1.5"),
    ([*BAG, "model.mode=median"], "model.mode=median"),
    ([*BAG, "model.embedding_dim=0"], "would have shape (10000, 0)"),
    (["model._target_=torch"], "model._target_=torch"),
    (["model._target_=os.path"], "model._target_=os.path"),
    (["model._target_=nosuch.Thing"], "model._target_=nosuch.Thing"),
    (["model._target_=1abc"], "model._target_=1abc"),
    (["model._target_=torch.nn.NoSuchLayer"], "model._target_=torch.nn.NoSuchLayer"),
    ([*SYNTH, "dataset.noise=-1"], "dataset.noise=-1"),
    ([*SYNTH, "dataset.noise=1e308"], "dataset.noise"),
    ([*SYNTH, "dataset.shape=[-1]"], "dataset.shape"),
    ([*SYNTH, "dataset.classes=1"], "dataset.classes"),
    ([*SYNTH, "dataset.val_fraction=0"], "dataset.val_fraction"),
    ([*SYNTH, "dataset.val_fraction=1"], "dataset.val_fraction"),
    ([*GPT, "dataset.vocab_size=0"], "dataset.vocab_size"),
    ([*GPT, "dataset.seq_len=0"], "dataset.seq_len"),
    (["dataset=cifar10", "dataset.root=/nonexistent"], "dataset.root=/nonexistent"),
    (["dataset=nonexistent"], "dataset"),
    ([*DATA2, "strategy.bucket_cap_mb=-1"], "strategy.bucket_cap_mb"),
    ([*DATA2, "strategy.first_bucket_mb=-1"], "strategy.first_bucket_mb"),
    ([*DATA2, "strategy.sparse=foo"], "strategy.sparse=foo"),
    ([*DATA2, "strategy.sparse_hot_rows=-1"], "strategy.sparse_hot_rows=-1"),
    ([*DATA2, "strategy.sparse_partitions=0"], "strategy.sparse_partitions=0"),
    ([*DATA2, "strategy.ranks_per_node=0"], "strategy.ranks_per_node=0"),
    ([*DATA2, "strategy.batch_norm=foo"], "strategy.batch_norm=foo"),
    (["strategy=model", "grid.pr=4", "grid.pc=1", "strategy.tp_layout=foo"],
     "strategy.tp_layout=foo"),
    (["strategy=domain", "strategy.overlap=foo"], "strategy.overlap=foo"),
    (["comm.backend=nccl2"], "comm.backend=nccl2"),
    (["comm.cuda_aware=maybe"], "comm.cuda_aware=maybe"),
    (["objective=foo"], "objective=foo"),
    (["launcher.nproc_flag=x"], "launcher.nproc_flag=x"),
    (["debug.fail_at_step=1", "debug.fail_on_rank=9"], "debug.fail_on_rank=9"),
    (["debug.slow_rank=-1"], "debug.slow_rank=-1"),
    (["debug.slow_rank=9"], "debug.slow_rank=9"),
    (["debug.stage_host_tensors=2"], "debug.stage_host_tensors=2"),
    (["hydra.run.dir=."], "hydra.run.dir"),
    (["hydra.run.dir=/"], "hydra.run.dir=/"),
    (["plugins=[nosuchmodule_xyz]"], "plugins"),
    (["plugins=[os.path.nope]"], "plugins"),
    (["+debug.x=1"], "debug.x"),
    (["+launcher.y=1"], "launcher.y"),
    (["+comm.z=1"], "comm.z"),
    (["trainer.eval_samples=abc"], "trainer.eval_samples=abc"),
    (["trainer.log_every=1.5"], "trainer.log_every=1.5"),
    (["grid.pc=1e3"], "grid.pc"),
    ([f"hydra.run.dir=/tmp/{'y' * 300}"], "is 300 bytes long; this file system takes at most"),
    ([f"hydra.run.dir=/tmp/{'/'.join(['z' * 200] * 25)}"], "file system takes paths of at most"),
    (["trainer.comm_timeout_s=1e-9"], "trainer.comm_timeout_s=1e-09"),
    (["trainer.comm_timeout_s=0.5"], "trainer.comm_timeout_s=0.5"),
    (["trainer.comm_timeout_s=1e308"], "trainer.comm_timeout_s=1e+308"),
    (["debug.slow_seconds=1e308"], "debug.slow_seconds=1e+308"),
    (["debug.slow_seconds=90000"], "debug.slow_seconds=90000"),
    (["debug.fail_at_step=11", "trainer.steps=10"],
     "debug.fail_at_step=11 is past trainer.steps=10"),
    (["trainer.accumulate_steps=0"], "trainer.accumulate_steps=0"),
    (["trainer.accumulate_steps=-2"], "trainer.accumulate_steps=-2"),
    ([*DATA2, "trainer.batch_size=10", "trainer.accumulate_steps=4"],
     "trainer.accumulate_steps=4: trainer.batch_size=10 does not split into 4 equal"),
    (["model=vgg", "dataset=digits", "model.batch_norm=true", *DATA2,
      "trainer.accumulate_steps=2"], "1 (BatchNorm2d), 5 (BatchNorm2d), 9 (BatchNorm2d) "
                                     "normalize by batch statistics"),
    (["model=vgg", "dataset=digits", *EASGD2, "trainer.accumulate_steps=2"],
     "with optimizer=easgd: a replica draws its own masks per forward"),
    (["model=vgg", "dataset=digits", "strategy=model", "grid.pr=1", "grid.pc=1",
      "trainer.accumulate_steps=2"], "strategy=model draws random numbers per forward"),
    (["trainer.activation_checkpointing=nosuch.*"],
     "trainer.activation_checkpointing=nosuch.*: matches no module of Sequential"),
    (["trainer.activation_checkpointing=units"], "Sequential has no nn.ModuleList"),
    (["model=vgg", "dataset=digits", "model.batch_norm=true",
      "trainer.activation_checkpointing=1"],
     "1 (BatchNorm2d) normalizes by batch statistics inside 1"),
    ([*PLANNED, "strategy.plan={nosuch.*: colwise}"],
     "strategy.plan: nosuch.* matches no module of the model"),
    ([*PLANNED, "strategy.plan={norm: colwise}"],
     "norm (LayerNorm): colwise splits a Linear or a Conv1D"),
    ([*PLANNED, "strategy.plan={head: diagonal}"], "head: diagonal is not a style"),
    ([*PLANNED, "strategy.plan={head: colwise}", "grid.pr=3"],
     "head (Linear): its 10000 output features do not divide over grid.pr=3"),
    ([*PLANNED, ATTENTION_PLAN, "model.heads=2", "grid.pr=4"],
     "blocks.0.attn (HeadsAttention): its heads=2 does not divide over grid.pr=4"),
    ([*PLANNED, ATTENTION_PLAN, "model._target_=tests.plan_models.FixedHeadsLM"],
     "blocks.0.attn (FixedHeadsAttention): cannot adjust its local_heads=4"),
    ([*PLANNED, "strategy.plan={blocks.*.fc1: colwise}"],
     "blocks.0.fc2 (Linear) runs on the features blocks.0.fc1 split over the model group"),
    ([*PLANNED, "strategy.plan={blocks.*.fc2: rowwise}"],
     "blocks.0.fc2 (Linear) is rowwise but no colwise module before it splits"),
    ([*PLANNED, "strategy.plan={blocks.0.fc1: vocab}"],
     "blocks.0.fc1 (Linear): vocab splits a projection only where its output is the model's "
     "output"),
    # what every rank would meet at its first step: the head sees it in the parts it builds
    ([*DATA2, "optimizer._target_=torch.optim.SparseAdam"],
     "optimizer._target_=torch.optim.SparseAdam takes only row-sparse gradients (an "
     "embedding's with sparse=True), and the model's 1.weight and 5 more get dense ones"),
    ([*BAG, "model.sparse=true", "optimizer._target_=torch.optim.SparseAdam"],
     "and the model's 1.weight and 3 more get dense ones"),
    ([*SYNTH, "dataset.shape=[10]", "model._target_=torch.nn.Identity"],
     "model._target_=torch.nn.Identity: Identity has no trainable parameters (it has none)"),
    (["model._target_=tests.test_user_code.frozen_mlp"],
     "Sequential has no trainable parameters (every one has requires_grad=False)"),
    # a __len__ past the rows: the head reads the last row
    (["dataset._target_=tests.test_user_code.rows_with", "dataset.length=401"],
     "the train set's row 400 cannot be read (IndexError: index 400 is out of bounds for "
     "dimension 0 with size 400): its __len__ says 401 rows"),
]


def test_the_table_is_large_enough() -> None:
    assert len(BAD) >= 200


@pytest.mark.parametrize(("overrides", "fragment"), BAD,
                         ids=[" ".join(o) for o, _ in BAD])
def test_a_bad_value_is_one_line_naming_it(overrides: list[str], fragment: str, tmp_path: Path,
                                           capfd: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    args = overrides if any(o.startswith("hydra.run.dir=") for o in overrides) else \
        [*overrides, f"hydra.run.dir={run_dir}"]
    try:
        problem = precheck(args)
    finally:
        release_run_dirs()  # a value this table wrongly lets through must not hold its lock
    assert problem, f"{overrides} was accepted"
    assert "\n" not in problem and fragment in problem, problem
    assert not run_dir.exists(), "a refused config must not leave a run directory"
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == "", printed  # e.g. no torch warning above it


def test_a_run_directory_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from runner.records.rundir import lock_run_dir; "
         f"lock_run_dir({str(run_dir)!r}); print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # holds until killed
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        problem = precheck([f"hydra.run.dir={run_dir}"])
        assert problem is not None and "in use by another run" in problem
        assert f"pid {holder.pid}" in problem
    finally:
        holder.kill()
        holder.wait()
    # the holder died without releasing: its lock file stays, its flock went with it
    assert (run_dir / LOCK_FILE).exists()
    try:
        assert precheck([f"hydra.run.dir={run_dir}"]) is None
        owner = json.loads((run_dir / LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid()
    finally:
        release_run_dirs()
    assert not (run_dir / LOCK_FILE).exists()


def test_metrics_lines_are_whole_or_absent(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write({"step": 1, "loss": 1.0})
    real_write = os.write

    def half_then_full(fd: int, data: bytes) -> int:  # the disk fills up mid-line
        return real_write(fd, data[:len(data) // 2])

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as failed:
        writer.write({"step": 2, "loss": 0.5, "padding": "x" * 100})
    monkeypatch.undo()
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert "No space left on device" in str(failed.value)
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_a_full_disk_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write the disk refuses outright (`/dev/full` is no regular file: a run never writes
    its metrics into one)."""
    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(path)

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as failed:
        writer.write({"step": 1})
    monkeypatch.undo()
    writer.close()
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(path)
    assert path.read_bytes() == b""


def test_a_failed_atomic_write_leaves_no_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as failed:
        atomic_write_text(tmp_path / "summary.json", "{}")
    assert failed.value.filename == str(tmp_path / "summary.json")
    assert list(tmp_path.iterdir()) == []


def test_checking_a_bad_value_is_quick() -> None:
    """The head refuses without the heavy parts: a type error costs no model at all."""
    started = time.perf_counter()
    for _ in range(5):
        assert precheck(["optimizer.lr=abc", "hydra.run.dir=/nonexistent/x"])
    assert (time.perf_counter() - started) / 5 < 2.0


def test_two_runs_into_one_directory_through_the_command_line(tmp_path: Path) -> None:
    """The second run is refused in one line while the first trains on, undisturbed: its
    summary is its own seed's, and its lock is gone when it ends. The first is held at its
    step 2 (`tests.gates`) until the second has been refused."""
    from tests.conftest import ROOT, read_summary, run_cli
    from tests.gates import Gate

    run_dir = tmp_path / "shared"
    gate = Gate(tmp_path / "gate", hold_at=2)
    first = subprocess.Popen(
        [sys.executable, "-m", "runner", "grid.pr=1", "grid.pc=2", "trainer.steps=10",
         *gate.overrides, "seed=1", f"hydra.run.dir={run_dir}"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        gate.wait_held(2, job=first)
        second = run_cli("grid.pr=1", "grid.pc=2", "trainer.steps=5", "seed=2",
                         f"hydra.run.dir={run_dir}", timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip().splitlines() == [
            line for line in second.stderr.strip().splitlines() if "in use by another run" in line]
        assert f"pid {first.pid}" in second.stderr
    finally:
        gate.release()
        _, err = first.communicate(timeout=240)
    assert first.returncode == 0, err
    summary = read_summary(run_dir)
    assert summary["seed"] == 1 and summary["steps"] == 10
    assert not (run_dir / LOCK_FILE).exists()


def test_the_run_directory_checked_and_locked_is_the_one_the_run_uses(tmp_path: Path) -> None:
    """The default `outputs/<date>/<time>` is resolved once: Hydra's second composition, seconds
    after the head's check, must not name (and leave) another, empty directory."""
    from tests.conftest import ROOT

    result = subprocess.run([sys.executable, "-m", "runner", "grid.pr=1", "grid.pc=1",
                             "trainer.steps=2"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    made = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(made) == 1 and (made[0] / "summary.json").exists(), made


def test_the_heads_check_of_a_good_config_stays_light(tmp_path: Path) -> None:
    """Validation, the memory estimate and the machine checks of a small model never load the
    meta kernels (torch._dynamo and sympy: 1-2 s of every run's start, see bench/startup.py)."""
    from tests.conftest import ROOT

    code = ("import sys; from runner.cli.app import precheck; "
            f"assert precheck(['hydra.run.dir={tmp_path / 'run'}']) is None; "
            "heavy = [m for m in ('torch._dynamo', 'sympy', 'sklearn') if m in sys.modules]; "
            "print(heavy)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("launcher,named", [
    (["launcher.command=/bin/false"], "the launcher (/bin/false) exited with code 1"),
    (["launcher.args=[--bogus-flag]"], "--bogus-flag) exited with code 255"),
])
def test_a_launcher_that_starts_no_rank_is_named_as_the_cause(
        launcher: list[str], named: str, tmp_path: Path) -> None:
    """The launcher fails before any rank runs: the last line says so, not only "the job
    failed"."""
    from tests.conftest import run_cli

    result = run_cli("strategy=data", "grid.pr=1", "grid.pc=2", "trainer.steps=2", *launcher,
                     f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert named in last and "before any rank started" in last, last


def _declared_keys() -> list[tuple[str, dict[str, object]]]:
    """(dotted key, field metadata) of every schema key that declares its choices or range."""
    import dataclasses

    from runner.config.schema import ConfigSchema

    found: list[tuple[str, dict[str, object]]] = []
    for section in dataclasses.fields(ConfigSchema):
        schema = section.default_factory if section.default_factory is not dataclasses.MISSING \
            else None
        if isinstance(schema, type) and dataclasses.is_dataclass(schema):
            found += [(f"{section.name}.{f.name}", dict(f.metadata))
                      for f in dataclasses.fields(schema) if f.metadata]
        elif section.metadata:
            found.append((section.name, dict(section.metadata)))
    return found


def test_every_declared_choice_and_range_is_checked_by_the_parse() -> None:
    """A value outside what a schema field declares is named by the parse itself (no key has
    its own check elsewhere), and its default stands in for the later checks."""
    from runner.config.schema import parse_with_problems
    from runner.core.grid import GridShape

    declared = _declared_keys()
    assert len(declared) >= 20  # every choice key and every bounded number
    for key, metadata in declared:
        if "choices" in metadata:
            bad: object = "no-such-choice"
        elif "maximum" in metadata:
            bad = metadata["maximum"] * 2  # type: ignore[operator]
        else:
            bad = metadata["minimum"] - 1  # type: ignore[operator]
        section, _, name = key.rpartition(".")
        config: dict[str, object] = ({section: {name: bad}} if section else {name: bad})
        run, problems = parse_with_problems({**config, "model": {"name": "mlp"},
                                             "dataset": {"name": "digits"},
                                             "strategy": {"name": "data"},
                                             "optimizer": {"name": "sgd"}})
        assert len(problems) == 1 and problems[0].startswith(f"{key}="), (key, problems)
        assert run.grid == GridShape(2, 2) or key.startswith("grid.")


# -- a validation set too small for the grid ----------------------------------------------------

def test_an_empty_validation_shard_gives_one_processs_numbers(tmp_path: Path) -> None:
    """`trainer.eval_samples=1` leaves one of the default grid's two batch groups without a
    validation row: the run completes, and its validation is one process's."""
    from tests.conftest import assert_ok, read_metrics, read_summary, run_cli_together

    common = ["trainer.steps=3", "trainer.eval_samples=1", "trainer.dtype=float64"]
    grid, one = tmp_path / "grid", tmp_path / "one"
    for result in run_cli_together([*common, f"hydra.run.dir={grid}"],
                                   [*common, "grid.pr=1", "grid.pc=1", f"hydra.run.dir={one}"]):
        assert_ok(result)
    got, want = read_summary(grid), read_summary(one)
    assert got["grid"] == {"pr": 2, "pc": 2}
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-9)
    assert got["val_accuracy"] == want["val_accuracy"]
    val = [r for r in read_metrics(grid) if r.get("split") == "val"]
    assert val and val[-1]["loss"] == pytest.approx(want["val_loss"], rel=1e-9)


def test_an_empty_validation_shard_under_every_strategy(tmp_path: Path) -> None:
    """tests/mpi/check_empty_shards.py: sets of 1 and 3 rows on grids of 2 and 4 batch groups
    under data, model, grid, domain, auto, fsdp (1-D and 2-D) and plans, against one process."""
    from tests.conftest import run_mpi_script

    script = "tests/mpi/check_empty_shards.py"
    result = run_mpi_script(script, 4, str(tmp_path))
    passed = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert result.returncode == 0 and len(passed) == 2, result.stderr[-4000:]
