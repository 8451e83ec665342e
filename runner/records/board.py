"""`logger=tensorboard`: every metrics line also as TensorBoard scalars, under
`<run dir>/tensorboard/` (rank 0 only; `tensorboard --logdir outputs` compares runs)."""

from __future__ import annotations

import os
from numbers import Real
from pathlib import Path
from typing import Any

from runner.records import safe_paths

INSTALL_HINT = "pip install 'gridrun[tensorboard]'"


def tensorboard_missing() -> str | None:
    """Why logger=tensorboard cannot run here (None: it can)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return f"logger=tensorboard needs the tensorboard package: {INSTALL_HINT}"
    return None


class TensorBoardWriter:
    """Scalars `train/<key>` and `val/<key>` at each line's step."""

    def __init__(self, directory: Path, start_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # The folder, made without following a link, is held open and named by its descriptor:
        # a link put in its place later does not lead the event files out of the run directory.
        self._folder = safe_paths.open_dir(*safe_paths.locate(directory), create=True)
        # purge_step: a resumed run drops the events of the steps it runs again
        self._writer = SummaryWriter(log_dir=safe_paths.fd_path(self._folder),
                                     purge_step=start_step + 1 if start_step else None)

    def write(self, record: dict[str, Any]) -> None:
        split = record.get("split", "train")
        step = int(record["step"])
        for key, value in record.items():
            if key not in ("step", "split") and isinstance(value, Real):
                self._writer.add_scalar(f"{split}/{key}", float(value), step)

    def close(self) -> None:
        self._writer.close()
        os.close(self._folder)
