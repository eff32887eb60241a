r"""Pointwise bias, variance and MSE of every estimator of $\mathrm{SM}(x, y) = e^{x^\top y}$.

Each random map estimates $\mathrm{SM}(x, y)$ by $\hat K = \varphi(x)^\top\varphi(y)
= \frac1r\sum_{i=1}^r X_i$, an average of ``r = num_features`` per-projection terms
$X_i$ (one per row $w_i$ of the projection). This module gives, in closed form and in
float64, the mean, variance and MSE of every entry of ``fm.kernel(q, k)``:

- trig sin/cos: per-projection term $X_i$: $C\cos(w_i^\top\Delta)$; feature coordinates: ``2r``
- trig offset: per-projection term $X_i$: $2C\cos(w_i^\top x+b_i)\cos(w_i^\top y+b_i)$; feature coordinates: ``r``
- positive (FAVOR+): per-projection term $X_i$: $\Lambda\, e^{w_i^\top z}$; feature coordinates: ``r``
- hyperbolic: per-projection term $X_i$: $\Lambda\cosh(w_i^\top z)$; feature coordinates: ``2r``

Notation (``docs/theory.md``, Notation): $z = x+y$, $\Delta = x-y$, $t=\|z\|^2$,
$s=\|\Delta\|^2$, $\Lambda=e^{-(\|x\|^2+\|y\|^2)/2}$, $C = 1/\Lambda$, so that
$\mathrm{SM}=\Lambda e^{t/2} = C e^{-s/2}$.

General structure (DERIVED, elementary). With $\mu = E X_i$, $m_2 = E X_i^2$ and, for
two distinct rows of the same orthogonal block, $p_2 = E X_iX_j$,

$$
\mathrm{bias} = \mu - \mathrm{SM},\qquad
\mathrm{Var}\,\hat K = \frac{m_2-\mu^2}{r} + \frac{P}{r^2}\,(p_2-\mu^2),\qquad
\mathrm{MSE} = \mathrm{bias}^2 + \mathrm{Var}\,\hat K,
$$

where $P$ is the number of *ordered* pairs $(i\ne j)$ of rows in the same block
(`orf_pair_count`): $P = 0$ for iid rows, and for ``r = b d + r'`` block-orthogonal
rows (``b`` full blocks, one partial block of ``r'`` rows), $P = b\,d(d-1) + r'(r'-1)$.
Rows of different blocks are independent. For a single block this is Performer's
$\frac{m-1}{m}$ factor; the partial-block count is DERIVED here and checked by Monte Carlo.

The ingredients, for $\omega \sim \mathcal N(0, I_d)$ (iid rows and χ-norm ORF rows are
marginally Gaussian):

* $E e^{\omega^\top a} = e^{\|a\|^2/2}$, $E\cos(\omega^\top a) = e^{-\|a\|^2/2}$
  (Gaussian MGF) — this gives Performer Lemma 2 [SOURCE] and the offset variance of
  Sutherland–Schneider [DERIVED, MC ✓].
* Two distinct rows of one χ-norm ORF block: $w_i \pm w_j = \rho u$ with
  $\rho^2\sim\chi^2_{2d}$ independent of $u$ uniform on $S^{d-1}$; averaging
  $E_u e^{\rho u^\top a} = {}_0F_1(;\tfrac d2;\rho^2\|a\|^2/4)$ over
  $E\rho^{2k} = 2^k(d)_k$ gives

  $$
  E\, e^{(w_i\pm w_j)^\top a} = {}_1F_1\!\big(d;\tfrac d2;\tfrac{\|a\|^2}{2}\big),\qquad
  E\cos\big((w_i\pm w_j)^\top a\big) = {}_1F_1\!\big(d;\tfrac d2;-\tfrac{\|a\|^2}{2}\big)
  $$

  [DERIVED; ``docs/theory.md`` §1, MC ✓]. Since $w_i$ and $-w_j$ are also an
  orthogonal pair, $E\cosh(w_i^\top z)\cosh(w_j^\top z) = {}_1F_1(d;\tfrac d2;\tfrac t2)$
  — the hyperbolic pair moment equals the positive one — and the random phases of the offset
  variant average out of $E X_iX_j$, leaving the sin/cos pair moment.
* Fixed-norm ORF (rows of norm $\sqrt d$, Yu's ORF′ / Performer's SMREG):
  $E e^{w^\top a} = {}_0F_1(;\tfrac d2;\tfrac{d\|a\|^2}{4})$ and
  $\|w_i \pm w_j\|^2 = 2d$, so $E e^{(w_i\pm w_j)^\top a} = {}_0F_1(;\tfrac d2;
  \tfrac{d\|a\|^2}{2})$ ($a \to ia$ for cosines, a normalised Bessel function) [DERIVED,
  MC ✓]. The estimator is biased: it estimates SMREG (positive/hyperbolic,
  `smreg_kernel`) or a Bessel kernel (trig, `fixed_norm_trig_kernel`).

Numerics. Every quantity is computed in float64 from a log-scale and an $O(1)$ bracket, so
the result is ``inf`` only where the true value overflows float64. $s$ and $t$ are
recomputed from the coordinates where $x\approx\pm y$ (no cancellation), the ORF pair
excesses ${}_1F_1(d;\tfrac d2;z) - e^{2z}$ are summed as series where they would cancel,
and ${}_0F_1$ uses the Bessel forms (``scipy.special.ive``/``jv``) with a series or an
``mpmath`` fallback where ``scipy.special.hyp0f1`` is inaccurate (large ``d``, negative
argument). ``scipy.special.hyp1f1(d, d/2, z)`` was checked against mpmath to 1e-11 relative for
``d`` up to 1024 and $-3000 \le z \le 600$ (``tests/test_theory_moments.py``).

Inputs and outputs. ``q`` of shape ``(..., n, d)`` and ``k`` of shape ``(..., m, d)`` (NumPy
arrays or torch tensors; leading dimensions broadcast) give ``(..., n, m)`` arrays, like
``fm.kernel(q, k)``. NumPy in → NumPy float64 out; a torch tensor in → a float64 torch tensor
on the input's device.

Structured (SORF) and QMC projections have no closed form here: `bias`, `variance`,
`mse` raise ``NotImplementedError`` pointing to `kernelapprox.montecarlo.kernel_error`.

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2, eq. 8; Theorem 2, eq. 10; SMREG §2.3).
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072 (Lemma 1; ORF′ eq. 4).
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015,
   arXiv:1506.02785.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, cast

import numpy as np
import torch
from scipy.special import gammaln, hyp0f1, hyp1f1, ive, jv

from kernelapprox.registry import Estimator, EstimatorTheory, estimator_of, get_estimator

from .simplex import simplex_components_cv

__all__ = [
    "Components",
    "Moments",
    "POSITIVE_THEORY",
    "HYPERBOLIC_THEORY",
    "TRIG_SINCOS_THEORY",
    "TRIG_OFFSET_THEORY",
    "orf_pair_count",
    "estimator_moments",
    "trig_sincos_mse",
    "trig_offset_mse",
    "positive_mse",
    "hyperbolic_mse",
    "trig_bias",
    "positive_bias",
    "hyperbolic_bias",
    "smreg_kernel",
    "fixed_norm_trig_kernel",
    "performer_theorem2_bound",
    "deterministic_error",
    "feature_map_kind",
    "bias",
    "variance",
    "mse",
    "relative_mse",
]

#: ``Sampler.row_law`` -> the ``orthogonal`` argument of the formulas.
_LAW_TO_ORTHOGONAL: dict[str, str | None] = {
    "iid": None, "orthogonal-chi": "chi", "orthogonal-fixed": "fixed", "simplex": "simplex",
}
_ALL_LAWS = frozenset(_LAW_TO_ORTHOGONAL)

_NO_CLOSED_FORM = (
    "no closed form for the {name!r} sampler ({what}): its rows are dependent in a way this module "
    "does not model, and using the iid formula would be silently wrong; estimate the error by "
    "Monte Carlo with ka.montecarlo.kernel_error(fm, q, k, draws=...)"
)


class Moments(NamedTuple):
    """Bias, variance and MSE of every kernel entry, each of shape ``(..., n, m)``."""

    bias: Any
    variance: Any
    mse: Any


# ----------------------------------------------------------------------------------------------
# input handling
# ----------------------------------------------------------------------------------------------


def _to_numpy(name: str, x: object) -> tuple[np.ndarray, torch.device | None]:
    if isinstance(x, torch.Tensor):
        if x.is_complex() or not x.is_floating_point():
            raise TypeError(f"{name} must have a real floating dtype, got {x.dtype}")
        return x.detach().to("cpu", torch.float64).numpy(), x.device
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real array or torch tensor, got {type(x).__name__}") from None
    return a, None


def _prepare(q: object, k: object) -> tuple[np.ndarray, np.ndarray, torch.device | None]:
    qa, dq = _to_numpy("q", q)
    ka, dk = _to_numpy("k", k)
    for name, a in (("q", qa), ("k", ka)):
        if a.ndim < 2:
            raise ValueError(f"{name} must have shape (..., n, d) with at least 2 dimensions, got {a.shape}")
    if qa.shape[-1] != ka.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension d, got {qa.shape[-1]} and {ka.shape[-1]}"
        )
    try:
        np.broadcast_shapes(qa.shape[:-2], ka.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading dimensions of q {qa.shape[:-2]} and k {ka.shape[:-2]} do not broadcast"
        ) from None
    device = dq if dq is not None else dk
    return qa, ka, device


def _out(a: np.ndarray, device: torch.device | None):
    if device is None:
        return a
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


class _Geometry(NamedTuple):
    nx: np.ndarray  # |x|^2, shape (..., n, m) after broadcasting
    ny: np.ndarray  # |y|^2
    xy: np.ndarray  # x.y
    s: np.ndarray  # |x - y|^2
    t: np.ndarray  # |x + y|^2
    d: int


def _geometry(q: np.ndarray, k: np.ndarray) -> _Geometry:
    """Pairwise |x|^2, |y|^2, x.y, |x-y|^2, |x+y|^2, recomputing s and t exactly where they cancel."""
    nq = np.einsum("...i,...i->...", q, q)[..., :, None]
    nk = np.einsum("...i,...i->...", k, k)[..., None, :]
    xy = np.matmul(q, np.swapaxes(k, -1, -2))
    shape = np.broadcast_shapes(nq.shape, nk.shape, xy.shape)
    nx, ny, xy = (np.broadcast_to(a, shape).copy() for a in (nq, nk, xy))
    s = nx + ny - 2 * xy
    t = nx + ny + 2 * xy
    lead = shape[:-2]
    qb = np.broadcast_to(q, lead + q.shape[-2:])
    kb = np.broadcast_to(k, lead + k.shape[-2:])
    for arr, sign in ((s, -1.0), (t, 1.0)):
        bad = arr < 1e-3 * (nx + ny)
        if bad.any():
            idx = np.nonzero(bad)
            xi = qb[idx[:-1]]
            yj = kb[idx[:-2] + (idx[-1],)]
            diff = xi + sign * yj
            arr[idx] = np.einsum("...i,...i->...", diff, diff)
    np.maximum(s, 0.0, out=s)
    np.maximum(t, 0.0, out=t)
    return _Geometry(nx, ny, xy, s, t, int(q.shape[-1]))


def _check_r(num_features: object) -> int:
    if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)):
        raise TypeError(f"num_features must be a positive int, got {num_features!r}")
    if num_features <= 0:
        raise ValueError(f"num_features must be a positive int, got {num_features}")
    return int(num_features)


def _check_orthogonal(orthogonal: object) -> str | None:
    if orthogonal is None or orthogonal in ("chi", "fixed", "simplex"):
        return orthogonal
    raise ValueError(f"orthogonal must be None, 'chi', 'fixed' or 'simplex', got {orthogonal!r}")


def orf_pair_count(num_features: int, dim: int) -> int:
    r"""Number $P$ of ordered pairs $(i \ne j)$ of rows in the same orthogonal block.

    ``r = num_features`` rows in ``ceil(r/d)`` blocks of ``d`` rows, the last keeping
    ``r' = r - b d`` rows (``b = r // d``): $P = b\,d(d-1) + r'(r'-1)$ [DERIVED]. The
    covariance term of an ORF estimator carries the factor $P/r^2$, which is
    $(r-1)/r$ for a single block (Performer's $\frac{m-1}{m}$).

    Parameters
    ----------
    num_features : int
        ``r``, the number of projections.
    dim : int
        ``d``, the block size.

    Returns
    -------
    int

    Examples
    --------
    >>> orf_pair_count(6, 4)  # one full block (12 pairs) + a block of 2 rows (2 pairs)
    14
    """
    r = _check_r(num_features)
    d = _check_r(dim)
    b, rp = divmod(r, d)
    return b * d * (d - 1) + rp * (rp - 1)


# ----------------------------------------------------------------------------------------------
# special functions
# ----------------------------------------------------------------------------------------------

_SERIES_TERMS = 220


def _pair_excess(d: int, z: np.ndarray) -> np.ndarray:
    r"""${}_1F_1(d;\tfrac d2;z) - e^{2z}$ elementwise (float64).

    This is $E e^{(w_i+w_j)^\top a} - E_{\rm iid}[\cdot]$ at $z = \|a\|^2/2$ (or the
    cosine version at $z=-\|a\|^2/2$). Series $\sum_{k\ge2} c_k z^k/k!$ with
    $c_k = (d)_k/(d/2)_k - 2^k \le 0$ where it would cancel (``|z| <= 1``) and for
    ``0 < z <= 35`` (all terms of one sign: stable); ``hyp1f1(d, d/2, z) - exp(2z)`` elsewhere.
    """
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    use_series = (np.abs(z) <= 1.0) | ((z > 0) & (z <= 35.0))
    if use_series.any():
        zs = z[use_series]
        j = np.arange(_SERIES_TERMS - 1, dtype=np.float64)
        logprod = np.concatenate(([0.0], np.cumsum(np.log1p(-j / (d + 2.0 * j)))))
        coef = np.expm1(logprod)  # c_k / 2^k, k = 0.._SERIES_TERMS-1 (c_0 = c_1 = 0)
        w = 2.0 * zs
        term = np.ones_like(w)
        acc = np.zeros_like(w)
        for kk in range(_SERIES_TERMS):
            if kk >= 2:
                acc += coef[kk] * term
                if kk > 4.0 * np.max(np.abs(w), initial=0.0) + 20 and np.all(
                    np.abs(coef[kk] * term) <= 1e-18 * np.abs(acc)
                ):
                    break
            term = term * w / (kk + 1)
        out[use_series] = acc
    rest = ~use_series
    if rest.any():
        zr = z[rest]
        out[rest] = hyp1f1(d, d / 2.0, zr) - np.exp(2.0 * zr)
    return out


def _log_hyp0f1_pos(b: float, x: np.ndarray) -> np.ndarray:
    r"""$\log {}_0F_1(;b;x)$ for ``x >= 0`` without overflow.

    ``log(hyp0f1)`` where finite; else $\log\Gamma(b) + \tfrac{1-b}{2}\log x +
    \log I_{b-1}^{(e)}(2\sqrt x) + 2\sqrt x$ with the exponentially scaled Bessel ``ive``.
    """
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros_like(x)
    pos = x > 0
    if pos.any():
        xp = x[pos]
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            v = np.where(xp < 1e5, hyp0f1(b, np.minimum(xp, 1e5)), np.inf)
            good = np.isfinite(v) & (v > 0)
            res = np.log(np.where(good, v, 1.0))
            if (~good).any():
                xb = xp[~good]
                res[~good] = (
                    gammaln(b)
                    + 0.5 * (1.0 - b) * np.log(xb)
                    + np.log(ive(b - 1.0, 2.0 * np.sqrt(xb)))
                    + 2.0 * np.sqrt(xb)
                )
        out[pos] = res
    return out


def _hyp0f1_neg(b: float, x: np.ndarray) -> np.ndarray:
    r"""${}_0F_1(;b;x)$ for ``x <= 0`` (bounded by 1 in absolute value).

    ``scipy.special.hyp0f1`` returns nan/inf for large ``b`` here, so: the power series where it is
    free of cancellation (``|x| <= 3.45 b``: at most ~3 digits lost), else
    $\Gamma(b)\,y^{(1-b)/2} J_{b-1}(2\sqrt y)$ (``y=-x``) where ``jv`` does not underflow,
    else ``mpmath.hyp0f1``.
    """
    x = np.asarray(x, dtype=np.float64)
    y = -x
    out = np.empty_like(x)
    ser = y <= 3.45 * b
    if ser.any():
        ys = y[ser]
        term = np.ones_like(ys)
        acc = np.ones_like(ys)
        for kk in range(1, 400):
            term = term * (-ys) / ((b + kk - 1.0) * kk)
            acc += term
            if np.all(np.abs(term) <= 1e-18 * np.maximum(np.abs(acc), 1e-300)):
                break
        out[ser] = acc
    rest = ~ser
    if rest.any():
        yr = y[rest]
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            J = jv(b - 1.0, 2.0 * np.sqrt(yr))
            val = np.sign(J) * np.exp(gammaln(b) + 0.5 * (1.0 - b) * np.log(yr) + np.log(np.abs(J)))
        ok = np.isfinite(val) & (np.abs(J) > 1e-280)
        if (~ok).any():
            import mpmath

            with mpmath.workdps(30):
                fb = mpmath.mpf(b)

                def f(v: float) -> float:
                    try:
                        return float(mpmath.hyp0f1(fb, -v, maxprec=100000))
                    except (ValueError, ZeroDivisionError):  # at a zero of the Bessel function
                        return 0.0

                uniq, inv = np.unique(yr[~ok], return_inverse=True)
                val[~ok] = np.array([f(float(v)) for v in uniq])[inv]
        out[rest] = val
    return out


# ----------------------------------------------------------------------------------------------
# core: log-variance and relative bias of each estimator
# ----------------------------------------------------------------------------------------------


class Components(NamedTuple):
    """Closed-form ingredients of one estimator at every ``(q_i, k_j)`` pair (float64 arrays).

    ``Var(K^) = exp(scale) * (v1 / r + P(r) / r^2 * cv)`` with ``P(r)`` from
    `orf_pair_count` (0 for iid rows); ``rbias = (E K^ - SM) / SM``; ``xy = log SM = q.k``;
    ``s = |q - k|^2`` and ``t = |q + k|^2``. An `kernelapprox.EstimatorTheory`'s
    ``components(geo, orthogonal)`` returns one.
    """

    scale: np.ndarray  # log of the common scale factor
    v1: np.ndarray  # per-projection variance / exp(scale)
    cv: np.ndarray  # same-block pair covariance / exp(scale) (0 for iid rows)
    rbias: np.ndarray  # (E K^ - SM) / SM
    xy: np.ndarray  # log SM = x.y
    s: np.ndarray  # |x - y|^2
    t: np.ndarray  # |x + y|^2


class _Core(NamedTuple):
    logvar: np.ndarray  # log Var(K^) (-inf where the variance is 0)
    rbias: np.ndarray  # (E K^ - SM) / SM
    xy: np.ndarray  # log SM


def _log_pos(scale_log: np.ndarray, bracket: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return scale_log + np.log(np.maximum(bracket, 0.0))


def _exp_family(geo: _Geometry, orthogonal: str | None, hyperbolic: bool) -> Components:
    r"""Positive ($X = \Lambda e^{w^\top z}$) and hyperbolic ($X = \Lambda\cosh w^\top z$)
    features: they share the mean, the ORF pair moment and the fixed-norm machinery."""
    d, s, t = geo.d, geo.s, geo.t
    cv = np.zeros_like(s)
    if orthogonal != "fixed":
        rbias = np.zeros_like(s)
        # Var X = Lambda^2 e^{2t} * v1,  Lambda^2 e^{2t} = exp(-(|x|^2+|y|^2) + 2t)
        scale = -(geo.nx + geo.ny) + 2.0 * t
        v1 = 0.5 * np.expm1(-t) ** 2 if hyperbolic else -np.expm1(-t)  # (e^t-1)^2/(2e^{2t}); (e^{2t}-e^t)/e^{2t}
        if orthogonal == "simplex":
            # simplex blocks (SimRF): pairs at the fixed angle -1/(d-1), kernelapprox.theory.simplex
            cv = simplex_components_cv("hyperbolic" if hyperbolic else "positive", geo)
        if orthogonal == "chi":
            # same-block pair covariance Lambda^2 (1F1(d; d/2; t/2) - e^t), scaled by e^{-2t}
            # (equal for positive and hyperbolic: w_i and -w_j are also an orthogonal pair)
            small = t <= 70.0
            if small.any():
                cv[small] = _pair_excess(d, 0.5 * t[small]) * np.exp(-2.0 * t[small])
            big = ~small
            if big.any():
                # |cv| <= e^{-t}: below double precision relative to v1 here, kept for completeness
                tb = t[big]
                with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                    rho = np.exp(np.log(hyp1f1(d, d / 2.0, np.minimum(tb, 1400.0) / 2.0)) - tb)
                rho = np.where(np.isfinite(rho), rho, 0.0)
                cv[big] = -np.exp(-tb) * (1.0 - rho)
        return Components(scale, v1, cv, rbias, geo.xy, s, t)
    # fixed-norm ORF (rows of norm sqrt(d)): 0F1 moments, biased (estimates SMREG)
    b = d / 2.0
    l1 = _log_hyp0f1_pos(b, d * t / 4.0)  # mean / Lambda
    l2 = _log_hyp0f1_pos(b, d * t / 2.0)  # pair moment / Lambda^2
    l4 = _log_hyp0f1_pos(b, d * t)  # E e^{2 w.z}
    rbias = np.expm1(l1 - 0.5 * t)  # SMREG / SM - 1
    scale = -(geo.nx + geo.ny) + l4
    mu2 = np.exp(2.0 * l1 - l4)
    m2 = 0.5 * (np.exp(-l4) + 1.0) if hyperbolic else np.ones_like(t)
    return Components(scale, m2 - mu2, np.exp(l2 - l4) - mu2, rbias, geo.xy, s, t)


def _trig_family(geo: _Geometry, orthogonal: str | None, offset: bool) -> Components:
    r"""Trigonometric features, sin/cos ($X = C\cos w^\top\Delta$) or offset
    ($X = 2C\cos(w^\top x + b)\cos(w^\top y + b)$: the random phase adds 1/2 to the
    per-projection second moment and averages out of the ORF pair moment)."""
    d, s, t = geo.d, geo.s, geo.t
    cv = np.zeros_like(s)
    scale = geo.nx + geo.ny  # Var X = C^2 * v1, C^2 = exp(|x|^2 + |y|^2)
    if orthogonal != "fixed":
        rbias = np.zeros_like(s)
        v1 = 0.5 * np.expm1(-s) ** 2
        if offset:
            v1 = v1 + 0.5  # 1 + e^{-2s}/2 - e^{-s} = (1 - e^{-s})^2/2 + 1/2
        if orthogonal == "simplex":
            cv = simplex_components_cv("trig-offset" if offset else "trig-sincos", geo)
        if orthogonal == "chi":
            cv = _pair_excess(d, -0.5 * s)
        return Components(scale, v1, cv, rbias, geo.xy, s, t)
    b = d / 2.0
    F1 = _hyp0f1_neg(b, -d * s / 4.0)  # mean / C
    F2 = _hyp0f1_neg(b, -d * s / 2.0)  # pair moment / C^2
    F4 = _hyp0f1_neg(b, -d * s)  # E cos(2 w.Delta)
    with np.errstate(divide="ignore", over="ignore"):
        rbias = np.sign(F1) * np.exp(np.log(np.abs(F1)) + 0.5 * s) - 1.0
    m2 = 0.5 * (1.0 + F4)
    if offset:
        m2 = m2 + 0.5
    return Components(scale, m2 - F1 * F1, F2 - F1 * F1, rbias, geo.xy, s, t)


def positive_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``PositiveRF`` (see `positive_mse`)."""
    return _exp_family(geo, orthogonal, hyperbolic=False)


def hyperbolic_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``HyperbolicRF`` (see `hyperbolic_mse`)."""
    return _exp_family(geo, orthogonal, hyperbolic=True)


def trig_sincos_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``TrigRF(variant="sincos")`` (see `trig_sincos_mse`)."""
    return _trig_family(geo, orthogonal, offset=False)


def trig_offset_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``TrigRF(variant="offset")`` (see `trig_offset_mse`)."""
    return _trig_family(geo, orthogonal, offset=True)


def _trig_sincos_term_bound(c: Components) -> np.ndarray:
    # |X_i| <= C and C / SM = C / (C e^{-s/2}) = e^{s/2}
    return np.exp(0.5 * c.s)


def _trig_offset_term_bound(c: Components) -> np.ndarray:
    # |X_i| = |2C cos(.) cos(.)| <= 2C
    return 2.0 * np.exp(0.5 * c.s)


# The closed forms of each built-in estimator, registered with its class in kernelapprox.maps.
# Attention pair terms (c, alpha, beta, gamma): E[X_j X_l] = sum c exp(alpha|q|^2 + beta(q.k_j +
# q.k_l) + gamma k_j.k_l) for one iid Gaussian projection, derived in kernelapprox.theory.attention.
POSITIVE_THEORY = EstimatorTheory(
    components=positive_components,
    row_laws=_ALL_LAWS,
    attention_pair_terms=((1.0, 1.0, 2.0, 1.0),),
)
HYPERBOLIC_THEORY = EstimatorTheory(
    components=hyperbolic_components,
    row_laws=_ALL_LAWS,
    attention_pair_terms=((0.5, 1.0, 2.0, 1.0), (0.5, -1.0, 0.0, -1.0)),
)
TRIG_SINCOS_THEORY = EstimatorTheory(
    components=trig_sincos_components,
    row_laws=_ALL_LAWS,
    attention_pair_terms=((0.5, -1.0, 2.0, -1.0), (0.5, 1.0, 0.0, 1.0)),
    term_bound=_trig_sincos_term_bound,
    uniform_variant="sincos",
)
TRIG_OFFSET_THEORY = EstimatorTheory(
    components=trig_offset_components,
    row_laws=_ALL_LAWS,
    attention_pair_terms=((0.5, -1.0, 2.0, -1.0), (1.0, 1.0, 0.0, 1.0)),
    term_bound=_trig_offset_term_bound,
    uniform_variant="offset",
)


def _theory_for(kind: Any) -> EstimatorTheory:
    """The closed-form theory of an estimator name (or `kernelapprox.Estimator`)."""
    est = get_estimator(kind)
    th = est.theory
    if th is None or th.components is None:
        raise NotImplementedError(
            f"estimator {est.name!r} has no closed-form moments; estimate its error by Monte Carlo "
            "with ka.montecarlo.kernel_error"
        )
    return th


def _components(kind: Any, geo: _Geometry, orthogonal: str | None, **params: Any) -> Components:
    components = cast("Callable[..., Components]", _theory_for(kind).components)  # not None: checked there
    return components(geo, orthogonal, **params)


def _fm_geometry(fm: Any, kind: Any, qa: np.ndarray, ka: np.ndarray) -> tuple[_Geometry, dict[str, Any]]:
    """Pair geometry and closed-form parameters of a feature map (its theory's ``prepare`` hook:
    fitted parameters, transformed inputs); plain geometry for an estimator name."""
    th = _theory_for(kind)
    params: dict[str, Any] = {}
    if th.prepare is not None and fm is not None and not isinstance(fm, (str, Estimator)):
        qa, ka, params = th.prepare(fm, qa, ka)
    return _geometry(qa, ka), params


def _core(kind: Any, geo: _Geometry, r: int, orthogonal: str | None, **params: Any) -> _Core:
    return _core_of(_components(kind, geo, orthogonal, **params), r, orthogonal, geo.d)


def _core_of(c: Components, r: int, orthogonal: str | None, d: int) -> _Core:
    """Log-variance of the mean of ``r`` terms with components ``c`` (block pairs for ORF rows)."""
    P = 0 if orthogonal is None else orf_pair_count(r, d)
    g = c.v1 / r + (P / (r * r)) * c.cv
    return _Core(_log_pos(c.scale, g), c.rbias, c.xy)


def _finish(core: _Core, what: str) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        if what == "variance":
            return np.exp(core.logvar)
        if what == "bias":
            out = core.rbias * np.exp(core.xy)
            return np.where(core.rbias == 0.0, 0.0, out)
        rel = np.exp(core.logvar - 2.0 * core.xy) + core.rbias**2
        if what == "relative_mse":
            return rel
        if what == "mse":
            with np.errstate(divide="ignore"):
                return np.exp(np.log(rel) + 2.0 * core.xy)
    raise ValueError(what)  # pragma: no cover


def estimator_moments(
    kind: str | Estimator,
    q: Any,
    k: Any,
    num_features: int,
    *,
    orthogonal: str | None = None,
    **params: Any,
) -> Moments:
    r"""Bias, variance and MSE of every entry of a random-feature estimate of $e^{q^\top k}$.

    See the module docstring for the formulas; the per-estimator functions
    (`positive_mse`, ...) document each one.

    Parameters
    ----------
    kind : str or Estimator
        A registered estimator with closed-form moments, by name (``"trig-sincos"``,
        ``"trig-offset"``, ``"positive"``, ``"hyperbolic"``, or any estimator registered with an
        `kernelapprox.EstimatorTheory`).
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of random projections.
    orthogonal : {None, "chi", "fixed", "simplex"}, default None
        ``None``: iid Gaussian rows; ``"chi"``: block-orthogonal rows with χ norms;
        ``"fixed"``: block-orthogonal rows of norm $\sqrt d$; ``"simplex"``: simplex blocks
        (SimRF, `kernelapprox.theory.simplex`).
    **params
        Parameters of a parametric estimator's closed form (e.g. ``A=`` for ``"oprf"``).

    Returns
    -------
    Moments
        ``(bias, variance, mse)``, each of shape ``(..., n, m)``, float64.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, -0.2, 0.1, 0.4]]); y = np.array([[0.1, 0.2, -0.3, 0.2]])
    >>> m = estimator_moments("positive", x, y, 8, orthogonal="chi")
    >>> bool(m.bias[0, 0] == 0.0 and m.mse[0, 0] < positive_mse(x, y, 8)[0, 0])
    True
    """
    r = _check_r(num_features)
    orthogonal = _check_orthogonal(orthogonal)
    qa, ka, dev = _prepare(q, k)
    core = _core(kind, _geometry(qa, ka), r, orthogonal, **params)
    return Moments(*(_out(_finish(core, w), dev) for w in ("bias", "variance", "mse")))


def _mse_of(kind: Any, q: Any, k: Any, num_features: int, orthogonal: str | None) -> Any:
    r = _check_r(num_features)
    orthogonal = _check_orthogonal(orthogonal)
    qa, ka, dev = _prepare(q, k)
    return _out(_finish(_core(kind, _geometry(qa, ka), r, orthogonal), "mse"), dev)


def trig_sincos_mse(q: Any, k: Any, num_features: int, *, orthogonal: str | None = None) -> Any:
    r"""MSE of ``TrigRF(variant="sincos")``: ``r`` projections, ``2r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{e^{\|x\|^2+\|y\|^2}}{2r}\big(1-e^{-s}\big)^2
    + \frac{P}{r^2}\,e^{\|x\|^2+\|y\|^2}\Big[{}_1F_1\big(d;\tfrac d2;-\tfrac s2\big) - e^{-s}\Big]
    $$

    with $s = \|x-y\|^2$ and $P$ = `orf_pair_count` (0 for iid rows).

    * iid (``orthogonal=None``): Performer Lemma 2, eq. (8) [SOURCE]; Yu et al. Lemma 1.
    * ``"chi"``: exact χ-norm ORF closed form, several blocks and a partial last block [DERIVED,
      MC ✓]. For large $s$ the ORF term has no fixed sign: by Kummer's transformation
      ${}_1F_1(d;\tfrac d2;-\tfrac s2) = e^{-s/2}\,\frac{(d/2)!}{(d/2)_{d/2}}
      L^{(d/2-1)}_{d/2}(\tfrac s2)$ for even $d$ (sign $(-1)^{d/2}$ beyond the largest root
      of the Laguerre polynomial), and it decays like
      $\frac{\Gamma(d/2)}{\Gamma(-d/2)}(\tfrac s2)^{-d}$ for odd $d$ (the sign of
      $\Gamma(-\tfrac d2)$) (DLMF 13.2.39, 13.6.19, 13.7.2). Its size is negligible: at
      $s = 20, 60, 200$ the bracket is $-3.0\cdot10^{-5}, -2.4\cdot10^{-11}, -5.3\cdot10^{-40}$
      for $d = 6$ and $+3.4\cdot10^{-5}, -1.2\cdot10^{-7}, -1.7\cdot10^{-10}$ for $d = 5$, so
      far from $x=y$ ORF and iid rows have the same MSE to within these terms.
    * ``"fixed"``: rows of norm $\sqrt d$; biased (mean
      $C\,{}_0F_1(;\tfrac d2;-\tfrac{ds}4)$, `fixed_norm_trig_kernel`); MSE =
      bias² + $\frac{C^2}{r}\big[\tfrac{1+F(-ds)}2-F(-\tfrac{ds}4)^2\big]
      +\frac{P}{r^2}C^2\big[F(-\tfrac{ds}2)-F(-\tfrac{ds}4)^2\big]$, $F={}_0F_1(;\tfrac d2;\cdot)$
      [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of projections $w_1..w_r$.
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Choromanski et al. 2021 (arXiv:2009.14794) Lemma 2; Yu et al. 2016 (arXiv:1610.09072) Lemma 1.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3)); float(trig_sincos_mse(x, x, 16)[0, 0])  # exact at x = y
    0.0
    """
    return _mse_of("trig-sincos", q, k, num_features, orthogonal)


def trig_offset_mse(q: Any, k: Any, num_features: int, *, orthogonal: str | None = None) -> Any:
    r"""MSE of ``TrigRF(variant="offset")``: ``r`` projections, ``r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{e^{\|x\|^2+\|y\|^2}}{r}\Big[1+\tfrac12e^{-2s}-e^{-s}\Big]
    + \frac{P}{r^2}\,e^{\|x\|^2+\|y\|^2}\Big[{}_1F_1\big(d;\tfrac d2;-\tfrac s2\big) - e^{-s}\Big]
    $$

    * iid: the Sutherland–Schneider variance of the $\breve z$ features transported to SM
      (``docs/theory.md`` §1) [DERIVED, MC ✓]. It exceeds the sin/cos MSE at equal ``r`` by
      $\frac{C^2}{2r}$ — never zero, even at ``x = y``.
    * ``"chi"``: the phases $b_i$ are independent, so
      $E X_iX_j = C^2 E\cos(w_i^\top\Delta)\cos(w_j^\top\Delta)$: the same pair term as
      sin/cos [DERIVED, MC ✓].
    * ``"fixed"``: as for sin/cos with $m_2 = C^2[1+\tfrac12 F(-ds)]$ [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Sutherland & Schneider 2015 (arXiv:1506.02785) §2 (recalled form, re-derived here).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3)); round(float(trig_offset_mse(x, x, 10)[0, 0]), 12)  # 1/(2r) at x = y = 0
    0.05
    """
    return _mse_of("trig-offset", q, k, num_features, orthogonal)


def positive_mse(q: Any, k: Any, num_features: int, *, orthogonal: str | None = None) -> Any:
    r"""MSE of ``PositiveRF`` (FAVOR+): ``r`` projections, ``r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{\Lambda^2}{r}\big(e^{2t}-e^{t}\big)
    + \frac{P}{r^2}\,\Lambda^2\Big[{}_1F_1\big(d;\tfrac d2;\tfrac t2\big) - e^{t}\Big],
    \qquad \Lambda = e^{-(\|x\|^2+\|y\|^2)/2},\ t = \|x+y\|^2 .
    $$

    * iid: Performer Lemma 2, eq. (8): $\frac1r e^{\|x+y\|^2}\mathrm{SM}^2(1-e^{-\|x+y\|^2})$
      [SOURCE]. Relative MSE $(e^t-1)/r$.
    * ``"chi"``: exact χ-norm ORF [DERIVED, MC ✓]; the pair term is $\le 0$ (ORF always
      helps), consistent with Performer Theorem 2 (`performer_theorem2_bound`).
    * ``"fixed"``: estimates SMREG (`smreg_kernel`); bias
      $\Lambda\,{}_0F_1(;\tfrac d2;\tfrac{dt}4) - \mathrm{SM}$, variance
      $\frac{\Lambda^2}{r}[F(dt) - F(\tfrac{dt}4)^2] + \frac{P}{r^2}\Lambda^2[F(\tfrac{dt}2) -
      F(\tfrac{dt}4)^2]$ [DERIVED, MC ✓].

    The per-projection term $\Lambda e^{w^\top z}$ is log-normal: heavy right tail, so
    Monte Carlo estimates of this MSE converge slowly at large $t$.

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Choromanski et al. 2021 (arXiv:2009.14794) Lemma 2, Theorem 2.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.0]]); y = -x
    >>> float(positive_mse(x, y, 4)[0, 0])  # exact at x = -y
    0.0
    """
    return _mse_of("positive", q, k, num_features, orthogonal)


def hyperbolic_mse(q: Any, k: Any, num_features: int, *, orthogonal: str | None = None) -> Any:
    r"""MSE of ``HyperbolicRF``: ``r`` projections, ``2r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{\Lambda^2}{2r}\big(e^{t}-1\big)^2
    + \frac{P}{r^2}\,\Lambda^2\Big[{}_1F_1\big(d;\tfrac d2;\tfrac t2\big) - e^{t}\Big]
    $$

    * iid: Performer Lemma 2: $\tfrac12(1-e^{-t})$ times the positive MSE [SOURCE].
    * ``"chi"``: $\cosh a\cosh b = \tfrac12[\cosh(a+b)+\cosh(a-b)]$ and
      $w_i - w_j \stackrel d= w_i + w_j$ for an orthogonal pair, so the pair moment is the
      positive one, $\Lambda^2{}_1F_1(d;\tfrac d2;\tfrac t2)$ [DERIVED, MC ✓].
    * ``"fixed"``: mean SMREG, $m_2 = \Lambda^2\,\tfrac{1+F(dt)}2$, pair moment
      $\Lambda^2F(\tfrac{dt}2)$ [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Choromanski et al. 2021 (arXiv:2009.14794) Lemma 2.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, 0.1]]); y = np.array([[0.2, -0.4]])
    >>> bool(hyperbolic_mse(x, y, 4)[0, 0] < positive_mse(x, y, 8)[0, 0])
    True
    """
    return _mse_of("hyperbolic", q, k, num_features, orthogonal)


def _bias_of(kind: Any, q: Any, k: Any, orthogonal: str | None) -> Any:
    orthogonal = _check_orthogonal(orthogonal)
    qa, ka, dev = _prepare(q, k)
    return _out(_finish(_core(kind, _geometry(qa, ka), 1, orthogonal), "bias"), dev)


def trig_bias(q: Any, k: Any, *, orthogonal: str | None = None) -> Any:
    r"""Bias $E\hat K - e^{q^\top k}$ of ``TrigRF`` (both variants); independent of ``r``.

    Zero for iid and χ-norm ORF rows; for fixed-norm ORF
    $C\big({}_0F_1(;\tfrac d2;-\tfrac{ds}4) - e^{-s/2}\big)$ [DERIVED, MC ✓]
    (`fixed_norm_trig_kernel` minus SM).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.4, 0.0, 0.0]]); y = np.array([[-0.4, 0.0, 0.0]])
    >>> float(trig_bias(x, y)[0, 0])
    0.0
    """
    return _bias_of("trig-sincos", q, k, orthogonal)


def positive_bias(q: Any, k: Any, *, orthogonal: str | None = None) -> Any:
    r"""Bias of ``PositiveRF``; independent of ``r``: zero unless ``orthogonal="fixed"``.

    Fixed-norm ORF estimates SMREG: bias $\Lambda\,{}_0F_1(;\tfrac d2;\tfrac{dt}4) -
    e^{x^\top y} \le 0$ (Performer Theorem 1: SMREG ≤ SM for $d\ge2$) [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.5, 0.0, 0.0]])
    >>> bool(positive_bias(x, x, orthogonal="fixed")[0, 0] < 0)
    True
    """
    return _bias_of("positive", q, k, orthogonal)


def hyperbolic_bias(q: Any, k: Any, *, orthogonal: str | None = None) -> Any:
    r"""Bias of ``HyperbolicRF``: the same as `positive_bias` ($\cosh$ is even).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    orthogonal : {None, "chi", "fixed", "simplex"}, default None

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.5, 0.0, 0.0]])
    >>> bool(hyperbolic_bias(x, x, orthogonal="fixed")[0, 0] == positive_bias(x, x, orthogonal="fixed")[0, 0])
    True
    """
    return _bias_of("hyperbolic", q, k, orthogonal)


def smreg_kernel(q: Any, k: Any) -> Any:
    r"""The regularised softmax kernel SMREG estimated by fixed-norm ($\sqrt d$) ORF positive features.

    $$
    \mathrm{SMREG}(x,y) = \Lambda\sum_k\frac{(t/2)^k}{k!}\frac{d^k}{d(d+2)\cdots(d+2k-2)}
    = e^{-(\|x\|^2+\|y\|^2)/2}\;{}_0F_1\!\big(;\tfrac d2;\tfrac{d\,\|x+y\|^2}{4}\big)
    $$

    The series is Performer §2.3 / eqs. (21)–(29) [SOURCE]; the ${}_0F_1$ closed form is
    [DERIVED, MC ✓] (it is $E e^{\sqrt d\,u^\top z}$ for $u$ uniform on the sphere).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Choromanski et al. 2021 (arXiv:2009.14794) §2.3, Theorem 1.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 4)); float(smreg_kernel(x, x)[0, 0])
    1.0
    """
    qa, ka, dev = _prepare(q, k)
    geo = _geometry(qa, ka)
    l1 = _log_hyp0f1_pos(geo.d / 2.0, geo.d * geo.t / 4.0)
    with np.errstate(over="ignore"):
        return _out(np.exp(-0.5 * (geo.nx + geo.ny) + l1), dev)


def fixed_norm_trig_kernel(q: Any, k: Any) -> Any:
    r"""The kernel estimated by trig features with fixed-norm ($\sqrt d$) ORF rows.

    $$
    E\hat K = e^{(\|x\|^2+\|y\|^2)/2}\;{}_0F_1\!\big(;\tfrac d2;-\tfrac{d\,\|x-y\|^2}{4}\big)
    = e^{(\|x\|^2+\|y\|^2)/2}\;\Gamma(\tfrac d2)\Big(\tfrac{\sqrt d\,\|x-y\|}{2}\Big)^{1-d/2}
    J_{d/2-1}(\sqrt d\,\|x-y\|)
    $$

    a Bessel kernel instead of $e^{(\|x\|^2+\|y\|^2)/2}e^{-\|x-y\|^2/2}$ [DERIVED, MC ✓;
    consistent with the abstract of Demni & Kadri, arXiv:2310.07370].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.ones((1, 4)) / 4; float(fixed_norm_trig_kernel(x, x)[0, 0]) == float(np.exp(0.25))
    True
    """
    qa, ka, dev = _prepare(q, k)
    geo = _geometry(qa, ka)
    F1 = _hyp0f1_neg(geo.d / 2.0, -geo.d * geo.s / 4.0)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.exp(0.5 * (geo.nx + geo.ny)) * F1
    return _out(np.where(F1 == 0.0, 0.0, out), dev)


def performer_theorem2_bound(q: Any, k: Any, num_features: int) -> Any:
    r"""Performer Theorem 2 upper bound on the MSE of positive features with (χ-norm) ORF.

    $$
    \mathrm{MSE}(\widehat{\mathrm{SM}}^{\rm ort+}_m) \le \mathrm{MSE}(\widehat{\mathrm{SM}}^{+}_m)
    - \frac{2(m-1)}{m(d+2)}\Big(\mathrm{SM}(x,y) - e^{-\frac{\|x\|^2+\|y\|^2}{2}}\Big)^2
    $$

    stated for $m \le d$ [SOURCE: arXiv:2009.14794, Theorem 2, eq. (10)]. Compare with the
    exact value ``positive_mse(q, k, m, orthogonal="chi")``.

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``m <= d`` (one orthogonal block), as in the theorem.

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    ValueError
        If ``num_features > d`` (the theorem does not cover several blocks).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, 0.2, -0.1, 0.2]]); y = np.array([[0.1, 0.4, 0.2, -0.2]])
    >>> bool(positive_mse(x, y, 4, orthogonal="chi")[0, 0] <= performer_theorem2_bound(x, y, 4)[0, 0])
    True
    """
    r = _check_r(num_features)
    qa, ka, dev = _prepare(q, k)
    d = qa.shape[-1]
    if r > d:
        raise ValueError(f"num_features={r} > d={d}: Performer Theorem 2 is stated for m <= d (one block)")
    geo = _geometry(qa, ka)
    iid = _finish(_core("positive", geo, r, None), "mse")
    with np.errstate(over="ignore", invalid="ignore"):
        lam = np.exp(-0.5 * (geo.nx + geo.ny))
        corr = 2.0 * (r - 1) / (r * (d + 2.0)) * (np.exp(geo.xy) - lam) ** 2
    return _out(iid - corr, dev)


# ----------------------------------------------------------------------------------------------
# feature-map dispatch
# ----------------------------------------------------------------------------------------------


def feature_map_kind(fm: Any) -> tuple[str, str | None]:
    """``(estimator name, orthogonal)`` of a feature map with closed-form moments, or
    ``(name, None)`` for a deterministic map (its error is exact, see `deterministic_error`).

    The identity comes from the registry (`kernelapprox.estimator_of`), the row law from
    ``fm.sampler.row_law``.

    Raises
    ------
    TypeError
        ``fm`` is not a registered feature map.
    NotImplementedError
        The estimator has no closed-form moments, or not for its sampler (``structured``, ``qmc``,
        a projection of unknown provenance).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> feature_map_kind(ka.TrigRF(4, 8, sampler="orthogonal", seed=0))
    ('trig-sincos', 'chi')
    """
    try:
        est = estimator_of(fm)
    except LookupError as e:
        raise TypeError(str(e)) from None
    if not est.is_random:
        return est.name, None
    th = _theory_for(est)
    law = getattr(fm.sampler, "row_law", None)
    if law not in th.row_laws:
        name = getattr(fm.sampler, "name", type(fm.sampler).__name__)
        what = {
            "structured": "SORF rows are biased (Yu et al. 2016 Thm 3)",
            "qmc": "rows are negatively dependent low-discrepancy points",
            "given": "the projection was supplied by the caller, its distribution is unknown",
        }.get(name, f"row law {law!r} is not covered by the {est.name!r} theory")
        raise NotImplementedError(_NO_CLOSED_FORM.format(name=name, what=what))
    return est.name, _LAW_TO_ORTHOGONAL[law]


def deterministic_error(fm: Any, q: Any, k: Any) -> Any:
    r"""Error $\varphi(q)^\top\varphi(k) - e^{q^\top k}$ of a deterministic map (elu+1, ReLU, ...).

    These maps are not random: the error is a pure bias (variance 0), computed in float64 from
    ``fm.kernel`` (log domain) and the exact kernel.

    Parameters
    ----------
    fm : FeatureMap
        A deterministic map (``fm.is_random`` false).
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> x = torch.zeros(1, 3, dtype=torch.float64)
    >>> float(deterministic_error(ka.EluFeatures(3), x, x)[0, 0])  # (1,1,1).(1,1,1) - e^0
    2.0
    """
    from kernelapprox.maps.base import FeatureMap

    if not isinstance(fm, FeatureMap) or fm.is_random:
        raise TypeError(f"fm must be a deterministic FeatureMap (is_random false), got {type(fm).__name__}")
    qa, ka, dev = _prepare(q, k)
    if qa.shape[-1] != fm.dim:
        raise ValueError(f"q has last dimension {qa.shape[-1]}, expected fm.dim={fm.dim}")
    qt, kt = torch.from_numpy(qa), torch.from_numpy(ka)
    est = fm.kernel(qt, kt, compute_dtype=torch.float64).cpu().numpy()
    with np.errstate(over="ignore"):
        exact = np.exp(np.matmul(qa, np.swapaxes(ka, -1, -2)))
    return _out(est - exact, dev)


def _dispatch(fm: Any, q: Any, k: Any, what: str) -> Any:
    kind, orthogonal = feature_map_kind(fm)
    if not fm.is_random:
        err = deterministic_error(fm, q, k)
        if what == "bias":
            return err
        if what == "variance":
            return err * 0.0
        if what == "mse":
            return err**2
        qa, ka, _ = _prepare(q, k)
        with np.errstate(over="ignore"):
            sm = np.exp(np.matmul(qa, np.swapaxes(ka, -1, -2)))
        rel = (np.asarray(err.cpu() if isinstance(err, torch.Tensor) else err) / sm) ** 2
        return _out(rel, err.device if isinstance(err, torch.Tensor) else None)
    qa, ka, dev = _prepare(q, k)
    if qa.shape[-1] != fm.dim:
        raise ValueError(f"q has last dimension {qa.shape[-1]}, expected fm.dim={fm.dim}")
    geo, params = _fm_geometry(fm, kind, qa, ka)
    core = _core(kind, geo, int(fm.num_features), orthogonal, **params)
    return _out(_finish(core, what), dev)


def bias(fm: Any, q: Any, k: Any) -> Any:
    r"""Bias $E\hat K - e^{q^\top k}$ of every entry of ``fm.kernel(q, k)``.

    Zero for iid and χ-norm ORF random maps; `positive_bias` / `trig_bias` for
    fixed-norm ORF; `deterministic_error` for elu/relu.

    Parameters
    ----------
    fm : FeatureMap
        ``TrigRF``, ``PositiveRF``, ``HyperbolicRF`` (sampler ``gaussian`` or ``orthogonal``),
        ``EluFeatures`` or ``ReluFeatures``.
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(4, 8, sampler="orthogonal", seed=0)
    >>> x = torch.full((1, 4), 0.2, dtype=torch.float64)
    >>> float(bias(fm, x, x)[0, 0])
    0.0
    """
    return _dispatch(fm, q, k, "bias")


def variance(fm: Any, q: Any, k: Any) -> Any:
    r"""Variance of every entry of ``fm.kernel(q, k)`` over the draw of the projection.

    Reads ``type(fm)``, ``fm.variant``, ``fm.num_features``, ``fm.dim``, ``fm.sampler.name`` and
    ``fm.sampler.norms``; see `trig_sincos_mse`, `trig_offset_mse`,
    `positive_mse`, `hyperbolic_mse` for the formulas. 0 for elu/relu.

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.TrigRF(4, 16, seed=0)
    >>> x = torch.full((1, 4), 0.2, dtype=torch.float64)
    >>> float(variance(fm, x, x)[0, 0])
    0.0
    """
    return _dispatch(fm, q, k, "variance")


def mse(fm: Any, q: Any, k: Any) -> Any:
    r"""Mean squared error $E(\hat K - e^{q^\top k})^2 = \mathrm{bias}^2 + \mathrm{Var}$ of every entry.

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(4, 64, seed=0)
    >>> q = torch.randn(3, 4, dtype=torch.float64) / 2
    >>> mse(fm, q, q).shape
    torch.Size([3, 3])
    """
    return _dispatch(fm, q, k, "mse")


def relative_mse(fm: Any, q: Any, k: Any) -> Any:
    r"""Relative MSE $\mathrm{MSE}/e^{2q^\top k}$ of every entry (computed in the log domain).

    For iid positive features this is $(e^{\|q+k\|^2}-1)/r$ (Performer Lemma 2).

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import math, torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(2, 10, seed=0)
    >>> x = torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    >>> round(float(relative_mse(fm, x, x)[0, 0]), 12) == round((math.e - 1) / 10, 12)
    True
    """
    return _dispatch(fm, q, k, "relative_mse")
