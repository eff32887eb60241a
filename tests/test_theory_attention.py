r"""Delta-method attention variance (``kernelapprox.theory.attention``) against Monte Carlo.

What is checked and how the tolerances are derived
--------------------------------------------------
1. **Pair covariances** :math:`\mathrm{Cov}(\hat K_{ij},\hat K_{il})` (exact, DERIVED). With S
   independent draws, the sample covariance :math:`\hat C_{jl}` is the mean of
   :math:`Y_s=(\hat K_{sj}-\bar K_j)(\hat K_{sl}-\bar K_l)`; its standard error is
   :math:`\mathrm{sd}(Y)/\sqrt S` (estimated from the draws: a fourth-moment quantity). We require
   :math:`|z|<4.5` for every entry (P(|N(0,1)|>4.5)=6.8e-6; ~150 checks in this file) and a
   power guard per entry, ``se < 0.1 * max(|Cov|, 5 % of the largest)``: an error of 45 % of an
   entry (2.3 % of the largest covariance for entries below 5 % of it) shifts z by 4.5. That is
   coarse on purpose -- a product of two centred estimates has ``sd(Y) >= |Cov| / |corr|``, so
   relative resolution of weakly correlated entries costs ~1/corr^2 draws. S = 6e4; measured over
   20 base seeds: max se/scale 0.009 (offset) to 0.07 (hyperbolic, sin/cos). (At S = 2e4 a seed
   sweep had 3 of 20 seeds fail this *guard* at 0.11-0.12, never the z-check.) The diagonal (the
   pointwise variance) is resolved to 5 % by ``test_mse_monte_carlo.py``. Inputs have
   :math:`\|q+k\|^2\le1` so the log-normal terms are light enough for the CLT on these draws.
2. **Normaliser relative variance** :math:`\mathrm{Var}(\hat D_i)/D_i^2` (exact): same z-check,
   resolving a 5 % error in the formula (``se <= 0.011 * Var``, 4.5 se <= 5 %), S = 5e4. Inputs
   have norm 0.4 (:math:`\|q+k\|^2\le0.64`): the se of a variance estimate needs the eighth
   moment of the log-normal terms (a factor :math:`e^{24t}`); at norm 0.5 one of 20 base seeds gave
   se/Var = 0.017 for hyperbolic features (a rare large draw) against 0.009-0.011 for the others,
   at norm 0.4 the 20 seeds give 0.006-0.0094.
3. **Delta-method variance** of each output coordinate (an *approximation*): the issue asks for
   agreement within 10% where q, k are attention-scaled and r >= 64. The Monte Carlo variance
   :math:`\hat V` has its own error: :math:`\mathrm{se}(\hat V)\approx\sqrt{(m_4-m_2^2)/S}` from the
   fourth central moment (``variance_se`` of :func:`kernelapprox.montecarlo.attention_error`). We
   require, per coordinate,

   .. math:: |V_\delta-\hat V|\le0.10\,\hat V+3\,\mathrm{se}(\hat V),

   with S large enough that :math:`\mathrm{se}/\hat V\le3\%` (asserted), so the 3-se slack is at
   most 9% and the check cannot pass vacuously. The inputs are attention-scaled:
   :math:`\tilde q=x/d^{1/4}` with raw rows :math:`x` of norm :math:`\rho d^{1/4}`, i.e.
   :math:`\|\tilde q\|=\|\tilde k\|=\rho`. The delta method needs :math:`\hat D_i/D_i` to
   concentrate: the tests use :math:`\rho=0.5` (r=64, all four estimators, causal and not) and
   :math:`\rho=0.75` (positive, r=256). At :math:`\rho=1` positive features are still 4-35% high
   at r=256, and at :math:`\rho=1.5` first order fails by factors for every r we tried (see
   ``docs/theory.md``); ``test_first_order_fails_when_normaliser_spreads`` pins that regime down
   as a true statement (delta over-states the variance by > 2x), not as a pass.

Measured (d=16, n=m=8, S=10000): delta/MC within 0.935-1.045 at rho=0.5, r=64 (all maps,
causal and not; offset trig is the lowest) and 0.99-1.08 at rho=0.75, r=256 (positive).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import seed

import kernelapprox as ka
from kernelapprox.montecarlo import attention_error, batched_draws
from kernelapprox.theory.attention import (
    attention_variance,
    kernel_covariance,
    normaliser_relative_variance,
)

F64 = torch.float64
Z_MAX = 4.5


def scaled_inputs(d: int, n: int, m: int, dv: int, rho: float, seed: int):
    """Attention-scaled q, k (rows of norm rho after dividing by d**0.25) and values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=F64)
    y = torch.randn(m, d, generator=g, dtype=F64)
    x = x / x.norm(dim=-1, keepdim=True) * rho * d**0.25
    y = y / y.norm(dim=-1, keepdim=True) * rho * d**0.25
    v = torch.randn(m, dv, generator=g, dtype=F64)
    return x / d**0.25, y / d**0.25, v


def make(kind: str, d: int, r: int, **kw):
    if kind == "positive":
        return ka.PositiveRF(d, r, seed=0, **kw)
    if kind == "hyperbolic":
        return ka.HyperbolicRF(d, r, seed=0, **kw)
    return ka.get_estimator(kind).build(d, r, sampler="gaussian", seed=0, **kw)  # iid: the theory's rows


KINDS = ["positive", "hyperbolic", "trig-sincos", "trig-offset"]


def kernel_draws(fm, q, k, draws: int, stream: int) -> torch.Tensor:
    return torch.cat([c.kernel(q, k) for c in batched_draws(fm, draws, seed=seed(stream), chunk_size=8000)])


@pytest.mark.statistical
@pytest.mark.parametrize("kind", KINDS)
def test_pair_covariance_matches_monte_carlo(kind):
    d, r, S = 4, 8, 60_000
    q, k, _ = scaled_inputs(d, 2, 5, 1, rho=0.5, seed=seed(703))
    fm = make(kind, d, r)
    Kh = kernel_draws(fm, q, k, S, stream=710 + KINDS.index(kind))[:, 0, :]  # (S, m): entries sharing q_0
    c = Kh - Kh.mean(0)
    prod = c[:, :, None] * c[:, None, :]  # (S, m, m)
    emp = prod.sum(0) / (S - 1)
    se = prod.std(0) / math.sqrt(S)
    th = kernel_covariance(fm, q, k)[0]
    z = (emp - th) / se
    # Power guard, per entry: se < 0.1 * max(|th|, FLOOR * max|th|), so an error of 4.5 se = 45 % of
    # |th| shifts z by Z_MAX (coarse: see the module docstring). Some covariances are ~0 (sincos: an
    # entry at 2e-5 of the largest -- the two estimates are nearly uncorrelated), where a relative
    # resolution is meaningless and unattainable; for entries below FLOOR = 5% of the largest we
    # instead require an absolute resolution of 0.5% of the largest covariance, so an error of
    # more than 4.5 se ~ 2.3% of the largest covariance is still detected there.
    FLOOR = 0.05
    scale = torch.clamp(th.abs(), min=FLOOR * th.abs().max())
    assert (se < 0.1 * scale).all(), f"{kind}: MC too noisy, max se/scale = {(se / scale).max():.3f}"
    assert z.abs().max() < Z_MAX, f"{kind}: max |z| = {z.abs().max():.2f}"
    # the diagonal is the pointwise variance of the other theory module
    diag = torch.diagonal(kernel_covariance(fm, q, k), dim1=-2, dim2=-1)
    torch.testing.assert_close(diag, torch.as_tensor(ka.theory.variance(fm, q, k), dtype=F64),
                               rtol=1e-9, atol=0.0)


@pytest.mark.statistical
@pytest.mark.parametrize("kind", KINDS)
def test_normaliser_relative_variance_matches_monte_carlo(kind):
    d, r, S = 8, 16, 50_000
    q, k, _ = scaled_inputs(d, 4, 6, 1, rho=0.4, seed=seed(704))  # rho: module docstring, item 2
    fm = make(kind, d, r)
    D = kernel_draws(fm, q, k, S, stream=720 + KINDS.index(kind)).sum(-1)  # (S, n)
    Dex = torch.exp(q @ k.T).sum(-1)
    c = (D - D.mean(0)) ** 2
    emp, se = c.mean(0) * S / (S - 1), c.std(0) / math.sqrt(S)
    th = normaliser_relative_variance(fm, q, k) * Dex**2
    assert (se <= 0.05 / Z_MAX * th).all(), (se / th).max()  # a 5 % error shifts z by Z_MAX
    z = (emp - th) / se
    assert z.abs().max() < Z_MAX, f"{kind}: max |z| = {z.abs().max():.2f}"


CASES = [
    ("positive", 0.5, 64, False),
    ("hyperbolic", 0.5, 64, False),
    ("trig-sincos", 0.5, 64, False),
    ("trig-offset", 0.5, 64, False),
    ("positive", 0.5, 64, True),
    ("trig-sincos", 0.5, 64, True),
    ("positive", 0.75, 256, False),
]


@pytest.mark.statistical
@pytest.mark.parametrize(("kind", "rho", "r", "causal"), CASES)
def test_delta_method_within_ten_percent(kind, rho, r, causal):
    d, n, dv, S = 16, 8, 2, 10_000
    q, k, v = scaled_inputs(d, n, n, dv, rho=rho, seed=seed(705))
    fm = make(kind, d, r)
    res = attention_error(fm, q, k, v, draws=S, causal=causal, seed=seed(730 + CASES.index((kind, rho, r, causal))),
                          quantiles=(0.5,))
    delta = attention_variance(fm, q, k, v, causal=causal).numpy()
    mc, se = res["variance"], res["variance_se"]
    if causal:  # row 0 attends to one key only: o_0 = v_0 exactly, variance 0 both ways
        assert abs(delta[0]).max() == 0.0 and abs(mc[0]).max() < 1e-20
        delta, mc, se = delta[1:], mc[1:], se[1:]
    assert (se <= 0.03 * mc).all(), f"MC relative se {(se / mc).max():.3f} > 3%"
    ratio = delta / mc
    assert (abs(delta - mc) <= 0.10 * mc + 3 * se).all(), (
        f"{kind} rho={rho} r={r}: delta/MC in [{ratio.min():.3f}, {ratio.max():.3f}]"
    )
    # the regime is the one the docs call safe: the normaliser concentrates
    assert normaliser_relative_variance(fm, q, k, causal=causal).max() < 0.1


@pytest.mark.statistical
def test_first_order_fails_when_normaliser_spreads():
    """rho = 1.5, r = 16: Var(D)/D^2 is of order 1 and the delta method over-states the variance
    of the (bounded) positive-feature output by more than 2x everywhere. A documented failure,
    asserted as such so that the docs' claim stays true."""
    d, n, dv, S, r = 16, 8, 2, 6000, 16
    q, k, v = scaled_inputs(d, n, n, dv, rho=1.5, seed=seed(705))
    fm = make("positive", d, r)
    res = attention_error(fm, q, k, v, draws=S, seed=seed(740), quantiles=(0.5,))
    delta = attention_variance(fm, q, k, v).numpy()
    assert (res["variance_se"] <= 0.05 * res["variance"]).all()
    assert (delta > 2 * (res["variance"] + 3 * res["variance_se"])).all()
    assert normaliser_relative_variance(fm, q, k).min() > 0.5


def test_shapes_broadcasting_and_batch_consistency():
    d, r = 8, 32
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, d, generator=g, dtype=F64) / 3
    k = torch.randn(2, 1, 6, d, generator=g, dtype=F64) / 3
    v = torch.randn(6, 4, generator=g, dtype=F64)
    fm = ka.PositiveRF(d, r, seed=0)
    out = attention_variance(fm, q, k, v)
    assert out.shape == (2, 3, 5, 4) and out.dtype == F64
    one = attention_variance(fm, q[1, 2], k[1, 0], v)
    torch.testing.assert_close(out[1, 2], one, rtol=1e-12, atol=0.0)
    assert normaliser_relative_variance(fm, q, k).shape == (2, 3, 5)
    assert kernel_covariance(fm, q[0, 0], k[0, 0]).shape == (5, 6, 6)
    # float32 inputs are promoted to float64
    assert attention_variance(fm, q[0, 0].float(), k[0, 0].float(), v.float()).dtype == F64


def test_row_blocks_do_not_change_the_result(monkeypatch):
    import kernelapprox.theory.attention as att

    q, k, v = scaled_inputs(8, 7, 7, 3, rho=0.5, seed=1)
    fm = ka.HyperbolicRF(8, 16, seed=0)
    full = attention_variance(fm, q, k, v, causal=True)
    monkeypatch.setattr(att, "_BLOCK_BYTES", 8 * 7 * 3 * 2)  # two query rows per block
    torch.testing.assert_close(attention_variance(fm, q, k, v, causal=True), full, rtol=1e-12, atol=0.0)


def test_scales_as_one_over_r_and_zero_for_constant_values():
    q, k, v = scaled_inputs(8, 4, 6, 2, rho=0.5, seed=2)
    a = attention_variance(ka.TrigRF(8, 16, seed=0), q, k, v)
    b = attention_variance(ka.TrigRF(8, 64, seed=0), q, k, v)
    torch.testing.assert_close(a, 4 * b, rtol=1e-12, atol=0.0)
    const = torch.ones(6, 2, dtype=F64) * 3.0
    assert attention_variance(ka.PositiveRF(8, 16, seed=0), q, k, const).abs().max() < 1e-12


def test_deterministic_maps_have_zero_variance():
    q, k, v = scaled_inputs(4, 3, 3, 2, rho=0.5, seed=0)
    assert attention_variance(ka.EluFeatures(4), q, k, v).abs().max() == 0.0
    assert normaliser_relative_variance(ka.ReluFeatures(4), q, k).abs().max() == 0.0


@pytest.mark.parametrize(
    "fm",
    [
        ka.PositiveRF(4, 8, sampler="orthogonal", seed=0),
        ka.TrigRF(4, 8, sampler="structured", seed=0),
        ka.HyperbolicRF(4, 8, sampler="qmc", seed=0),
        ka.PositiveRF.from_projection(torch.randn(8, 4)),
    ],
)
def test_non_gaussian_samplers_point_to_montecarlo(fm):
    q, k, v = scaled_inputs(4, 3, 3, 2, rho=0.5, seed=0)
    with pytest.raises(NotImplementedError, match="montecarlo"):
        attention_variance(fm, q, k, v)
    with pytest.raises(NotImplementedError, match="montecarlo"):
        kernel_covariance(fm, q, k)


def test_bad_inputs():
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = scaled_inputs(4, 3, 5, 2, rho=0.5, seed=0)
    with pytest.raises(ValueError, match="dim=4"):
        attention_variance(fm, q[:, :3], k, v)
    with pytest.raises(ValueError, match="v must have shape"):
        attention_variance(fm, q, k, v[:4])
    with pytest.raises(ValueError, match="causal"):
        attention_variance(fm, q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        attention_variance(fm, q, k, v, causal=1)
    with pytest.raises(TypeError, match="floating"):
        attention_variance(fm, q.long(), k, v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        attention_variance(fm, q.numpy(), k, v)
