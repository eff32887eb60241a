"""SDERF's orientation, a guard independent of the kernel tests: the fitted ``Q_`` diagonalises
the statistic it is computed from, and each ``A_l`` is the one-dimensional optimum at the
eigenvalue of its own column.

With $P = M_x + M_y + \\mu_x\\mu_y^\\top + \\mu_y\\mu_x^\\top$ (recomputed here in float64
NumPy from the data, not from the library), $Q^\\top P Q = \\mathrm{diag}(\\sigma)$ to rounding
(1e-10 of $\\|P\\|$), $Q^\\top Q = I$, and $A_l = A^*(\\sigma_l, 1)$ with
$A^*(t, 1) = (1 - 2t - \\sqrt{(2t+1)^2 + 8t})/16$. A map using $Q$ (instead of $Q^\\top$), a
permuted $A$, or the statistic of one side only fails.
"""

from __future__ import annotations

import numpy as np
import torch

import kernelapprox as ka


def _P(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    mx, my = q.mean(0), k.mean(0)
    return q.T @ q / len(q) + k.T @ k / len(k) + np.outer(mx, my) + np.outer(my, mx)


def _A_star(t: np.ndarray) -> np.ndarray:
    return (1 - 2 * t - np.sqrt((2 * t + 1) ** 2 + 8 * t)) / 16


def _data(seed: int, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5  # correlated coordinates
    q = torch.randn(40, d, generator=g, dtype=torch.float64) @ mix + 0.3
    k = torch.randn(50, d, generator=g, dtype=torch.float64) @ mix.T * 0.7
    return q, k


def test_fitted_Q_diagonalises_the_fitted_statistic():
    for seed in range(4):
        q, k = _data(seed)
        fm = ka.SDERF(6, 16, seed=0, dtype=torch.float64).fit(q, k)
        P = _P(q.numpy(), k.numpy())
        Q, A = fm.Q_.numpy(), fm.A_.numpy()
        D = Q.T @ P @ Q
        off = D - np.diag(np.diag(D))
        assert np.abs(off).max() <= 1e-10 * np.abs(P).max()
        np.testing.assert_allclose(Q.T @ Q, np.eye(6), atol=1e-12)
        np.testing.assert_allclose(A, _A_star(np.diag(D)), rtol=1e-10, atol=1e-14)


def test_orientation_guard_catches_a_transposed_or_permuted_fit():
    """The assertions above fail for the plausible mistakes (so the guard has power)."""
    q, k = _data(0)
    fm = ka.SDERF(6, 16, seed=0, dtype=torch.float64).fit(q, k)
    P = _P(q.numpy(), k.numpy())
    Q, A = fm.Q_.numpy(), fm.A_.numpy()
    D_t = Q @ P @ Q.T  # Q used as Q^T
    assert np.abs(D_t - np.diag(np.diag(D_t))).max() > 1e-3 * np.abs(P).max()
    sigma = np.diag(Q.T @ P @ Q)
    assert np.abs(A[::-1] - _A_star(sigma)).max() > 1e-3  # A paired with the wrong columns
    P_q = _P(q.numpy(), np.zeros_like(k.numpy()))  # the statistic of the queries alone
    D_q = Q.T @ P_q @ Q
    assert np.abs(D_q - np.diag(np.diag(D_q))).max() > 1e-3 * np.abs(P_q).max()
