"""Causal linear attention with peaked features: finite gradients and right outputs where the
per-row shifts of the chunked paths let a denominator underflow.

A fitted FAVOR++/FAVOR# map (OPRF, SADERF, SDERF; ``A* << 0``) has query and key features that
peak at different random features at large norms: with each query and key shifted by its own
maximum over the features, ``phi(q_i)^T psi(k_j)`` underflows in float32 although the attention
weights are ordinary numbers. Such rows are recomputed by
`kernelapprox.attention.linear.chunk.per_feature_attention` (every feature at its own causal scale,
``den_i >= 1``). Without it, the outputs of those rows were 0 (errors of order 1) and their
gradients ``1 / den`` overflowed into NaN.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import F64, randn

import kernelapprox as ka
from kernelapprox.attention.linear import chunk
from kernelapprox.attention.linear.chunk import per_feature_attention

FITTED = ["oprf", "saderf", "sderf"]
LOG2_MAPS = ["positive", "hyperbolic", *FITTED]  # the registered maps with log2 features
SEEDS = range(10)


def _peaked_inputs(seed: int, norm: float = 20.0, n: int = 8, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 2, n, d, generator=g, dtype=F64).unbind(0)
    q = q / q.norm(dim=-1, keepdim=True) * norm
    k = k / k.norm(dim=-1, keepdim=True) * norm
    v = torch.randn(2, n, 4, generator=g, dtype=F64)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FITTED)
def test_fitted_maps_at_norm_20_give_finite_gradients_and_the_reference_output(name, dtype):
    """Ten seeds at |q| = |k| = 20 (r = 32, d = 16, n = 8), causal: the outputs match the float64
    quadratic reference of the same fitted map, and the gradients w.r.t. q and k are finite.

    Tolerance: the float32 log2-features reach |l| ~ 10^3 here, whose rounding (|l| 2^-24) is a
    relative error of up to ln 2 * 10^3 * 2^-24 = 4e-5 per weight, so 1e-3 on outputs of unit
    scale (bfloat16 inputs are rounded first; the reference takes the same rounded inputs). The
    old rows were 0 instead (errors > 2), with NaN gradients at 5 of the 10 OPRF seeds."""
    est = ka.get_estimator(name)
    for seed in SEEDS:
        q0, k0, v0 = _peaked_inputs(seed)
        q = q0.to(dtype).requires_grad_()
        k = k0.to(dtype).requires_grad_()
        v = v0.to(dtype)
        fm = est.build(16, 32, seed=seed)
        fm.fit(q.detach().float(), k.detach().float())
        out = ka.linear_attention(q, k, v, fm, causal=True, check=False)
        fm64 = copy.deepcopy(fm).double()
        ref = ka.naive_linear_attention(q.detach().double(), k.detach().double(), v.double(), fm64, causal=True)
        assert bool(ref.isfinite().all()), f"seed {seed}: the reference itself"
        assert bool(out.isfinite().all()), f"seed {seed}"
        tol = 1e-3 if dtype == torch.float32 else 1e-2  # bfloat16 output: 2^-8 relative rounding
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol, msg=f"seed {seed}")
        out.float().sum().backward()
        assert q.grad is not None and k.grad is not None
        assert bool(q.grad.isfinite().all()) and bool(k.grad.isfinite().all()), f"seed {seed}"
        with torch.no_grad():  # inference: the fast paths reuse their buffers, the rows still right
            torch.testing.assert_close(ka.linear_attention(q, k, v, fm, causal=True, check=False), out)


@pytest.fixture
def rescue_every_row(monkeypatch):
    """Every row of a positive map with log2 features goes through `per_feature_attention`."""
    monkeypatch.setattr(chunk, "den_floor", lambda dtype: math.inf)


def _map(name: str, d: int = 4):
    est = ka.get_estimator(name)
    fm = est.build(d, 16, seed=3, dtype=F64)
    if est.data_dependent:
        fm.fit(randn(2, 3, 30, d, seed=20, scale=0.5), randn(2, 3, 30, d, seed=21, scale=0.5))
    return fm


def _leaves(n=23, seed=11):
    q = randn(2, 3, n, 4, seed=seed, scale=0.5)
    k = randn(2, 3, n, 4, seed=seed + 1, scale=0.5)
    v = randn(2, 3, n, 3, seed=seed + 2)
    return [t.clone().requires_grad_(True) for t in (q, k, v)]


def _check_against_naive(out, ref, leaves, tol=1e-10):
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    w = randn(*out.shape, seed=5)  # a random cotangent: no gradient cancels by symmetry
    g_fast = torch.autograd.grad((out * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        assert b.abs().max() > 0, what
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("name", LOG2_MAPS)
def test_per_feature_path_equals_naive_forward_and_backward(rescue_every_row, name, chunk_size):
    """Every row recomputed per feature (n = 23: blocks of 8 and a partial one): equal to the
    quadratic reference in float64, forward (1e-10) and backward (1e-8), for every map that
    takes the path."""
    fm = _map(name)
    q, k, v = _leaves()
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk_size)
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    _check_against_naive(out, ref, (q, k, v))


@pytest.mark.parametrize("name", ["positive", "oprf"])
def test_per_feature_path_with_padding_and_initial_state(rescue_every_row, name):
    """Padded keys (weight 0, rows before the first valid key 0) and an initial state (the
    continuation of a prefix, its masses as the per-feature scales before the first block):
    equal to the quadratic reference of the valid keys, forward and backward."""
    fm = _map(name)
    q, k, v = _leaves()
    pad = torch.zeros(2, 23, dtype=torch.bool)
    pad[0, :3] = True  # left padding: rows 0-2 see no valid key
    pad[1, [4, 9, 10, 22]] = True
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=5, key_padding_mask=pad)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    # reference: the padded keys removed by weight 0 in the plain quadratic formula
    A = fm(q) @ fm.key_features(k).mT
    A = A * torch.ones(23, 23, dtype=F64).tril() * (~pad)[:, None, None, :]
    ref = (A @ v) / A.sum(-1, keepdim=True).clamp_min(1e-300)
    _check_against_naive(out, ref, (q, k, v))

    q, k, v = _leaves(seed=31)
    split = 9
    o1, st = ka.linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, causal=True,
                                 chunk_size=4, return_state=True)
    o2 = ka.linear_attention(q[..., split:, :], k[..., split:, :], v[..., split:, :], fm, causal=True,
                             chunk_size=5, initial_state=st)
    _check_against_naive(torch.cat([o1, o2], -2), ka.naive_linear_attention(q, k, v, fm, causal=True), (q, k, v))


def _log_domain_reference(lq, lk, v):
    """float64 ``[num | den]`` with each row scaled by 2^-s_i: l_ij = log2 sum_f 2^(lq_if + lk_jf)."""
    lij = torch.logsumexp((lq.unsqueeze(-2) + lk.unsqueeze(-3)) * math.log(2), dim=-1) / math.log(2)
    n = lq.shape[-2]
    lij = lij.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(lij * math.log(2), dim=-1)
    return w @ v


def test_per_feature_denominators_are_at_least_one_in_float32():
    """Log2 features spread over +-300 (peaks that meet in no per-row shift, and values 2^+-300
    beyond float32): the denominators are in [1, F (n + 1)] as the docstring proves, and the
    outputs match the float64 log-domain softmax over l_ij = log2 sum_f 2^(lq_if + lk_jf) to
    float32 rounding of exponents of size 600 (600 * 2^-24 * ln 2 = 2.5e-5 relative)."""
    g = torch.Generator().manual_seed(0)
    n, Fd = 29, 12
    lq = 300 * torch.rand(3, n, Fd, generator=g, dtype=F64) - 150 * torch.arange(Fd, dtype=F64) / Fd
    lk = 300 * torch.rand(3, n, Fd, generator=g, dtype=F64) + 150 * torch.arange(Fd, dtype=F64) / Fd - 300
    v = torch.randn(3, n, 2, generator=g, dtype=F64)
    v1 = torch.cat((v, torch.ones(3, n, 1, dtype=F64)), -1)
    raw = per_feature_attention(lq.float(), lk.float(), v1.float(), None, None, torch.Size([3]), 2)
    den = raw[..., 2]
    assert bool((den >= 1 - 1e-6).all()) and bool((den <= Fd * (n + 1)).all())
    torch.testing.assert_close((raw[..., :2] / raw[..., 2:]).double(), _log_domain_reference(lq, lk, v),
                               rtol=1e-4, atol=1e-4)


def test_per_feature_path_gradcheck():
    """Gradients of `per_feature_attention` w.r.t. lq, lk and the values, float64, with a partial
    block, padding and an initial state (its shifts are constants: the check sees the true ratio's
    derivatives)."""
    g = torch.Generator().manual_seed(1)
    n, Fd = 11, 5
    lq = (3 * torch.randn(2, n, Fd, generator=g, dtype=F64)).requires_grad_()
    lk = (3 * torch.randn(2, n, Fd, generator=g, dtype=F64)).requires_grad_()
    v = torch.randn(2, n, 2, generator=g, dtype=F64).requires_grad_()
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, 2] = True
    kv0 = torch.rand(2, Fd, 3, generator=g, dtype=F64) + 0.1
    state = ka.LinearAttentionState(kv0, torch.full((2, 1, 1), 0.7, dtype=F64))

    def ratio(lq, lk, v):
        v1 = torch.cat((v, torch.ones(2, n, 1, dtype=F64)), -1).masked_fill(pad.unsqueeze(-1), 0.0)
        raw = per_feature_attention(lq, lk, v1, pad, state, torch.Size([2]), 2)
        return raw[..., :2] / raw[..., 2:]

    assert torch.autograd.gradcheck(ratio, (lq, lk, v))


def test_rows_depend_on_earlier_positions_only():
    """A later key 2^+400 above every other (in one feature) leaves the earlier rows unchanged:
    no block or state scale reads ahead (a shared reference would underflow them to 0)."""
    g = torch.Generator().manual_seed(2)
    n, Fd = 21, 6
    lq = 10 * torch.randn(1, n, Fd, generator=g)
    lk = 10 * torch.randn(1, n, Fd, generator=g)
    v1 = torch.cat((torch.randn(1, n, 3, generator=g), torch.ones(1, n, 1)), -1)
    base = per_feature_attention(lq, lk, v1, None, None, torch.Size([1]), 3)
    for j in (3, 8, 15):  # inside a block, the first of a block, later
        lk2 = lk.clone()
        lk2[0, j, 2] = 400.0
        out = per_feature_attention(lq, lk2, v1, None, None, torch.Size([1]), 3)
        o, b = out[0, :j, :3] / out[0, :j, 3:], base[0, :j, :3] / base[0, :j, 3:]
        torch.testing.assert_close(o, b, rtol=1e-6, atol=1e-6)
        assert bool(out.isfinite().all())
        assert not torch.allclose(out[0, j:, :3] / out[0, j:, 3:], base[0, j:, :3] / base[0, j:, 3:])


def test_only_the_underflowing_rows_and_sequences_change(monkeypatch):
    """In a batch of a pathological sequence (fitted OPRF at norm 20) and a benign one (norm 1),
    the benign sequence's rows, and the rows of the pathological one whose denominator does not
    underflow, are bitwise those of the chunked path without the recomputation."""
    q, k, v = (t.float() for t in _peaked_inputs(0))
    q[1], k[1] = q[1] / 20, k[1] / 20
    fm = ka.get_estimator("oprf").build(16, 32, seed=0).fit(q[:1], k[:1])
    seen = {}
    den_floor, rescue = chunk.den_floor, chunk._rescue_underflow

    def spy(raw, *args):
        seen["den"] = raw[..., 4].clone()  # dv = 4: the ones column of [num | den | 0...]
        return rescue(raw, *args)

    monkeypatch.setattr(chunk, "_rescue_underflow", spy)
    out = ka.linear_attention(q, k, v, fm, causal=True, check=False)
    monkeypatch.setattr(chunk, "den_floor", lambda dtype: 0.0)
    plain = ka.linear_attention(q, k, v, fm, causal=True, check=False)
    small = seen["den"] < den_floor(torch.float32)
    assert bool(small[0].any()) and not bool(small[1].any())  # the case is not vacuous
    assert torch.equal(out[~small], plain[~small])
    assert not torch.allclose(out[small], plain[small])
