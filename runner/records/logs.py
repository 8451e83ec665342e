"""Per-rank logging into logs/rank<k>.log (the console is rank 0's, see `console.py`)."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TextIO

from runner.records import safe_paths

LOGGER_NAME = "gridrun"


class _AppendHandler(logging.StreamHandler[TextIO]):
    """Lines appended to a file gridrun opened itself (no link followed on the way, no FIFO
    opened: `safe_paths.open_file`), closed with the handler as a `FileHandler` is."""

    def close(self) -> None:
        self.acquire()
        try:
            with contextlib.suppress(OSError, ValueError):
                self.flush()
                self.stream.close()
        finally:
            self.release()
        super().close()


def setup_rank_logging(path: Path, rank: int) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    fd = safe_paths.open_file(*safe_paths.locate(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                              create_dirs=True)
    handler = _AppendHandler(os.fdopen(fd, "a", encoding="utf-8"))
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s rank{rank} %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
