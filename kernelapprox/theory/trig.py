r"""Closed-form bias, variance and MSE of the trigonometric random features
(`kernelapprox.TrigRF`, variants sin/cos and cos+offset) [Cho21]_ [SS15]_ [Yu16]_.

Per-projection terms $X_i = C\cos(w_i^\top\Delta)$ (sin/cos, ``2r`` feature coordinates) and
$X_i = 2C\cos(w_i^\top x+b_i)\cos(w_i^\top y+b_i)$ (offset, ``r``), $\Delta = x - y$,
$C = e^{(\|x\|^2+\|y\|^2)/2}$; the derivations for iid, χ-norm, fixed-norm and simplex rows are
in `kernelapprox.theory.moments` (module docstring) and ``docs/theory.md``. Fixed-norm rows
estimate a Bessel kernel (`fixed_norm_trig_kernel`).

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2, eq. 8).
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072 (Lemma 1; ORF′ eq. 4).
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015,
   arXiv:1506.02785.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kernelapprox.registry import EstimatorTheory

from ._common import (
    _ALL_LAWS,
    Components,
    _bias_of,
    _deprecated_keywords,
    _Geometry,
    _geometry,
    _hyp0f1_neg,
    _law_code,
    _mse_of,
    _out,
    _pair_excess,
    _prepare,
)
from .simplex import simplex_components_cv

__all__ = [
    "TRIG_SINCOS_THEORY",
    "TRIG_OFFSET_THEORY",
    "trig_sincos_components",
    "trig_offset_components",
    "trig_sincos_mse",
    "trig_offset_mse",
    "trig_bias",
    "fixed_norm_trig_kernel",
]


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


@_deprecated_keywords(orthogonal="row_law")
def trig_sincos_mse(q: Any, k: Any, num_features: int, *, row_law: str = "iid") -> Any:
    r"""MSE of ``TrigRF(variant="sincos")``: ``r`` projections, ``2r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{e^{\|x\|^2+\|y\|^2}}{2r}\big(1-e^{-s}\big)^2
    + \frac{P}{r^2}\,e^{\|x\|^2+\|y\|^2}\Big[{}_1F_1\big(d;\tfrac d2;-\tfrac s2\big) - e^{-s}\Big]
    $$

    with $s = \|x-y\|^2$ and $P$ = `orf_pair_count` (0 for iid rows).

    * iid (``row_law="iid"``): Performer Lemma 2, eq. (8) [SOURCE]; Yu et al. Lemma 1.
    * ``"orthogonal-chi"``: exact χ-norm ORF closed form, several blocks and a partial last block [DERIVED,
      MC ✓]. For large $s$ the ORF term has no fixed sign: by Kummer's transformation
      ${}_1F_1(d;\tfrac d2;-\tfrac s2) = e^{-s/2}\,\frac{(d/2)!}{(d/2)_{d/2}}
      L^{(d/2-1)}_{d/2}(\tfrac s2)$ for even $d$ (sign $(-1)^{d/2}$ beyond the largest root
      of the Laguerre polynomial), and it decays like
      $\frac{\Gamma(d/2)}{\Gamma(-d/2)}(\tfrac s2)^{-d}$ for odd $d$ (the sign of
      $\Gamma(-\tfrac d2)$) (DLMF 13.2.39, 13.6.19, 13.7.2). Its size is negligible: at
      $s = 20, 60, 200$ the bracket is $-3.0\cdot10^{-5}, -2.4\cdot10^{-11}, -5.3\cdot10^{-40}$
      for $d = 6$ and $+3.4\cdot10^{-5}, -1.2\cdot10^{-7}, -1.7\cdot10^{-10}$ for $d = 5$, so
      far from $x=y$ ORF and iid rows have the same MSE to within these terms.
    * ``"orthogonal-fixed"``: rows of norm $\sqrt d$; biased (mean
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
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        The law of the projection rows (`kernelapprox.samplers.Sampler.row_law`); the former
        ``orthogonal={None, "chi", "fixed", "simplex"}`` is deprecated.

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
    return _mse_of("trig-sincos", q, k, num_features, _law_code(row_law))


@_deprecated_keywords(orthogonal="row_law")
def trig_offset_mse(q: Any, k: Any, num_features: int, *, row_law: str = "iid") -> Any:
    r"""MSE of ``TrigRF(variant="offset")``: ``r`` projections, ``r`` feature coordinates.

    $$
    \mathrm{MSE} = \frac{e^{\|x\|^2+\|y\|^2}}{r}\Big[1+\tfrac12e^{-2s}-e^{-s}\Big]
    + \frac{P}{r^2}\,e^{\|x\|^2+\|y\|^2}\Big[{}_1F_1\big(d;\tfrac d2;-\tfrac s2\big) - e^{-s}\Big]
    $$

    * iid: the Sutherland–Schneider variance of the $\breve z$ features transported to SM
      (``docs/theory.md`` §1) [DERIVED, MC ✓]. It exceeds the sin/cos MSE at equal ``r`` by
      $\frac{C^2}{2r}$ — never zero, even at ``x = y``.
    * ``"orthogonal-chi"``: the phases $b_i$ are independent, so
      $E X_iX_j = C^2 E\cos(w_i^\top\Delta)\cos(w_j^\top\Delta)$: the same pair term as
      sin/cos [DERIVED, MC ✓].
    * ``"orthogonal-fixed"``: as for sin/cos with $m_2 = C^2[1+\tfrac12 F(-ds)]$ [DERIVED, MC ✓].

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
    Sutherland & Schneider 2015 (arXiv:1506.02785) §2 (recalled form, re-derived here).

    Examples
    --------
    >>> import numpy as np
    >>> x = np.zeros((1, 3)); round(float(trig_offset_mse(x, x, 10)[0, 0]), 12)  # 1/(2r) at x = y = 0
    0.05
    """
    return _mse_of("trig-offset", q, k, num_features, _law_code(row_law))


@_deprecated_keywords(orthogonal="row_law")
def trig_bias(q: Any, k: Any, *, row_law: str = "iid") -> Any:
    r"""Bias $E\hat K - e^{q^\top k}$ of ``TrigRF`` (both variants); independent of ``r``.

    Zero for iid and χ-norm ORF rows; for fixed-norm ORF
    $C\big({}_0F_1(;\tfrac d2;-\tfrac{ds}4) - e^{-s/2}\big)$ [DERIVED, MC ✓]
    (`fixed_norm_trig_kernel` minus SM).

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
    >>> x = np.array([[0.4, 0.0, 0.0]]); y = np.array([[-0.4, 0.0, 0.0]])
    >>> float(trig_bias(x, y)[0, 0])
    0.0
    """
    return _bias_of("trig-sincos", q, k, _law_code(row_law))


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
