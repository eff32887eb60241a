"""Feature maps: formulas, shapes, log-domain form and batch semantics (exact checks, no Monte Carlo).

Unbiasedness of every random estimator under every sampler is tested in ``test_unbiased.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import F64, randn, with_norm

import kernelapprox as ka
from kernelapprox.samplers import OrthogonalSampler, QMCSampler

SAMPLERS = {
    "gaussian": "gaussian",
    "orthogonal": "orthogonal",
    "orth_chi_obj": OrthogonalSampler(norms="chi"),
    "orth_fixed": OrthogonalSampler(norms="fixed"),
    "structured": "structured",
    "qmc_sobol": "qmc",
    "qmc_halton": QMCSampler(method="halton"),
}

MAPS = {
    "trig-sincos": lambda d, r, **kw: ka.TrigRF(d, r, variant="sincos", **kw),
    "trig-offset": lambda d, r, **kw: ka.TrigRF(d, r, variant="offset", **kw),
    "positive": lambda d, r, **kw: ka.PositiveRF(d, r, **kw),
    "hyperbolic": lambda d, r, **kw: ka.HyperbolicRF(d, r, **kw),
}


def phi_by_formula(name: str, fm, x: torch.Tensor) -> torch.Tensor:
    """The contract's formula, written out from fm.weight (and fm.offsets) in float64."""
    W = fm.weight.to(F64)
    x = x.to(F64)
    r = W.shape[-2]
    u = x @ W.mT
    h = 0.5 * (x * x).sum(-1, keepdim=True)
    if name == "trig-sincos":
        return torch.exp(h) / math.sqrt(r) * torch.cat([torch.sin(u), torch.cos(u)], -1)
    if name == "trig-offset":
        b = fm.offsets.to(F64).unsqueeze(-2)
        return torch.exp(h) * math.sqrt(2 / r) * torch.cos(u + b)
    if name == "positive":
        return torch.exp(u - h) / math.sqrt(r)
    if name == "hyperbolic":
        return torch.exp(-h) / math.sqrt(2 * r) * torch.cat([torch.exp(u), torch.exp(-u)], -1)
    raise AssertionError(name)


# --------------------------------------------------------------------------- formulas and shapes


@pytest.mark.parametrize("sampler", list(SAMPLERS.values()), ids=list(SAMPLERS))
@pytest.mark.parametrize("name", list(MAPS))
def test_features_match_formula(name, sampler):
    d, r = 5, 11  # d not a power of two; r not a multiple of d (partial blocks)
    fm = MAPS[name](d, r, sampler=sampler, seed=3, dtype=F64)
    assert fm.weight.shape == (r, d)
    x = randn(2, 6, d, seed=1, scale=0.7)
    out = fm(x)
    assert out.shape == (2, 6, fm.feature_dim)
    assert out.dtype == F64
    # For "structured" this also checks the fast Walsh-Hadamard path against the dense weight.
    torch.testing.assert_close(out, phi_by_formula(name, fm, x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "name,feature_dim",
    [("trig-sincos", 14), ("trig-offset", 7), ("positive", 7), ("hyperbolic", 14)],
)
def test_feature_dim(name, feature_dim):
    fm = MAPS[name](3, 7, seed=0)
    assert fm.num_features == 7
    assert fm.feature_dim == feature_dim
    assert fm.dim == 3
    assert fm(torch.randn(4, 3)).shape == (4, feature_dim)


@pytest.mark.parametrize("cls", [ka.EluFeatures, ka.ReluFeatures], ids=["elu", "relu"])
def test_deterministic_maps_formula(cls):
    x = randn(3, 9, 4, seed=0, scale=2.0)
    fm = cls(4)
    assert fm.feature_dim == 4 and fm.num_features == 4 and fm.dim == 4
    expected = torch.nn.functional.elu(x) + 1 if cls is ka.EluFeatures else torch.relu(x)
    torch.testing.assert_close(fm(x), expected, rtol=1e-14, atol=1e-15)
    q, k = x[0], x[1]
    torch.testing.assert_close(fm.kernel(q, k), fm(q) @ fm(k).mT, rtol=1e-12, atol=1e-14)


def test_class_attributes():
    assert ka.PositiveRF.is_random and ka.PositiveRF.positive
    assert ka.HyperbolicRF.is_random and ka.HyperbolicRF.positive
    assert ka.TrigRF.is_random and not ka.TrigRF.positive
    assert not ka.EluFeatures.is_random and ka.EluFeatures.positive
    assert not ka.ReluFeatures.is_random and ka.ReluFeatures.positive


@pytest.mark.parametrize("name", list(MAPS))
def test_kernel_equals_feature_product(name):
    fm = MAPS[name](6, 32, seed=0, dtype=F64)
    q, k = randn(2, 7, 6, seed=1, scale=0.8), randn(2, 5, 6, seed=2, scale=0.8)
    K = fm.kernel(q, k)
    assert K.shape == (2, 7, 5)
    torch.testing.assert_close(K, fm(q) @ fm(k).mT, rtol=1e-11, atol=1e-13)


def test_kernel_closed_forms():
    """Independent formulations: sincos = e^{(|x|^2+|y|^2)/2} mean cos(w.(x-y)),
    hyperbolic = e^{-(|x|^2+|y|^2)/2} mean cosh(w.(x+y))."""
    d, r = 4, 20
    q, k = randn(6, d, seed=5), randn(4, d, seed=6)
    nq = 0.5 * (q * q).sum(-1)[:, None]
    nk = 0.5 * (k * k).sum(-1)[None, :]
    trig = ka.TrigRF(d, r, seed=1, dtype=F64)
    W = trig.weight
    diff = q[:, None, :] - k[None, :, :]
    expected = torch.exp(nq + nk) * torch.cos(diff @ W.T).mean(-1)
    torch.testing.assert_close(trig.kernel(q, k), expected, rtol=1e-11, atol=1e-12)
    hyp = ka.HyperbolicRF(d, r, seed=1, dtype=F64)
    W = hyp.weight
    s = q[:, None, :] + k[None, :, :]
    expected = torch.exp(-nq - nk) * torch.cosh(s @ W.T).mean(-1)
    torch.testing.assert_close(hyp.kernel(q, k), expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True], ids=["per_row", "shared"])
@pytest.mark.parametrize("name", list(MAPS) + ["elu"])
def test_log_features_reconstruct(name, shared):
    fm = ka.EluFeatures(5) if name == "elu" else MAPS[name](5, 9, seed=0, dtype=F64)
    x = randn(3, 8, 5, seed=4)
    f, ls = fm.log_features(x, shared=shared)
    assert f.shape == (3, 8, fm.feature_dim)
    assert ls.shape == ((3, 1) if shared else (3, 8))
    torch.testing.assert_close(f * ls.exp()[..., None], fm(x), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["positive", "hyperbolic", "trig-sincos", "trig-offset"])
def test_log_features_bounded_at_large_norm(name):
    """The stabilised part stays bounded where the plain features overflow (|x| = 40 in float32)."""
    fm = MAPS[name](8, 16, seed=0)
    x = with_norm(randn(2, 10, 8, seed=1), 40.0).float()
    for shared in (False, True):
        f, ls = fm.log_features(x, shared=shared)
        assert torch.isfinite(f).all() and torch.isfinite(ls).all()
        assert f.abs().max() <= 1.0 + 1e-6
        # ... and it is the right thing: log|phi| = log|f| + log_scale against the float64 formula,
        # wherever phi is not negligible next to the row's (or sequence's) largest feature.
        xd, W = x.double(), fm.weight.double()
        u = xd @ W.mT
        half = 0.5 * (xd * xd).sum(-1, keepdim=True)
        r = fm.num_features
        if name == "positive":
            log_phi = u - half - 0.5 * math.log(r)
        elif name == "hyperbolic":
            log_phi = torch.cat((u, -u), -1) - half - 0.5 * math.log(2 * r)
        elif name == "trig-sincos":
            log_phi = torch.log(torch.cat((torch.sin(u), torch.cos(u)), -1).abs()) + half - 0.5 * math.log(r)
        else:
            c = torch.cos(u + fm.offsets.double())
            log_phi = torch.log(c.abs()) + half + 0.5 * math.log(2.0 / r)
        got = torch.log(f.double().abs()) + (ls.double().unsqueeze(-1))
        keep = f.abs() > 1e-3  # float32 f near 0 carries only absolute precision
        # power: every row keeps its largest feature (per-row scale), or the sequence does (shared)
        assert keep.any(-1).all() if not shared else keep.flatten(-2).any(-1).all()
        assert (got - log_phi)[keep].abs().max() < 1e-2  # float32 on |Wx| ~ 100: abs error ~ 1e-5 * 100


# --------------------------------------------------------------------------- batch_shape semantics


def test_batch_shape_monte_carlo_layout():
    d, r, S = 4, 8, 5
    fm = ka.PositiveRF(d, r, seed=0, batch_shape=(S, 1, 1), dtype=F64)
    x = randn(2, 3, 6, d, seed=1)  # (B, H, n, d)
    out = fm(x)
    assert out.shape == (S, 2, 3, 6, r)
    for s in range(S):
        single = ka.PositiveRF.from_projection(fm.weight[s, 0, 0])
        torch.testing.assert_close(out[s], single(x), rtol=1e-13, atol=0)
    # independent draws: no two are equal
    W = fm.weight.reshape(S, r * d)
    assert torch.cdist(W, W).add(torch.eye(S, dtype=F64)).min() > 0.1


def test_batch_shape_per_head():
    d, r, H = 4, 8, 3
    fm = ka.TrigRF(d, r, seed=0, batch_shape=(H,), dtype=F64)
    x = randn(2, H, 6, d, seed=1)
    out = fm(x)
    assert out.shape == (2, H, 6, 2 * r)
    for h in range(H):
        single = ka.TrigRF.from_projection(fm.weight[h])
        torch.testing.assert_close(out[:, h], single(x[:, h]), rtol=1e-13, atol=0)
    K = fm.kernel(x, x)
    assert K.shape == (2, H, 6, 6)
    torch.testing.assert_close(K, out @ out.mT, rtol=1e-11, atol=1e-13)


# Unbiasedness of every random estimator (z-tests resolving a 1 % bias), the bandwidth-bug
# detection and the fixed-norm SMREG check live in tests/test_unbiased.py.


# --------------------------------------------------------------------------- fast paths


FAST = {
    "positive-dense": lambda **kw: ka.PositiveRF(6, 10, **kw),
    "positive-sorf": lambda **kw: ka.PositiveRF(6, 10, sampler="structured", **kw),
    "hyperbolic-dense": lambda **kw: ka.HyperbolicRF(6, 10, **kw),
    "hyperbolic-sorf": lambda **kw: ka.HyperbolicRF(6, 10, sampler="structured", **kw),
    "sincos-sorf": lambda **kw: ka.TrigRF(6, 10, sampler="structured", **kw),
}


def _formula_name(fm) -> str:
    if isinstance(fm, ka.PositiveRF):
        return "positive"
    if isinstance(fm, ka.HyperbolicRF):
        return "hyperbolic"
    return "trig-sincos"


@pytest.mark.parametrize("name", list(FAST))
def test_fast_forward_and_backward_match_formula(name):
    """The one-addmm forward (bias folded into the GEMM, in-place exp; SORF through its cached
    dense W) against the float64 formula, values and gradients, with and without autograd."""
    fm = FAST[name](seed=1, dtype=F64)
    from kernelapprox._logdomain import _affine_rows

    xc = randn(2, 5, 6, seed=2, scale=0.6)
    assert _affine_rows(fm.projection, xc, xc[..., 0]) is not None  # the fast path is taken
    x = xc.clone().requires_grad_(True)
    g = randn(2, 5, fm.feature_dim, seed=3)
    out = fm(x)
    (gx,) = torch.autograd.grad((out * g).sum(), x)
    xr = xc.clone().requires_grad_(True)
    ref = phi_by_formula(_formula_name(fm), fm, xr)
    (gr,) = torch.autograd.grad((ref * g).sum(), xr)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gx, gr, rtol=1e-11, atol=1e-13)
    with torch.no_grad():  # the no-grad path writes into one preallocated buffer
        torch.testing.assert_close(fm(xc), ref.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", list(FAST))
def test_fast_paths_gradcheck(name):
    fm = FAST[name](seed=4, dtype=F64)
    x = randn(3, 6, seed=5, scale=0.5).requires_grad_(True)
    assert torch.autograd.gradcheck(fm, (x,), eps=1e-6, atol=1e-8)

    def phi_from_log(t):  # f alone has detached shifts: check the reconstructed phi
        f, ls = fm.log_features(t)
        return f * ls.exp().unsqueeze(-1)

    assert torch.autograd.gradcheck(phi_from_log, (x,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("name", ["positive-dense", "hyperbolic-dense"])
def test_fast_paths_half_precision_inputs(name):
    """bf16 inputs are computed in float32 (one addmm in float32) and returned in bf16."""
    fm = FAST[name](seed=6)
    x = randn(4, 6, seed=7, scale=0.5)
    out = fm(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ref = fm(x.to(torch.bfloat16).float())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-3)


def test_fast_path_hyperbolic_large_norm_finite_log_features():
    """The fast forward may over/underflow where phi does, but log_features stays finite and
    bounded at |x| = 40 (the stabilised path used by attention)."""
    fm = ka.HyperbolicRF(8, 16, seed=0)
    x = with_norm(randn(2, 10, 8, seed=1), 40.0).float()
    f, ls = fm.log_features(x)
    assert torch.isfinite(f).all() and torch.isfinite(ls).all() and f.abs().max() <= 1 + 1e-6
    assert not torch.isnan(fm(x)).any()


@pytest.mark.parametrize("layout", ["dense", "draws", "sorf-transform"])
@pytest.mark.parametrize("name", ["positive", "hyperbolic"])
def test_base2_exponent_paths_match_formula(name, layout, monkeypatch):
    """The exponential maps compute e^u as exp2(u log2 e) with log2 e folded into the smaller GEMM
    operand (`features._project2`): W for attention-sized inputs ("dense"), x for many draws
    against a few rows ("draws": W of shape (S, r, d)), x for the Walsh-Hadamard transform
    ("sorf-transform", dense_max_dim 0). Each layout, every entry point, against the float64
    formula; natural-log scales, f <= 1. A wrong factor on any branch (base-2 units left in a
    log scale, or a missing log2 e) moves values by O(1), far outside these tolerances."""
    from kernelapprox.samplers import HadamardProjection

    d, r = 6, 10
    kw = {"seed": 5, "dtype": F64}
    if layout == "draws":
        kw["batch_shape"] = (40,)  # S r d = 2400 > n d = 18: x is the operand scaled
    if layout == "sorf-transform":
        monkeypatch.setattr(HadamardProjection, "dense_max_dim", 0)
        kw["sampler"] = "structured"
    fm = MAPS[name](d, r, **kw)
    x = randn(3, d, seed=6, scale=0.8)
    ref = phi_by_formula(name, fm, x)
    for grad in (False, True):
        xx = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(fm(xx), ref, rtol=1e-12, atol=0)
            for shared in (False, True):
                f, ls = fm.log_features(xx, shared=shared)
                assert f.max() <= 1.0
                torch.testing.assert_close(f * ls.exp().unsqueeze(-1), ref, rtol=1e-12, atol=0)
            q = fm.query_features(xx)
            torch.testing.assert_close(q / q.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True),
                                       rtol=1e-12, atol=0)
    if layout != "draws" and name == "positive":
        with torch.no_grad():
            buf = torch.empty(2 * x.shape[0] * r, dtype=F64)
            q = fm.query_features_into(x, buf)
            torch.testing.assert_close(q / q.sum(-1, keepdim=True), ref / ref.sum(-1, keepdim=True),
                                       rtol=1e-12, atol=0)
