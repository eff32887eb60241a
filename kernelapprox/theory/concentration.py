r"""Pointwise concentration: bounds on $P(|\hat K - K| \ge \varepsilon K)$ and the ``r`` they require.

For one kernel entry $K = e^{x^\top y}$ and its estimate $\hat K = \frac1r\sum_iX_i$
(see `kernelapprox.theory.moments`), write $b = E\hat K - K$ (0 except for fixed-norm
ORF) and $\tau = \varepsilon K - |b|$. Four bounds are offered, all built on the exact
moments:

``"chebyshev"`` (always valid, any sampler with a closed form, iid or ORF)
    Markov's inequality on the squared error: $P \le \mathrm{MSE}/(\varepsilon K)^2$
    [elementary]. The ORF dependence between rows is fully accounted for by the exact ORF
    variance.

``"clt"`` (asymptotic, *not* a bound)
    $\hat K \approx \mathcal N(K + b, \mathrm{Var}\hat K)$:
    $P \approx \Phi\big(\frac{-\varepsilon K - b}{\sigma}\big) + \Phi\big(\frac{b -
    \varepsilon K}{\sigma}\big)$. Valid as ``r → ∞`` for iid rows and, for ORF, as the number of
    independent blocks grows. For positive/hyperbolic features at large $\|x+y\|$ the
    convergence is slow (log-normal summands), and the approximation underestimates the tail.

``"hoeffding"`` (trig only, valid)
    The per-projection terms are bounded: $|X_i| \le a$ with $a = C =
    e^{(\|x\|^2+\|y\|^2)/2}$ (sin/cos) or $a = 2C$ (offset: $X_i = 2C\cos(\cdot)\cos(\cdot)$,
    the $\sqrt2^2$ of the $\sqrt{2/r}$ scaling). Rows of different orthogonal blocks
    are independent, so Hoeffding applies to the block sums $B_k \in [-a n_k, a n_k]$:

    $$
    P \le 2\exp\Big(-\frac{r^2\tau^2}{2a^2\sum_k n_k^2}\Big),
    $$

    with $\sum_k n_k^2 = r$ for iid rows (the usual $2e^{-r\tau^2/(2a^2)}$) and
    $b\,d^2 + r'^2$ for ``r = b d + r'`` ORF rows (a factor ≈ ``d`` weaker: Hoeffding cannot
    see the variance reduction of ORF; use Chebyshev with the exact variance there) [DERIVED].

``"bernstein"`` (trig only, valid)
    On the same independent block sums, with $|B_k - EB_k| \le n_k(a + |\mu|)$ and
    $\sum_k\mathrm{Var}B_k = r^2\,\mathrm{Var}\hat K$ (exact):

    $$
    P \le 2\exp\Big(-\frac{r^2\tau^2/2}{r^2\mathrm{Var}\hat K + M r\tau/3}\Big),\qquad
    M = \max_k n_k\,(a+|\mu|) .
    $$

Positive and hyperbolic features have no Hoeffding/Bernstein bound here: the per-projection term
$\Lambda e^{w^\top z}$ is log-normal — unbounded, with a heavy right tail (its moment
generating function is infinite) — so exponential bounds need care (Performer Thms 3/5 give
bounds of a different, Chernoff-type form). Use Chebyshev (valid) or the CLT (asymptotic).

Samplers ``structured`` and ``qmc`` have no closed-form moments: these functions raise
``NotImplementedError`` (use ``ka.montecarlo.kernel_error``).

References
----------
- [Hoe63] W. Hoeffding. "Probability inequalities for sums of bounded random variables", JASA 1963.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from scipy.special import ndtr

from kernelapprox.registry import EstimatorTheory, get_estimator

from ._common import (
    Components,
    _check_r,
    _components,
    _deprecated_keywords,
    _fm_geometry,
    _law_code,
    _out,
    _prepare,
    _theory_for,
)
from .moments import feature_map_kind

__all__ = ["METHODS", "failure_probability", "required_features"]

#: Bounds understood by `failure_probability` and `required_features`.
METHODS = ("chebyshev", "clt", "hoeffding", "bernstein")

_R_MAX = 2**62


def _check_eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"eps must be a positive number, got {eps!r}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps}")
    return float(eps)


def _check_delta(delta: object) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.integer, np.floating)):
        raise TypeError(f"delta must be a number in (0, 1), got {delta!r}")
    if not (0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return float(delta)


def _resolve(estimator: Any, row_law: str | None) -> tuple[str, EstimatorTheory, str | None, int | None, int | None]:
    """(name, theory, orthogonal code, num_features or None, dim or None) from a feature map or an
    estimator name (``row_law`` ``None``: iid for a name, the map's own for a map)."""
    if isinstance(estimator, str):
        est = get_estimator(estimator)
        if not est.is_random:
            raise ValueError(
                f"{est.name!r} is deterministic: its error does not shrink with r "
                "(see ka.theory.deterministic_error)"
            )
        return est.name, _theory_for(est), _law_code("iid" if row_law is None else row_law), None, None
    name, orth = feature_map_kind(estimator)
    if not estimator.is_random:
        raise ValueError(
            f"{type(estimator).__name__} is deterministic: its error does not shrink with r "
            "(see ka.theory.deterministic_error)"
        )
    if row_law is not None and _law_code(row_law) != orth:
        raise ValueError(f"row_law={row_law!r} contradicts the feature map's sampler ({estimator.sampler.row_law!r})")
    return name, _theory_for(name), orth, int(estimator.num_features), int(estimator.dim)


def _pairs_and_sq(r: np.ndarray, d: int, orthogonal: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P(r), sum_k n_k^2, max_k n_k) for integer arrays r."""
    r = r.astype(np.float64)
    if orthogonal is None:
        return np.zeros_like(r), r, np.ones_like(r)
    b = np.floor(r / d)
    rp = r - b * d
    P = b * d * (d - 1) + rp * (rp - 1)
    sq = b * d * d + rp * rp
    mx = np.minimum(r, d)
    return P, sq, mx


def _bound(
    method: str,
    name: str,
    theory: EstimatorTheory,
    comp: Components,
    d: int,
    orthogonal: str | None,
    r: np.ndarray,
    eps: float,
) -> np.ndarray:
    """Failure-probability bound (relative units) for integer array r broadcast against the entries."""
    r = np.asarray(r, dtype=np.float64)
    P, sq, mx = _pairs_and_sq(r, d, orthogonal)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        rel_scale = np.exp(comp.scale - 2.0 * comp.xy)  # exp(scale) / K^2
        var_rel = rel_scale * np.maximum(comp.v1 / r + P / (r * r) * comp.cv, 0.0)
        rb = comp.rbias
        if method == "chebyshev":
            out = (var_rel + rb * rb) / eps**2
        elif method == "clt":
            sd = np.sqrt(var_rel)
            out = np.where(
                sd > 0,
                ndtr((-eps - rb) / sd) + ndtr((rb - eps) / sd),
                (np.abs(rb) >= eps).astype(np.float64),
            )
        else:
            if theory.term_bound is None:
                raise ValueError(
                    f"method={method!r} needs bounded per-projection terms (e.g. trig features); "
                    f"the {name!r} estimator declares none (positive features: the per-projection "
                    "term is log-normal, unbounded with a heavy right tail): use "
                    "method='chebyshev' (valid) or 'clt' (asymptotic)"
                )
            a = theory.term_bound(comp)  # |X_i| <= a K
            tau = eps - np.abs(rb)
            if method == "hoeffding":
                expo = -(r * r) * tau * tau / (2.0 * a * a * sq)
            else:
                mu = np.abs(1.0 + rb)
                M = mx * (a + mu)
                expo = -(r * r) * tau * tau / 2.0 / (r * r * var_rel + M * r * tau / 3.0)
            out = np.where(tau > 0, 2.0 * np.exp(expo), 1.0)
    return np.clip(np.nan_to_num(out, nan=1.0), 0.0, 1.0)


def _check_method(method: object) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


@_deprecated_keywords(fm_or_kind="estimator", orthogonal="row_law")
def failure_probability(
    estimator: Any,
    eps: float,
    q: Any,
    k: Any,
    num_features: int | None = None,
    *,
    method: str = "chebyshev",
    row_law: str | None = None,
) -> Any:
    r"""Bound (or CLT approximation) on $P(|\hat K_{ij} - K_{ij}| \ge \varepsilon K_{ij})$ per entry.

    See the module docstring for the four methods and their validity.

    Parameters
    ----------
    estimator : FeatureMap or str
        A random feature map (its ``num_features``, ``dim``, sampler and variant are used) or a
        registered estimator name with closed-form moments (``"trig-sincos"``, ``"trig-offset"``,
        ``"positive"``, ``"hyperbolic"``, ...).
    eps : float
        Relative error level, > 0.
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int, optional
        ``r``; required with a name, defaults to ``fm.num_features`` with a map.
    method : {"chebyshev", "clt", "hoeffding", "bernstein"}, default "chebyshev"
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, optional
        Row law when ``estimator`` is a name (default ``"iid"``); with a map, its sampler's (a
        different value is an error). The former ``orthogonal={None, "chi", "fixed"}`` and
        ``fm_or_kind=`` are deprecated.

    Returns
    -------
    array or Tensor, shape (..., n, m), float64 in [0, 1]

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, 0.1]]); y = np.array([[0.1, -0.2]])
    >>> p = failure_probability("positive", 0.1, x, y, 1000)
    >>> bool(0 < p[0, 0] < 1)
    True
    """
    eps = _check_eps(eps)
    method = _check_method(method)
    name, theory, orth, r_fm, _ = _resolve(estimator, row_law)
    r = r_fm if num_features is None else _check_r(num_features)
    if r is None:
        raise ValueError("num_features is required when estimator is a name")
    qa, ka, dev = _prepare(q, k)
    geo, params = _fm_geometry(estimator, name, qa, ka)
    comp = _components(name, geo, orth, **params)
    return _out(_bound(method, name, theory, comp, geo.d, orth, np.asarray(r), eps), dev)


@_deprecated_keywords(fm_or_kind="estimator", orthogonal="row_law")
def required_features(
    estimator: Any,
    eps: float,
    delta: float,
    q: Any = None,
    k: Any = None,
    *,
    method: str = "chebyshev",
    row_law: str | None = None,
    reduce: str | None = "max",
) -> Any:
    r"""Smallest number of projections ``r`` with $P(|\hat K - K| \ge \varepsilon K) \le \delta$.

    Inverts the bound of `failure_probability` entry by entry. Closed forms in the iid
    unbiased case ($v_1$ = relative per-projection variance, $a$ = relative bound on a
    term, $z = \Phi^{-1}(1-\delta/2)$):

    * Chebyshev: $r = \lceil v_1/(\varepsilon^2\delta)\rceil$;
    * CLT: $r = \lceil v_1 z^2/\varepsilon^2\rceil$ (asymptotic);
    * Hoeffding: $r = \lceil 2a^2\log(2/\delta)/\varepsilon^2\rceil$
      ($a = e^{s/2}$ for sin/cos, $2e^{s/2}$ for offset);
    * Bernstein: $r = \lceil 2(v_1 + M\varepsilon/3)\log(2/\delta)/\varepsilon^2\rceil$.

    In general (ORF, bias) ``r`` is found by integer bisection on the exact bound, which returns
    ``r`` with ``bound(r) <= delta < bound(r - 1)``; this is the smallest such ``r`` whenever the
    bound decreases in ``r`` (always for iid rows; ORF bounds may wiggle by a few percent at
    block boundaries). CLT values are asymptotic, not guarantees.

    Parameters
    ----------
    estimator : FeatureMap or str
        A random feature map (its ``num_features`` is ignored) or a registered estimator name
        (``"trig-sincos"``, ``"trig-offset"``, ``"positive"``, ``"hyperbolic"``, ...).
    eps : float
        Relative error level, > 0.
    delta : float
        Failure probability, in (0, 1).
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
        The query/key pairs (required: the variance depends on them).
    method : {"chebyshev", "clt", "hoeffding", "bernstein"}, default "chebyshev"
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, optional
        Row law when ``estimator`` is a name (default ``"iid"``); with a map, its sampler's (a
        different value is an error). The former ``orthogonal={None, "chi", "fixed"}`` and
        ``fm_or_kind=`` are deprecated.
    reduce : {"max", None}, default "max"
        ``"max"``: one ``int``, enough for every entry; ``None``: a float64 array of shape
        ``(..., n, m)`` with one value per entry.

    Returns
    -------
    int or float or array
        ``math.inf`` (or ``inf`` entries) where no ``r`` achieves the level: a fixed-norm ORF bias
        with $|b| \ge \varepsilon K$ (or $b^2 \ge \delta\varepsilon^2K^2$ for Chebyshev).

    Raises
    ------
    ValueError
        Bad ``eps``/``delta``/``method``, missing ``q``/``k``, or Hoeffding/Bernstein for
        positive/hyperbolic features (unbounded terms).
    NotImplementedError
        ``structured``/``qmc`` samplers (no closed form).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, 0.1]]); y = np.array([[0.1, -0.2]])
    >>> t = float(np.sum((x + y) ** 2))
    >>> required_features("positive", 0.1, 0.05, x, y) == int(np.ceil(np.expm1(t) / (0.1**2 * 0.05)))
    True
    """
    eps = _check_eps(eps)
    delta = _check_delta(delta)
    method = _check_method(method)
    if reduce not in ("max", None):
        raise ValueError(f"reduce must be 'max' or None, got {reduce!r}")
    if q is None or k is None:
        raise ValueError("q and k are required: the pointwise error depends on the (q, k) pair")
    name, theory, orth, _, _ = _resolve(estimator, row_law)
    qa, ka, dev = _prepare(q, k)
    geo, params = _fm_geometry(estimator, name, qa, ka)
    comp = _components(name, geo, orth, **params)
    shape = comp.v1.shape

    def ok(r: np.ndarray) -> np.ndarray:
        return _bound(method, name, theory, comp, geo.d, orth, r, eps) <= delta

    # exponential search for an upper end, then bisection with the invariant: lo fails, hi passes
    hi = np.ones(shape, dtype=np.int64)
    for _ in range(63):
        passed = ok(hi)
        if passed.all():
            break
        hi = np.where(passed, hi, np.minimum(hi * 2, _R_MAX))
    unreachable = ~ok(hi)
    hi = np.where(unreachable, 1, hi)
    lo = np.where(unreachable | (hi == 1), 0, hi // 2)
    while True:
        gap = (hi - lo) > 1
        if not gap.any():
            break
        mid = np.where(gap, (lo + hi) // 2, hi)
        good = ok(mid)
        hi = np.where(gap & good, mid, hi)
        lo = np.where(gap & ~good, mid, lo)
    out = np.where(unreachable, np.inf, hi.astype(np.float64))
    if reduce == "max":
        m = float(np.max(out)) if out.size else 1.0
        return math.inf if math.isinf(m) else int(m)
    return _out(out, dev)
