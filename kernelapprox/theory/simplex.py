r"""Exact pair moments and MSE of simplex random features (SimRF).

A SimRF block (`kernelapprox.samplers.SimplexSampler`) has rows
$w_i = \rho_i R^\top s_i$, $i = 1..d$, with $s_i$ the unit vertices of a regular
simplex ($s_i^\top s_j = c = -\tfrac1{d-1}$ for $i \ne j$), $R$ Haar-orthogonal and
$\rho_i$ iid $\chi_d$. Each row is $\mathcal N(0, I_d)$, so the per-projection mean
and second moment are the iid ones (`kernelapprox.theory.moments`); only the covariance of two
rows of one block changes, and every such pair has the same law.

The pair moment [DERIVED, MC ✓]. For $a = \rho_i$, $b = \rho_j$ and
$\sigma = \pm 1$, $w_i + \sigma w_j = R^\top(a s_i + \sigma b s_j)$ is a vector of
squared norm $\rho_\sigma^2 = a^2 + b^2 + 2\sigma c\,ab$ in a uniform direction independent
of $(a, b)$, and $E_u e^{\rho u^\top z} = {}_0F_1(;\tfrac d2;\rho^2\|z\|^2/4)$ for
$u$ uniform on $S^{d-1}$, so

$$
E\,e^{(w_i + \sigma w_j)^\top z} = E_{a,b}\,{}_0F_1\!\big(;\tfrac d2;\tfrac t4\rho_\sigma^2\big),
\qquad t = \|z\|^2 .
$$

Write $a = \varrho\cos\theta$, $b = \varrho\sin\theta$: the joint density
$\propto (ab)^{d-1}e^{-(a^2+b^2)/2}$ factorises, $\varrho^2 \sim \chi^2_{2d}$ is
independent of $\theta$, and $\rho_\sigma^2 = \varrho^2(1 + \sigma c\,v)$ with
$v = \sin 2\theta$, $v^2 \sim \mathrm{Beta}(\tfrac d2, \tfrac12)$ (density of
$\phi = 2\theta$ on $[0, \pi]$ proportional to $\sin^{d-1}\phi$). Averaging
${}_0F_1$ over $\varrho^2$ term by term ($E\varrho^{2k} = 2^k(d)_k$) gives

$$
E\,e^{(w_i + \sigma w_j)^\top z} = E_v\,{}_1F_1\!\big(d;\tfrac d2;\tfrac t2(1 + \sigma c\,v)\big),
$$

a one-dimensional average (ORF is $c = 0$: ${}_1F_1(d;\tfrac d2;\tfrac t2)$). The
cosine moments are the same with $t \to -s$, $s = \|\Delta\|^2$:
$E\cos((w_i + \sigma w_j)^\top\Delta) = E_v\,{}_1F_1(d;\tfrac d2;-\tfrac s2(1+\sigma c v))$.
Unlike ORF, $w_i - w_j$ and $w_i + w_j$ do *not* have the same law (angles
$\mp c$), which matters for hyperbolic and trigonometric features:
$\cosh\alpha\cosh\beta = \tfrac12[\cosh(\alpha+\beta) + \cosh(\alpha-\beta)]$ and
$\cos\alpha\cos\beta = \tfrac12[\cos(\alpha+\beta)+\cos(\alpha-\beta)]$ bring in both signs.

Small $t$ [DERIVED]. Since $E v = (E\chi_d)^2/d$ (from $E[2ab] = E\varrho^2\,E v$),
the excess $E e^{(w_i+w_j)^\top z} - e^t = c\,t\,(E\chi_d)^2/d + O(t^2)$ is *first* order in
$t$ (ORF: second order). With one full block ($r = d$, $P/r^2 = (d-1)/d$) the
positive-feature MSE is $\Lambda^2 t\,\mathrm{Var}(\chi_d)/d^2 + O(t^2)$ against
$\Lambda^2 t/d + O(t^2)$ for ORF and iid rows: $\mathrm{MSE_{SimRF}}/\mathrm{MSE_{ORF}}
\to \mathrm{Var}(\chi_d)/d$. The ratio of the covariance terms alone diverges like $1/t$. For
hyperbolic and trigonometric features the first-order terms of the two signs cancel, and the
second-order term is *larger* than ORF's: SimRF is worse than ORF there.

Numerics. $E_v$ is a 96-node Gauss–Legendre rule in $\phi \in [\phi_0, \pi/2]$ with the
weight $\sin^{d-1}\phi$ taken in the log domain and normalised to sum to 1
($\phi_0 = \max(0, \pi/2 - \sqrt{100/(d-1)})$ drops a mass below $e^{-50}$); the
integrand is entire in $\phi$. The excess is summed as
$E_v[{}_1F_1(d;\tfrac d2;\tfrac x2 g) - e^{xg}] + e^{x}E_v[\operatorname{expm1}(\sigma c x v)]$
($g = 1+\sigma c v$), each part free of cancellation (the first through the ORF series of
`kernelapprox.theory._common._pair_excess`), where $x|c| \le 5$; beyond, where
$e^{xg}$ would dwarf the result, as $E_v{}_1F_1 - e^x$ directly (the two then differ
by a factor $\gtrsim e^{\pm x|c|v}$). Checked against a brute-force two-dimensional
quadrature over the $\chi_d$ densities and against ``mpmath`` (``tests/test_simplex.py``):
relative error below 1e-12 for $2 \le d \le 1024$, $-10 \le x \le 40$.

Inputs and outputs follow `kernelapprox.theory.moments`: ``q`` (..., n, d) and ``k``
(..., m, d), NumPy or torch, give (..., n, m) float64 (a tensor on the input's device for tensor
inputs).

References
----------
- [Rei23] I. Reid, K. Choromanski, V. Likhosherstov, A. Weller. "Simplex Random Features",
   ICML 2023, arXiv:2301.13856.
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from scipy.special import gammaln, hyp1f1, roots_legendre

from ._common import (
    _check_r,
    _components,
    _deprecated_keywords,
    _Geometry,
    _geometry,
    _out,
    _pair_excess,
    _prepare,
    orf_pair_count,
)

__all__ = [
    "KINDS",
    "simplex_pair_excess",
    "simplex_trig_pair_excess",
    "simplex_components_cv",
    "simplex_mse",
    "simplex_positive_mse",
    "chi_variance",
]

#: Estimators whose same-block pair covariance `simplex_components_cv` computes.
KINDS = ("positive", "hyperbolic", "trig-sincos", "trig-offset")

_NODES = 96
_BIG_T = 70.0  # above: log-domain positive/hyperbolic covariance (as moments._exp_family)


def _check_dim(d: object) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
        raise TypeError(f"d must be an int >= 2, got {d!r}")
    if d < 2:
        raise ValueError(f"d must be >= 2 for simplex random features (no simplex in dimension 1), got {d}")
    return int(d)


def _check_sign(sign: object) -> int:
    if isinstance(sign, bool) or sign not in (1, -1):
        raise ValueError(f"sign must be +1 (w_i + w_j) or -1 (w_i - w_j), got {sign!r}")
    return 1 if sign == 1 else -1


def _check_real(name: str, x: object) -> np.ndarray:
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number or array, got {type(x).__name__}") from None
    if not np.isfinite(a).all():
        raise ValueError(f"{name} must be finite, got {x!r}")
    return a


@functools.lru_cache(maxsize=64)
def _angle_rule(d: int) -> tuple[np.ndarray, np.ndarray]:
    r"""Nodes $v_k = \sin\phi_k$ and weights (sum 1) of $E_v$, $v^2 \sim \mathrm{Beta}(d/2, 1/2)$."""
    x, w = roots_legendre(_NODES)
    lo = max(0.0, 0.5 * np.pi - np.sqrt(100.0 / (d - 1)))
    phi = lo + (0.5 * np.pi - lo) * 0.5 * (x + 1.0)
    logw = np.log(w) + (d - 1) * np.log(np.sin(phi))
    om = np.exp(logw - logw.max())
    om /= om.sum()
    v = np.sin(phi)
    v.setflags(write=False)
    om.setflags(write=False)
    return v, om


def _excess(d: int, x: np.ndarray, sign: int) -> np.ndarray:
    r"""$E_v\,{}_1F_1(d;\tfrac d2;\tfrac x2(1+\sigma c v)) - e^x$ elementwise, ``x`` real (float64).

    Where $x|c| \le 5$ or $x \le 0$: $E_v[{}_1F_1(d;\tfrac d2;\tfrac x2 g) - e^{xg}]
    + E_v[e^{xg} - e^x]$, both parts free of cancellation (the first is the ORF excess series of
    `kernelapprox.theory.moments`, $O(x^2)$; the second is $e^x\operatorname{expm1}(\sigma c x v)$,
    $O(x)$). For $x|c| > 5$ the terms $e^{xg}$ would dwarf the result (up to
    $e^{x|c|}$ times), while $E_v{}_1F_1$ and $e^x$ differ by a factor
    $\gtrsim e^{\pm x|c| v}$ there: the difference is taken directly.
    """
    v, om = _angle_rule(d)
    c = -1.0 / (d - 1)
    x = np.asarray(x, dtype=np.float64)
    out = np.empty_like(x)
    g = 1.0 + sign * c * v
    direct = (x > 0) & (x * abs(c) > 5.0)
    split = ~direct
    with np.errstate(over="ignore", invalid="ignore"):
        if split.any():
            xe = x[split][..., None]
            y = sign * c * xe * v  # x g = x + y
            orf_part = _pair_excess(d, 0.5 * xe * g)  # 1F1(d; d/2; xg/2) - e^{xg}
            # hyp1f1 fails only far out on the negative axis (xg < -6000), where |1F1| < 1e-300
            orf_part = np.where(np.isfinite(orf_part) | (xe > 0), orf_part, 0.0)
            lin_part = np.where(np.abs(y) < 1.0, np.exp(xe) * np.expm1(y), np.exp(xe * g) - np.exp(xe))
            out[split] = (orf_part + lin_part) @ om
        if direct.any():
            xd = x[direct]
            out[direct] = hyp1f1(d, d / 2.0, 0.5 * xd[..., None] * g) @ om - np.exp(xd)
    return out


def simplex_pair_excess(d: int, t: Any, sign: int = 1) -> np.ndarray:
    r"""Excess of the SimRF pair moment over iid rows, $E\,e^{(w_i \pm w_j)^\top z} - e^{t}$.

    $$
    E_{a,b}\Big[{}_0F_1\big(;\tfrac d2;\tfrac t4\rho_\pm^2\big)\Big] - e^t
    = E_v\Big[{}_1F_1\big(d;\tfrac d2;\tfrac t2(1 \pm c\,v)\big)\Big] - e^t,
    $$

    $\rho_\pm^2 = a^2 + b^2 \pm 2abc$, $a, b$ iid $\chi_d$, $c = -\tfrac1{d-1}$,
    $v^2 \sim \mathrm{Beta}(\tfrac d2, \tfrac12)$ (module docstring) [DERIVED, MC ✓].
    ``sign=+1`` is $w_i + w_j$ (angle $c$), ``sign=-1`` is $w_i - w_j$
    (angle $-c$). A negative ``t`` gives the cosine moment:
    ``simplex_pair_excess(d, -s, sign)`` $= E\cos((w_i \pm w_j)^\top\Delta) - e^{-s}$
    (`simplex_trig_pair_excess`).

    Parameters
    ----------
    d : int
        Dimension, ``>= 2``.
    t : float or array
        $\|z\|^2$ (any shape); finite, and ``<= 350`` for a finite result (the moment itself
        exceeds $e^t$, which overflows beyond $t \approx 709$).
    sign : {+1, -1}, default +1

    Returns
    -------
    ndarray, float64, shape of ``t``

    References
    ----------
    Reid et al., "Simplex Random Features", ICML 2023, arXiv:2301.13856 (the simplex coupling;
    this closed form is derived here).

    Examples
    --------
    >>> float(simplex_pair_excess(4, 0.0))
    0.0
    >>> bool(simplex_pair_excess(4, 0.5) < 0 < simplex_pair_excess(4, 0.5, sign=-1))
    True
    """
    d = _check_dim(d)
    sign = _check_sign(sign)
    return _excess(d, _check_real("t", t), sign)


def simplex_trig_pair_excess(d: int, s: Any, sign: int = 1) -> np.ndarray:
    r"""Cosine analogue: $E\cos\big((w_i \pm w_j)^\top\Delta\big) - e^{-s}$, $s = \|\Delta\|^2$.

    $$
    E_{a,b}\Big[{}_0F_1\big(;\tfrac d2;-\tfrac s4\rho_\pm^2\big)\Big] - e^{-s}
    = E_v\Big[{}_1F_1\big(d;\tfrac d2;-\tfrac s2(1 \pm c\,v)\big)\Big] - e^{-s}
    $$

    (${}_0F_1$ of a negative argument is a normalised Bessel function $J_{d/2-1}$)
    [DERIVED, MC ✓].

    Parameters
    ----------
    d : int
        Dimension, ``>= 2``.
    s : float or array
        $\|\Delta\|^2 \ge 0$.
    sign : {+1, -1}, default +1

    Returns
    -------
    ndarray, float64, shape of ``s``

    References
    ----------
    Reid et al., "Simplex Random Features", ICML 2023, arXiv:2301.13856.

    Examples
    --------
    >>> float(simplex_trig_pair_excess(3, 0.0, sign=-1))
    0.0
    """
    d = _check_dim(d)
    sign = _check_sign(sign)
    s = _check_real("s", s)
    if (s < 0).any():
        raise ValueError(f"s = |x - y|^2 must be >= 0, got {s.min()}")
    return _excess(d, -s, sign)


def _check_estimator(estimator: object) -> str:
    if not isinstance(estimator, str):
        raise TypeError(f"estimator must be a str in {KINDS}, got {type(estimator).__name__}")
    if estimator not in KINDS:
        raise ValueError(f"estimator must be one of {KINDS}, got {estimator!r}")
    return estimator


def _exp_cv(d: int, t: np.ndarray, both: bool) -> np.ndarray:
    r"""Positive (``both=False``) / hyperbolic (``both=True``) same-block covariance over
    $\Lambda^2 e^{2t}$."""
    t = np.asarray(t, dtype=np.float64)
    out = np.empty_like(t)
    signs = (1, -1) if both else (1,)
    small = t <= _BIG_T
    if small.any():
        ts = t[small]
        ex = sum(_excess(d, ts, sg) for sg in signs) / len(signs)
        out[small] = ex * np.exp(-2.0 * ts)
    big = ~small
    if big.any():
        # cv = E_v[1F1(d; d/2; t g / 2)] e^{-2t} - e^{-t}: both terms below e^{-t(1-|c|)} poly(t)
        tb = t[big][..., None]
        v, om = _angle_rule(d)
        c = -1.0 / (d - 1)
        acc = np.zeros(tb.shape[:-1])
        for sg in signs:
            z = np.minimum(0.5 * tb * (1.0 + sg * c * v), 700.0)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                term = np.exp(np.log(hyp1f1(d, d / 2.0, z)) - 2.0 * tb)
            acc += np.where(np.isfinite(term), term, 0.0) @ om
        out[big] = acc / len(signs) - np.exp(-tb[..., 0])
    return out


@_deprecated_keywords(kind="estimator")
def simplex_components_cv(estimator: str, geo: _Geometry) -> np.ndarray:
    r"""Same-block pair covariance ``cv`` of a SimRF estimator, in the normalisation of
    `kernelapprox.theory.moments.Components`.

    ``Var(K^) = exp(scale) * (v1 / r + P / r^2 * cv)`` with ``P`` = `orf_pair_count`
    (the same block structure as ORF) and ``scale``, ``v1`` the iid ones:

    * ``"positive"``: $\mathrm{cv} = e^{-2t}\big[E e^{(w_i+w_j)^\top z} - e^t\big]$
      (scale $\Lambda^2 e^{2t}$);
    * ``"hyperbolic"``: $\mathrm{cv} = e^{-2t}\big[\tfrac12(E e^{(w_i+w_j)^\top z} +
      E e^{(w_i-w_j)^\top z}) - e^t\big]$;
    * ``"trig-sincos"``, ``"trig-offset"`` (the phases average out of the pair moment):
      $\mathrm{cv} = \tfrac12\big(E\cos(w_i+w_j)^\top\Delta + E\cos(w_i-w_j)^\top\Delta\big) - e^{-s}$
      (scale $C^2 = e^{\|x\|^2+\|y\|^2}$),

    each pair moment from `simplex_pair_excess` [DERIVED, MC ✓].

    Parameters
    ----------
    estimator : {"positive", "hyperbolic", "trig-sincos", "trig-offset"}
    geo : moments._Geometry
        Pairwise geometry (reads ``geo.d``, ``geo.t`` = $\|x+y\|^2$, ``geo.s`` =
        $\|x-y\|^2$; arrays of shape (..., n, m)).

    Returns
    -------
    ndarray, float64, shape (..., n, m)

    References
    ----------
    Reid et al., "Simplex Random Features", ICML 2023, arXiv:2301.13856.

    Examples
    --------
    >>> import numpy as np
    >>> from kernelapprox.theory._common import _geometry
    >>> x = np.array([[0.3, 0.1, -0.2]]); y = np.array([[0.2, -0.4, 0.1]])
    >>> cv = simplex_components_cv("positive", _geometry(x, y))
    >>> cv.shape, bool(cv[0, 0] < 0)
    ((1, 1), True)
    """
    kind = _check_estimator(estimator)
    d = _check_dim(geo.d)
    if kind in ("positive", "hyperbolic"):
        return _exp_cv(d, geo.t, both=kind == "hyperbolic")
    s = np.asarray(geo.s, dtype=np.float64)
    return 0.5 * (_excess(d, -s, 1) + _excess(d, -s, -1))


@_deprecated_keywords(kind="estimator")
def simplex_mse(estimator: str, q: Any, k: Any, num_features: int) -> Any:
    r"""MSE (= variance: SimRF is unbiased) of every entry of a SimRF kernel estimate.

    $$
    \mathrm{MSE} = e^{\text{scale}}\Big(\frac{v_1}{r} + \frac{P}{r^2}\,\mathrm{cv}\Big),
    \qquad P = b\,d(d-1) + r'(r'-1)\ \ (r = bd + r'),
    $$

    with ``scale``, ``v1`` the iid per-projection variance of
    `kernelapprox.theory.moments` and ``cv`` from `simplex_components_cv` [DERIVED, MC ✓].

    Parameters
    ----------
    estimator : {"positive", "hyperbolic", "trig-sincos", "trig-offset"}
    q : array or Tensor, shape (..., n, d), ``d >= 2``
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of projections (rows of the SimRF projection).

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Reid et al., "Simplex Random Features", ICML 2023, arXiv:2301.13856; Choromanski et al.,
    "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794 (the iid term, Lemma 2).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, -0.2, 0.1, 0.4]]); y = np.array([[0.1, 0.2, -0.3, 0.2]])
    >>> float(simplex_mse("trig-sincos", x, x, 8)[0, 0])  # exact at x = y
    0.0
    >>> bool(simplex_mse("positive", x, y, 4)[0, 0] < 0.5 * simplex_mse("positive", x, y, 1)[0, 0] / 4)
    True
    """
    kind = _check_estimator(estimator)
    r = _check_r(num_features)
    qa, ka, dev = _prepare(q, k)
    geo = _geometry(qa, ka)
    _check_dim(geo.d)
    comp = _components(kind, geo, None)  # the iid per-projection terms, from the registered theory
    P = orf_pair_count(r, geo.d)
    bracket = comp.v1 / r + (P / (r * r)) * simplex_components_cv(kind, geo)
    with np.errstate(divide="ignore", over="ignore"):
        out = np.exp(comp.scale + np.log(np.maximum(bracket, 0.0)))
    return _out(out, dev)


def simplex_positive_mse(q: Any, k: Any, num_features: int) -> Any:
    r"""MSE of ``PositiveRF(d, r, sampler="simplex")`` (FAVOR+ on SimRF rows), every (q, k) entry.

    $$
    \mathrm{MSE} = \frac{\Lambda^2}{r}\big(e^{2t} - e^t\big)
    + \frac{P}{r^2}\Lambda^2\Big[E_v\,{}_1F_1\big(d;\tfrac d2;\tfrac t2(1 + c\,v)\big) - e^t\Big],
    $$

    $\Lambda = e^{-(\|x\|^2+\|y\|^2)/2}$, $t = \|x + y\|^2$, $c = -\tfrac1{d-1}$,
    $v^2 \sim \mathrm{Beta}(\tfrac d2,\tfrac12)$, $P$ as for ORF
    (`kernelapprox.theory.moments.orf_pair_count`) [DERIVED, MC ✓]. The bracket is below the
    ORF one (${}_1F_1$ increases and $1 + cv \le 1$), so SimRF $\le$ ORF
    $\le$ iid for positive features at every $(x, y)$; for one block and
    $t \to 0$ the ratio to ORF tends to $\mathrm{Var}(\chi_d)/d$ (`chi_variance`).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d), ``d >= 2``
    k : array or Tensor, shape (..., m, d)
    num_features : int

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    References
    ----------
    Reid et al., "Simplex Random Features", ICML 2023, arXiv:2301.13856.

    Examples
    --------
    >>> import numpy as np
    >>> from kernelapprox.theory import positive_mse
    >>> x = np.array([[0.2, 0.1, 0.0, -0.1]]); y = np.array([[0.1, -0.1, 0.2, 0.1]])
    >>> sim = simplex_positive_mse(x, y, 4)[0, 0]
    >>> bool(sim < positive_mse(x, y, 4, row_law="orthogonal-chi")[0, 0] < positive_mse(x, y, 4)[0, 0])
    True
    """
    return simplex_mse("positive", q, k, num_features)


def chi_variance(d: int) -> float:
    r"""$\mathrm{Var}(\chi_d) = d - 2\,\Gamma(\tfrac{d+1}2)^2/\Gamma(\tfrac d2)^2$.

    ``chi_variance(d) / d`` is the $t \to 0$ limit of
    $\mathrm{MSE_{SimRF}}/\mathrm{MSE_{ORF}}$ for positive features with one full block.

    Parameters
    ----------
    d : int
        ``>= 1``.

    Returns
    -------
    float

    Examples
    --------
    >>> round(chi_variance(4) / 4, 5)
    0.11643
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    mean_sq = 2.0 * np.exp(2.0 * (gammaln((d + 1) / 2.0) - gammaln(d / 2.0)))
    return float(d - mean_sq)
