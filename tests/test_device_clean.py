"""Every tensor the training code creates lands on the device of the tensors it works with.

CI has no GPU, so a buffer that would land on the host while the model is on a GPU (a receive
buffer, a gradient bucket, an index tensor) passes every test here and fails only on a GPU run:
`torch.empty(n)` is a CPU tensor whatever the model's device. This static check is how CI
catches it. In the modules that move or compute with model tensors, every call of a torch
factory that defaults to the CPU must say where its tensor goes (`device=...`), or carry a
`# host:` comment on its line or the line before, saying why the host is meant (a small
control message: counts, flags). Functions that can only make host tensors (`frombuffer`,
`from_numpy`, `.numpy()`) need the comment. `x.new_empty(...)` and `torch.zeros_like(x)`
follow `x` and need neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch import nn

from runner.core.comm import CommCounter, CountedComm
from runner.core.halo import HaloPlan, Window, halo_accumulate_op
from runner.core.primitives import all_sum_reduce_op, broadcast_op, sum_reduce_op
from runner.core.row_sparse import CyclicRows
from runner.cost.collectives import DEFAULT_COSTS
from strategies.exchange.buckets import GradientBuckets
from strategies.exchange.sparse_gradients import SparseGradientExchange

ROOT = Path(__file__).resolve().parent.parent

CHECKED = (sorted((ROOT / "strategies").rglob("*.py"))
           + [ROOT / "runner" / "core" / name
              for name in ("primitives.py", "halo.py", "row_sparse.py", "rma.py", "standin.py",
                           "comm.py", "mpi_transport.py", "torchdist.py", "torch_transport.py",
                           "staging.py", "watchdog.py")]
           + sorted((ROOT / "runner" / "optim").glob("*.py"))
           + sorted((ROOT / "runner" / "checkpoint").glob("*.py"))
           + [ROOT / "runner" / "training" / name
              for name in ("evaluation.py", "step.py", "loop.py", "precision.py")])

# torch factories whose tensor is on the CPU unless `device=` says otherwise.
DEFAULT_CPU = frozenset({
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_strided", "scalar_tensor",
})
# Only ever host tensors: no `device=` helps, the host must be meant.
HOST_ONLY = frozenset({"frombuffer", "from_numpy"})
MARK = "# host:"


def unplaced_calls(source: str, filename: str = "<source>") -> list[str]:
    """`file:line: call` for each factory call in `source` that neither passes `device=` nor
    carries a `# host:` comment (on its lines or the line before)."""
    lines = source.splitlines()
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, owner = node.func.attr, node.func.value
        from_torch = isinstance(owner, ast.Name) and owner.id == "torch"
        if from_torch and name in DEFAULT_CPU:
            if any(keyword.arg == "device" for keyword in node.keywords):
                continue
        elif not ((from_torch and name in HOST_ONLY) or name == "numpy"):
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        if any(MARK in line for line in lines[max(first - 2, 0):last]):
            continue
        found.append((first, f"{filename}:{first}: {ast.unparse(node.func)}(...)"))
    return [text for _, text in sorted(found)]


def test_every_factory_call_says_where_its_tensor_goes() -> None:
    problems = []
    for path in CHECKED:
        problems += unplaced_calls(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, (
        "tensors created on the host by default next to model tensors (pass device=x.device, "
        "use x.new_empty/new_zeros, or mark a deliberate host tensor with '# host: why'):\n"
        + "\n".join(problems))


def test_the_checked_modules_exist_and_create_tensors() -> None:
    """A renamed module would leave the check above with nothing to look at."""
    missing = [str(path) for path in CHECKED if not path.is_file()]
    assert not missing
    calls = sum(source.count("device=") for source in (p.read_text() for p in CHECKED))
    assert calls >= 10


def test_the_check_tells_placed_from_unplaced_calls() -> None:
    source = "\n".join([
        "import torch",
        "a = torch.empty(3, dtype=torch.long)",  # 2: unplaced
        "b = torch.empty(3, device=x.device)",
        "c = torch.zeros(2)  # host: control",
        "# host: control, a comment on the line before",
        "d = torch.tensor([1, 2])",
        "e = torch.frombuffer(buf, dtype=torch.uint8)",  # 7: host only, unmarked
        "f = x.new_empty(3)",
        "g = torch.zeros_like(x)",
        "h = y.numpy()",  # 10: host only, unmarked
        "i = torch.arange(",  # 11: unplaced over two lines
        "    4)",
    ])
    assert [problem.split(":")[1] for problem in unplaced_calls(source)] == [
        "2", "7", "10", "11"]


# -- the same on tensors: the meta device stands in for a GPU -----------------------------------
# A meta tensor has a device other than the host's and no data: a buffer created on the host
# next to it is caught by its device (and most mixed operations refuse it), without a GPU.


def _self_comm() -> CountedComm:
    return CountedComm(None, CommCounter(), "self")


def test_buffers_follow_the_parameters_device() -> None:
    params = [nn.Parameter(torch.empty(3, 2, device="meta")),
              nn.Parameter(torch.empty(5, device="meta"))]
    GradientBuckets(params, _self_comm(), 0.5, bucket_cap_bytes=1 << 20)
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in params)


def test_primitives_and_halo_adjoint_make_their_outputs_on_the_input_device() -> None:
    comm = _self_comm()
    x = torch.empty(2, 3, 4, 5, device="meta")
    for out in (broadcast_op(x, comm), sum_reduce_op(x, comm), all_sum_reduce_op(x, comm)):
        assert out.device.type == "meta"
    plan = HaloPlan(4, Window(3, padding=1), 1, 0)
    window = torch.empty(2, 3, plan.window_rows[1] - plan.window_rows[0], 5, device="meta")
    assert halo_accumulate_op(window, comm, 2, plan).device.type == "meta"


def test_sparse_rows_and_their_indices_share_the_rows_device() -> None:
    rows = CyclicRows(10, 3)
    assert rows.owned(1, torch.device("meta")).device.type == "meta"
    table = nn.Embedding(10, 4, sparse=True,  # given its weight: no initialisation to run
                         _weight=torch.empty(10, 4, device="meta"))
    exchange = SparseGradientExchange([("table", table)], _self_comm(), 1.0, "allgather",
                                      DEFAULT_COSTS)
    indices, values = exchange._local_rows(exchange.tables[0])  # no gradient yet: no rows
    assert indices.device.type == values.device.type == "meta"
