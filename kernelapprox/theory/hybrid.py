r"""Closed-form MSE of the angular hybrid estimator (`kernelapprox.maps.hybrid.HybridRF`).

The estimator [HRF22]_ mixes two unbiased estimators of $\mathrm{SM}(x, y) = e^{x^\top y}$
that share the projections $w_1..w_r$,

$$
A = \frac{\Lambda}{r}\sum_{i=1}^r \cosh(w_i^\top z), \qquad
B = \frac{1}{\Lambda r}\sum_{i=1}^r \cos(w_i^\top \Delta)
$$

(hyperbolic and sin/cos features; $z = x+y$, $\Delta = x-y$,
$\Lambda = e^{-(\|x\|^2+\|y\|^2)/2}$), with the weight

$$
\hat\lambda = \frac12 - \frac1{2n}\sum_{l=1}^n \operatorname{sgn}(g_l^\top x)\operatorname{sgn}(g_l^\top y),
\qquad \mathbb E\hat\lambda = \lambda = \frac{\theta_{x,y}}{\pi},
$$

from $n$ Gaussian vectors $g_l$ independent of the $w_i$:
$\hat K = \hat\lambda A + (1-\hat\lambda) B$.

MSE (DERIVED). $\hat K - \mathrm{SM} = \hat\lambda(A - \mathrm{SM}) + (1-\hat\lambda)(B - \mathrm{SM})$
and $\hat\lambda$ is independent of $(A, B)$, so with $v = \mathrm{Var}\,\hat\lambda$

$$
\mathrm{MSE} = (\lambda^2 + v)\,V_A + \big((1-\lambda)^2 + v\big)\,V_B
+ 2\big(\lambda(1-\lambda) - v\big)\,C
= (\lambda^2+v)(V_A+V_B-2C) + 2\lambda(C-V_B) + V_B .
$$

For iid sign vectors the $n$ terms $\operatorname{sgn}(g_l^\top x)\operatorname{sgn}(g_l^\top y)$
are iid $\pm1$ with mean $1-2\lambda$, so $v = \lambda(1-\lambda)/n$. For iid
Gaussian rows $w_i$ (Performer Lemma 2 [Cho21]_),

$$
V_A = \frac{\Lambda^2}{2r}\,(e^{t}-1)^2,\qquad V_B = \frac{1}{2r\Lambda^2}(1-e^{-s})^2,
\qquad t = \|z\|^2,\ s = \|\Delta\|^2,
$$

and the covariance of the two estimators, which share the $w_i$ (DERIVED):
$\cosh a\cos b = \tfrac12\mathrm{Re}\,(e^{a+ib} + e^{-a+ib})$ and the Gaussian MGF
$\mathbb E e^{w^\top c} = e^{c^\top c/2}$ at the complex points $c = \pm z + i\Delta$,
$c^\top c = t - s \pm 2i\,z^\top\Delta$, with $t - s = 4x^\top y$ and
$z^\top\Delta = \|x\|^2 - \|y\|^2$, give
$\mathbb E\cosh(w^\top z)\cos(w^\top\Delta) = e^{2x^\top y}\cos(\|x\|^2-\|y\|^2)$, while
$\mathbb E\cosh(w^\top z)\,\mathbb E\cos(w^\top \Delta) = e^{(t - s)/2} = e^{2x^\top y}$. Terms of
different rows are independent, hence

$$
C = \mathrm{Cov}(A, B) = \frac{\mathrm{SM}^2}{r}\big(\cos(\|x\|^2-\|y\|^2) - 1\big) \le 0 .
$$

(The same $C$ holds for positive features $A = \frac\Lambda r\sum e^{w_i^\top z}$: only
the real part of $\mathbb E e^{w^\top(z + i\Delta)}$ enters.) The covariance vanishes for
equal norms and is most negative at $\|x\|^2-\|y\|^2 = \pi$. Checked by Monte Carlo at 5 %
resolution in ``tests/maps/test_hybrid.py``; the MSE without $C$ is rejected there.

Extremes: at $\theta = 0$ the weight is $\hat\lambda \equiv 0$ (every sign product is
$+1$) and at $\theta=\pi$ it is $\hat\lambda\equiv 1$, so $v = 0$ and the
MSE is $V_B$ (0 when also $x = y$) or $V_A$ (0 when $x = -y$). A zero
input has $\operatorname{sgn}(0) = 0$ in every product: $\hat\lambda \equiv \tfrac12$,
$v = 0$.

Numerics: everything is computed relative to $\mathrm{SM}^2$ (``relative`` terms below) and
rescaled by $e^{2x^\top y}$ in the log domain, in float64; $s$ and $t$ are
recomputed from the coordinates where they cancel, and $\theta$ uses the stable form
$\theta = 2\operatorname{atan2}(\|\hat x - \hat y\|, \|\hat x + \hat y\|)$.

Orthogonal or QMC projections and angular vectors are not covered (iid only).

References
----------
- [HRF22] K. Choromanski, H. Chen, H. Lin, Y. Ma, A. Sehanobish, D. Jain, M. S. Ryoo, J. Varley,
   A. Zeng, V. Likhosherstov, D. Kalashnikov, V. Sindhwani, A. Weller. "Hybrid Random Features",
   ICLR 2022, arXiv:2110.04367 (angular hybrid estimator, §3).
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from kernelapprox.registry import EstimatorTheory

from ._common import Components, _check_r, _Geometry, _geometry, _out, _prepare

__all__ = ["HYBRID_THEORY", "HybridTerms", "hybrid_components", "hybrid_terms", "hybrid_mse"]


class HybridTerms(NamedTuple):
    r"""Ingredients of the hybrid MSE at every ``(q_i, k_j)`` pair, float64 arrays ``(..., n, m)``.

    Variances and the covariance are *relative*, divided by $\mathrm{SM}^2 = e^{2x^\top y}$
    (``xy``), so that none of them overflows.
    """

    lam: np.ndarray  # lambda = theta / pi (1/2 where an input is zero)
    v: np.ndarray  # Var(lambda_hat) = lambda (1 - lambda) / n (0 where an input is zero)
    var_a: np.ndarray  # Var(A) / SM^2, hyperbolic part
    var_b: np.ndarray  # Var(B) / SM^2, sin/cos part
    cov: np.ndarray  # Cov(A, B) / SM^2
    xy: np.ndarray  # log SM = x.y


def _check_n(num_angular: object) -> int:
    if isinstance(num_angular, bool) or not isinstance(num_angular, (int, np.integer)):
        raise TypeError(f"num_angular must be a positive int, got {num_angular!r}")
    if num_angular <= 0:
        raise ValueError(f"num_angular must be a positive int, got {num_angular}")
    return int(num_angular)


def _angle_over_pi(q: np.ndarray, k: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``theta / pi`` for every pair (stable near 0 and pi) and a mask of pairs with a zero input."""
    nq = np.sqrt(np.einsum("...i,...i->...", q, q))
    nk = np.sqrt(np.einsum("...i,...i->...", k, k))
    with np.errstate(invalid="ignore", divide="ignore"):
        uq = q / nq[..., None]
        uk = k / nk[..., None]
    uq = np.where(nq[..., None] > 0, uq, 0.0)
    uk = np.where(nk[..., None] > 0, uk, 0.0)
    diff = uq[..., :, None, :] - uk[..., None, :, :]
    summ = uq[..., :, None, :] + uk[..., None, :, :]
    lam = 2.0 * np.arctan2(np.sqrt(np.einsum("...i,...i->...", diff, diff)),
                           np.sqrt(np.einsum("...i,...i->...", summ, summ))) / np.pi
    zero = (nq[..., :, None] == 0) | (nk[..., None, :] == 0)
    lam = np.broadcast_to(lam, shape).copy()
    zero = np.broadcast_to(zero, shape)
    lam[zero] = 0.5
    return lam, zero


def hybrid_terms(q: Any, k: Any, num_features: int, *, num_angular: int) -> HybridTerms:
    r"""The ingredients $\lambda, v, V_A, V_B, C$ of `hybrid_mse` (module docstring).

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of projections $w_i$ shared by both parts.
    num_angular : int
        ``n``, the number of angular vectors $g_l$.

    Returns
    -------
    HybridTerms
        NumPy float64 arrays of shape ``(..., n, m)``; variances and covariance relative to
        $\mathrm{SM}^2$.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.6, 0.0]]); y = np.array([[0.0, 0.6]])
    >>> t = hybrid_terms(x, y, 8, num_angular=4)
    >>> float(t.lam[0, 0]), float(t.v[0, 0]), float(t.cov[0, 0])  # theta = pi/2, equal norms
    (0.5, 0.0625, 0.0)
    """
    qa, ka, _ = _prepare(q, k)
    return _terms(qa, ka, _check_r(num_features), _check_n(num_angular))[0]


def _terms(qa: np.ndarray, ka: np.ndarray, r: int, n: int) -> tuple[HybridTerms, _Geometry]:
    geo = _geometry(qa, ka)
    return _terms_of(geo, _angle_over_pi(qa, ka, geo.xy.shape), r, n), geo


def _angle_from_geometry(geo: _Geometry) -> tuple[np.ndarray, np.ndarray]:
    r"""``theta / pi`` from the pair geometry alone (no coordinates): with $a = \|x\|$,
    $b = \|y\|$, $s - (a-b)^2 = ab\|\hat x-\hat y\|^2$ and $t - (a-b)^2 = ab\|\hat x+\hat y\|^2$, so
    $\theta = 2\operatorname{atan2}(\sqrt{s-(a-b)^2}, \sqrt{t-(a-b)^2})$ (absolute error
    $\lesssim\sqrt{\epsilon}$ near $\theta = 0, \pi$ for unequal norms; `_angle_over_pi` is exact)."""
    a, b = np.sqrt(geo.nx), np.sqrt(geo.ny)
    gap = (a - b) ** 2
    lam = 2.0 * np.arctan2(np.sqrt(np.maximum(geo.s - gap, 0.0)), np.sqrt(np.maximum(geo.t - gap, 0.0))) / np.pi
    zero = (a == 0) | (b == 0)
    return np.where(zero, 0.5, lam), zero


def _terms_of(geo: _Geometry, angle: tuple[np.ndarray, np.ndarray], r: int, n: int) -> HybridTerms:
    lam, zero = angle
    v = np.where(zero, 0.0, lam * (1.0 - lam) / n)
    with np.errstate(over="ignore"):
        # V_A / SM^2 = (1 - e^{-t})^2 e^{t} / (2r);  V_B / SM^2 = (1 - e^{-s})^2 e^{s} / (2r)
        var_a = np.expm1(-geo.t) ** 2 * np.exp(geo.t) / (2.0 * r)
        var_b = np.expm1(-geo.s) ** 2 * np.exp(geo.s) / (2.0 * r)
    # cos(a) - 1 = -2 sin^2(a / 2), without cancellation for small a
    cov = 0.0 - 2.0 * np.sin(0.5 * (geo.nx - geo.ny)) ** 2 / r  # 0.0 - : no negative zero
    return HybridTerms(lam, v, var_a, var_b, cov, geo.xy)


def _log_mse(t: HybridTerms, geo: _Geometry, r: int) -> np.ndarray:
    """log MSE of every pair (``-inf`` where the MSE is 0, ``inf`` where it overflows)."""
    alpha = t.lam**2 + t.v
    beta = (1.0 - t.lam) ** 2 + t.v
    gamma = 2.0 * (t.lam * (1.0 - t.lam) - t.v)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        # relative MSE = alpha V_A + beta V_B + gamma C, in the log domain: log(alpha V_A) etc.
        # (V_A, V_B overflow for t, s above ~709 while the MSE need not), rescaled by the larger
        # term; gamma C <= 0 is bounded by 2 gamma / r.
        log_2r = np.log(2.0 * r)
        la = np.log(alpha) + 2.0 * np.log(-np.expm1(-geo.t)) + geo.t - log_2r
        lb = np.log(beta) + 2.0 * np.log(-np.expm1(-geo.s)) + geo.s - log_2r
        top = np.maximum(la, lb)
        ok = np.isfinite(top)
        top0 = np.where(ok, top, 0.0)
        rel = np.exp(la - top0) + np.exp(lb - top0) + gamma * t.cov * np.exp(-top0)
        log_mse = np.log(np.maximum(rel, 0.0)) + top0 + 2.0 * t.xy
    return np.where(ok, log_mse, np.where(top > 0, np.inf, -np.inf))


def hybrid_mse(q: Any, k: Any, num_features: int, *, num_angular: int) -> Any:
    r"""MSE of every entry of ``HybridRF(d, r, num_angular=n).kernel(q, k)`` (iid rows and vectors).

    $$
    \mathrm{MSE} = (\lambda^2+v)(V_A+V_B-2C) + 2\lambda(C-V_B) + V_B,\quad
    \lambda = \frac{\theta_{q,k}}\pi,\ v = \frac{\lambda(1-\lambda)}{n},\
    C = \frac{\mathrm{SM}^2}{r}\big(\cos(\|q\|^2-\|k\|^2)-1\big)
    $$

    with $V_A$ (hyperbolic) and $V_B$ (sin/cos) the Performer variances (module
    docstring) [DERIVED, MC ✓]. Zero at $q = k$ and at $q = -k$.

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of projections.
    num_angular : int
        ``n``, the number of angular vectors.

    Returns
    -------
    array or Tensor, shape (..., n, m), float64
        NumPy in, NumPy out; a torch tensor in gives a float64 tensor on its device.

    References
    ----------
    Choromanski et al. 2022 (arXiv:2110.04367) §3; Choromanski et al. 2021 (arXiv:2009.14794) Lemma 2.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.5, 0.2]])
    >>> float(hybrid_mse(x, x, 8, num_angular=8)[0, 0]), float(hybrid_mse(x, -x, 8, num_angular=8)[0, 0])
    (0.0, 0.0)
    """
    r = _check_r(num_features)
    n = _check_n(num_angular)
    qa, ka, dev = _prepare(q, k)
    t, geo = _terms(qa, ka, r, n)
    with np.errstate(over="ignore"):
        return _out(np.exp(_log_mse(t, geo, r)), dev)


def hybrid_components(
    geo: _Geometry, orthogonal: str | None, *, num_angular: int, angle: Any = None
) -> Components:
    r"""`kernelapprox.theory.moments.Components` of ``HybridRF`` (iid rows): the estimator is
    unbiased and every term of `hybrid_mse` is $\propto 1/r$, so ``scale`` is the log MSE of
    one projection, ``v1 = 1`` and ``cv = 0``.

    Parameters
    ----------
    geo : pair geometry of ``(q, k)``
    orthogonal : None
        Only iid rows are covered (``HYBRID_THEORY.row_laws``).
    num_angular : int
        ``n``, the number of angular vectors.
    angle : tuple of arrays, optional
        ``(theta / pi, zero-input mask)`` from the coordinates (the ``prepare`` hook passes it);
        recomputed from ``geo`` when absent.

    Returns
    -------
    Components

    Examples
    --------
    >>> import numpy as np
    >>> from kernelapprox.theory._common import _geometry
    >>> x = np.array([[0.5, 0.2]]); y = np.array([[-0.1, 0.4]])
    >>> c = hybrid_components(_geometry(x, y), None, num_angular=4)
    >>> bool(np.isclose(np.exp(c.scale[0, 0]) / 8, hybrid_mse(x, y, 8, num_angular=4)[0, 0]))
    True
    """
    if orthogonal is not None:
        raise NotImplementedError(f"the hybrid closed form covers iid rows only, got orthogonal={orthogonal!r}")
    n = _check_n(num_angular)
    t = _terms_of(geo, _angle_from_geometry(geo) if angle is None else angle, 1, n)
    scale = _log_mse(t, geo, 1)
    zeros = np.zeros_like(scale)
    return Components(scale, np.ones_like(scale), zeros, zeros.copy(), geo.xy, geo.s, geo.t)


def _hybrid_prepare(fm: Any, qa: np.ndarray, ka: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    shape = np.broadcast_shapes(qa.shape[:-2], ka.shape[:-2]) + (qa.shape[-2], ka.shape[-2])
    return qa, ka, {"num_angular": int(fm.num_angular), "angle": _angle_over_pi(qa, ka, shape)}


#: The closed forms of ``HybridRF`` (registered with its class in `kernelapprox.maps.hybrid`):
#: moments for iid rows and angular vectors.
HYBRID_THEORY = EstimatorTheory(
    components=hybrid_components, row_laws=frozenset({"iid"}), prepare=_hybrid_prepare
)
