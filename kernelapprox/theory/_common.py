r"""What every closed form of `kernelapprox.theory` shares: argument checks and preparation, the
pair geometry, the special functions, the block pair counts, and the registry-driven core that
turns an estimator's `Components` into bias, variance and MSE.

Private to `kernelapprox.theory` (the public names are re-exported by `kernelapprox.theory` and
`kernelapprox.theory.moments`); the formulas are derived in `kernelapprox.theory.moments`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar, cast

import numpy as np
import torch
from scipy.special import gammaln, hyp0f1, hyp1f1, ive, jv

from kernelapprox.registry import Estimator, EstimatorTheory, get_estimator

__all__ = ["Components", "orf_pair_count"]

_LAW_TO_ORTHOGONAL: dict[str, str | None] = {
    "iid": None, "orthogonal-chi": "chi", "orthogonal-fixed": "fixed", "simplex": "simplex",
}
_ALL_LAWS = frozenset(_LAW_TO_ORTHOGONAL)
#: The deprecated ``orthogonal=`` spelling of the row law -> ``row_law``.
_ORTHOGONAL_TO_LAW: dict[str | None, str] = {v: k for k, v in _LAW_TO_ORTHOGONAL.items()}

_F = TypeVar("_F", bound=Callable[..., Any])


def _law_code(row_law: object) -> str | None:
    """The formulas' short code (``None``, ``"chi"``, ``"fixed"``, ``"simplex"``) of a row law."""
    if isinstance(row_law, str) and row_law in _LAW_TO_ORTHOGONAL:
        return _LAW_TO_ORTHOGONAL[row_law]
    raise ValueError(f"row_law must be one of {sorted(_LAW_TO_ORTHOGONAL)}, got {row_law!r}")


def _deprecated_keywords(**renames: str) -> Callable[[_F], _F]:
    """Accept the former keyword spellings for one release, with a ``DeprecationWarning``:
    ``orthogonal=`` (``None``/``"chi"``/``"fixed"``/``"simplex"``) becomes ``row_law=``
    (``"iid"``/``"orthogonal-chi"``/``"orthogonal-fixed"``/``"simplex"``); ``kind=`` and
    ``fm_or_kind=`` become ``estimator=``."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got both {old}= and {new}= ({old} is the deprecated spelling of {new})")
                value = kwargs.pop(old)
                if old == "orthogonal":
                    if not (value is None or isinstance(value, str)) or value not in _ORTHOGONAL_TO_LAW:
                        raise ValueError(f"orthogonal must be None, 'chi', 'fixed' or 'simplex', got {value!r}")
                    value = _ORTHOGONAL_TO_LAW[value]
                    hint = f"row_law={value!r}"
                else:
                    hint = f"{new}="
                warnings.warn(
                    f"{fn.__name__}(): {old}= is deprecated and will be removed in the next release; use {hint}",
                    DeprecationWarning,
                    stacklevel=2,
                )
                kwargs[new] = value
            return fn(*args, **kwargs)

        return cast(_F, wrapper)

    return decorate


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
    for name, a in (("q", qa), ("k", ka)):
        if not np.isfinite(a).all():
            raise ValueError(f"{name} must be finite, got {int((~np.isfinite(a)).sum())} NaN or infinite entries")
    if dq is not None and dk is not None and dq != dk:
        raise ValueError(f"q and k must be on the same device, got q on {dq} and k on {dk}")
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


def _check_r(num_features: object, name: str = "num_features") -> int:
    if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {num_features!r}")
    if num_features <= 0:
        raise ValueError(f"{name} must be a positive int, got {num_features}")
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
    d = _check_r(dim, "dim")
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
    r"""Closed-form ingredients of one estimator at every ``(q_i, k_j)`` pair (float64 arrays).

    ``Var(K^) = exp(scale) * (v1 / r + P(r) / r^2 * cv)`` with ``P(r)`` from
    `orf_pair_count` (0 for iid rows); ``rbias = (E K^ - SM) / SM``; ``xy = log SM = q.k``;
    ``s = |q - k|^2`` and ``t = |q + k|^2``. An `kernelapprox.EstimatorTheory`'s
    ``components(geo, orthogonal)`` returns one.

    Attributes
    ----------
    scale : ndarray, shape (..., n, m)
        Log of the common scale factor of the variance.
    v1 : ndarray, shape (..., n, m)
        Variance of one projection's term, divided by ``exp(scale)``.
    cv : ndarray, shape (..., n, m)
        Covariance of two terms of the same orthogonal block, divided by ``exp(scale)`` (0 for iid
        rows).
    rbias : ndarray, shape (..., n, m)
        Relative bias $(E\hat K - K)/K$.
    xy, s, t : ndarray, shape (..., n, m)
        $q^\top k = \log K$, $\|q - k\|^2$ and $\|q + k\|^2$.

    Examples
    --------
    FAVOR+ with iid rows [Cho21]_: one term $X = e^{w^\top(x+y) - (\|x\|^2+\|y\|^2)/2}$ has
    $\mathrm{Var}\,X = e^{2x^\top y}(e^{\|x+y\|^2} - 1)$:

    >>> import numpy as np, kernelapprox as ka
    >>> x = np.array([[0.3, -0.2, 0.1, 0.4]]); y = np.array([[0.1, 0.2, -0.3, 0.2]])
    >>> xy = x @ y.T
    >>> s, t = (((x[:, None] + sign * y[None]) ** 2).sum(-1) for sign in (-1, 1))
    >>> zero = np.zeros_like(t)
    >>> c = ka.theory.Components(scale=2 * xy, v1=np.expm1(t), cv=zero, rbias=zero, xy=xy, s=s, t=t)
    >>> r = 8
    >>> np.allclose(np.exp(c.scale) * c.v1 / r, ka.theory.positive_mse(x, y, r))
    True
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


def _mse_of(kind: Any, q: Any, k: Any, num_features: int, orthogonal: str | None) -> Any:
    r = _check_r(num_features)
    orthogonal = _check_orthogonal(orthogonal)
    qa, ka, dev = _prepare(q, k)
    return _out(_finish(_core(kind, _geometry(qa, ka), r, orthogonal), "mse"), dev)


def _bias_of(kind: Any, q: Any, k: Any, orthogonal: str | None) -> Any:
    orthogonal = _check_orthogonal(orthogonal)
    qa, ka, dev = _prepare(q, k)
    return _out(_finish(_core(kind, _geometry(qa, ka), 1, orthogonal), "bias"), dev)
