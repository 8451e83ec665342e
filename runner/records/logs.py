"""Per-rank logging into logs/rank<k>.log (the console is rank 0's, see `console.py`)."""

from __future__ import annotations

import logging
from pathlib import Path

LOGGER_NAME = "gridrun"


def setup_rank_logging(path: Path, rank: int) -> logging.Logger:
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s rank{rank} %(levelname)s %(message)s", datefmt="%Y-%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
