r"""Closed-form variance and MSE of the dense-exponential estimators (OPRF/FAVOR++, SADERF, SDERF).

One term of OPRF with parameter $A < 1/8$ (`kernelapprox.OptimalPositiveRF`) is
$X = \Lambda D^2 e^{2A\|\omega\|^2 + \sqrt{1-4A}\,\omega^\top z}$ with $z = x + y$,
$t = \|z\|^2$, $\Lambda = e^{-(\|x\|^2+\|y\|^2)/2}$, $D^2 = (1-4A)^{d/2}$. By the
Gaussian integral $E\,e^{a\|\omega\|^2 + b^\top\omega} = (1-2a)^{-d/2}e^{\|b\|^2/(2(1-2a))}$
($a < 1/2$):

$$
E X = e^{x^\top y},\qquad
E X^2 = \Lambda^2 (1-4A)^d (1-8A)^{-d/2} \exp\Big(\frac{2(1-4A)\,t}{1-8A}\Big)
$$

([LCD22]_; DERIVED, MC-verified in tests/maps/test_dense_exponential.py).

Block-orthogonal rows with χ norms (``sampler="orthogonal"``): for two rows of one block,
$\|w_i + w_j\|^2 = \|w_i\|^2 + \|w_j\|^2 =: \rho^2 \sim \chi^2_{2d}$ and the direction of
$w_i + w_j$ is uniform and independent of $\rho$, so

$$
E X_iX_j = \Lambda^2 D^4\, E_\rho\Big[e^{2A\rho^2}\,{}_0F_1\big(;\tfrac d2;\tfrac{(1-4A)\rho^2 t}{4}\big)\Big]
= \Lambda^2\,{}_1F_1\big(d; \tfrac d2; \tfrac t2\big),
$$

independent of $A$ (the series in $E\rho^{2k}e^{2A\rho^2} = (1-4A)^{-d-k}2^k(d)_k$ sums
to FAVOR+'s pair moment) [DERIVED; MC-verified]. Hence
$\mathrm{MSE}^{\rm ort} = \frac{\mathrm{Var}X}{r} + \frac{P}{r^2}\Lambda^2({}_1F_1 - e^t)$ with
the pair count $P$ of `kernelapprox.theory.orf_pair_count`.

SADERF is OPRF on $(\Psi x, \Psi^{-1} y)$: the same formulas on the scaled pair. SDERF is a
product over the eigen-directions $l$ of one-dimensional OPRFs with parameters $A_l$ on
$z' = Q^\top z$:

$$
E X^2 = \Lambda^2 \prod_l \frac{1-4A_l}{\sqrt{1-8A_l}}\exp\Big(\frac{2(1-4A_l)}{1-8A_l}z_l'^2\Big)
$$

(iid rows only: with orthogonal rows the anisotropic quadratic term breaks the rotation
invariance used above, and no closed form is given).

All values are float64, from a log scale and an $O(1)$ bracket (as in
`kernelapprox.theory.moments`).

References
----------
- [LCD22] V. Likhosherstov et al. "Chefs' Random Tables: Non-Trigonometric Random Features",
   NeurIPS 2022, arXiv:2205.15317.
- [LCD23] V. Likhosherstov et al. "Dense-Exponential Random Features: Sharp Positive Estimators
   of the Gaussian Kernel", NeurIPS 2023, arXiv:2302.00787.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernelapprox._validation import check_positive_int
from kernelapprox.registry import EstimatorTheory

from ._common import (
    Components,
    _check_r,
    _core_of,
    _deprecated_keywords,
    _finish,
    _Geometry,
    _geometry,
    _law_code,
    _out,
    _prepare,
)
from .exponential import positive_components

__all__ = [
    "oprf_optimal_A",
    "oprf_components",
    "oprf_mse",
    "sderf_components",
    "OPRF_THEORY",
    "SADERF_THEORY",
    "SDERF_THEORY",
]


def oprf_optimal_A(t: Any, d: int) -> np.ndarray:
    r"""$A^*(t, d) = \frac{d - 2t - \sqrt{(2t+d)^2 + 8dt}}{16d}$ (float64 array), the
    variance-optimal OPRF parameter at $t = \|x+y\|^2$ (see
    `kernelapprox.maps.dense_exponential.optimal_A`).

    Parameters
    ----------
    t : array_like
        $\|x + y\|^2 \ge 0$ (any shape).
    d : int
        Input dimension.

    Returns
    -------
    ndarray, float64, the shape of ``t``
        $A^* \in (-\infty, 0]$, computed as $-t / (d - 2t + \sqrt{(2t+d)^2 + 8dt})$ (the same
        value without cancellation).

    Examples
    --------
    >>> float(oprf_optimal_A(0.0, 64))
    -0.0
    """
    d = check_positive_int("d", d)
    t = np.asarray(t, dtype=np.float64)
    if not np.isfinite(t).all():
        raise ValueError(f"t must be finite, got {int((~np.isfinite(t)).sum())} non-finite entries "
                         f"(shape {t.shape})")
    S = np.sqrt((2 * t + d) ** 2 + 8 * d * t)
    return -t / (d - 2 * t + S)


def _log_second_moment(d: float, t: np.ndarray, A: np.ndarray) -> np.ndarray:
    """log(E X^2 / Lambda^2) of one OPRF term (per dimension count ``d``)."""
    one4 = 1.0 - 4.0 * A
    one8 = 1.0 - 8.0 * A
    return d * np.log(one4) - 0.5 * d * np.log(one8) + 2.0 * one4 / one8 * t


def oprf_components(geo: _Geometry, orthogonal: str | None, A: Any = None) -> Components:
    r"""`kernelapprox.theory.moments.Components` of OPRF with parameter ``A``.

    ``A`` broadcasts against the ``(..., n, m)`` pair arrays; ``None`` takes each pair's own
    optimum $A^*(\|x+y\|^2, d)$ (the estimator tuned at that pair, as in the CRT
    variance comparisons). ``orthogonal`` is ``None`` (iid) or ``"chi"``.
    """
    if orthogonal not in (None, "chi"):
        raise NotImplementedError(f"OPRF has closed forms for iid and chi-norm orthogonal rows, not {orthogonal!r}")
    d, t = geo.d, geo.t
    A = oprf_optimal_A(t, d) if A is None else np.asarray(A, dtype=np.float64)
    if np.any(A >= 0.125):
        raise ValueError("A must be < 1/8 for a finite variance")
    L = _log_second_moment(d, t, A)  # log E X^2 / Lambda^2
    L, t_b = np.broadcast_arrays(L, t)
    scale = -(geo.nx + geo.ny) + L
    # Var X / exp(scale) = 1 - e^{t - L}
    v1 = -np.expm1(t_b - L)
    cv = np.zeros_like(v1)
    if orthogonal == "chi":
        # pair covariance Lambda^2 (1F1(d; d/2; t/2) - e^t), independent of A: FAVOR+'s cv is
        # normalised by Lambda^2 e^{2t}; renormalise by Lambda^2 e^{L}
        pos = positive_components(geo, "chi")
        cv = np.broadcast_to(pos.cv * np.exp(2.0 * t - L), v1.shape).copy()
    shape = v1.shape
    return Components(
        np.broadcast_to(scale, shape), v1, cv, np.zeros(shape),
        np.broadcast_to(geo.xy, shape), np.broadcast_to(geo.s, shape), np.broadcast_to(t_b, shape),
    )


@_deprecated_keywords(orthogonal="row_law")
def oprf_mse(q: Any, k: Any, num_features: int, *, A: Any = None, row_law: str = "iid") -> Any:
    r"""MSE (= variance: OPRF is unbiased) of every entry of an OPRF estimate of $e^{q^\top k}$.

    $$
    \mathrm{MSE} = \frac{e^{-\|x\|^2-\|y\|^2}}{r}\Big[(1-4A)^d(1-8A)^{-d/2}
    e^{\frac{2(1-4A)t}{1-8A}} - e^t\Big] + \frac{P}{r^2}e^{-\|x\|^2-\|y\|^2}
    \big[{}_1F_1(d;\tfrac d2;\tfrac t2) - e^t\big]
    $$

    ($P = 0$ for iid rows; see the module docstring). ``A = 0`` gives
    `kernelapprox.theory.positive_mse`.

    Parameters
    ----------
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``.
    A : float or array, optional
        Broadcasts against ``(..., n, m)``; default: each pair's optimum $A^*(t)$.
    row_law : {"iid", "orthogonal-chi"}, default "iid"
        iid rows, or block-orthogonal rows with χ norms (the former ``orthogonal={None, "chi"}``
        is deprecated).

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import numpy as np
    >>> from kernelapprox.theory import positive_mse
    >>> x = np.full((1, 64), 0.15); y = np.full((1, 64), 0.1)
    >>> bool(oprf_mse(x, y, 256)[0, 0] < positive_mse(x, y, 256)[0, 0])
    True
    >>> bool(np.isclose(oprf_mse(x, y, 256, A=0.0)[0, 0], positive_mse(x, y, 256)[0, 0]))
    True
    """
    r = _check_r(num_features)
    orthogonal = _law_code(row_law)
    qa, ka, dev = _prepare(q, k)
    c = oprf_components(_geometry(qa, ka), orthogonal, A)
    return _out(_finish(_core_of(c, r, orthogonal, qa.shape[-1]), "mse"), dev)


def sderf_components(geo: _Geometry, orthogonal: str | None, tw: Any = None, L0: Any = None) -> Components:
    r"""`kernelapprox.theory.moments.Components` of SDERF (iid rows).

    ``tw`` is $\sum_l \frac{1-4A_l}{1-8A_l} z_l'^2$ per pair and ``L0`` is
    $\sum_l[\log(1-4A_l) - \frac12\log(1-8A_l)]$ (from a fitted map; see the module docstring).
    """
    if tw is None or L0 is None:
        raise NotImplementedError("SDERF's moments need a fitted map: call ka.theory.mse(fm, q, k) with fm.fit(...) done")
    if orthogonal is not None:
        raise NotImplementedError("SDERF has closed-form moments for iid rows only")
    t = geo.t
    L = np.asarray(L0)[..., None, None] + 2.0 * np.asarray(tw)
    L, t_b = np.broadcast_arrays(L, t)
    shape = L.shape
    scale = -(np.broadcast_to(geo.nx, shape) + np.broadcast_to(geo.ny, shape)) + L
    v1 = -np.expm1(t_b - L)
    return Components(scale, v1, np.zeros(shape), np.zeros(shape), np.broadcast_to(geo.xy, shape),
                      np.broadcast_to(geo.s, shape), t_b)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float64).numpy()


def _oprf_prepare(fm: Any, qa: np.ndarray, ka: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    return qa, ka, {"A": _np(fm.A_)[..., None, None]}


def _saderf_prepare(fm: Any, qa: np.ndarray, ka: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    psi = _np(fm.psi_)[..., None, :]  # (..., 1, d)
    return qa * psi, ka / psi, {"A": _np(fm.A_)[..., None, None]}


def _sderf_prepare(fm: Any, qa: np.ndarray, ka: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    A = _np(fm.A_)  # (*fb, d)
    Q = _np(fm.Q_)  # (*fb, d, d)
    kappa = (1.0 - 4.0 * A) / (1.0 - 8.0 * A)  # (*fb, d)
    u = qa @ Q  # (..., n, d): rows Q^T x
    v = ka @ Q
    kap = kappa[..., None, :]
    tw = (
        np.einsum("...nd,...nd->...n", u * kap, u)[..., :, None]
        + np.einsum("...md,...md->...m", v * kap, v)[..., None, :]
        + 2.0 * (u * kap) @ np.swapaxes(v, -1, -2)
    )
    L0 = (np.log(1.0 - 4.0 * A) - 0.5 * np.log(1.0 - 8.0 * A)).sum(-1)
    return qa, ka, {"tw": tw, "L0": L0}


_LAWS = frozenset({"iid", "orthogonal-chi"})

OPRF_THEORY = EstimatorTheory(components=oprf_components, row_laws=_LAWS, prepare=_oprf_prepare)
SADERF_THEORY = EstimatorTheory(components=oprf_components, row_laws=_LAWS, prepare=_saderf_prepare)
SDERF_THEORY = EstimatorTheory(components=sderf_components, row_laws=frozenset({"iid"}), prepare=_sderf_prepare)
