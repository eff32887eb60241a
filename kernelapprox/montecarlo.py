r"""Monte Carlo machinery: error metrics, estimators with confidence intervals, batched drivers.

Everything a study needs to measure how wrong a random-feature estimate is, and how sure the
measurement is:

* **error metrics** as plain functions on tensors (`relative_error`, `relative_rms`,
  `relative_frobenius`, `max_abs_error`, `attention_relative_error`,
  `total_variation`);
* **estimators over S independent draws** with confidence intervals (`mean_ci`: Student t;
  `variance_ci`: asymptotic normal from the fourth moment; `quantile_ci`: exact
  order-statistic intervals, ``scipy.stats.quantile_test``);
* **drivers** `kernel_error` and `attention_error` that evaluate ``S`` independent
  projections of a feature map through its ``batch_shape`` (one batched matmul per chunk of draws,
  memory bounded by ``max_bytes``; never a Python loop over single draws; fused float64 power
  sums; close to the bare batched-matmul floor, ``benchmarks/mc.py``), and
  `batched_draws`, the generator they are built on.

All statistics are computed in float64 by default.

Examples
--------
>>> import torch, kernelapprox as ka
>>> fm = ka.PositiveRF(dim=8, num_features=64, seed=0)
>>> q, k = torch.randn(2, 16, 8, dtype=torch.float64).unbind(0)
>>> q, k = q / 8**0.25, k / 8**0.25
>>> res = ka.montecarlo.kernel_error(fm, q, k, draws=2000)
>>> res["mse"].shape
(16, 16)
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from kernelapprox._validation import (
    check_bool,
    check_device,
    check_dtype,
    check_finite_float,
    check_floating,
    check_positive_int,
    check_seed,
)

from ._validation import broadcast_shapes

if TYPE_CHECKING:  # pragma: no cover
    from kernelapprox.maps.base import FeatureMap

__all__ = [
    "relative_error",
    "relative_rms",
    "relative_frobenius",
    "max_abs_error",
    "attention_relative_error",
    "total_variation",
    "mean_ci",
    "variance_ci",
    "quantile_ci",
    "ratio_of_means_ci",
    "StreamingMoments",
    "batched_draws",
    "kernel_error",
    "attention_error",
]

_DEFAULT_BYTES = 256 * 2**20
_METRIC_DIMS = (-2, -1)


# ------------------------------------------------------------------------------------ metrics
def _pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    check_floating(name_a, a)
    check_floating(name_b, b)
    try:
        broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        raise ValueError(
            f"{name_a} {tuple(a.shape)} and {name_b} {tuple(b.shape)} do not broadcast"
        ) from None
    return a, b


def _matrix(name: str, x: torch.Tensor) -> None:
    if x.dim() < 2:
        raise ValueError(f"{name} must have shape (..., n, m), got shape {tuple(x.shape)}")


def relative_error(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Entrywise relative error $|\hat K_{ij}-K_{ij}|/|K_{ij}|$.

    Parameters
    ----------
    estimate : torch.Tensor
        $\hat K$, any shape broadcasting with ``exact`` (e.g. ``(S, ..., n, m)``).
    exact : torch.Tensor
        $K$, e.g. ``(..., n, m)``.

    Returns
    -------
    torch.Tensor
        The broadcast shape. ``inf`` where ``exact`` is 0 and the estimate is not.

    Examples
    --------
    >>> relative_error(torch.tensor([1.1, 1.8]), torch.tensor([1.0, 2.0]))
    tensor([0.1000, 0.1000])
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    return (estimate - exact).abs() / exact.abs()


def relative_rms(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Root mean square of the entrywise relative error over a matrix,
    $\sqrt{\frac1{nm}\sum_{ij}(\hat K_{ij}-K_{ij})^2/K_{ij}^2}$.

    Parameters
    ----------
    estimate : torch.Tensor
        Shape ``(..., n, m)``.
    exact : torch.Tensor
        Shape broadcasting with ``estimate``, e.g. ``(n, m)``.

    Returns
    -------
    torch.Tensor
        Shape ``(...)``: one value per matrix.

    Examples
    --------
    >>> relative_rms(torch.tensor([[1.1, 1.8]]), torch.tensor([[1.0, 2.0]]))
    tensor(0.1000)
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    _matrix("estimate", estimate)
    return ((estimate - exact) / exact).square().mean(dim=_METRIC_DIMS).sqrt()


def relative_frobenius(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Relative Frobenius error of a matrix, $\|\hat K-K\|_F/\|K\|_F$.

    Parameters
    ----------
    estimate : torch.Tensor
        Shape ``(..., n, m)``.
    exact : torch.Tensor
        Shape broadcasting with ``estimate``.

    Returns
    -------
    torch.Tensor
        Shape ``(...)``.

    Examples
    --------
    >>> relative_frobenius(torch.tensor([[3.0, 4.0]]), torch.tensor([[3.0, 3.0]]))
    tensor(0.2357)
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    _matrix("estimate", estimate)
    num = torch.linalg.vector_norm(estimate - exact, dim=_METRIC_DIMS)
    return num / torch.linalg.vector_norm(exact, dim=_METRIC_DIMS)


def max_abs_error(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Largest absolute error over a matrix, $\max_{ij}|\hat K_{ij}-K_{ij}|$.

    Parameters
    ----------
    estimate : torch.Tensor
        Shape ``(..., n, m)``.
    exact : torch.Tensor
        Shape broadcasting with ``estimate``.

    Returns
    -------
    torch.Tensor
        Shape ``(...)``.

    Examples
    --------
    >>> max_abs_error(torch.tensor([[1.0, 5.0]]), torch.tensor([[2.0, 3.0]]))
    tensor(2.)
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    _matrix("estimate", estimate)
    return (estimate - exact).abs().amax(dim=_METRIC_DIMS)


def attention_relative_error(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Relative Frobenius error of an attention output per row-set,
    $\|\hat O-O\|_F/\|O\|_F$ over the ``(n, dv)`` block of one sequence (and head).

    Parameters
    ----------
    estimate : torch.Tensor
        $\hat O$, shape ``(..., n, dv)``.
    exact : torch.Tensor
        $O$, broadcasting with ``estimate``.

    Returns
    -------
    torch.Tensor
        Shape ``(...)``.

    Examples
    --------
    >>> attention_relative_error(torch.ones(4, 2) * 1.1, torch.ones(4, 2))
    tensor(0.1000)
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    _matrix("estimate", estimate)
    num = torch.linalg.vector_norm(estimate - exact, dim=_METRIC_DIMS)
    return num / torch.linalg.vector_norm(exact, dim=_METRIC_DIMS)


def total_variation(estimate: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    r"""Total variation distance between attention rows,
    $\mathrm{TV}_i=\tfrac12\sum_j|\hat a_{ij}-a_{ij}|$.

    The rows $\hat a_i=\hat K_{i\cdot}/\sum_j\hat K_{ij}$ sum to one; for non-positive
    estimators (trigonometric features) they may have negative entries, and the distance may then
    exceed 1.

    Parameters
    ----------
    estimate : torch.Tensor
        Normalised estimated attention weights, shape ``(..., n, m)``.
    exact : torch.Tensor
        Exact softmax weights, broadcasting with ``estimate``.

    Returns
    -------
    torch.Tensor
        Shape ``(..., n)``: one distance per query row.

    Examples
    --------
    >>> total_variation(torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]]))
    tensor([0.5000])
    """
    estimate, exact = _pair("estimate", estimate, "exact", exact)
    return 0.5 * (estimate - exact).abs().sum(dim=-1)


# --------------------------------------------------------------------------- estimators
def _as_numpy(name: str, x: object) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_meta:
            raise ValueError(f"{name} is a meta tensor (no data); pass draws with values")
        x = x.detach().cpu().to(torch.float64).numpy()
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be an array of real numbers, got {type(x).__name__} {x!r:.60}") from None
    if arr.ndim == 0:
        raise ValueError(f"{name} must hold draws along an axis, got a scalar")
    return arr


def _check_axis(axis: object, *arrays: np.ndarray) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r} ({type(axis).__name__})")
    for arr in arrays:
        if not -arr.ndim <= int(axis) < arr.ndim:
            raise ValueError(f"axis={axis} is out of range for draws of shape {arr.shape}")
    return int(axis)


def _check_confidence(confidence: float) -> float:
    return check_finite_float("confidence", confidence, min=0.0, max=1.0, min_open=True, max_open=True)


def mean_ci(
    x: np.ndarray | torch.Tensor, *, axis: int = 0, confidence: float = 0.95, nan_policy: str = "raise"
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r"""Sample mean with its Student-t confidence interval.

    $$
    \bar x\pm t_{S-1,(1+c)/2}\,\frac{s}{\sqrt S},\qquad
    s^2=\frac1{S-1}\sum_{d=1}^S(x_d-\bar x)^2 .
    $$

    Valid for independent draws with finite variance (CLT); for heavy-tailed draws (positive
    features at large norms) the interval can be too narrow at small S.

    Parameters
    ----------
    x : array_like or torch.Tensor
        Draws along ``axis`` (S >= 2 of them), any other shape.
    axis : int, default 0
        The draw axis.
    confidence : float, default 0.95
        Two-sided coverage.
    nan_policy : {"raise", "propagate"}, default "raise"
        A NaN draw is an error (``"raise"``), or makes its mean and interval NaN
        (``"propagate"``, as `scipy.stats` does by default).

    Returns
    -------
    mean, se, low, high : numpy.ndarray
        float64, shape of ``x`` without ``axis``.

    Examples
    --------
    >>> m, se, lo, hi = mean_ci(np.array([1.0, 2.0, 3.0, 4.0]))
    >>> float(m), bool(lo < 2.5 < hi)
    (2.5, True)
    """
    from scipy import stats

    confidence = _check_confidence(confidence)
    if nan_policy not in ("raise", "propagate"):
        raise ValueError(f"nan_policy must be 'raise' or 'propagate', got {nan_policy!r}")
    arr = _as_numpy("x", x)
    axis = _check_axis(axis, arr)
    s = arr.shape[axis]
    if s < 2:
        raise ValueError(f"mean_ci needs at least 2 draws along axis {axis}, got {s}")
    if nan_policy == "raise" and np.isnan(arr).any():
        raise ValueError(f"x holds {int(np.isnan(arr).sum())} NaN draws; drop them, or pass "
                         "nan_policy='propagate' for NaN results")
    mean = arr.mean(axis=axis)
    se = arr.std(axis=axis, ddof=1) / math.sqrt(s)
    half = stats.t.ppf(0.5 + confidence / 2, df=s - 1) * se
    return mean, se, mean - half, mean + half


def variance_ci(
    x: np.ndarray | torch.Tensor, *, axis: int = 0, confidence: float = 0.95
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r"""Sample variance with an asymptotic normal confidence interval from the fourth moment.

    With central moments $m_2, m_4$ of the S draws, $s^2=\frac S{S-1}m_2$ and

    $$
    \mathrm{se}(s^2)\approx\sqrt{\frac{m_4-m_2^2}{S}},\qquad
    s^2\pm z_{(1+c)/2}\,\mathrm{se}(s^2).
    $$

    This does not assume normal draws (the chi-square interval would, and is badly wrong for the
    heavy-tailed estimates of random features); it needs a finite fourth moment and large S.

    Parameters
    ----------
    x : array_like or torch.Tensor
        Draws along ``axis`` (S >= 2).
    axis : int, default 0
    confidence : float, default 0.95

    Returns
    -------
    variance, se, low, high : numpy.ndarray
        float64, shape of ``x`` without ``axis``.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> var, se, lo, hi = variance_ci(rng.normal(size=100_000))
    >>> bool(lo < 1.0 < hi)
    True
    """
    from scipy import stats

    confidence = _check_confidence(confidence)
    arr = _as_numpy("x", x)
    axis = _check_axis(axis, arr)
    s = arr.shape[axis]
    if s < 2:
        raise ValueError(f"variance_ci needs at least 2 draws along axis {axis}, got {s}")
    c = arr - arr.mean(axis=axis, keepdims=True)
    m2 = np.mean(c**2, axis=axis)
    m4 = np.mean(c**4, axis=axis)
    var = m2 * s / (s - 1)
    se = np.sqrt(np.maximum(m4 - m2**2, 0.0) / s)
    half = stats.norm.ppf(0.5 + confidence / 2) * se
    return var, se, var - half, var + half


def quantile_ci(
    x: np.ndarray | torch.Tensor,
    q: float | Sequence[float],
    *,
    confidence: float = 0.95,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Sample quantiles of a 1-D set of iid draws with exact distribution-free confidence intervals.

    The interval for the population $p$-quantile is a pair of order statistics
    $[x_{(l)}, x_{(u)}]$ whose coverage $P(l \le B < u)$, $B \sim
    \mathrm{Binomial}(S, p)$, is at least ``confidence`` for any continuous distribution
    (``scipy.stats.quantile_test(...).confidence_interval``; Conover 1999, §3.2). No resampling,
    no normal approximation. Where too few draws exist for a bound at this level (e.g. the
    upper bound of a 0.99 quantile from 100 draws) that bound is ``nan``: honest, not
    extrapolated.

    Parameters
    ----------
    x : array_like or torch.Tensor
        Shape ``(S,)``, the per-draw values (e.g. the relative Frobenius error of each draw).
    q : float or sequence of float
        Probabilities in (0, 1).
    confidence : float, default 0.95

    Returns
    -------
    quantiles, low, high : numpy.ndarray
        Shape ``(len(q),)`` (or ``()`` for a float ``q``); the point estimate is
        ``numpy.quantile(x, q)`` (linear interpolation).

    References
    ----------
    W. J. Conover, *Practical Nonparametric Statistics*, 3rd ed., Wiley, 1999, §3.2.

    Examples
    --------
    >>> x = np.random.default_rng(0).exponential(size=5000)
    >>> med, lo, hi = quantile_ci(x, 0.5)
    >>> bool(lo < np.log(2) < hi)
    True
    """
    from scipy import stats

    confidence = _check_confidence(confidence)
    arr = _as_numpy("x", x)
    if arr.ndim != 1:
        raise ValueError(f"x must be a 1-D array of draws for quantile_ci, got shape {arr.shape}")
    if arr.size < 2:
        raise ValueError(f"quantile_ci needs at least 2 draws, got {arr.size}")
    if not np.all(np.isfinite(arr)):
        raise ValueError("quantile_ci needs finite draws (drop or count the non-finite ones first)")
    scalar = np.ndim(q) == 0
    probs = np.atleast_1d(np.asarray(q, dtype=np.float64))
    if probs.ndim != 1 or np.any((probs <= 0) | (probs >= 1)) or not np.all(np.isfinite(probs)):
        raise ValueError(f"q must be probabilities in (0, 1), got {q!r}")
    point = np.quantile(arr, probs)
    low = np.empty_like(point)
    high = np.empty_like(point)
    for i, p in enumerate(probs):
        ci = stats.quantile_test(arr, q=point[i], p=p).confidence_interval(confidence_level=confidence)
        low[i], high[i] = ci.low, ci.high
    if scalar:
        return point[0], low[0], high[0]
    return point, low, high


class _Workspace:
    """Float64 scratch tensors reused from chunk to chunk (a fresh multi-MB tensor per chunk costs
    page faults comparable to the arithmetic on it)."""

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A tensor of ``like``'s shape, dtype and device (contents undefined)."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._bufs[name] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return buf


class _PowerSums:
    """Streaming sums of (x - shift)^p, p = 1..4, over draws (axis 0 of each update), float64.

    The sums over a chunk's draw axis are products with a vector of ones (a GEMV reads the
    ``(c, L)`` block once, at memory speed; ``Tensor.sum(0)`` over the outer axis is ~10x
    slower on CPU)."""

    def __init__(self, shift: torch.Tensor) -> None:
        self.shift = shift.to(torch.float64)
        self.count = 0
        self.sums = [torch.zeros_like(self.shift) for _ in range(4)]
        self.work = _Workspace()

    def update(self, x: torch.Tensor) -> None:
        self.add_centred(x.to(torch.float64) - self.shift)

    def add_centred(self, y: torch.Tensor, y2: torch.Tensor | None = None) -> None:
        """Add draws already shifted, ``y = x - shift`` (float64, shape ``(c, *shift.shape)``,
        not modified), and optionally their squares ``y2`` (same shape)."""
        c = y.shape[0]
        self.count += c
        flat = y.reshape(c, -1)
        if y2 is None:
            y2 = torch.mul(flat, flat, out=self.work.get("y2", flat))
        y2 = y2.reshape(c, -1)
        ones = flat.new_ones(c)
        p = torch.mul(y2, flat, out=self.work.get("p", flat))  # y^3, then y^4 in place
        for i, t in enumerate((flat, y2, p, p)):
            if i == 3:
                p.mul_(flat)
            self.sums[i] += (ones @ t).view(self.shift.shape)

    def raw(self, p: int) -> np.ndarray:
        return (self.sums[p - 1] / self.count).cpu().numpy()

    def summary(self, confidence: float) -> dict[str, np.ndarray]:
        """Mean, bias (mean - shift), variance and MSE (mean of (x - shift)^2), each with a
        standard error and a confidence interval."""
        from scipy import stats

        s = self.count
        e1, e2, e3, e4 = (self.raw(p) for p in (1, 2, 3, 4))
        m2 = np.maximum(e2 - e1**2, 0.0)
        m4 = np.maximum(e4 - 4 * e1 * e3 + 6 * e1**2 * e2 - 3 * e1**4, 0.0)
        shift = self.shift.cpu().numpy()
        t = stats.t.ppf(0.5 + confidence / 2, df=max(s - 1, 1))
        z = stats.norm.ppf(0.5 + confidence / 2)
        out: dict[str, np.ndarray] = {}
        with np.errstate(invalid="ignore", divide="ignore"):
            var = m2 * s / max(s - 1, 1)
            bias_se = np.sqrt(var / s)
            var_se = np.sqrt(np.maximum(m4 - m2**2, 0.0) / s)
            mse_se = np.sqrt(np.maximum(e4 - e2**2, 0.0) / max(s - 1, 1))
        out["mean"] = shift + e1
        out["mean_ci"] = np.stack([shift + e1 - t * bias_se, shift + e1 + t * bias_se])
        out["bias"] = e1
        out["bias_se"] = bias_se
        out["bias_ci"] = np.stack([e1 - t * bias_se, e1 + t * bias_se])
        out["variance"] = var
        out["variance_se"] = var_se
        out["variance_ci"] = np.stack([var - z * var_se, var + z * var_se])
        out["mse"] = e2
        out["mse_se"] = mse_se
        out["mse_ci"] = np.stack([e2 - t * mse_se, e2 + t * mse_se])
        return out


class StreamingMoments:
    r"""Mean and variance of draws that arrive in chunks (along axis 0), with confidence intervals.

    Keeps float64 sums of $(x - c)^p$, $p = 1..4$, with $c$ the mean of the
    first chunk (so the variance does not cancel when the mean is far from 0). The intervals are
    those of `mean_ci` (Student t) and `variance_ci` (fourth moment), computed from
    the sums: use it when the draws do not fit in memory at once.

    Examples
    --------
    >>> acc = StreamingMoments()
    >>> for chunk in torch.randn(10, 1000, 3, dtype=torch.float64).unbind(0):
    ...     acc.update(chunk)
    >>> mean, se, lo, hi = acc.mean_ci()
    >>> acc.count, mean.shape, bool(np.all(lo < hi))
    (10000, (3,), True)
    """

    def __init__(self) -> None:
        self._acc: _PowerSums | None = None

    def update(self, x: torch.Tensor | np.ndarray) -> None:
        """Add the draws ``x`` (shape ``(b, ...)``, ``b`` draws of an array of any shape)."""
        t = torch.as_tensor(_as_numpy("x", x) if not isinstance(x, torch.Tensor) else x).detach()
        if t.is_meta:
            raise ValueError("x is a meta tensor (no data); pass draws with values")
        t = t.to(torch.float64)
        if t.dim() == 0:
            raise ValueError("x must hold draws along axis 0, got a scalar")
        if self._acc is not None and tuple(t.shape[1:]) != tuple(self._acc.shift.shape):
            raise ValueError(
                f"x must have shape (b, {', '.join(map(str, self._acc.shift.shape))}) like the earlier draws, "
                f"got shape {tuple(t.shape)}"
            )
        if self._acc is None:
            self._acc = _PowerSums(t.mean(0))
        self._acc.update(t)

    @property
    def count(self) -> int:
        """Number of draws seen."""
        return 0 if self._acc is None else self._acc.count

    def _summary(self, confidence: float) -> dict[str, np.ndarray]:
        if self.count < 2:
            raise ValueError(f"need at least 2 draws, got {self.count}")
        return cast(_PowerSums, self._acc).summary(_check_confidence(confidence))  # count >= 2

    def mean_ci(self, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``mean, se, low, high`` of the mean (Student t), as `mean_ci`."""
        out = self._summary(confidence)
        return out["mean"], out["bias_se"], out["mean_ci"][0], out["mean_ci"][1]

    def variance_ci(self, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``variance, se, low, high`` of the variance (fourth moment), as `variance_ci`."""
        out = self._summary(confidence)
        return out["variance"], out["variance_se"], out["variance_ci"][0], out["variance_ci"][1]


def ratio_of_means_ci(
    x: np.ndarray | torch.Tensor,
    y: np.ndarray | torch.Tensor,
    *,
    axis: int = 0,
    confidence: float = 0.95,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    r"""Ratio of the means of two *independent* samples of positive draws, with a delta-method CI.

    $$
    \hat\rho = \bar x/\bar y,\qquad
    \mathrm{se}(\log\hat\rho)^2 = \frac{s_x^2}{S_x\bar x^2} + \frac{s_y^2}{S_y\bar y^2},\qquad
    \hat\rho\, e^{\pm z\,\mathrm{se}}.
    $$

    Valid for large samples with finite variances. For heavy-tailed draws (squared errors of
    positive random features at large $\|q+k\|$, whose fourth moment grows like
    $e^{8\|q+k\|^2}$) the sample variances are unreliable and the interval is too narrow;
    check convergence before trusting it.

    Parameters
    ----------
    x, y : array_like or torch.Tensor
        Draws along ``axis`` (at least 2 each); the other dimensions must broadcast.
    axis : int, default 0
    confidence : float, default 0.95

    Returns
    -------
    ratio, se_log, low, high : numpy.ndarray
        float64, the broadcast shape without ``axis``.

    Examples
    --------
    >>> x, y = np.array([1.0, 3.0, 2.0, 2.0]), np.array([1.0, 1.0, 0.5, 1.5])
    >>> ratio, se, lo, hi = ratio_of_means_ci(x, y)
    >>> float(ratio), bool(lo < ratio < hi)
    (2.0, True)
    """
    from scipy import stats

    confidence = _check_confidence(confidence)
    xa, ya = _as_numpy("x", x), _as_numpy("y", y)
    axis = _check_axis(axis, xa, ya)
    if xa.ndim != ya.ndim:
        raise ValueError(f"x and y must have the same number of dimensions, got shapes {xa.shape} and {ya.shape}")
    try:
        np.broadcast_shapes(np.delete(xa.shape, axis), np.delete(ya.shape, axis))
    except ValueError:
        raise ValueError(
            f"x and y must broadcast apart from the draw axis {axis}, got shapes {xa.shape} and {ya.shape}"
        ) from None
    sx, sy = xa.shape[axis], ya.shape[axis]
    if sx < 2 or sy < 2:
        raise ValueError(f"ratio_of_means_ci needs at least 2 draws of each, got {sx} and {sy}")
    mx, my = xa.mean(axis=axis), ya.mean(axis=axis)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = mx / my
        se = np.sqrt(xa.var(axis=axis, ddof=1) / (sx * mx**2) + ya.var(axis=axis, ddof=1) / (sy * my**2))
    z = stats.norm.ppf(0.5 + confidence / 2)
    return ratio, se, ratio * np.exp(-z * se), ratio * np.exp(z * se)


# ------------------------------------------------------------------------------- drivers
def _chunk_seed(seed: int, index: int) -> int:
    state = np.random.SeedSequence([seed, index]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 31 ^ int(state[1])


def batched_draws(
    fm: FeatureMap,
    draws: int,
    *,
    seed: int = 0,
    chunk_size: int,
    extra_dims: int = 0,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Iterator[FeatureMap]:
    r"""Yield copies of a random feature map holding ``chunk_size`` independent projections each.

    Each copy is ``type(fm)(**fm.get_params())`` (same estimator, ``dim``, ``num_features``,
    sampler and other constructor arguments) with ``batch_shape = (c, 1, ..., 1)`` (``extra_dims`` ones, so that the draw axis goes in front of
    an input's own leading dimensions); ``c = chunk_size`` except possibly for the last chunk.
    Chunk ``i`` is drawn from the seed ``SeedSequence([seed, i])``, so results are reproducible
    for a given ``(seed, chunk_size)``. The draws of ``fm`` itself are not used.

    Parameters
    ----------
    fm : RandomFeatureMap
        The estimator to copy (``fm.is_random`` must be true).
    draws : int
        Total number S of independent projections.
    seed : int, default 0
    chunk_size : int
        Draws per chunk.
    extra_dims : int, default 0
        Number of leading (batch) dimensions of the inputs the copies will see.
    dtype : torch.dtype, default torch.float64
    device : optional
        Where the projections live.

    Yields
    ------
    RandomFeatureMap
        With ``batch_shape == (c,) + (1,) * extra_dims``; ``copy(x)`` for ``x`` of shape
        ``(..., n, d)`` gives ``(c, ..., n, feature_dim)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.TrigRF(dim=4, num_features=8, seed=0)
    >>> [c.batch_shape for c in batched_draws(fm, 5, chunk_size=2)]
    [(2,), (2,), (1,)]
    """
    draws = check_positive_int("draws", draws)
    chunk_size = check_positive_int("chunk_size", chunk_size)
    seed = cast(int, check_seed("seed", seed, allow_none=False))
    dtype = cast(torch.dtype, check_dtype("dtype", dtype, allow_none=False))
    device = check_device("device", device)
    if isinstance(extra_dims, bool) or not isinstance(extra_dims, int) or extra_dims < 0:
        raise ValueError(f"extra_dims must be a non-negative int, got {extra_dims!r}")
    if not getattr(fm, "is_random", False):
        raise ValueError(f"fm must be a random feature map (fm.is_random) for batched_draws, got {type(fm).__name__}")
    params = fm.get_params()
    current = None
    for index, start in enumerate(range(0, draws, chunk_size)):
        c = min(chunk_size, draws - start)
        s = _chunk_seed(seed, index)
        if current is None or current.batch_shape[0] != c:
            current = type(fm)(
                **{**params, "seed": s, "batch_shape": (c,) + (1,) * extra_dims, "dtype": dtype, "device": device}
            )
        else:
            current.redraw(seed=s)
        yield current


def _estimate(copy: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    r"""$\hat K$ of every draw of ``copy``: ``(c, ..., n, m)``, from the stabilised features.

    The same value as ``copy.kernel(q, k)`` up to rounding; the key scale is shared over the
    sequence, so the scales combine as one broadcast product (no log of the Gram matrix). The
    result is a fresh tensor (callers may edit it in place), in the promoted dtype of the features
    and the float64 log scales, computed as ``G.to(dtype) * scale`` (in place on the Gram matrix
    when it already has that dtype).
    """
    fq, sq = copy.log_features(q)
    fk, sk = copy.key_log_features(k, shared=True)
    G = fq @ fk.mT
    scale = torch.exp(sq[..., :, None] + sk[..., None, :])
    if broadcast_shapes(G.shape, scale.shape) != G.shape:  # pragma: no cover - defensive
        return G * scale
    out = G.to(torch.promote_types(G.dtype, scale.dtype))
    return out.mul_(scale)


def _auto_chunk(fm: FeatureMap, per_row: int, per_pair: int, chunk_size, max_bytes) -> int:
    if chunk_size is not None:
        return check_positive_int("chunk_size", chunk_size)
    max_bytes = check_positive_int("max_bytes", max_bytes)
    # float64 bytes per draw: features of all rows (x3 for the log-domain intermediates),
    # the projection, and the (n, m) products (x4: estimate, error, powers).
    per_draw = 8 * (3 * per_row * fm.feature_dim + fm.num_features * fm.dim + 4 * per_pair)
    return max(1, int(max_bytes // per_draw))


def _check_common(fm, q, k, draws, seed, confidence, quantiles, dtype, device, chunk_size, max_bytes):
    check_floating("q", q)
    check_floating("k", k)
    for name, x in (("q", q), ("k", k)):
        if x.is_meta:
            raise ValueError(f"{name} is a meta tensor (no data); Monte Carlo errors need values")
        if not bool(torch.isfinite(x).all()):  # once per call, outside the draws
            raise ValueError(f"{name} must be finite, got {int((~torch.isfinite(x)).sum())} NaN or infinite entries")
    if q.device != k.device:
        raise ValueError(f"q and k must be on the same device, got q on {q.device} and k on {k.device}")
    check_dtype("dtype", dtype, allow_none=False)
    check_device("device", device)
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    check_positive_int("max_bytes", max_bytes)
    from kernelapprox.maps.base import FeatureMap

    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")
    for name, x in (("q", q), ("k", k)):
        if x.dim() < 2 or x.shape[-1] != fm.dim:
            raise ValueError(
                f"{name} must have shape (..., n, {fm.dim}) for a feature map with dim={fm.dim}, "
                f"got {tuple(x.shape)}"
            )
    draws = check_positive_int("draws", draws)
    check_seed("seed", seed, allow_none=False)
    _check_confidence(confidence)
    probs = np.atleast_1d(np.asarray(quantiles, dtype=np.float64))
    if probs.ndim != 1 or np.any((probs <= 0) | (probs >= 1)):
        raise ValueError(f"quantiles must be probabilities in (0, 1), got {quantiles!r}")
    if getattr(fm, "is_random", False) and draws < 2:
        raise ValueError(f"draws must be >= 2 for a random feature map, got {draws}")
    return draws, probs


def _summary_frame(per_draw: dict[str, np.ndarray], probs, confidence):
    import pandas as pd

    rows = []
    for name, values in per_draw.items():
        finite = np.isfinite(values)
        # non-finite draws (a trigonometric denominator that hit 0) are counted, not averaged
        row: dict = {"metric": name, "draws": values.size, "nonfinite": int((~finite).sum())}
        values = values[finite]
        if values.size >= 2 and np.ptp(values) > 0:
            mean, se, lo, hi = (float(a) for a in mean_ci(values, confidence=confidence))
            qs, qlo, qhi = quantile_ci(values, probs, confidence=confidence)
        else:  # one distinct value (a deterministic map) or none left
            centre = float(values[0]) if values.size else math.nan
            mean, se, lo, hi = centre, 0.0, centre, centre
            qs = qlo = qhi = np.full(probs.shape, centre)
        row.update(mean=float(mean), mean_se=float(se), mean_low=float(lo), mean_high=float(hi))
        for p, v, a, b in zip(probs, qs, qlo, qhi, strict=True):
            row[f"q{p:g}"] = float(v)
            row[f"q{p:g}_low"] = float(a)
            row[f"q{p:g}_high"] = float(b)
        rows.append(row)
    return pd.DataFrame(rows).set_index("metric")


class _Results(dict):
    """The result dict of `kernel_error` / `attention_error`: ``res["summary"]``, the per-metric
    ``pandas.DataFrame``, is built on first access, so that pandas is imported only by the callers
    that read it."""

    def __init__(self, *args: Any, summary: tuple[dict, Any, float], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._summary_args = summary

    def __missing__(self, key: str) -> Any:
        if key != "summary":
            raise KeyError(key)
        value = self["summary"] = _summary_frame(*self._summary_args)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key == "summary" else super().get(key, default)


def _entry_frame(stats_: dict[str, np.ndarray], exact: np.ndarray, last: tuple[str, str]):
    import pandas as pd

    names = [f"b{i}" for i in range(exact.ndim - 2)] + list(last)
    idx = pd.MultiIndex.from_tuples(list(np.ndindex(exact.shape)), names=names)
    cols = {"exact": exact.ravel()}
    for key, val in stats_.items():
        if key.endswith("_ci"):
            cols[key[:-3] + "_low"] = np.asarray(val[0]).ravel()
            cols[key[:-3] + "_high"] = np.asarray(val[1]).ravel()
        else:
            cols[key] = np.asarray(val).ravel()
    return pd.DataFrame(cols, index=idx)


def kernel_error(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    draws: int = 10_000,
    *,
    seed: int = 0,
    chunk_size: int | None = None,
    max_bytes: int = _DEFAULT_BYTES,
    confidence: float = 0.95,
    quantiles: Sequence[float] = (0.5, 0.9, 0.99),
    dtype: torch.dtype = torch.float64,
    as_frame: bool = False,
) -> dict:
    r"""Monte Carlo error of a kernel estimator over S independent projections.

    For draws $d=1..S$ of the projection, $\hat K^{(d)}$ = ``copy.kernel(q, k)`` (computed from
    ``copy.log_features``) and
    $e^{(d)}=\hat K^{(d)}-K$ with $K=e^{qk^\top}$; per entry

    $$
    \overline{K}=K+\bar e,\quad \mathrm{bias}=\bar e\pm t\frac{s_e}{\sqrt S},\quad
    \mathrm{MSE}=\overline{e^2}\pm t\frac{s_{e^2}}{\sqrt S},\quad
    \mathrm{Var}=s_e^2\pm z\sqrt{\frac{m_4-m_2^2}{S}},
    $$

    accumulated as streaming power sums (float64) chunk by chunk, plus per-draw scalar metrics
    (relative Frobenius, relative RMS, max absolute and max relative error over the whole
    ``(..., n, m)`` block) summarised by their mean (t-interval) and quantiles (exact
    order-statistic intervals, `quantile_ci`). The theory's ``ka.theory.mse(fm, q, k)`` is what ``mse`` estimates.

    Draws are evaluated ``chunk`` at a time through ``batch_shape=(chunk, 1, ...)``: one batched
    matmul per chunk, memory about ``max_bytes``. Per chunk the error $e$ is formed once, in place;
    $e^2$ feeds both the power sums (taken as products with a vector of ones, one read each) and
    the per-draw metrics; scratch tensors are reused across chunks; no Python loop over draws.
    This keeps the driver close to the same work written as bare batched matmuls
    (``python -m benchmarks mc``; see docs/performance.md). The
    statistics do not depend on ``dtype`` beyond the rounding of the features: they are float64.

    Parameters
    ----------
    fm : FeatureMap
        The estimator. Its class, ``dim``, ``num_features``, sampler and ``variant`` are used; its
        own projection is not (fresh draws from ``seed``). A deterministic map (elu, relu) is
        evaluated once: bias = its deterministic error, variance 0.
    q : torch.Tensor
        Shape ``(..., n, d)``.
    k : torch.Tensor
        Shape ``(..., m, d)``.
    draws : int, default 10_000
        S, the number of independent projections.
    seed : int, default 0
    chunk_size : int, optional
        Draws per batched evaluation; default from ``max_bytes``.
    max_bytes : int, default 256 MiB
    confidence : float, default 0.95
    quantiles : sequence of float, default (0.5, 0.9, 0.99)
        Quantiles of the per-draw metrics to report.
    dtype : torch.dtype, default torch.float64
        Compute dtype of inputs and projections.
    as_frame : bool, default False
        Return a per-entry ``pandas.DataFrame`` (index ``(..., i, j)``) with columns ``exact``,
        ``mean``, ``mean_low``, ``mean_high``, ``bias``, ..., ``mse_high`` instead of the dict.

    Returns
    -------
    dict
        ``draws`` (int), ``exact`` (``(..., n, m)`` ndarray), ``mean``, ``mean_ci``
        (``(2, ..., n, m)``: low, high), ``bias``, ``bias_se``, ``bias_ci``, ``variance``,
        ``variance_se``, ``variance_ci``, ``mse``, ``mse_se``, ``mse_ci``, ``relative_mse``
        (``mse / exact**2``), and ``summary`` (built on first access, the one entry that needs
        pandas): a ``pandas.DataFrame`` indexed by metric
        (``relative_frobenius``, ``relative_rms``, ``max_abs_error``, ``max_relative_error``) with
        columns ``draws``, ``nonfinite`` (draws with an inf/nan metric, left out of the statistics),
        ``mean``, ``mean_se``, ``mean_low``, ``mean_high`` and ``q<p>``, ``q<p>_low``,
        ``q<p>_high`` per quantile. ``per_draw`` holds the (S,) arrays of those metrics.

    Raises
    ------
    ValueError, TypeError
        For bad shapes, dtypes, ``draws < 2`` or a feature map built from a given projection
        (its sampler cannot draw).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.TrigRF(dim=4, num_features=32, seed=0)
    >>> q, k = torch.randn(2, 8, 4, dtype=torch.float64).unbind(0)
    >>> res = ka.montecarlo.kernel_error(fm, q / 2, k / 2, draws=1000, quantiles=(0.5,))
    >>> list(res["summary"].columns[:4])
    ['draws', 'nonfinite', 'mean', 'mean_se']
    """
    from kernelapprox.exact import softmax_kernel

    draws, probs = _check_common(fm, q, k, draws, seed, confidence, quantiles, dtype, None, chunk_size,
                                 max_bytes)
    check_bool("as_frame", as_frame)
    q = q.detach().to(dtype)
    k = k.detach().to(dtype)
    exact = softmax_kernel(q, k)
    extra = max(q.dim(), k.dim()) - 2
    n, m = q.shape[-2], k.shape[-2]
    lead = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2]))

    acc = _PowerSums(exact)
    per_draw: dict[str, list[np.ndarray]] = {
        "relative_frobenius": [],
        "relative_rms": [],
        "max_abs_error": [],
        "max_relative_error": [],
    }

    exact64 = acc.shift  # K in float64
    norm_k = torch.linalg.vector_norm(exact64)

    def consume(est: torch.Tensor) -> None:
        # One fused pass over the chunk's (c, ..., n, m) estimates (est is owned: edited in place):
        # e = K^ - K, e^2 (shared by the power sums and the per-draw metrics), then e / K.
        e = est.to(torch.float64).sub_(exact64)
        e2 = torch.mul(e, e, out=acc.work.get("e2", e))
        acc.add_centred(e, e2)
        s = e.shape[0]
        e2f = e2.reshape(s, -1)  # the whole (..., n, m) block as one matrix
        per_draw["relative_frobenius"].append((e2f.sum(-1).sqrt_() / norm_k).cpu().numpy())
        per_draw["max_abs_error"].append(e2f.amax(-1).sqrt_().cpu().numpy())
        rel2 = e.div_(exact64).square_().reshape(s, -1)  # ((K^ - K) / K)^2
        per_draw["relative_rms"].append(rel2.mean(-1).sqrt_().cpu().numpy())
        per_draw["max_relative_error"].append(rel2.amax(-1).sqrt_().cpu().numpy())

    if getattr(fm, "is_random", False):
        chunk = _auto_chunk(fm, lead * (n + m), lead * n * m, chunk_size, max_bytes)
        for copy in batched_draws(
            fm, draws, seed=seed, chunk_size=chunk, extra_dims=extra, dtype=dtype, device=q.device
        ):
            consume(_estimate(copy, q, k))
    else:
        draws = 1
        consume(fm.kernel(q, k).to(dtype).unsqueeze(0))

    out: dict[str, Any] = dict(acc.summary(confidence))
    if draws == 1:
        for key in ("bias_se", "variance", "variance_se", "mse_se"):
            out[key] = np.zeros_like(out["bias"])
        for key, centre in (("mean_ci", "mean"), ("bias_ci", "bias"), ("mse_ci", "mse")):
            out[key] = np.stack([out[centre], out[centre]])
        out["variance_ci"] = np.zeros((2,) + out["bias"].shape)
    exact_np = exact.cpu().numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        out["relative_mse"] = out["mse"] / exact_np**2
    if as_frame:
        return _entry_frame(out, exact_np, ("i", "j"))
    flat = {key: np.concatenate(val) for key, val in per_draw.items()}
    out.update(draws=draws, exact=exact_np, per_draw=flat)
    return _Results(out, summary=(flat, probs, confidence))


def attention_error(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    draws: int = 10_000,
    *,
    causal: bool = False,
    seed: int = 0,
    chunk_size: int | None = None,
    max_bytes: int = _DEFAULT_BYTES,
    confidence: float = 0.95,
    quantiles: Sequence[float] = (0.5, 0.9, 0.99),
    dtype: torch.dtype = torch.float64,
    as_frame: bool = False,
) -> dict:
    r"""Monte Carlo error of random-feature attention over S independent projections.

    Per draw, $\hat K$ = ``copy.kernel(q, k)`` (masked to $j\le i$ if ``causal``),
    $\hat a_{ij}=\hat K_{ij}/\sum_l\hat K_{il}$ and $\hat o_i=\sum_j\hat a_{ij}v_j$
    (the same function of the features as `kernelapprox.linear_attention`, evaluated through
    the kernel matrix so that the attention rows are available). Against the exact
    $o_i=\sum_jA_{ij}v_j$ it reports per output coordinate the mean of $\hat o$
    (t-interval), bias, variance (with the fourth-moment standard error, the quantity
    `kernelapprox.theory.attention_variance` approximates) and MSE, and per draw
    the relative error $\|\hat O-O\|_F/\|O\|_F$ over the whole block and the mean and max
    over rows of $\mathrm{TV}_i=\frac12\sum_j|\hat a_{ij}-A_{ij}|$.

    For non-positive maps (trigonometric) the denominator $\sum_j\hat K_{ij}$ can be near 0
    and $\hat o$ then has no finite variance: expect large, unstable variance estimates and
    look at the quantiles.

    Parameters
    ----------
    fm : FeatureMap
        The estimator (its own projection is not used; see `kernel_error`).
    q : torch.Tensor
        Shape ``(..., n, d)``.
    k : torch.Tensor
        Shape ``(..., m, d)``.
    v : torch.Tensor
        Shape ``(..., m, dv)``.
    draws : int, default 10_000
    causal : bool, default False
        Row i attends to keys j <= i (n == m).
    seed, chunk_size, max_bytes, confidence, quantiles, dtype, as_frame
        As in `kernel_error`; the per-entry frame is indexed by ``(..., i, c)``.

    Returns
    -------
    dict
        ``draws``, ``exact`` (``(..., n, dv)``), ``mean``, ``mean_ci``, ``bias``, ``bias_se``,
        ``bias_ci``, ``variance``, ``variance_se``, ``variance_ci``, ``mse``, ``mse_se``,
        ``mse_ci`` (each ``(..., n, dv)``, CIs with a leading axis of 2), ``per_draw`` and
        ``summary`` over the metrics ``attention_relative_error``, ``mean_total_variation``,
        ``max_total_variation``.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(dim=4, num_features=64, seed=0)
    >>> q, k, v = torch.randn(3, 8, 4, dtype=torch.float64).unbind(0)
    >>> res = ka.montecarlo.attention_error(fm, q / 2, k / 2, v, draws=1000, quantiles=(0.5,))
    >>> res["variance"].shape
    (8, 4)
    """
    from kernelapprox.exact import check_qkv, softmax_attention

    draws, probs = _check_common(fm, q, k, draws, seed, confidence, quantiles, dtype, None, chunk_size,
                                 max_bytes)
    check_bool("as_frame", as_frame)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    check_qkv(q, k, v, causal=causal)
    q = q.detach().to(dtype)
    k = k.detach().to(dtype)
    v = v.detach().to(dtype)
    n, m, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    extra = max(q.dim(), k.dim(), v.dim()) - 2
    lead = math.prod(broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]))
    exact = softmax_attention(q, k, v, causal=causal)
    logits = q @ k.mT
    mask = None
    if causal:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(mask, -math.inf)
    weights = torch.softmax(logits, dim=-1)

    acc = _PowerSums(exact)
    per_draw: dict[str, list[np.ndarray]] = {
        "attention_relative_error": [],
        "mean_total_variation": [],
        "max_total_variation": [],
    }

    v64 = v.to(torch.float64)
    weights64 = weights.to(torch.float64)
    norm_o = torch.linalg.vector_norm(acc.shift.reshape(-1, dv), dim=(-2, -1))

    def consume(kh: torch.Tensor) -> None:
        # in place on the owned (c, ..., n, m) estimate: mask, normalise, then a - A for the TV
        kh = kh.to(torch.float64)
        if mask is not None:
            kh = kh.masked_fill_(mask, 0.0)
        a = kh.div_(kh.sum(dim=-1, keepdim=True))
        e = torch.matmul(a, v64).sub_(acc.shift)  # o^ - o, (c, ..., n, dv)
        e2 = torch.mul(e, e, out=acc.work.get("e2", e))
        acc.add_centred(e, e2)
        s = e.shape[0]
        err = e2.reshape(s, -1).sum(-1).sqrt_() / norm_o
        tv = a.sub_(weights64).abs_().sum(dim=-1).mul_(0.5).reshape(s, -1)
        per_draw["attention_relative_error"].append(err.cpu().numpy())
        per_draw["mean_total_variation"].append(tv.mean(-1).cpu().numpy())
        per_draw["max_total_variation"].append(tv.amax(-1).cpu().numpy())

    if getattr(fm, "is_random", False):
        chunk = _auto_chunk(fm, lead * (n + m), lead * n * (m + dv), chunk_size, max_bytes)
        for copy in batched_draws(
            fm, draws, seed=seed, chunk_size=chunk, extra_dims=extra, dtype=dtype, device=q.device
        ):
            consume(_estimate(copy, q, k))
    else:
        draws = 1
        consume(fm.kernel(q, k).to(dtype).unsqueeze(0))

    out: dict[str, Any] = dict(acc.summary(confidence))
    if draws == 1:
        for key in ("bias_se", "variance", "variance_se", "mse_se"):
            out[key] = np.zeros_like(out["bias"])
        for key, centre in (("mean_ci", "mean"), ("bias_ci", "bias"), ("mse_ci", "mse")):
            out[key] = np.stack([out[centre], out[centre]])
        out["variance_ci"] = np.zeros((2,) + out["bias"].shape)
    exact_np = exact.cpu().numpy()
    if as_frame:
        return _entry_frame(out, exact_np, ("i", "c"))
    flat = {key: np.concatenate(val) for key, val in per_draw.items()}
    out.update(draws=draws, exact=exact_np, per_draw=flat)
    return _Results(out, summary=(flat, probs, confidence))
