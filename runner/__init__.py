"""gridrun: a declarative runner for distributed neural-network training on MPI."""

__version__ = "0.1.0"
