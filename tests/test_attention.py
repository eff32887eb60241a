"""Linear attention (parallel, causal chunked, recurrent) and the exact softmax references.

Every form is compared in float64 to the quadratic formula written out by hand
(``conftest.lin_attn_ref``: A = phi(q) phi(k)^T, masked with tril when causal, out = A v / A 1),
at 1e-10, so a causal path that ignores q or k (the xformers bug) cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from conftest import F64, lin_attn_ref, randn, softmax_attn_ref, with_norm

import kernelapprox as ka

TOL = {"rtol": 1e-10, "atol": 1e-10}
B, H, N, D, DV = 2, 3, 37, 4, 3


def make_map(name: str, d: int = D):
    if name == "positive":
        return ka.PositiveRF(d, 16, sampler="orthogonal", seed=0, dtype=F64)
    if name == "hyperbolic":
        return ka.HyperbolicRF(d, 8, seed=1, dtype=F64)
    if name == "trig":  # signed features: inputs kept small so denominators stay far from 0
        return ka.TrigRF(d, 64, seed=2, dtype=F64)
    if name == "elu":
        return ka.EluFeatures(d)
    raise AssertionError(name)


MAP_NAMES = ["positive", "hyperbolic", "trig", "elu"]


def qkv(n=N, m=None, seed=0, scale=0.5, lead=(B, H)):
    m = n if m is None else m
    q = randn(*lead, n, D, seed=seed, scale=scale)
    k = randn(*lead, m, D, seed=seed + 1, scale=scale)
    v = randn(*lead, m, DV, seed=seed + 2)
    return q, k, v


def scale_for(name):
    return 0.3 if name == "trig" else 0.5


# --------------------------------------------------------------------------- parallel and causal vs hand


@pytest.mark.parametrize("name", MAP_NAMES)
def test_noncausal_equals_hand_formula(name):
    fm = make_map(name)
    q, k, v = qkv(n=11, m=23, scale=scale_for(name))
    out = ka.linear_attention(q, k, v, fm)
    assert out.shape == (B, H, 11, DV) and out.dtype == F64
    torch.testing.assert_close(out, lin_attn_ref(fm(q), fm(k), v, causal=False), **TOL)


def test_noncausal_elu_written_out():
    """Katharopoulos et al.: phi = elu + 1, written with torch.nn.functional, no library features."""
    q, k, v = qkv(n=9, m=13, scale=1.5)
    pq, pk = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    expected = (pq @ (pk.mT @ v)) / (pq @ pk.sum(-2, keepdim=True).mT)
    torch.testing.assert_close(ka.linear_attention(q, k, v, ka.EluFeatures(D)), expected, **TOL)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 64, 100])
@pytest.mark.parametrize("name", MAP_NAMES)
def test_causal_equals_masked_quadratic(name, chunk_size):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk_size)
    assert out.shape == (B, H, N, DV) and out.dtype == F64
    torch.testing.assert_close(out, lin_attn_ref(fm(q), fm(k), v, causal=True), **TOL)


def test_causal_depends_on_q_and_k():
    """The reference changes when q (or k) changes, and the library follows it exactly.
    A causal path that ignores q and k (xformers: running mean of v) is rejected."""
    fm = make_map("positive")
    q, k, v = qkv()
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    base = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16)
    for q2, k2 in ((q[..., perm, :], k), (q, k[..., perm, :]), (2 * q, k), (q, -k)):
        ref2 = lin_attn_ref(fm(q2), fm(k2), v, causal=True)
        assert (ref2 - base).abs().max() > 1e-3  # the test input really changes the answer
        torch.testing.assert_close(
            ka.linear_attention(q2, k2, v, fm, causal=True, chunk_size=16), ref2, **TOL
        )
    # a q/k-independent output (the xformers bug) is far from the reference
    running_mean = v.cumsum(-2) / torch.arange(1, N + 1, dtype=F64)[:, None]
    assert (running_mean - base).abs().max() > 1e-2


def test_noncausal_last_row_equals_causal_last_row():
    fm = make_map("positive")
    q, k, v = qkv()
    c = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=5)
    nc = ka.linear_attention(q, k, v, fm, causal=False)
    torch.testing.assert_close(c[..., -1, :], nc[..., -1, :], **TOL)
    assert (c[..., 0, :] - nc[..., 0, :]).abs().max() > 1e-3


@pytest.mark.parametrize("name", MAP_NAMES)
def test_recurrent_equals_causal(name):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    rnn = ka.RecurrentLinearAttention(fm)
    steps = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(N)], dim=-2)
    assert steps.shape == (B, H, N, DV)
    torch.testing.assert_close(steps, lin_attn_ref(fm(q), fm(k), v, causal=True), **TOL)
    torch.testing.assert_close(steps, ka.linear_attention(q, k, v, fm, causal=True, chunk_size=7), **TOL)


# --------------------------------------------------------------------------- state hand-over


@pytest.mark.parametrize("prefix", [1, 13, 32, 36])
@pytest.mark.parametrize("name", ["positive", "trig", "elu"])
def test_state_handover_chunked(name, prefix):
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    whole = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=8)
    o1, st = ka.linear_attention(
        q[..., :prefix, :],
        k[..., :prefix, :],
        v[..., :prefix, :],
        fm,
        causal=True,
        chunk_size=16,
        return_state=True,
    )
    o2 = ka.linear_attention(
        q[..., prefix:, :],
        k[..., prefix:, :],
        v[..., prefix:, :],
        fm,
        causal=True,
        chunk_size=5,
        initial_state=st,
    )
    torch.testing.assert_close(torch.cat([o1, o2], -2), whole, **TOL)


@pytest.mark.parametrize("name", ["positive", "hyperbolic", "elu"])
def test_state_handover_to_recurrent(name):
    """A prompt processed in parallel hands over to token-by-token decoding."""
    fm = make_map(name)
    q, k, v = qkv(scale=scale_for(name))
    p = 20
    o1, st = ka.linear_attention(
        q[..., :p, :], k[..., :p, :], v[..., :p, :], fm, causal=True, return_state=True
    )
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    o2 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(p, N)], dim=-2)
    torch.testing.assert_close(torch.cat([o1, o2], -2), lin_attn_ref(fm(q), fm(k), v, causal=True), **TOL)


def test_state_handover_when_key_scale_grows():
    """Keys of the continuation have much larger norm than the prompt's: the stabilised state must be
    rescaled, not overwritten (float64 keeps the hand reference finite at these norms)."""
    fm = make_map("positive")
    q, k, v = qkv(scale=0.3)
    k = k.clone()
    k[..., 20:, :] = with_norm(k[..., 20:, :], 4.0)
    q[..., 20:, :] = with_norm(q[..., 20:, :], 3.0)
    ref = lin_attn_ref(fm(q), fm(k), v, causal=True)
    o1, st = ka.linear_attention(
        q[..., :20, :], k[..., :20, :], v[..., :20, :], fm, causal=True, return_state=True
    )
    o2 = ka.linear_attention(
        q[..., 20:, :], k[..., 20:, :], v[..., 20:, :], fm, causal=True, initial_state=st
    )
    torch.testing.assert_close(torch.cat([o1, o2], -2), ref, **TOL)
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    o3 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(20, N)], dim=-2)
    torch.testing.assert_close(o3, ref[..., 20:, :], **TOL)


def test_returned_state_values():
    """state.S = sum_j phi(k_j) v_j^T, state.z = sum_j phi(k_j) (true, unstabilised values)."""
    fm = make_map("hyperbolic")
    q, k, v = qkv()
    _, st = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=6, return_state=True)
    pk = fm(k)
    torch.testing.assert_close(st.S, pk.mT @ v, **TOL)
    torch.testing.assert_close(st.z, pk.sum(-2), **TOL)


def test_noncausal_with_initial_state():
    """Non-causal queries over (prompt keys from a state) + (new keys) = attention over all keys."""
    fm = make_map("positive")
    q, k, v = qkv()
    _, st = ka.linear_attention(
        q[..., :15, :], k[..., :15, :], v[..., :15, :], fm, causal=True, return_state=True
    )
    out = ka.linear_attention(q[..., 15:, :], k[..., 15:, :], v[..., 15:, :], fm, initial_state=st)
    torch.testing.assert_close(out, lin_attn_ref(fm(q[..., 15:, :]), fm(k), v, causal=False), **TOL)


# --------------------------------------------------------------------------- batch shapes of the map


def test_per_head_projection_in_attention():
    fm = ka.PositiveRF(D, 16, seed=3, batch_shape=(H,), dtype=F64)
    q, k, v = qkv()
    for causal in (False, True):
        out = ka.linear_attention(q, k, v, fm, causal=causal, chunk_size=8)
        for h in range(H):
            single = ka.PositiveRF.from_projection(fm.weight[h])
            ref = lin_attn_ref(single(q[:, h]), single(k[:, h]), v[:, h], causal=causal)
            torch.testing.assert_close(out[:, h], ref, **TOL)


def test_monte_carlo_batch_in_attention():
    S = 4
    fm = ka.PositiveRF(D, 16, seed=3, batch_shape=(S, 1, 1), dtype=F64)
    q, k, v = qkv()
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=8)
    assert out.shape == (S, B, H, N, DV)
    for s in range(S):
        single = ka.PositiveRF.from_projection(fm.weight[s, 0, 0])
        torch.testing.assert_close(out[s], lin_attn_ref(single(q), single(k), v, causal=True), **TOL)


# --------------------------------------------------------------------------- exact references


def test_softmax_kernel_exact():
    q, k = randn(2, 7, 5, seed=0, scale=2.0), randn(2, 9, 5, seed=1, scale=2.0)
    K = ka.softmax_kernel(q, k)
    assert K.shape == (2, 7, 9) and K.dtype == F64
    torch.testing.assert_close(K, torch.exp(q @ k.mT), rtol=1e-14, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("norm", [1.0, 10.0], ids=["norm1", "norm10"])
def test_softmax_attention_matches_torch(causal, norm):
    n = 29
    q = with_norm(randn(B, H, n, D, seed=0), norm)
    k = with_norm(randn(B, H, n if causal else 17, D, seed=1), norm)
    v = randn(B, H, k.shape[-2], DV, seed=2)
    ref = softmax_attn_ref(q, k, v, causal)
    assert torch.isfinite(ref).all()
    for chunk_size in (4, 1024):  # memory-bounded path: queries in chunks
        out = ka.softmax_attention(q, k, v, causal=causal, chunk_size=chunk_size)
        assert out.shape == ref.shape and out.dtype == F64
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_softmax_attention_float32_large_logits_finite():
    q = with_norm(randn(2, 64, 16, seed=0), 10.0).float()
    k = with_norm(randn(2, 64, 16, seed=1), 10.0).float()
    v = randn(2, 64, 8, seed=2).float()
    for causal in (False, True):
        out = ka.softmax_attention(q, k, v, causal=causal)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        ref = softmax_attn_ref(q.double(), k.double(), v.double(), causal)
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-4)
