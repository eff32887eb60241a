"""Shared helpers of the studies: points on spheres and balls, log-log slopes, one-thread sections."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch


def sphere_points(
    n: int, d: int, radius: float, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``n`` points uniform on the sphere of radius ``radius`` in R^d, shape (n, d)."""
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    return (radius * x / x.norm(dim=-1, keepdim=True)).to(dtype)


def ball_points(
    n: int, d: int, radius: float, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``n`` points uniform in the ball of radius ``radius`` in R^d, shape (n, d)."""
    u = torch.rand(n, 1, generator=generator, dtype=torch.float64) ** (1.0 / d)
    return (sphere_points(n, d, radius, generator) * u).to(dtype)


def loglog_slope(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """OLS slope of log(y) on log(x) with its t confidence interval ``(slope, lo, hi)``."""
    from scipy import stats

    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    ok = np.isfinite(lx) & np.isfinite(ly)
    lx, ly = lx[ok], ly[ok]
    if lx.size < 3:
        return float("nan"), float("nan"), float("nan")
    res = stats.linregress(lx, ly)
    half = stats.t.ppf(0.5 + level / 2, lx.size - 2) * res.stderr
    return float(res.slope), float(res.slope - half), float(res.slope + half)




@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread, restoring the previous count after it.

    Small batched kernels (QRs of 64 x 64 blocks, the short matmuls of a study cell) were
    measured 3-20x slower with 2 threads than with 1 on a loaded 2-core machine: OpenMP regions
    wait for a descheduled second thread.
    """
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
