"""gridrun: a declarative runner for distributed neural-network training on MPI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gridrun")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0+unknown"
