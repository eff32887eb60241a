"""Timing helpers shared by the benchmarks: device synchronisation and medians of wall times."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def sync(device: torch.device) -> None:
    """Wait for the queued work on ``device`` (``torch.cuda.synchronize`` on GPU; no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: Sequence[float]) -> float:
    """The upper median of ``xs``: ``sorted(xs)[len(xs) // 2]`` (an element of ``xs``)."""
    return sorted(xs)[len(xs) // 2]


def timeit(fn: Callable[[], object], device: torch.device, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn`` in seconds, without autograd.

    ``warmup`` calls first, then ``repeats`` timed calls, each followed by `sync`.
    """
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        sync(device)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync(device)
            ts.append(time.perf_counter() - t0)
    return median(ts)
