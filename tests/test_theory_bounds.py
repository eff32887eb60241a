r"""Concentration and uniform-convergence bounds of ``kernelapprox.theory``: validity and monotonicity.

Validity check. For a bound that promises :math:`P(\text{fail}) \le \delta` at the returned
``r``, draw ``S`` independent feature maps with exactly ``r`` projections (``batch_shape=(S,)``),
count the failures :math:`\hat p = \#\{|\hat K - K| \ge \varepsilon K\}/S`, and assert
:math:`\hat p \le \delta`. The rigorous bounds (Chebyshev, Hoeffding, Bernstein, the uniform
bounds) are conservative, so :math:`\hat p` is far below :math:`\delta` and the check has no
statistical flakiness; the measured ratio :math:`\hat p/\delta` is printed (``-s``) and asserted
``< 1``. The CLT value is an asymptotic approximation, not a bound: there the true failure
probability is ≈ δ, and we assert :math:`\hat p \le \delta + 4\sqrt{\delta(1-\delta)/S}` (4 binomial
standard errors) — a check that the approximation is not optimistic beyond sampling noise.

Uniform bounds promise :math:`\sup_{x,y\in B(R)}|\hat K - K| \le \varepsilon`; we measure the max
over a finite set of points of :math:`B(R)` (a lower bound of the sup), so the check can only
miss a violation, never report a false one; it is there to catch gross errors (a wrong
:math:`e^{R^2}` transport, a wrong exponent), and the printed ratio sup-error/ε shows how loose
each bound is.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kernelapprox as ka
from kernelapprox.samplers import OrthogonalSampler
from kernelapprox.theory import concentration as C
from kernelapprox.theory import uniform as U

F64 = torch.float64
S_DRAWS = 2000


def _fm(kind, orth, d, r, S, seed):
    samp = "gaussian" if orth is None else OrthogonalSampler(norms=orth)
    if kind == "trig_sincos":
        return ka.TrigRF(d, r, sampler=samp, batch_shape=(S,), seed=seed, dtype=F64)
    if kind == "trig_offset":
        return ka.TrigRF(d, r, variant="offset", sampler=samp, batch_shape=(S,), seed=seed, dtype=F64)
    if kind == "positive":
        return ka.PositiveRF(d, r, sampler=samp, batch_shape=(S,), seed=seed, dtype=F64)
    return ka.HyperbolicRF(d, r, sampler=samp, batch_shape=(S,), seed=seed, dtype=F64)


def _failure_rate(kind, orth, x, y, r, eps, seed):
    d = x.shape[-1]
    fm = _fm(kind, orth, d, r, S_DRAWS, seed)
    Kh = fm.kernel(torch.tensor(x, dtype=F64), torch.tensor(y, dtype=F64))[:, 0, 0].numpy()
    K = math.exp(float(x[0] @ y[0]))
    return float(np.mean(np.abs(Kh - K) >= eps * K))


X = np.array([[0.35, -0.2, 0.25, 0.1]])
Y = np.array([[0.1, 0.15, 0.3, -0.2]])  # s = 0.24, t = 0.65, K = 1.08

CASES = [
    ("trig_sincos", None, ("chebyshev", "clt", "hoeffding", "bernstein")),
    ("trig_sincos", "chi", ("chebyshev", "clt", "hoeffding", "bernstein")),
    ("trig_offset", None, ("chebyshev", "hoeffding", "bernstein")),
    ("positive", None, ("chebyshev", "clt")),
    ("positive", "chi", ("chebyshev", "clt")),
    ("hyperbolic", None, ("chebyshev",)),
]


@pytest.mark.parametrize("kind,orth,methods", CASES)
def test_pointwise_bounds_hold_at_returned_r(kind, orth, methods):
    seed = 11
    for method in methods:
        grid = [(0.1, 0.05), (0.2, 0.05), (0.2, 0.2)]
        if method == "hoeffding" and orth is not None:
            grid = grid[1:]  # block Hoeffding needs ~4000 ORF projections at eps=0.1: too slow here
        for eps, delta in grid:
            r = C.required_features(kind, eps, delta, X, Y, method=method, orthogonal=orth)
            # the bound at r is <= delta and at r - 1 it is not (bisection invariant)
            assert C.failure_probability(kind, eps, X, Y, r, method=method, orthogonal=orth)[0, 0] <= delta
            if r > 1:
                assert (
                    C.failure_probability(kind, eps, X, Y, r - 1, method=method, orthogonal=orth)[0, 0]
                    > delta
                )
            p = _failure_rate(kind, orth, X, Y, r, eps, seed)
            seed += 1
            print(
                f"\n{kind:11s} orth={orth!s:4s} {method:9s} eps={eps} delta={delta} r={r} failure={p:.4f} ratio={p / delta:.3f}"
            )
            if method == "clt":
                assert p <= delta + 4 * math.sqrt(delta * (1 - delta) / S_DRAWS)
            else:
                assert p <= delta


def test_closed_forms_iid():
    t = float(np.sum((X + Y) ** 2))
    s = float(np.sum((X - Y) ** 2))
    eps, delta = 0.1, 0.05
    v_pos = math.expm1(t)
    assert C.required_features("positive", eps, delta, X, Y) == math.ceil(v_pos / (eps**2 * delta))
    z = 1.959963984540054
    assert C.required_features("positive", eps, delta, X, Y, method="clt") == math.ceil(v_pos * z**2 / eps**2)
    a2 = math.exp(s)
    assert C.required_features("trig", eps, delta, X, Y, method="hoeffding") == math.ceil(
        2 * a2 * math.log(2 / delta) / eps**2
    )
    assert C.required_features("trig_offset", eps, delta, X, Y, method="hoeffding") == math.ceil(
        8 * a2 * math.log(2 / delta) / eps**2
    )


def test_orf_needs_fewer_features_and_chebyshev_is_conservative_vs_clt():
    for kind in ("positive", "trig_sincos"):
        iid = C.required_features(kind, 0.1, 0.05, X, Y)
        orf = C.required_features(kind, 0.1, 0.05, X, Y, orthogonal="chi")
        assert orf <= iid
        assert C.required_features(kind, 0.1, 0.05, X, Y, method="clt") < iid


def test_required_features_monotone_pointwise():
    for kind, orth, methods in CASES:
        for method in methods:
            rs_eps = [
                C.required_features(kind, e, 0.05, X, Y, method=method, orthogonal=orth)
                for e in (0.05, 0.1, 0.2, 0.4)
            ]
            rs_del = [
                C.required_features(kind, 0.1, dl, X, Y, method=method, orthogonal=orth)
                for dl in (0.01, 0.05, 0.2, 0.5)
            ]
            assert rs_eps == sorted(rs_eps, reverse=True), (kind, method, rs_eps)
            assert rs_del == sorted(rs_del, reverse=True), (kind, method, rs_del)


def test_required_features_array_and_fixed_norm_unreachable():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(3, 4)) * 0.3
    k = rng.normal(size=(5, 4)) * 0.3
    arr = C.required_features("positive", 0.1, 0.05, q, k, reduce=None)
    assert arr.shape == (3, 5)
    assert C.required_features("positive", 0.1, 0.05, q, k) == int(arr.max())
    # fixed-norm ORF is biased: at |q+k| large and small eps no r reaches the level
    x = np.array([[1.0, 1.0, 0.0, 0.0]])
    rb = float(C._components("positive", C._geometry(x, x), "fixed").rbias[0, 0])
    assert abs(rb) > 0.01
    assert (
        C.required_features("positive", 0.5 * abs(rb), 0.05, x, x, orthogonal="fixed", method="clt")
        == math.inf
    )
    assert math.isfinite(
        C.required_features("positive", 3 * abs(rb), 0.05, x, x, orthogonal="fixed", method="clt")
    )


def test_concentration_validation():
    fm = ka.PositiveRF(4, 8, seed=0)
    with pytest.raises(ValueError, match="eps"):
        C.required_features(fm, 0.0, 0.1, X, Y)
    with pytest.raises(ValueError, match="delta"):
        C.required_features(fm, 0.1, 1.0, X, Y)
    with pytest.raises(ValueError, match="log-normal"):
        C.required_features(fm, 0.1, 0.1, X, Y, method="hoeffding")
    with pytest.raises(ValueError, match="method"):
        C.required_features(fm, 0.1, 0.1, X, Y, method="markov")
    with pytest.raises(ValueError, match="q and k"):
        C.required_features(fm, 0.1, 0.1)
    with pytest.raises(NotImplementedError, match="montecarlo"):
        C.required_features(ka.TrigRF(4, 8, sampler="structured", seed=0), 0.1, 0.1, X, Y)
    with pytest.raises(ValueError, match="deterministic"):
        C.required_features(ka.EluFeatures(4), 0.1, 0.1, X, Y)
    # a map's sampler is read: same answer as the kind with orthogonal="chi"
    fmo = ka.TrigRF(4, 8, sampler="orthogonal", seed=0)
    assert C.required_features(fmo, 0.1, 0.1, X, Y) == C.required_features(
        "trig", 0.1, 0.1, X, Y, orthogonal="chi"
    )


# ------------------------------------------------------------------------------------------------
# uniform convergence
# ------------------------------------------------------------------------------------------------


def _ball_points(d, R, n, seed):
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(n, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    radii = R * np.concatenate([np.ones(n // 2), rng.uniform(size=n - n // 2) ** (1 / d)])
    return u * radii[:, None]


def _sup_errors(variant, d, r, pts, S, seed, chunk=50):
    x = torch.tensor(pts, dtype=F64)
    K = torch.exp(x @ x.T)
    out = []
    for c in range(0, S, chunk):
        fm = ka.TrigRF(d, r, variant=variant, batch_shape=(chunk,), seed=seed + c, dtype=F64)
        out.append((fm.kernel(x, x) - K).abs().amax(dim=(-2, -1)))
    return torch.cat(out).numpy()


@pytest.mark.parametrize(
    "bound,variant,eps",
    [
        ("rahimi-recht", "offset", 1.0),
        ("rahimi-recht", "sincos", 1.0),
        ("sutherland-schneider", "sincos", 1.0),
        ("sutherland-schneider", "offset", 2.0),
        ("sriperumbudur-szabo", "sincos", 3.0),
    ],
)
def test_uniform_bounds_hold(bound, variant, eps):
    d, R, delta = 2, 0.5, 0.1
    r = U.required_features_uniform(variant, eps, delta, d, R, bound=bound)
    pts = _ball_points(d, R, 12, seed=0)
    sup = _sup_errors(variant, d, r, pts, S=200, seed=100)
    p = float(np.mean(sup >= eps))
    print(
        f"\n{bound:20s} {variant:6s} eps={eps} r={r} failure={p:.3f} max sup-error/eps={sup.max() / eps:.3f}"
    )
    assert p <= delta


def test_uniform_formulas():
    eps, delta, d, R = 0.3, 0.05, 8, 0.7
    eg = eps * math.exp(-R * R)
    rr = 4 * (d + 2) / eg**2 * math.log(2**8 * d * (2 * R) ** 2 / (delta * eg**2))
    assert U.rahimi_recht_features(eps, delta, d, R) == math.ceil(rr)
    pf = d / eg**2 * math.log(4 * d * R / eg)
    assert U.performer_theorem4_features(eps, delta, d, R) == math.ceil(pf)
    assert U.performer_theorem4_features(eps, delta, d, R, constant=3.0) == math.ceil(3 * pf)
    assert U.required_features_uniform("trig", eps, delta, d, R) == U.rahimi_recht_features(eps, delta, d, R)
    fm = ka.TrigRF(d, 4, variant="offset", seed=0)
    assert U.required_features_uniform(fm, eps, delta, d, R, bound="sutherland-schneider") == (
        U.sutherland_schneider_features(eps, delta, d, R, variant="offset")
    )


@pytest.mark.parametrize("bound", U.UNIFORM_BOUNDS)
def test_uniform_monotone(bound):
    f = lambda e=0.3, dl=0.05, d=8, R=0.7: U.required_features_uniform("trig", e, dl, d, R, bound=bound)  # noqa: E731
    by_eps = [f(e=e) for e in (0.1, 0.2, 0.4, 0.8)]
    by_del = [f(dl=x) for x in (0.001, 0.01, 0.1, 0.5)]
    by_R = [f(R=x) for x in (0.2, 0.5, 1.0, 1.5)]
    by_d = [f(d=x) for x in (2, 8, 32, 128)]
    assert by_eps == sorted(by_eps, reverse=True) and by_eps[0] > by_eps[-1]
    assert by_del == sorted(by_del, reverse=True)
    if bound != "performer":  # delta does not enter Performer's Theta statement
        assert by_del[0] > by_del[-1]
    assert by_R == sorted(by_R) and by_R[0] < by_R[-1]
    assert by_d == sorted(by_d) and by_d[0] < by_d[-1]


def test_uniform_validation():
    with pytest.raises(ValueError, match="eps"):
        U.rahimi_recht_features(-1.0, 0.1, 2, 1.0)
    with pytest.raises(ValueError, match="delta"):
        U.rahimi_recht_features(0.1, 0.0, 2, 1.0)
    with pytest.raises(ValueError, match="radius"):
        U.sriperumbudur_szabo_features(0.1, 0.1, 2, -1.0)
    with pytest.raises(ValueError, match="dim"):
        U.sutherland_schneider_features(0.1, 0.1, 0, 1.0)
    with pytest.raises(TypeError, match="dim"):
        U.sutherland_schneider_features(0.1, 0.1, 2.5, 1.0)
    with pytest.raises(ValueError, match="constant"):
        U.performer_theorem4_features(0.1, 0.1, 2, 1.0, constant=0.0)
    with pytest.raises(ValueError, match="bound"):
        U.required_features_uniform("trig", 0.1, 0.1, 2, 1.0, bound="chernoff")
    with pytest.raises(ValueError, match="positive"):
        U.required_features_uniform("positive", 0.1, 0.1, 2, 1.0)
    with pytest.raises(ValueError, match="TrigRF"):
        U.required_features_uniform(ka.PositiveRF(2, 4, seed=0), 0.1, 0.1, 2, 1.0)
