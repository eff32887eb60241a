r"""Closed-form error of hybrid attention (``kernelapprox.theory.hybrid_attention``) against Monte Carlo.

What is checked and how the tolerances are derived
--------------------------------------------------
1. **Kernel level** (exact formulas): :math:`\mathrm{Var}(\hat D_i)` and
   :math:`\mathrm{Var}(\hat N_{ic})` for the four Gaussian-sampler maps with pair terms, with a
   window and sinks, causal and not. With S independent draws the sample variance is the mean of
   :math:`Y_s=(\hat D_s-\bar D)^2` (times S/(S-1)); its standard error is
   :math:`\mathrm{sd}(Y)/\sqrt S` (estimated from the same draws: a fourth-moment quantity, valid
   by the CLT for S in the tens of thousands at these light-tailed inputs, :math:`\|q\|=\|k\|=0.4`).
   We require :math:`|z|<4.5` per query (P(|N(0,1)|>4.5)=6.8e-6 per check; ~100 checks here) and a
   power guard ``se <= 0.05 / 4.5 * Var``: a 5 % error in the formula shifts z by 4.5, so it is
   detected. The *planted* errors (the sum over every attended key, as full random-feature
   attention has, and the sum over the remainder without the :math:`-D_R^2` term) must give
   :math:`|z| > 4.5` at some query: the test can fail.
2. **Delta method** (an approximation, first order in :math:`\hat D_i/D_i-1`): as for full
   random-feature attention (``tests/test_theory_attention.py``) we require, per coordinate,
   :math:`|V_\delta-\hat V|\le0.10\,\hat V+3\,\mathrm{se}(\hat V)` with
   :math:`\mathrm{se}(\hat V)=\mathrm{sd}((\hat o-\bar o)^2)/\sqrt S` and S large enough that
   :math:`\mathrm{se}/\hat V\le3\%` (asserted), at :math:`\rho=0.5`, r = 64 where the normaliser
   concentrates (asserted: relative variance < 0.1).
3. **Deterministic maps**: MSE = squared bias over the remainder, checked exactly against the
   materialised estimate.
4. **The error identity**: exact algebra, checked to 1e-12 against the fast hybrid form for a
   random map (any remainder error :math:`\delta`), by construction with :math:`\delta=0`, and with a
   Nyström map whose landmarks are the remainder keys (error 0).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import seed

import kernelapprox as ka
from kernelapprox.attention.hybrid import exact_set_mask, hybrid_attention
from kernelapprox.montecarlo import batched_draws
from kernelapprox.theory.attention import attention_variance, normaliser_relative_variance
from kernelapprox.theory.hybrid_attention import (
    exact_mass,
    hybrid_attention_variance,
    hybrid_error_identity,
    hybrid_normaliser_mse,
    hybrid_normaliser_variance,
    hybrid_numerator_mse,
    hybrid_numerator_variance,
)

F64 = torch.float64
Z_MAX = 4.5
KINDS = ["positive", "hyperbolic", "trig-sincos", "trig-offset"]
CONFIGS = [  # (window, sinks, causal)
    (2, [0], False),
    (3, [0, 5], True),
]


def scaled_inputs(d: int, n: int, dv: int, rho: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.randn(n, d, generator=g, dtype=F64)
    x = x / x.norm(dim=-1, keepdim=True) * rho
    y = y / y.norm(dim=-1, keepdim=True) * rho
    v = torch.randn(n, dv, generator=g, dtype=F64)
    return x, y, v


def make(kind: str, d: int, r: int):
    """The map of ``kind`` on iid rows (the delta-method theory's rows; random maps only)."""
    return ka.get_estimator(kind).build(d, r, sampler="gaussian", seed=0, dtype=F64)


def kernel_draws(fm, q, k, draws: int, stream: int) -> torch.Tensor:
    """(S, n, n) kernel estimates, one independent projection per draw (batch_shape (S,))."""
    return torch.cat([c.kernel(q, k) for c in batched_draws(fm, draws, seed=seed(stream), chunk_size=10_000)])


def hybrid_parts(Kh, q, k, window, sinks, causal):
    """Per-draw hybrid kernel matrix: exact on the exact set, estimate elsewhere, 0 where not attended."""
    n = q.shape[0]
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal)
    A = torch.where(S, torch.exp(q @ k.T), Kh)
    if causal:
        A = A.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), 0.0)
    return A


def z_scores(samples: torch.Tensor, th: torch.Tensor):
    """z of the sample variance (over dim 0) against ``th``, and its standard error."""
    S = samples.shape[0]
    c = (samples - samples.mean(0)) ** 2
    emp, se = c.mean(0) * S / (S - 1), c.std(0) / math.sqrt(S)
    return (emp - th) / se, se


@pytest.mark.statistical
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_level_variance_matches_monte_carlo(kind, config):
    window, sinks, causal = config
    d, n, r, S = 8, 8, 16, 50_000
    q, k, v = scaled_inputs(d, n, 2, rho=0.4, seed=seed(801))
    fm = make(kind, d, r)
    A = hybrid_parts(kernel_draws(fm, q, k, S, stream=810 + KINDS.index(kind) + 10 * CONFIGS.index(config)),
                     q, k, window, sinks, causal)  # (S, n, n)
    D = A.sum(-1)  # (S, n)
    N = A @ v  # (S, n, dv)
    kw = {"window": window, "sinks": sinks, "causal": causal}
    th_D = hybrid_normaliser_variance(fm, q, k, **kw)
    th_N = hybrid_numerator_variance(fm, q, k, v, **kw)
    rows = th_D > 0  # causal rows i < window (no remainder key but a sink): variance 0 both ways
    assert rows.sum() >= n // 2
    if not rows.all():
        assert (D[:, ~rows] == D[:1, ~rows]).all() and (th_N[~rows] == 0).all()
    for name, samples, th in (("D", D[:, rows], th_D[rows]), ("N", N[:, rows], th_N[rows])):
        z, se = z_scores(samples, th)
        assert (se <= 0.05 / Z_MAX * th).all(), f"{kind} {name}: MC too noisy, max se/Var = {(se / th).max():.4f}"
        assert z.abs().max() < Z_MAX, f"{kind} {name}: max |z| = {z.abs().max():.2f}"
    # planted errors must be detected: (a) the sum over every attended key (full random-feature
    # attention), (b) the remainder sum without the -D_R^2 term
    full = normaliser_relative_variance(fm, q, k, causal=causal) * torch.exp(
        torch.logsumexp((q @ k.T).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
                        if causal else q @ k.T, -1)) ** 2
    Rmask = ~exact_set_mask(n, window=window, sinks=sinks, causal=causal)
    if causal:
        Rmask &= torch.ones(n, n, dtype=torch.bool).tril()
    DR = (torch.exp(q @ k.T) * Rmask).sum(-1)
    no_square = th_D + DR**2 / fm.num_features
    for planted in (full, no_square):
        z, _ = z_scores(D[:, rows], planted[rows])
        assert z.abs().max() > Z_MAX


@pytest.mark.statistical
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("kind", ["positive", "trig-sincos"])
def test_delta_method_within_ten_percent(kind, config):
    window, sinks, causal = config
    d, n, dv, r, S = 16, 8, 2, 64, 20_000
    q, k, v = scaled_inputs(d, n, dv, rho=0.5, seed=seed(802))
    fm = make(kind, d, r)
    A = hybrid_parts(kernel_draws(fm, q, k, S, stream=850 + KINDS.index(kind) + 10 * CONFIGS.index(config)),
                     q, k, window, sinks, causal)
    o = (A @ v) / A.sum(-1, keepdim=True)  # (S, n, dv)
    c = (o - o.mean(0)) ** 2
    mc, se = c.mean(0) * S / (S - 1), c.std(0) / math.sqrt(S)
    delta = hybrid_attention_variance(fm, q, k, v, window=window, sinks=sinks, causal=causal)
    rows = delta[:, 0] > 0
    assert rows.sum() >= n // 2
    delta, mc, se = delta[rows], mc[rows], se[rows]
    assert (se <= 0.03 * mc).all(), f"MC relative se {(se / mc).max():.3f} > 3%"
    assert (abs(delta - mc) <= 0.10 * mc + 3 * se).all(), f"delta/MC in [{(delta / mc).min():.3f}, {(delta / mc).max():.3f}]"
    assert hybrid_normaliser_variance(fm, q, k, window=window, sinks=sinks, causal=causal, relative=True).max() < 0.1


def test_empty_exact_set_is_full_random_feature_attention():
    q, k, v = scaled_inputs(8, 10, 3, rho=0.6, seed=3)
    fm = make("positive", 8, 32)
    for causal in (False, True):
        torch.testing.assert_close(hybrid_attention_variance(fm, q, k, v, window=0, causal=causal),
                                   attention_variance(fm, q, k, v, causal=causal), rtol=1e-9, atol=1e-15)
        torch.testing.assert_close(hybrid_normaliser_variance(fm, q, k, window=0, causal=causal, relative=True),
                                   normaliser_relative_variance(fm, q, k, causal=causal), rtol=1e-9, atol=1e-15)


def test_full_window_has_no_error():
    q, k, v = scaled_inputs(8, 10, 3, rho=0.6, seed=4)
    fm = make("hyperbolic", 8, 32)
    for causal in (False, True):
        assert (hybrid_attention_variance(fm, q, k, v, window=10, causal=causal) == 0).all()
        assert (hybrid_normaliser_variance(fm, q, k, window=10, causal=causal) == 0).all()
        torch.testing.assert_close(exact_mass(q, k, window=10, causal=causal), torch.ones(10, dtype=F64))
        assert (exact_mass(q, k, window=0, causal=causal) == 0).all()


def test_exact_mass_is_the_softmax_mass_of_the_exact_set():
    q, k, _ = scaled_inputs(8, 12, 1, rho=1.0, seed=5)
    for causal in (False, True):
        A = ka.softmax_attention(q, k, torch.eye(12, dtype=F64), causal=causal)  # rows: attention weights
        S = exact_set_mask(12, window=3, sinks=[0, 7], causal=causal)
        torch.testing.assert_close(exact_mass(q, k, window=3, sinks=[0, 7], causal=causal), (A * S).sum(-1))


@pytest.mark.parametrize("name", ["taylor", "elu", "nystrom"])
def test_deterministic_mse_is_the_squared_remainder_bias(name):
    q, k, v = scaled_inputs(4, 12, 2, rho=0.8, seed=6)
    fm = ka.get_estimator(name).build(4, 4, seed=0, dtype=F64).fit(q, k)
    for causal in (False, True):
        kw = {"window": 3, "sinks": [0], "causal": causal}
        A = hybrid_parts(fm.kernel(q, k), q, k, 3, [0], causal)
        Aex = hybrid_parts(torch.exp(q @ k.T), q, k, 3, [0], causal)
        torch.testing.assert_close(hybrid_normaliser_mse(fm, q, k, **kw), (A.sum(-1) - Aex.sum(-1)) ** 2,
                                   rtol=1e-10, atol=1e-14)
        torch.testing.assert_close(hybrid_numerator_mse(fm, q, k, v, **kw), (A @ v - Aex @ v) ** 2,
                                   rtol=1e-10, atol=1e-14)


def _pieces(q, k, v, Kh, window, sinks, causal):
    """p, o_S, o_R, o_R_hat, delta from a materialised estimate Kh (n, n)."""
    n = q.shape[0]
    att = torch.ones(n, n, dtype=torch.bool)
    if causal:
        att = att.tril()
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal) & att
    R = att & ~S
    K = torch.exp(q @ k.T)
    KS, KR, KhR = K * S, K * R, Kh * R
    p = KS.sum(-1) / (K * att).sum(-1)
    o_S, o_R, o_Rh = (KS @ v) / KS.sum(-1, keepdim=True), (KR @ v) / KR.sum(-1, keepdim=True), (KhR @ v) / KhR.sum(-1, keepdim=True)
    return p, o_S, o_R, o_Rh, KhR.sum(-1) / KR.sum(-1) - 1, R


@pytest.mark.parametrize("causal", [False, True])
def test_error_identity_is_exact(causal):
    q, k, v = scaled_inputs(8, 16, 3, rho=1.0, seed=7)
    fm = ka.PositiveRF(8, 16, seed=1, dtype=F64)
    window, sinks = 3, [0, 9]
    out = hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal)
    o = ka.softmax_attention(q, k, v, causal=causal)
    p, o_S, o_R, o_Rh, delta, _ = _pieces(q, k, v, fm.kernel(q, k), window, sinks, causal)
    rows = slice(window + 1, None) if causal else slice(None)  # causal: early rows have no remainder
    assert delta[rows].abs().min() > 1e-3  # the general case: the remainder mass is not exact
    pred = hybrid_error_identity(p[rows], o_S[rows], o_R[rows], o_Rh[rows], delta[rows])
    torch.testing.assert_close(out[rows] - o[rows], pred, rtol=1e-10, atol=1e-12)
    # the first-order term alone is wrong when delta != 0: the identity is not vacuous
    assert ((out[rows] - o[rows]) - (1 - p[rows, None]) * (o_Rh[rows] - o_R[rows])).abs().max() > 1e-4


def test_error_identity_with_exact_remainder_mass():
    """delta = 0 by construction (the estimate rescaled per row to the exact remainder mass): the
    hybrid error is exactly (1 - p)(o_R_hat - o_R)."""
    q, k, v = scaled_inputs(8, 16, 3, rho=1.0, seed=8)
    fm = ka.PositiveRF(8, 16, seed=1, dtype=F64)
    window, sinks = 3, [0, 9]
    _, _, _, _, delta, R = _pieces(q, k, v, fm.kernel(q, k), window, sinks, False)
    Kh = fm.kernel(q, k) / (1 + delta[:, None])  # row sums over R now exact
    p, o_S, o_R, o_Rh, delta0, _ = _pieces(q, k, v, Kh, window, sinks, False)
    assert delta0.abs().max() < 1e-12
    A = hybrid_parts(Kh, q, k, window, sinks, False)
    err = (A @ v) / A.sum(-1, keepdim=True) - ka.softmax_attention(q, k, v)
    torch.testing.assert_close(err, (1 - p[:, None]) * (o_Rh - o_R), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(err, hybrid_error_identity(p, o_S, o_R, o_Rh), rtol=1e-10, atol=1e-13)
    assert err.abs().max() > 1e-3


def test_nystrom_on_the_remainder_keys_is_exact():
    """Sinks only (no window): every query has the same remainder, the non-sink keys; Nyström with
    those keys as landmarks estimates each of them exactly, so the hybrid is softmax attention."""
    q, k, v = scaled_inputs(4, 12, 3, rho=0.8, seed=9)
    sinks = [0, 5]
    rem = [j for j in range(12) if j not in sinks]
    fm = ka.NystromFeatures(4, landmarks=k[rem].clone(), dtype=F64)
    out = hybrid_attention(q, k, v, fm, window=0, sinks=sinks)
    torch.testing.assert_close(out, ka.softmax_attention(q, k, v), rtol=1e-7, atol=1e-8)
    p = exact_mass(q, k, window=0, sinks=sinks)
    assert (p > 0.05).all() and (p < 0.95).all()


def test_bad_inputs():
    q, k, v = scaled_inputs(4, 6, 2, rho=0.5, seed=10)
    with pytest.raises(NotImplementedError, match="gaussian"):
        hybrid_normaliser_variance(ka.PositiveRF(4, 8, sampler="orthogonal", seed=0), q, k, window=2)
    with pytest.raises(ValueError, match="as many queries as keys"):
        hybrid_attention_variance(make("positive", 4, 8), q[:3], k, v, window=2)
    with pytest.raises(ValueError, match="window"):
        exact_mass(q, k, window=-1)
    with pytest.raises(TypeError, match="causal"):
        exact_mass(q, k, window=1, causal="yes")
