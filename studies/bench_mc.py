"""Moved to `benchmarks.mc` (``python -m benchmarks mc``); this module is kept for existing command lines."""

from __future__ import annotations

import sys

import benchmarks.mc as _moved
from benchmarks import run as _run
from benchmarks.mc import main

__all__ = ["main"]


def __getattr__(name: str) -> object:
    # the other names of the old module (imports such as ``from studies.bench_mc import ...``)
    return getattr(_moved, name)


if __name__ == "__main__":
    sys.exit(_run("mc"))
