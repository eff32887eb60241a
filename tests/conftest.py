"""Shared helpers for the core test suite.

Statistical tests in this suite
-------------------------------
Every Monte Carlo check uses the same statistic.  For ``S`` independent draws ``X_1..X_S`` of an
estimator of a known value ``K`` (one draw per element of ``batch_shape=(S,)``),

    z = (mean(X) - K) / se,      se = std(X, ddof=1) / sqrt(S)   (the *sample* standard error)

and we require ``|z| < Z_MAX``.  Under the null (estimator unbiased) and for ``S`` large enough that
the mean is close to normal, ``z`` is approximately N(0, 1).

Choice of ``Z_MAX = 4.5``: P(|N(0,1)| > 4.5) = 6.8e-6.  The suite makes fewer than ~150 such
z-checks in total, so by Bonferroni the family-wise false-alarm probability for a *fresh* choice of
seeds is below 150 * 6.8e-6 = 1e-3.  All seeds are fixed, so the suite is deterministic anyway;
the threshold only says how surprising a failure would be.

To keep the normal approximation honest, checks are only made where the estimator's variance is
finite and its distribution not too heavy-tailed (for positive/hyperbolic features
``|q + k|^2 <= 2``: per-feature log-normal with sigma^2 <= 2, skewness <= 24, so the skewness of a
mean over ``S * r >= 1e5`` features is < 0.08).  Large *norms* are still tested, with ``q`` and
``k`` nearly opposite (positive features) or nearly equal (trigonometric features), which is where
each estimator is accurate.  Every check also asserts that ``se`` is small relative to ``K`` so the
test has power (a vacuous check with a huge ``se`` cannot pass silently).
"""

from __future__ import annotations

import math

import pytest
import torch

Z_MAX = 4.5
F64 = torch.float64


def zscores(draws: torch.Tensor, target: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """z-statistic and sample standard error of the mean over dim 0 of ``draws`` (S, ...)."""
    draws = draws.to(F64)
    S = draws.shape[0]
    mean = draws.mean(0)
    se = draws.std(0, unbiased=True) / math.sqrt(S)
    target = torch.as_tensor(target, dtype=F64)
    return (mean - target) / se, se


def orthonormal(d: int, k: int, seed: int) -> torch.Tensor:
    """``k`` orthonormal vectors in R^d (rows), float64, deterministic."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, k, generator=g, dtype=F64)
    Q, R = torch.linalg.qr(A)
    Q = Q * torch.sign(torch.diagonal(R)).unsqueeze(0)
    return Q.T.contiguous()


def randn(*shape, seed: int, dtype=F64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


def with_norm(x: torch.Tensor, norm: float) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True) * norm


def lin_attn_ref(phq: torch.Tensor, phk: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Quadratic-form linear attention by hand: A = phi(q) phi(k)^T (masked), out = A v / A 1."""
    A = phq @ phk.mT
    if causal:
        n, m = A.shape[-2:]
        A = A * torch.ones(n, m, dtype=torch.bool).tril()
    return (A @ v) / A.sum(-1, keepdim=True)


def softmax_attn_ref(q, k, v, causal: bool) -> torch.Tensor:
    s = q @ k.mT
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.fixture(autouse=True)
def _few_threads():
    """The suite is sized for 2 CPU cores; keep torch from oversubscribing."""
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    yield
    torch.set_num_threads(old)
