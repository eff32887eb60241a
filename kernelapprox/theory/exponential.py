r"""Closed-form bias, variance and MSE of the exponential random features: positive (FAVOR+,
`kernelapprox.PositiveRF`) and hyperbolic (`kernelapprox.HyperbolicRF`) [Cho21]_.

Per-projection terms $X_i = \Lambda e^{w_i^\top z}$ (positive, ``r`` feature coordinates) and
$X_i = \Lambda\cosh(w_i^\top z)$ (hyperbolic, ``2r``), $z = x + y$,
$\Lambda = e^{-(\|x\|^2+\|y\|^2)/2}$; the derivations for iid, χ-norm, fixed-norm and simplex rows
are in `kernelapprox.theory.moments` (module docstring) and ``docs/theory.md``. Fixed-norm rows
estimate the regularised kernel SMREG (`smreg_kernel`).

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2, eq. 8; Theorem 2, eq. 10; SMREG §2.3).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import hyp1f1

from kernelapprox.registry import EstimatorTheory

from ._common import (
    _ALL_LAWS,
    Components,
    _bias_of,
    _check_r,
    _core,
    _deprecated_keywords,
    _finish,
    _Geometry,
    _geometry,
    _law_code,
    _log_hyp0f1_pos,
    _mse_of,
    _out,
    _pair_excess,
    _prepare,
)
from .simplex import simplex_components_cv

__all__ = [
    "POSITIVE_THEORY",
    "HYPERBOLIC_THEORY",
    "positive_components",
    "hyperbolic_components",
    "positive_mse",
    "hyperbolic_mse",
    "positive_bias",
    "hyperbolic_bias",
    "smreg_kernel",
    "performer_theorem2_bound",
]


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


def positive_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``PositiveRF`` (see `positive_mse`)."""
    return _exp_family(geo, orthogonal, hyperbolic=False)


def hyperbolic_components(geo: _Geometry, orthogonal: str | None) -> Components:
    """`Components` of ``HyperbolicRF`` (see `hyperbolic_mse`)."""
    return _exp_family(geo, orthogonal, hyperbolic=True)


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


@_deprecated_keywords(orthogonal="row_law")
def positive_mse(q: Any, k: Any, num_features: int, *, row_law: str = "iid") -> Any:
    r"""MSE of ``PositiveRF`` (FAVOR+): ``r`` projections, ``r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{\Lambda^2}{r}\big(e^{2t}-e^{t}\big)
    + \frac{P}{r^2}\,\Lambda^2\Big[{}_1F_1\big(d;\tfrac d2;\tfrac t2\big) - e^{t}\Big],
    \qquad \Lambda = e^{-(\|x\|^2+\|y\|^2)/2},\ t = \|x+y\|^2 .
    $$

    * iid: Performer Lemma 2, eq. (8): $\frac1r e^{\|x+y\|^2}\mathrm{SM}^2(1-e^{-\|x+y\|^2})$
      [SOURCE]. Relative MSE $(e^t-1)/r$.
    * ``"orthogonal-chi"``: exact χ-norm ORF [DERIVED, MC ✓]; the pair term is $\le 0$ (ORF always
      helps), consistent with Performer Theorem 2 (`performer_theorem2_bound`).
    * ``"orthogonal-fixed"``: estimates SMREG (`smreg_kernel`); bias
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
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        The law of the projection rows (`kernelapprox.samplers.Sampler.row_law`); the former
        ``orthogonal={None, "chi", "fixed", "simplex"}`` is deprecated.

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
    return _mse_of("positive", q, k, num_features, _law_code(row_law))


@_deprecated_keywords(orthogonal="row_law")
def hyperbolic_mse(q: Any, k: Any, num_features: int, *, row_law: str = "iid") -> Any:
    r"""MSE of ``HyperbolicRF``: ``r`` projections, ``2r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{\Lambda^2}{2r}\big(e^{t}-1\big)^2
    + \frac{P}{r^2}\,\Lambda^2\Big[{}_1F_1\big(d;\tfrac d2;\tfrac t2\big) - e^{t}\Big]
    $$

    * iid: Performer Lemma 2: $\tfrac12(1-e^{-t})$ times the positive MSE [SOURCE].
    * ``"orthogonal-chi"``: $\cosh a\cosh b = \tfrac12[\cosh(a+b)+\cosh(a-b)]$ and
      $w_i - w_j \stackrel d= w_i + w_j$ for an orthogonal pair, so the pair moment is the
      positive one, $\Lambda^2{}_1F_1(d;\tfrac d2;\tfrac t2)$ [DERIVED, MC ✓].
    * ``"orthogonal-fixed"``: mean SMREG, $m_2 = \Lambda^2\,\tfrac{1+F(dt)}2$, pair moment
      $\Lambda^2F(\tfrac{dt}2)$ [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        The law of the projection rows (`kernelapprox.samplers.Sampler.row_law`); the former
        ``orthogonal={None, "chi", "fixed", "simplex"}`` is deprecated.

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
    return _mse_of("hyperbolic", q, k, num_features, _law_code(row_law))


@_deprecated_keywords(orthogonal="row_law")
def positive_bias(q: Any, k: Any, *, row_law: str = "iid") -> Any:
    r"""Bias of ``PositiveRF``; independent of ``r``: zero unless ``row_law="orthogonal-fixed"``.

    Fixed-norm ORF estimates SMREG: bias $\Lambda\,{}_0F_1(;\tfrac d2;\tfrac{dt}4) -
    e^{x^\top y} \le 0$ (Performer Theorem 1: SMREG ≤ SM for $d\ge2$) [DERIVED, MC ✓].

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        The law of the projection rows (`kernelapprox.samplers.Sampler.row_law`); the former
        ``orthogonal={None, "chi", "fixed", "simplex"}`` is deprecated.

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.5, 0.0, 0.0]])
    >>> bool(positive_bias(x, x, row_law="orthogonal-fixed")[0, 0] < 0)
    True
    """
    return _bias_of("positive", q, k, _law_code(row_law))


@_deprecated_keywords(orthogonal="row_law")
def hyperbolic_bias(q: Any, k: Any, *, row_law: str = "iid") -> Any:
    r"""Bias of ``HyperbolicRF``: the same as `positive_bias` ($\cosh$ is even).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        The law of the projection rows (`kernelapprox.samplers.Sampler.row_law`); the former
        ``orthogonal={None, "chi", "fixed", "simplex"}`` is deprecated.

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.5, 0.0, 0.0]])
    >>> bool(hyperbolic_bias(x, x, row_law="orthogonal-fixed")[0, 0] == positive_bias(x, x, row_law="orthogonal-fixed")[0, 0])
    True
    """
    return _bias_of("hyperbolic", q, k, _law_code(row_law))


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


def performer_theorem2_bound(q: Any, k: Any, num_features: int) -> Any:
    r"""Performer Theorem 2 upper bound on the MSE of positive features with (χ-norm) ORF.

    $$
    \mathrm{MSE}(\widehat{\mathrm{SM}}^{\rm ort+}_m) \le \mathrm{MSE}(\widehat{\mathrm{SM}}^{+}_m)
    - \frac{2(m-1)}{m(d+2)}\Big(\mathrm{SM}(x,y) - e^{-\frac{\|x\|^2+\|y\|^2}{2}}\Big)^2
    $$

    stated for $m \le d$ [SOURCE: arXiv:2009.14794, Theorem 2, eq. (10)]. Compare with the
    exact value ``positive_mse(q, k, m, row_law="orthogonal-chi")``.

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
    >>> bool(positive_mse(x, y, 4, row_law="orthogonal-chi")[0, 0] <= performer_theorem2_bound(x, y, 4)[0, 0])
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
