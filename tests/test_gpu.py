"""On a GPU, through the real command line: devices, staging, NCCL and mixed precision.

Skipped where torch sees no GPU (CI, a CPU-only machine): the whole module is marked.
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

from pathlib import Path

import pytest
import torch

from strategies.probe import draw_plan
from strategies.whole_batch import RandomDrawError, RowDraws, forward_key
from tests.conftest import RunCache, read_metrics, read_summary, train_losses
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
    # one rank with a GPU of its own: NCCL
    "cuda_p1_torch": [*DATA, "grid.pc=1", *CUDA, "comm.backend=torch", f"trainer.steps={STEPS}"],
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
    _check_buffers(summary, "direct (NCCL)")
    losses = train_losses(run_dir)
    assert len(losses) == STEPS
    assert _relative_gap(train_losses(gpu_runs("cuda_p1")), losses) <= GAP


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
