"""On a GPU, through the real command line: devices, staging, NCCL and mixed precision.

Skipped where torch sees no GPU (CI, a CPU-only machine): the whole module is marked. The
tests of NCCL between GPUs (one rank per GPU: NCCL refuses two ranks on one GPU) are skipped
where the machine has fewer GPUs than they have ranks; on one GPU the NCCL tests are those of a
one-rank group and of CUDA-event timing.
On a GPU machine every run is small (the default 64→128→128→10 MLP on digits), so the module
takes about a minute, most of it interpreters importing torch and initialising CUDA.

Losses are compared per step by the largest gap relative to the reference loss, <= 1e-4, as
tests/test_cli_runs.py compares at 1e-5 on the CPU: relative, so that the tolerance reads the same
whatever the size of the loss (here ~2.3 falling to ~2.0 over the 20 steps); 1e-4 because a
GPU's kernels sum in another order than the CPU's, and four ranks' all-reduce in another order
than one process, a few float32 ulps per operation compounded over 20 steps (seen on the CPU:
2e-7 between 1 and 4 ranks). It holds only with TF32 matmuls off
(`torch.backends.cuda.matmul.allow_tf32`, False by default in PyTorch): the runner must not turn
them on in fp32 (TF32 keeps 10 mantissa bits, ~5e-4 relative per product: these tests would
likely, not surely, see it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from runner.core import CommCounter, CommWatchdog, CountedComm, torch_transport, torchdist
from runner.core.staging import StagedTransport
from runner.training.devices import place_rank
from strategies.layers.whole_batch import RandomDrawError, RowDraws, forward_key
from strategies.probe import draw_plan
from tests.conftest import (
    ROOT,
    RunCache,
    read_metrics,
    read_summary,
    run_mpi_script,
    train_losses,
)
from tests.test_failures import finish, job_processes, start_cli, wait_for_step
from tests.test_mpi_checks import _declared_checks
from tests.test_whole_batch import CASES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

STEPS = 20
LONG_STEPS = 300  # bf16 against fp32 on accuracy: trained, not 20 steps into it
GAP = 1e-4
COMMON = ["trainer.eval_every=null", "seed=1"]  # null: evaluated once, at the end
DATA = ["strategy=data", "grid.pr=1"]
CUDA = ["trainer.device=cuda"]
STAGED = ["comm.backend=mpi", "comm.cuda_aware=false"]  # GPU tensors through pinned host buffers
RUNS: dict[str, list[str]] = {
    "cpu_p1": [*DATA, "grid.pc=1", "trainer.device=cpu", f"trainer.steps={STEPS}"],
    "cuda_p1": [*DATA, "grid.pc=1", *CUDA, "trainer.precision=fp32", f"trainer.steps={STEPS}"],
    # four ranks sharing the one GPU
    "cuda_data_1x4_mpi": [*DATA, "grid.pc=4", *CUDA, *STAGED, f"trainer.steps={STEPS}"],
    "cuda_grid_2x2_mpi": ["strategy=grid", "grid.pr=2", "grid.pc=2", *CUDA, *STAGED,
                          f"trainer.steps={STEPS}"],
    # ranks that share a GPU cannot use NCCL: gloo, through host copies
    "cuda_data_1x4_torch": [*DATA, "grid.pc=4", *CUDA, "comm.backend=torch",
                            f"trainer.steps={STEPS}"],
    # one rank: no process group at all (the summary says no collective ran)
    "cuda_p1_torch": [*DATA, "grid.pc=1", *CUDA, "comm.backend=torch", f"trainer.steps={STEPS}"],
    # two ranks, each seeing every GPU, on a machine of two or more: one GPU each, NCCL
    "cuda_data_1x2_torch": [*DATA, "grid.pc=2", *CUDA, "comm.backend=torch",
                            f"trainer.steps={STEPS}"],
    "cuda_fp32_long": [*DATA, "grid.pc=1", *CUDA, "trainer.precision=fp32",
                       f"trainer.steps={LONG_STEPS}"],
    "cuda_bf16_long": [*DATA, "grid.pc=1", *CUDA, "trainer.precision=bf16",
                       f"trainer.steps={LONG_STEPS}"],
}
# The transformers library's Llama split by its declared plan (q/k/v, gate and up colwise, o and
# down rowwise, the head colwise), and GPT-2 by the plan derived from its modules (its fused
# `c_attn` Conv1D by chunk), each against its own one-process run on the GPU.
LM = ["dataset=tokens", "dataset.vocab_size=64", "dataset.seq_len=16", "dataset.samples=512",
      "trainer.batch_size=16", f"trainer.steps={STEPS}"]
LLAMA = [*LM, "model._target_=tests.plan_models.hf_llama"]
GPT2 = [*LM, "model._target_=tests.plan_models.hf_gpt2"]
PLANNED: dict[str, list[str]] = {
    "llama_p1": [*LLAMA, *DATA, "grid.pc=1", *CUDA],
    "llama_model_2x1_mpi": [*LLAMA, "strategy=model", "grid.pr=2", "grid.pc=1", *CUDA, *STAGED],
    "llama_grid_2x2_torch": [*LLAMA, "strategy=grid", "grid.pr=2", "grid.pc=2", *CUDA,
                             "comm.backend=torch"],
    "llama_p1_bf16": [*LLAMA, *DATA, "grid.pc=1", *CUDA, "trainer.precision=bf16"],
    "llama_model_2x1_bf16": [*LLAMA, "strategy=model", "grid.pr=2", "grid.pc=1", *CUDA,
                             *STAGED, "trainer.precision=bf16"],
    "gpt2_p1": [*GPT2, *DATA, "grid.pc=1", *CUDA],
    "gpt2_model_2x1_mpi": [*GPT2, "strategy=model", "grid.pr=2", "grid.pc=1", *CUDA, *STAGED],
}
RUNS.update(PLANNED)
BF16_GAP = 2e-2  # bf16 keeps 8 mantissa bits: two ranks' partial sums round apart (~4e-3 each)


Runs = RunCache


@pytest.fixture(scope="session")
def gpu_runs(session_tmp: Path) -> Runs:
    root = session_tmp / "gpu"
    root.mkdir()
    return RunCache(root, {name: (overrides, None) for name, overrides in RUNS.items()}, COMMON)


def _relative_gap(reference: list[float], other: list[float]) -> float:
    assert reference and len(reference) == len(other)
    return max(abs(a - b) / abs(a) for a, b in zip(reference, other, strict=True))


def _precision(summary: dict) -> str:
    """summary.json's `precision`: "fp32", or a record naming it ({"name": "fp32", ...})."""
    value = summary["precision"]
    return value["name"] if isinstance(value, dict) else value


def test_one_process_on_cuda_reproduces_the_cpu_losses(gpu_runs: Runs) -> None:
    cpu, cuda = train_losses(gpu_runs("cpu_p1")), train_losses(gpu_runs("cuda_p1"))
    assert len(cuda) == STEPS
    assert _relative_gap(cpu, cuda) <= GAP


def _check_buffers(summary: dict, expected: str) -> None:
    """How device tensors travelled, where the summary says (`device_buffers`)."""
    if "device_buffers" in summary:
        assert summary["device_buffers"].startswith(expected), summary["device_buffers"]


@pytest.mark.parametrize("name,buffers", [
    ("cuda_data_1x4_mpi", "staged"), ("cuda_grid_2x2_mpi", "staged"),
    ("cuda_data_1x4_torch", "staged"),  # four ranks on one GPU: no NCCL
])
def test_four_ranks_sharing_the_gpu_reproduce_one_process_and_move_the_predicted_bytes(
        gpu_runs: Runs, name: str, buffers: str) -> None:
    run_dir = gpu_runs(name)
    summary = read_summary(run_dir)
    assert summary["world_size"] == 4
    _check_buffers(summary, buffers)
    assert _relative_gap(train_losses(gpu_runs("cuda_p1")), train_losses(run_dir)) <= GAP
    predicted = summary["predicted_comm_bytes_per_step"]
    assert predicted > 0 and summary["comm_bytes_per_step"] == predicted
    assert all(m["comm_bytes"] == predicted for m in read_metrics(run_dir) if "split" not in m)


def test_the_torch_backend_on_one_gpu_runs_and_equals_the_mpi_run(gpu_runs: Runs) -> None:
    run_dir = gpu_runs("cuda_p1_torch")
    summary = read_summary(run_dir)
    assert summary["comm_backend"] == "torch"
    assert summary["device_buffers"] == "none: one rank"  # no process group at one rank
    losses = train_losses(run_dir)
    assert len(losses) == STEPS
    assert _relative_gap(train_losses(gpu_runs("cuda_p1")), losses) <= GAP


def test_ranks_sharing_the_gpu_are_named_by_its_uuid_in_the_summary_and_one_warning(
        gpu_runs: Runs) -> None:
    run_dir = gpu_runs("cuda_data_1x4_torch")
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    buffers = read_summary(run_dir)["device_buffers"]
    assert buffers.startswith("staged through host buffers (gloo); 4 ranks share "), buffers
    assert uuid in buffers and buffers.endswith("(ranks 0, 1, 2, 3)"), buffers
    warned = [line for line in gpu_runs.results["cuda_data_1x4_torch"].stderr.splitlines()
              if line.startswith("warning: ") and "ranks share" in line]
    assert len(warned) == 1 and uuid in warned[0], warned
    assert "4 ranks share" in (run_dir / "logs" / "rank0.log").read_text()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_each_on_a_gpu_of_their_own_use_nccl_and_equal_one_process(
        gpu_runs: Runs) -> None:
    run_dir = gpu_runs("cuda_data_1x2_torch")
    summary = read_summary(run_dir)
    assert summary["device_buffers"] == "direct (NCCL)", summary["device_buffers"]
    assert [d.split(" ")[0] for d in summary["devices"]] == ["cuda:0", "cuda:1"]
    assert _relative_gap(train_losses(gpu_runs("cuda_p1")), train_losses(run_dir)) <= GAP


def test_a_rank_is_placed_on_its_gpu_by_uuid() -> None:
    placement = place_rank("cuda", None)
    assert placement.device == torch.device("cuda", 0)
    assert placement.uuid == str(torch.cuda.get_device_properties(0).uuid)
    assert placement.gpus == torch.cuda.device_count()


class _TwoRanksOnHost:
    """A host transport for two ranks holding the same tensors: a sum doubles, at once."""

    backend = "mpi"
    rank, size = 0, 2

    def iallreduce_(self, tensor: torch.Tensor) -> _Done:
        assert tensor.device.type == "cpu" and tensor.is_pinned()
        tensor.mul_(2)
        return _Done()

    def allreduce_(self, tensor: torch.Tensor) -> None:
        tensor.mul_(2)


class _Done:
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


SLEEP_CYCLES = 200_000_000  # a kernel of about 0.1 s at 2 GHz: the stream stays busy meanwhile


class _HostWaits:
    """Counts the host's waits for the GPU through torch.cuda's calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for owner, name in ((torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"),
                            (torch.cuda.Stream, "synchronize")):
            original = getattr(owner, name)

            def counted(*args: Any, original: Any = original, **kwargs: Any) -> Any:
                self.count += 1
                return original(*args, **kwargs)

            monkeypatch.setattr(owner, name, counted)


def test_a_staged_iallreduce_issued_in_a_gradient_hook_leaves_the_host_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy to the host is queued behind the kernels before it, on a side stream: the hook
    returns while the GPU is still busy, and nothing waits on the host."""
    staged = StagedTransport(_TwoRanksOnHost())
    bucket = torch.ones(1 << 20, device="cuda")
    staged.iallreduce_(bucket).wait()  # the side stream and a pooled buffer, as after step 1
    torch.cuda.synchronize()
    weight = torch.nn.Parameter(torch.ones(8, device="cuda"))
    seen: dict[str, Any] = {}
    waits = _HostWaits(monkeypatch)

    def hook(param: torch.Tensor) -> None:
        torch.cuda._sleep(SLEEP_CYCLES)
        bucket.fill_(3.0)  # written by the stream before the copy: the copy must see it
        seen["request"] = staged.iallreduce_(bucket)
        seen["busy"] = not torch.cuda.current_stream().query()
        seen["tested"] = seen["request"].test()  # too early: the copy is still queued
        seen["waits"] = waits.count

    weight.register_post_accumulate_grad_hook(hook)
    (weight * 2).sum().backward()
    assert seen["busy"] and seen["waits"] == 0 and not seen["tested"]
    seen["request"].wait()
    torch.cuda.synchronize()
    assert torch.equal(bucket, torch.full_like(bucket, 6.0))


def test_a_staged_result_is_copied_back_behind_the_stream_without_a_host_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    staged = StagedTransport(_TwoRanksOnHost())
    tensor = torch.ones(1 << 20, device="cuda")
    request = staged.iallreduce_(tensor)
    torch.cuda.synchronize()  # the copy in is done: test() starts the sum and completes it
    waits = _HostWaits(monkeypatch)
    torch.cuda._sleep(SLEEP_CYCLES)
    assert request.test()
    assert not torch.cuda.current_stream().query() and waits.count == 0
    after = tensor * 1  # on the current stream: runs after the copy back
    assert torch.equal(after, torch.full_like(tensor, 2.0))
    kept = staged.pool._kept
    assert kept and all(flat.is_pinned() for _, flat, _ in kept)
    staged.allreduce_(tensor)  # the same size again: the pool's buffer, once its copy is done
    assert torch.equal(tensor, torch.full_like(tensor, 4.0))
    assert staged.pool.allocated_bytes == tensor.numel() * tensor.element_size()


def test_a_cpu_run_on_a_gpu_machine_makes_no_cuda_context() -> None:
    """Placement on the CPU and the staged path with host tensors (debug.stage_host_tensors)
    leave CUDA uninitialised: nothing pinned, no stream, no query."""
    code = (
        "import torch\n"
        "from runner.core.staging import StagedTransport\n"
        "from runner.core.torch_transport import LocalTransport\n"
        "from runner.training.devices import place_rank\n"
        "assert place_rank('cpu', None).device.type == 'cpu'\n"
        "staged = StagedTransport(LocalTransport(), force=True)\n"
        "x = torch.ones(8)\n"
        "staged.allreduce_(x)\n"
        "staged.iallreduce_(x).wait()\n"
        "print(torch.cuda.is_initialized())\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_bf16_trains_digits_to_the_accuracy_of_fp32(gpu_runs: Runs) -> None:
    fp32, bf16 = read_summary(gpu_runs("cuda_fp32_long")), read_summary(gpu_runs("cuda_bf16_long"))
    assert _precision(fp32) == "fp32" and _precision(bf16) == "bf16"
    assert fp32["steps"] == bf16["steps"] == LONG_STEPS
    assert fp32["val_accuracy"] > 0.9, fp32["val_accuracy"]  # trained: chance is 0.1
    assert abs(bf16["val_accuracy"] - fp32["val_accuracy"]) <= 0.02, (bf16["val_accuracy"],
                                                                      fp32["val_accuracy"])


@pytest.mark.parametrize("name,precision", [
    ("cuda_p1", "fp32"), ("cuda_data_1x4_mpi", "fp32"), ("cuda_grid_2x2_mpi", "fp32"),
    ("cuda_data_1x4_torch", "fp32"), ("cuda_p1_torch", "fp32"), ("cuda_bf16_long", "bf16"),
])
def test_the_summary_names_each_ranks_gpu_and_the_precision(gpu_runs: Runs, name: str,
                                                           precision: str) -> None:
    summary = read_summary(gpu_runs(name))
    devices = summary["devices"]
    assert len(devices) == summary["world_size"]
    gpus = torch.cuda.device_count()  # rank r on GPU local_rank % GPUs: one node here
    for rank, device in enumerate(devices):
        assert device.startswith(f"cuda:{rank % gpus} ("), (rank, device)
        assert torch.cuda.get_device_name(rank % gpus) in device
    assert _precision(summary) == precision
    assert read_summary(gpu_runs("cpu_p1"))["devices"] == ["cpu"]


def _rows_on_cuda(model: torch.nn.Module, x: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of `x` as the rank holding them draws them, on the GPU."""
    torch.manual_seed(1)
    with RowDraws(draw_plan(model, x.shape[1:]), forward_key(), start, rows):
        return model(x[start:start + rows])


@pytest.mark.parametrize("case", CASES)
def test_on_cuda_each_rank_draws_its_rows_as_one_process_does(case: str) -> None:
    """CUDA's dropout is one operator (`native_dropout`, not the CPU's `bernoulli_`), and
    attention with dropout picks a fused kernel that draws inside itself (also inside
    `nn.MultiheadAttention`): drawn row by row all the same, by torch's math attention."""
    build, shape = CASES[case]
    torch.manual_seed(0)
    model = build().cuda()
    x = torch.randn(6, *shape, device="cuda")
    whole = _rows_on_cuda(model, x, 0, 6)
    for start in (0, 3):
        torch.testing.assert_close(_rows_on_cuda(model, x, start, 3), whole[start:start + 3],
                                   rtol=1e-6, atol=1e-6)


class FusedAttention(torch.nn.Module):
    """Calls the fused kernel's operator itself, as a kernel library would."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False,
                                                                     dropout_p=0.3)[0]
        return out.flatten(1)


def test_on_cuda_a_fused_attention_kernel_called_with_dropout_is_refused() -> None:
    model = FusedAttention().cuda()
    x = torch.randn(6, 5, 16, device="cuda")
    with (pytest.raises(RandomDrawError, match="fused kernel"),
          RowDraws(draw_plan(model, x.shape[1:]), forward_key(), 0, 6)):
        model(x)


@pytest.mark.parametrize("name,reference,gap", [
    ("llama_model_2x1_mpi", "llama_p1", GAP), ("llama_grid_2x2_torch", "llama_p1", GAP),
    ("llama_model_2x1_bf16", "llama_p1_bf16", BF16_GAP), ("gpt2_model_2x1_mpi", "gpt2_p1", GAP),
])
def test_on_cuda_a_model_split_by_its_plan_reproduces_one_process(
        gpu_runs: Runs, name: str, reference: str, gap: float) -> None:
    """Ranks sharing the GPU hold their heads and features of each planned projection (through
    host buffers: no NCCL between ranks of one GPU), and train as one process on it does."""
    run_dir = gpu_runs(name)
    summary = read_summary(run_dir)
    assert any(style == "colwise" for style in summary["layouts"].values()), summary["layouts"]
    assert all(device.startswith("cuda:") for device in summary["devices"])
    losses = train_losses(run_dir)
    assert len(losses) == STEPS
    assert _relative_gap(train_losses(gpu_runs(reference)), losses) <= gap
    assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"] > 0


# -- NCCL: one rank per GPU ------------------------------------------------------------------------

NCCL_CHECKS = "tests/mpi/check_nccl.py"


def _one_gpu_per_rank(ranks: int) -> None:
    gpus = torch.cuda.device_count()
    if gpus < ranks:
        pytest.skip(f"NCCL needs a GPU per rank (it refuses two ranks on one GPU): {ranks} "
                    f"ranks, {gpus} GPU(s) here")


@pytest.mark.parametrize("ranks", [2, 4])
def test_nccl_collectives_and_exchanges_equal_the_host_path(ranks: int) -> None:
    """Every operation of the counted communicator on GPU tensors through NCCL (the padded
    uneven all-gather and reduce-scatter, all-to-all-v, halos and the ring shift by
    `batch_isend_irecv`) against the same grid's gloo path on host tensors: equal results, equal
    records (bytes), nothing staged, seconds from CUDA events (tests/mpi/check_nccl.py). Skipped
    where the machine has fewer GPUs than `ranks`: NCCL needs one GPU per rank."""
    _one_gpu_per_rank(ranks)
    result = run_mpi_script(NCCL_CHECKS, ranks, "--backend=torch")
    passed = {line.split()[1] for line in result.stdout.splitlines() if line.startswith("ok ")}
    missing = [name for name in _declared_checks(NCCL_CHECKS) if name not in passed]
    assert result.returncode == 0 and not missing, (
        f"exit {result.returncode}, not passed: {missing}\n{result.stderr[-4000:]}")


def test_a_collective_hung_on_the_gpus_ends_the_job_within_the_timeout() -> None:
    """Rank 1 sleeps outside any collective; rank 0's all-reduce through NCCL returns at once
    and its host waits on the device (`torch.cuda.synchronize()`, as a loss read): its watchdog
    (1 s) still sees the operation in flight and ends the job. Skipped with fewer than 2 GPUs:
    NCCL needs one GPU per rank."""
    _one_gpu_per_rank(2)
    started = time.monotonic()
    result = run_mpi_script(NCCL_CHECKS, 2, "hang", "--backend=torch", timeout=120)
    elapsed = time.monotonic() - started
    assert result.stdout.splitlines() == ["issued"], result.stdout
    assert result.returncode != 0, result.stderr
    assert ("rank 0: allreduce 'hang' on group world (2 ranks) did not complete within 1 s"
            in result.stderr), result.stderr
    assert elapsed < 60, f"the job took {elapsed:.1f} s to end"  # start-up included


def test_under_nccl_a_hung_rank_is_named_and_the_job_ends_within_the_timeout(
        tmp_path: Path) -> None:
    """The command line on 2 GPUs under NCCL: rank 1 hangs in step 3 outside any collective;
    rank 0 names it from its watchdog within `trainer.comm_timeout_s` of the collective its
    device never completes, as tests/test_failures.py checks on the CPU. Skipped with fewer
    than 2 GPUs: NCCL needs one GPU per rank."""
    _one_gpu_per_rank(2)
    run_dir = tmp_path / "nccl_hung"
    timeout = 5
    job = start_cli(*DATA, "grid.pc=2", *CUDA, "comm.backend=torch", "trainer.steps=100",
                    "trainer.eval_every=null", "debug.fail_at_step=3", "debug.fail_on_rank=1",
                    "debug.fail_mode=hang", f"trainer.comm_timeout_s={timeout}",
                    f"hydra.run.dir={run_dir}")
    seen = wait_for_step(job, run_dir, 2)
    out, err, ended = finish(job, run_dir, timeout=timeout + 60)
    assert job.returncode not in (0, 2), f"exit {job.returncode}\n{out}\n{err}"
    assert ended - seen < timeout + 15, f"{ended - seen:.1f} s after step 2\n{err}"
    summary = read_summary(run_dir)
    timed_out = summary["timed_out"]
    assert timed_out["rank"] == 0 and timed_out["missing_ranks"] == [1], timed_out
    assert "in step 3 did not complete within 5 s" in summary["error"], summary["error"]
    assert "rank 1 did not arrive" in summary["error"], summary["error"]
    assert not job_processes(run_dir)


class SpinningTransport:
    """Stands for NCCL on the one GPU a machine may have: its all-reduce queues a kernel that
    spins for `cycles` GPU clock cycles on the current stream and returns at once."""

    backend = "torch"
    rank, size = 0, 2

    def __init__(self) -> None:
        self.cycles = 0

    def stream_ordered(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def allreduce_(self, tensor: torch.Tensor) -> None:
        torch.cuda._sleep(self.cycles)


def test_on_one_gpu_operations_the_host_does_not_wait_for_are_timed_and_watched() -> None:
    """Real CUDA events (`runner.core.comm.cuda_mark`): an operation left to the stream counts
    at once and its seconds when the totals are read; one the device does not complete in
    time fires the watchdog while the host has moved on."""
    transport = SpinningTransport()
    counter = CommCounter(keep_records=True)
    comm = CountedComm(None, counter, "world", transport)  # type: ignore[arg-type]
    x = torch.zeros(4, device="cuda")
    fired: list[str] = []
    with CommWatchdog(counter, 0.3, 0, lambda message, _: fired.append(message),
                      interval=0.02):
        before = counter.snapshot()
        transport.cycles = 10**6  # about a millisecond
        comm.allreduce_(x, label="short")
        assert counter.totals.calls == 1 and counter._on_device
        spent = counter.since(before)
        assert 0 < spent.seconds < 0.3 and not counter._on_device, spent
        transport.cycles = 4 * 10**9  # seconds at any GPU's clock
        issued = time.monotonic()
        comm.allreduce_(x, label="long")
        assert time.monotonic() - issued < 0.1, "the host waited for the device"
        assert counter.in_flight is None and counter.watched() is not None
        time.sleep(1.0)
        assert fired == ["rank 0: allreduce 'long' on group world (2 ranks) did not complete "
                         "within 0.3 s (the communication timeout); a peer may have hung or "
                         "died"], fired
    torch.cuda.synchronize()
    assert counter.since(before).seconds > 1.0
    assert [r.label for r in counter.records] == ["short", "long"]
    assert counter.records[1].seconds > 1.0


def test_on_one_gpu_a_one_rank_nccl_group_takes_the_native_calls() -> None:
    """The one NCCL group a single GPU allows: one rank, made as a grid's are (an NCCL backend
    on the group, connected at once), outside an MPI job (the session set by hand). Its
    all-gather, reduce-scatter and all-to-all are NCCL's on the device tensors, timed by CUDA
    events; the multi-rank paths are in tests/mpi/check_nccl.py."""
    torch.cuda.set_device(0)
    assert torchdist._session is None
    torchdist._session = torchdist._Session(0, 1, None, dist.HashStore(),
                                            torchdist.process_group_timeout(60), False)
    try:
        transport = torch_transport.TorchTransport([0], ("cpu", "cuda"))
        assert type(transport.groups.backends["cuda"]).__name__ == "ProcessGroupNCCL"
        counter = CommCounter(keep_records=True)
        comm = CountedComm(None, counter, "world", transport)
        x = torch.arange(6.0, device="cuda")
        results: list[Any] = []
        for run in (lambda out: comm.allgatherv_(x, out, [6], "gather"),
                    lambda out: comm.reduce_scatter_(x, out, [6], "scatter"),
                    lambda out: comm.alltoallv_(x, [6], out, [6], "all-to-all")):
            out = torch.full_like(x, -1)
            run(out)
            results.append(out)
        assert len(counter._on_device) == 3  # timed on the device
        counter.snapshot()
        assert not counter._on_device
        for out in results:
            assert torch.equal(out, x)
        assert [(r.op, r.nbytes) for r in counter.records] == [
            ("allgather", 24), ("reduce_scatter", 24), ("alltoall", 24)]
        assert all(r.seconds > 0 for r in counter.records), counter.records
    finally:
        torchdist.shutdown_torch_distributed(barrier=False)


# -- validation in batches, the summary's GPU figures, the GPU's calibration, bench/gpu.py --------

def test_on_cuda_validation_in_batches_equals_one_forward_over_the_set() -> None:
    """A model on the GPU scores the set in global batches of the batch size as one forward
    over it does (float64: to summation order), its sums read back once."""
    from runner.core import ProcessGrid
    from runner.training.evaluation import evaluate
    from runner.zoo.models import resnet
    from strategies import STRATEGIES

    torch.manual_seed(0)
    model = resnet((3, 16, 16), 10, widths=(8, 16), blocks=(1, 1)).double().cuda()
    pmodel = STRATEGIES.get("data")().parallelize(model, (3, 16, 16), ProcessGrid(1, 1))
    x = torch.randn(301, 3, 16, 16, dtype=torch.float64, device="cuda")
    y = torch.randint(0, 10, (301,), device="cuda")
    whole = evaluate(pmodel, x, y)
    for batch in (16, 64, 300):
        part = evaluate(pmodel, x, y, batch_size=batch)
        assert abs(part.loss - whole.loss) <= 1e-12 * abs(whole.loss), (batch, part, whole)
        assert part.accuracy == whole.accuracy


def test_the_validation_numbers_on_cuda_are_the_cpus(gpu_runs: Runs) -> None:
    cpu, cuda = read_summary(gpu_runs("cpu_p1")), read_summary(gpu_runs("cuda_p1"))
    assert abs(cuda["val_loss"] - cpu["val_loss"]) <= GAP * abs(cpu["val_loss"])
    assert abs(cuda["val_accuracy"] - cpu["val_accuracy"]) <= 0.01


@pytest.mark.parametrize("name,gpus", [("cuda_p1", 1), ("cuda_bf16_long", 1),
                                       ("cuda_data_1x4_mpi", 1)])
def test_the_summary_gives_tflops_per_gpu_mfu_and_peak_memory(gpu_runs: Runs, name: str,
                                                             gpus: int) -> None:
    from runner.training.summary import gpu_peak

    summary = read_summary(gpu_runs(name))
    assert summary["gpus"] == gpus  # four ranks sharing one GPU: one GPU
    assert summary["model_flops_per_step"] > 0 and summary["tflops_per_gpu"] > 0
    flops_per_s = summary["model_flops_per_step"] / summary["median_step_time_s"] / gpus
    assert summary["tflops_per_gpu"] * 1e12 == pytest.approx(flops_per_s)
    peak, label = gpu_peak(torch.cuda.get_device_name(0), _precision(summary))
    if peak is None:
        assert summary["mfu"] is None and summary["gpu_peak"]["name"] == "unknown"
    else:
        assert 0 < summary["mfu"] < 1 and summary["gpu_peak"]["name"] == label
    assert 0 < summary["device_memory_peak_bytes"] < torch.cuda.get_device_properties(
        0).total_memory
    assert read_summary(gpu_runs("cpu_p1"))["tflops_per_gpu"] is None  # not measured on a CPU


def test_the_calibration_measures_the_gpu_and_plans_on_it_use_it(tmp_path: Path) -> None:
    """plan.calibrate=true on a GPU machine stores the GPU's rates (float32 and bfloat16) and
    its all-reduce's α–β by its name; a plan for trainer.device=cuda is priced with them."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    stored = tmp_path / "calibration.json"
    env = {**os.environ, "GRIDRUN_CALIBRATION": str(stored)}

    def plan(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runner.plan", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=600)

    calibrated = plan("plan.calibrate=true", "plan.calibrate_repeats=3")
    assert calibrated.returncode == 0, calibrated.stderr
    name = torch.cuda.get_device_name(0)
    device = json.loads(stored.read_text())["devices"][name]
    assert name in calibrated.stdout
    for key in ("compute", "compute_bf16"):
        assert all(rate > 0 for band in device[key]["gemm"].values() for _, rate in band)

    def best(key: str) -> float:
        return max(rate for band in device[key]["gemm"].values() for _, rate in band)

    assert best("compute_bf16") > best("compute")  # tensor cores
    collective = device["collective"]
    assert collective["alpha"] >= 0 and collective["beta"] > 0
    planned = plan("plan.world=2", "trainer.device=cuda", "trainer.precision=bf16")
    assert planned.returncode == 0, planned.stderr
    # the GPU's α, β and rates (the line as one, wherever the console wrapped it)
    assert f"{stored}, {name}" in " ".join(planned.stdout.split())


def test_bench_gpu_runs_on_the_gpu(tmp_path: Path) -> None:
    """bench/gpu.py's GPU path, small: both sides timed by CUDA events, the same losses in
    fp32, gridrun's GPU figures beside them."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "gpu.json"
    result = subprocess.run(
        [sys.executable, "bench/gpu.py", "--small", "--steps", "5", "--warmup", "2",
         "--rounds", "1", "--precisions", "fp32", "--ranks", "0", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["gpu_figures_measured"] and report["measured_on"] == torch.cuda.get_device_name()
    for entry in report["one_device"]:
        assert entry["plain"]["samples_per_s"] > 0 and entry["gridrun"]["samples_per_s"] > 0
        assert entry["max_rel_loss_gap"] <= GAP
        assert entry["gridrun"]["rounds"][0]["summary"]["tflops_per_gpu"] > 0


@pytest.mark.parametrize("name", ["mlp_fp32", "mlp_bf16", "mlp_fp16", "gpt_vocab_head",
                                  "resnet_batch_norm", "mlp_accumulated"])
def test_on_cuda_a_step_waits_for_the_device_only_as_the_readme_states(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/test_host_syncs.py's runs on the GPU, in this process: no synchronising CUDA call
    on a step that does not read its loss (CUDA's sync debug mode raises on one), and the
    step's own waits, per step, are the README's numbers."""
    from tests.test_host_syncs import RUNS, readme_waits, train_on_cuda

    waits = train_on_cuda(RUNS[name], tmp_path / "run", monkeypatch)
    assert waits == readme_waits(RUNS[name]), waits


# trainer.compile on the GPU (inductor's Triton kernels): a small GPT, compiled by block, against
# its eager run on the GPU, in fp32 and bf16, and split over two ranks sharing the GPU (its
# projections' all-reduces outside the graphs).
GPT_SMALL = [*LM, "model=gpt", "model.width=64", "model.layers=2"]
COMPILED_GPU: dict[str, tuple[str, list[str]]] = {
    "gpt_cuda_compiled": ("gpt_cuda", [*GPT_SMALL, *DATA, "grid.pc=1", *CUDA,
                                       "trainer.compile=blocks"]),
    "gpt_cuda_bf16_compiled": ("gpt_cuda_bf16", [*GPT_SMALL, *DATA, "grid.pc=1", *CUDA,
                                                 "trainer.precision=bf16",
                                                 "trainer.compile=blocks"]),
    "gpt_cuda_tp_compiled": ("gpt_cuda", [*GPT_SMALL, "strategy=grid", "grid.pr=2",
                                          "grid.pc=1", *CUDA, *STAGED,
                                          "trainer.compile=blocks"]),
}
RUNS.update({"gpt_cuda": [*GPT_SMALL, *DATA, "grid.pc=1", *CUDA],
             "gpt_cuda_bf16": [*GPT_SMALL, *DATA, "grid.pc=1", *CUDA, "trainer.precision=bf16"],
             **{name: overrides for name, (_, overrides) in COMPILED_GPU.items()}})
# inductor's fused kernels sum in other orders than eager's: a few float32 ulps per operation,
# compounded over the steps (bf16: its own rounding, as between ranks)
COMPILED_GAP = 1e-3


@pytest.mark.parametrize("name", list(COMPILED_GPU))
def test_on_cuda_compiled_blocks_train_what_eager_trains(gpu_runs: Runs, name: str) -> None:
    reference, _ = COMPILED_GPU[name]
    gap = BF16_GAP if "bf16" in name else COMPILED_GAP
    assert _relative_gap(train_losses(gpu_runs(reference)), train_losses(gpu_runs(name))) <= gap
    summary = read_summary(gpu_runs(name))
    assert summary["comm_bytes_per_step"] == summary["predicted_comm_bytes_per_step"]
    compiled = summary["compile"]
    assert compiled["mode"] == "blocks" and compiled["compile_s"] > 0
    if name == "gpt_cuda_tp_compiled":  # the row-parallel projections all-reduce: eager
        assert set(compiled["eager"]) == {f"blocks.{i}.{p}.proj" for i in (0, 1)
                                          for p in ("attn", "mlp")}
    else:
        assert compiled["compiled"] == ["blocks.0", "blocks.1"]
