r"""Unbiasedness of every random estimator under every sampler that claims it, to a resolution of 1 %.

The statistic (see ``conftest.py``): ``S`` independent draws of the whole estimator (one projection
-- and offsets -- per element of ``batch_shape``), ``z = (mean - K) / se`` with
``se = std(ddof=1) / sqrt(S)`` and ``K = exp(q.k)``, and ``|z| < Z_MAX = 4.5``.

Power (derivation of the guard ``se <= 0.0022 K``). If the estimator had a relative bias ``b``,
``E z = b K / se``. Requiring ``se <= 0.01 K / Z_MAX = 0.00222 K`` makes a bias of 1 % shift ``z``
by at least ``Z_MAX``, so it fails the check with probability >= 1/2; with the measured ``se``
(at most 0.00185 K over all estimators, samplers and pairs; 0.0001-0.0009 K for most) the shift is
>= 5.4 and a 1 % bias fails with probability >= 0.8, a 1.5 % bias with probability > 0.999. The
guard is asserted at every (q, k) pair, so a check cannot pass vacuously.

Sizing. ``Var(K_hat) / K^2 = v / r`` with ``v`` the per-projection relative variance, so
``se / K = sqrt(v / (r S))`` and the guard needs ``r S >= v / 0.0022^2``. The pairs are chosen with
``v <= 2.7`` (iid rows; orthogonal rows are lower): positive-type maps at ``|q + k|^2 <= 1.28``,
trigonometric maps at ``|q - k|^2 <= 1.28``, plus large norms (``|q|, |k|`` up to 5, ``K`` from
``e^-25`` to ``e^25``) where each map is accurate (``q ~ -k`` for positive features, ``q ~ k`` for
trigonometric ones). Pairs with ``v ~ 25`` (trig at ``q = -k``) would need ten times the draws.
Which set a map gets is read from the registry (``Estimator.positive``), not from class names.

* iid / orthogonal rows: ``r = 8`` at ``d = 5`` (two orthogonal blocks, the second partial),
  ``S = 100 000`` (``r S = 8e5``), vectorised in chunks.
* QMC, ``randomization="scramble"``: scipy scrambles one draw at a time (~0.3-1 ms each), so few
  draws with many rows: ``r = 1024``, ``S = 640``. QMC lowers the variance of the projection part
  by 5-100x; the random phases of the offset variant are plain iid uniforms and keep ``v ~ 2``.
* QMC, ``randomization="shift"``: vectorised; ``r = 256``, ``S = 3000``.

Normal approximation. Each ``z`` is a mean of ``S >= 640`` iid draws, each itself an average of
``r`` terms; for the positive-type maps the terms are log-normal with ``sigma^2 = |q+k|^2 <= 1.28``
(skewness <= 6.6, so the skewness of the mean of ``r S >= 6e5`` terms is < 0.01).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
from conftest import F64, Z_MAX, orthonormal, seed, zscores
from scipy.special import hyp0f1

import kernelapprox as ka
from kernelapprox.samplers import (
    SAMPLERS,
    GivenSampler,
    OrthogonalSampler,
    QMCSampler,
    Sampler,
    SimplexSampler,
    StructuredSampler,
)

D = 5
BIAS_RESOLUTION = 0.01  # relative bias that must shift z by Z_MAX
SE_GUARD = BIAS_RESOLUTION / Z_MAX  # 0.00222


@dataclass(frozen=True)
class Config:
    sampler: Sampler
    r: int
    S: int
    chunk: int


UNBIASED = {
    "gaussian": Config(ka.get_sampler("gaussian"), r=8, S=100_000, chunk=25_000),
    "orthogonal_chi": Config(OrthogonalSampler(norms="chi"), r=8, S=100_000, chunk=25_000),
    "qmc_sobol_scramble": Config(QMCSampler("sobol", "scramble"), r=1024, S=640, chunk=160),
    "qmc_halton_scramble": Config(QMCSampler("halton", "scramble"), r=1024, S=640, chunk=160),
    "qmc_sobol_shift": Config(QMCSampler("sobol", "shift"), r=256, S=3000, chunk=1000),
    "qmc_halton_shift": Config(QMCSampler("halton", "shift"), r=256, S=3000, chunk=1000),
    "simplex": Config(SimplexSampler(), r=8, S=100_000, chunk=25_000),
    "simplex_plus": Config(SimplexSampler(plus=True), r=8, S=100_000, chunk=25_000),
}
RANDOM = [e.name for e in ka.estimators(random=True)]


#: Pair sets by estimator where neither the positive nor the trigonometric set fits: hybrid
#: features are accurate near theta = 0 and pi (where they reduce to the trigonometric resp.
#: hyperbolic part) but carry both parts' variance in between, so only moderate norms.
PAIR_SET = {"hybrid": "angular"}


def pair_set(est: ka.Estimator) -> str:
    return PAIR_SET.get(est.name, "positive" if est.positive else "signed")


def pairs(kind: str | bool, stream: int) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(q_i, k_i) test pairs in R^D built on three random orthonormal directions (from ``seed``).

    Positive-type maps are accurate when ``|q + k|`` is small, trigonometric ones when ``|q - k|``
    is; both sets include moderate norms and large ones (``|q|, |k|`` up to 5). The "angular" set
    (hybrid features) has moderate norms at several angles, parallel and antiparallel pairs of
    unequal norms, and one pair ``q = k`` where the estimator is exact."""
    u, v, w = orthonormal(D, 3, seed=seed(stream))
    kind = {True: "positive", False: "signed"}.get(kind, kind) if isinstance(kind, bool) else kind
    if kind == "angular":
        p = {
            "small": (0.6 * u + 0.2 * v, 0.3 * u - 0.5 * v),
            "orthogonal": (0.8 * u, 0.8 * v),  # theta = pi/2
            "mixed": (0.5 * u + 0.3 * w, -0.2 * u + 0.6 * v),
            "parallel_unequal": (0.7 * u, 0.4 * u),  # lambda = 0: trigonometric part, s = 0.09
            "antiparallel_unequal": (0.7 * u, -0.4 * u),  # lambda = 1: hyperbolic part, t = 0.09
            "equal": (0.9 * u, 0.9 * u),  # exact (zero variance)
        }
    elif kind == "positive":
        p = {
            "small": (0.6 * u + 0.2 * v, 0.3 * u - 0.5 * v),  # |q+k|^2 = 0.90
            "orthogonal": (0.8 * u, 0.8 * v),  # |q+k|^2 = 1.28, K = 1
            "aligned": (0.55 * u, 0.55 * u),  # |q+k|^2 = 1.21, K = e^0.30
            "large_opposite": (3 * u, -3 * u + 0.8 * v),  # |q|=3, |k|=3.1, K = e^-9
            "large_mixed": (2 * u + v, -1.5 * u - 0.5 * v + 0.5 * w),  # |q+k|^2 = 0.75, K = e^-3.5
            "very_large_opposite": (5 * u, -5 * u + 0.5 * w),  # |q|=|k|=5, K = e^-25
        }
    else:
        p = {
            "small": (0.6 * u + 0.2 * v, 0.3 * u - 0.5 * v),  # |q-k|^2 = 0.58
            "orthogonal": (0.8 * u, 0.8 * v),  # |q-k|^2 = 1.28
            "opposite": (0.55 * u, -0.55 * u),  # |q-k|^2 = 1.21, K = e^-0.30
            "large_near": (3 * u, 3 * u + 0.5 * v),  # |q|=3, K = e^9
            "large_mixed": (2 * u + v, 2 * u + 1.2 * v - 0.4 * w),  # K = e^5.2
            "very_large_near": (5 * u, 5 * u + 0.3 * w),  # |q|=|k|=5, K = e^25
        }
    q = torch.stack([a for a, _ in p.values()])
    k = torch.stack([b for _, b in p.values()])
    return q, k, list(p)


def kernel_draws(est: ka.Estimator, cfg: Config, q: torch.Tensor, k: torch.Tensor, stream: int) -> torch.Tensor:
    """(S, P) independent draws of the estimate of exp(q_i . k_i), through the library's
    ``est.build(..., batch_shape=(chunk,)).kernel(q, k)`` (chunks from one generator)."""
    g = torch.Generator().manual_seed(seed(stream))
    out = []
    for start in range(0, cfg.S, cfg.chunk):
        n = min(cfg.chunk, cfg.S - start)
        fm = est.build(D, cfg.r, sampler=cfg.sampler, generator=g, batch_shape=(n,), dtype=F64)
        assert fm.weight.shape == (n, cfg.r, D)
        out.append(torch.diagonal(fm.kernel(q, k), dim1=-2, dim2=-1))  # (n, P): pair i = (q_i, k_i)
    return torch.cat(out)


@pytest.mark.statistical
@pytest.mark.parametrize("sampler_id", list(UNBIASED))
@pytest.mark.parametrize("name", RANDOM)
def test_unbiased(name, sampler_id):
    """E[K_hat(q, k)] = exp(q.k) for every random estimator and every unbiased sampler, resolved to
    a 1 % relative bias: ``|z| < 4.5`` and ``se <= 0.0022 K`` at every pair (module docstring)."""
    est = ka.get_estimator(name)
    cfg = UNBIASED[sampler_id]
    assert cfg.sampler.unbiased
    q, k, labels = pairs(pair_set(est), stream=11)
    stream = 100 + 10 * RANDOM.index(name) + list(UNBIASED).index(sampler_id)
    # data-dependent maps are drawn unfitted (their data-free parameters, FAVOR+'s), and say so
    unfitted = pytest.warns(UserWarning, match="used before fit") if est.data_dependent else contextlib.nullcontext()
    with unfitted:
        draws = kernel_draws(est, cfg, q, k, stream)
    assert draws.shape == (cfg.S, len(labels)) and torch.isfinite(draws).all()
    exact = torch.exp((q * k).sum(-1))
    z, se = zscores(draws, exact)
    rel_se = se / exact
    # Pairs where the estimator is exact (zero variance: hybrid features at q = k) have se at the
    # rounding level, where z is meaningless: there every draw must equal K to rounding instead.
    exact_pair = rel_se < 1e-9
    print(f"\n{name:12s} {sampler_id:20s} se/K max {rel_se.max():.5f}  |z| max {z[~exact_pair].abs().max():.2f}")
    assert (rel_se <= SE_GUARD).all(), ("power guard", dict(zip(labels, rel_se.tolist(), strict=True)))
    assert ((draws[:, exact_pair] - exact[exact_pair]).abs() <= 1e-9 * exact[exact_pair]).all()
    assert (z[~exact_pair].abs() < Z_MAX).all(), dict(zip(labels, z.tolist(), strict=True))


# --------------------------------------------------------------------------- which samplers claim it


def _default_instances() -> list[Sampler]:
    return [ka.get_sampler(name) for name in SAMPLERS]


def test_every_unbiased_sampler_is_tested():
    """Every registered sampler (in its default configuration) that claims ``unbiased`` is in
    ``UNBIASED`` above, and so are the variants whose ``unbiased`` flag is True: a new unbiased
    sampler cannot be added without its unbiasedness test."""
    tested = [c.sampler for c in UNBIASED.values()]
    variants = _default_instances() + [
        OrthogonalSampler(norms="chi"),
        OrthogonalSampler(norms="fixed"),
        QMCSampler("sobol", "shift"),
        QMCSampler("halton", "scramble"),
        QMCSampler("halton", "shift"),
    ]
    for s in variants:
        if s.unbiased:
            assert s in tested, f"{s!r} claims unbiased draws but is not tested in test_unbiased"
    assert {type(s) for s in tested} >= {type(s) for s in _default_instances() if s.unbiased}


def test_biased_samplers_declare_it():
    """SORF (structured) and fixed-norm orthogonal rows are biased and say so; the closed-form theory
    refuses SORF (no formula is claimed for it) and, for fixed norms, reports a nonzero bias."""
    assert StructuredSampler().unbiased is False
    assert ka.get_sampler("structured").unbiased is False
    assert OrthogonalSampler(norms="fixed").unbiased is False
    assert GivenSampler().unbiased is False
    q = torch.tensor([[0.5, -0.2, 0.3, 0.1, 0.0]], dtype=F64)
    k = torch.tensor([[0.4, 0.3, -0.1, 0.2, 0.2]], dtype=F64)
    for est in ka.estimators(random=True):
        fm = est.build(D, 8, sampler="structured", seed=0, dtype=F64)
        for fn in (ka.theory.mse, ka.theory.bias, ka.theory.variance):
            with pytest.raises(NotImplementedError):
                fn(fm, q, k)
        fixed = est.build(D, 8, sampler=OrthogonalSampler(norms="fixed"), seed=0, dtype=F64)
        if "moments" in est.closed_forms(fixed.sampler):
            assert abs(float(ka.theory.bias(fixed, q, k)[0, 0])) > 0


# --------------------------------------------------------------------------- the statistic can fail


@pytest.mark.statistical
def test_unbiased_statistic_detects_a_bandwidth_bug():
    """The statistic above fails for a wrong estimator (sklearn PR #3656: a factor-2 bandwidth, i.e.
    rows scaled by sqrt(2)), with the same draws and pairs as the iid sin/cos check."""
    est = ka.get_estimator("trig-sincos")
    cfg = UNBIASED["gaussian"]
    q, k, _ = pairs(False, stream=11)
    g = torch.Generator().manual_seed(seed(190))
    fm = est.build(D, cfg.r, sampler=cfg.sampler, generator=g, batch_shape=(cfg.chunk,), dtype=F64)
    bad = ka.TrigRF.from_projection(fm.weight * math.sqrt(2.0))
    draws = torch.diagonal(bad.kernel(q, k), dim1=-2, dim2=-1)
    z, _ = zscores(draws, torch.exp((q * k).sum(-1)))
    assert z.abs().max() > 10 * Z_MAX


@pytest.mark.statistical
def test_fixed_norm_orthogonal_is_smreg():
    """Fixed-norm ORF (rows of norm sqrt(d)) is biased: positive features estimate
    SMREG = e^{-(|x|^2+|y|^2)/2} 0F1(; d/2; d|x+y|^2/4) < exp(x.y) (Performer Thm 1), not exp(x.y).

    Same statistic: |z| < Z_MAX against SMREG, and z far below -Z_MAX against exp(x.y)."""
    d, r, S = 4, 4, 80_000  # se/K ~ 0.0018: the same 1 % resolution as test_unbiased
    u, v, _ = orthonormal(d, 3, seed=seed(2))
    q = torch.stack([1.2 * u, 1.0 * u + 0.3 * v])
    k = torch.stack([0.0 * u + 0.1 * v, 0.2 * u - 0.2 * v])
    fm = ka.PositiveRF(d, r, sampler=OrthogonalSampler(norms="fixed"), seed=seed(9), batch_shape=(S,), dtype=F64)
    torch.testing.assert_close(fm.weight.norm(dim=-1), torch.full((S, r), math.sqrt(d), dtype=F64))
    draws = torch.diagonal(fm.kernel(q, k), dim1=-2, dim2=-1)
    t = ((q + k) ** 2).sum(-1)
    lam = torch.exp(-0.5 * ((q * q).sum(-1) + (k * k).sum(-1)))
    smreg = lam * torch.tensor(hyp0f1(d / 2, (d * t / 4).numpy()), dtype=F64)
    exact = torch.exp((q * k).sum(-1))
    z_reg, se = zscores(draws, smreg)
    z_sm, _ = zscores(draws, exact)
    assert (smreg < exact).all()
    assert (se <= SE_GUARD * smreg).all(), se / smreg
    assert (z_reg.abs() < Z_MAX).all(), z_reg
    assert (z_sm < -3 * Z_MAX).all(), z_sm  # clearly below exp(q.k)
