"""What is checked on the machine before a run starts, after the config itself is valid: that
the run directory can be made and written, and that its disk has room for the checkpoints the
run will keep. A problem is one line, before any MPI job exists."""

from __future__ import annotations

from pathlib import Path

import torch

from runner.checkpoint import checkpoint_bytes, space_problem
from runner.config import RunConfig
from runner.models import dataset_arguments
from runner.registry import DATASETS, MODELS, OPTIMIZERS, load_plugins
from runner.rundir import unwritable

MIN_FREE_BYTES = 16 << 20  # logs, metrics and the summary of any run


def parameter_bytes(run: RunConfig) -> int:
    """The sequential model's parameter bytes (built on the meta device: no memory used)."""
    load_plugins()
    spec = DATASETS.get(run.dataset.name)(**run.dataset.options).spec()
    factory = MODELS.get(run.model.name)
    with torch.device("meta"):
        model = factory(spec.input_shape, spec.num_classes, **dataset_arguments(factory, spec),
                        **run.model.options)
    itemsize = torch.empty((), dtype=getattr(torch, run.trainer.dtype)).element_size()
    return sum(p.numel() for p in model.parameters()) * itemsize


def output_problems(run: RunConfig, run_dir: Path) -> list[str]:
    problem = unwritable(run_dir)
    if problem:
        return [problem]
    needed, what = MIN_FREE_BYTES, "the run's logs"
    if run.trainer.checkpoint_every:
        optimizer = OPTIMIZERS.get(run.optimizer.name)
        has_state = any(float(run.optimizer.options.get(k) or 0) > 0 for k in ("momentum",))
        one = checkpoint_bytes(parameter_bytes(run), run.grid.pc, optimizer.per_replica,
                               optimizer.has_centre, int(has_state))
        kept = (run.trainer.keep_checkpoints or max(1, run.trainer.steps
                                                    // run.trainer.checkpoint_every)) + 1
        needed += one * kept  # the ones kept, and the next one being written
        what = f"{kept} checkpoints of {one / (1 << 20):,.1f} MiB and the logs"
    problem = space_problem(run_dir, needed, what)
    return [problem] if problem else []
