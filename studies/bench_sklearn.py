"""Moved to `benchmarks.sklearn` (``python -m benchmarks sklearn``); this module is kept for existing command lines."""

from __future__ import annotations

import sys

import benchmarks.sklearn as _moved
from benchmarks import run as _run
from benchmarks.sklearn import main

__all__ = ["main"]


def __getattr__(name: str) -> object:
    # the other names of the old module (imports such as ``from studies.bench_sklearn import ...``)
    return getattr(_moved, name)


if __name__ == "__main__":
    sys.exit(_run("sklearn"))
