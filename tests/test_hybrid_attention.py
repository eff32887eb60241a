"""Hybrid attention (exact window and sinks, feature map on the remainder, one normaliser).

Every fast form (parallel non-causal, chunked causal, recurrent, and the state handed from one
segment to the next) is compared in float64 with the materialised reference
``kernelapprox.attention.hybrid.naive`` (exact kernel on the masked exact set, phi(q)^T phi(k)
elsewhere, rows normalised), forward at 1e-10 and backward at 1e-8, for every registered map
(data-dependent ones fitted first). The limits window >= n (softmax attention) and window = 0
without sinks (linear attention) are checked against the library's own forms.
"""

from __future__ import annotations

import pytest
import torch
from conftest import F64, randn

import kernelapprox as ka
from kernelapprox.attention.hybrid import (
    HybridAttentionState,
    chunk_hybrid_attention,
    exact_set_mask,
    hybrid_attention,
    parallel_hybrid_attention,
    resolve_sinks,
)
from kernelapprox.attention.hybrid.naive import naive_hybrid_attention
from kernelapprox.attention.hybrid.recurrent import RecurrentHybridAttention

TOL = {"rtol": 1e-10, "atol": 1e-10}
B, H, N, D, DV = 2, 3, 29, 4, 3
ESTIMATOR_NAMES = [e.name for e in ka.estimators()]


def _map(name: str):
    est = ka.get_estimator(name)
    r = 8 if name == "nystrom" else 64 if not est.positive else 16  # nystrom: fewer landmarks than keys
    return est.build(D, r, seed=3, dtype=F64)


def _inputs(name: str = "positive", n: int = N, seed: int = 11, grad: bool = True):
    scale = 0.3 if name.startswith("trig") else 0.5
    q = randn(B, H, n, D, seed=seed, scale=scale)
    k = randn(B, H, n, D, seed=seed + 1, scale=scale)
    v = randn(B, H, n, DV, seed=seed + 2)
    if name == "relu":
        q, k = q.abs() + 0.1, k.abs() + 0.1
    return [t.clone().requires_grad_(grad) for t in (q, k, v)]


def _recurrent(q, k, v, fm, window, sinks, split=None):
    rnn = RecurrentHybridAttention(fm, window=window, sinks=sinks)
    return torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])], -2)


def _handover_chunk(q, k, v, fm, window, sinks, split=11):
    o1, st = chunk_hybrid_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, window=window,
                                    sinks=sinks, chunk_size=4, return_state=True)
    o2 = chunk_hybrid_attention(q[..., split:, :], k[..., split:, :], v[..., split:, :], fm, window=window,
                                sinks=sinks, chunk_size=5, initial_state=st)
    return torch.cat([o1, o2], -2)


def _handover_recurrent(q, k, v, fm, window, sinks, split=13):
    o1, st = hybrid_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, window=window,
                              sinks=sinks, causal=True, chunk_size=8, return_state=True)
    rnn = RecurrentHybridAttention(fm, window=window, sinks=sinks, state=st)
    o2 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(split, q.shape[-2])], -2)
    return torch.cat([o1, o2], -2)


FORMS = {
    # name: (form, causal)
    "parallel4": (lambda q, k, v, fm, w, s: hybrid_attention(q, k, v, fm, window=w, sinks=s, chunk_size=4), False),
    "parallel64": (lambda q, k, v, fm, w, s: parallel_hybrid_attention(q, k, v, fm, window=w, sinks=s), False),
    "chunk1": (lambda q, k, v, fm, w, s: hybrid_attention(q, k, v, fm, window=w, sinks=s, causal=True,
                                                         chunk_size=1), True),
    "chunk6": (lambda q, k, v, fm, w, s: chunk_hybrid_attention(q, k, v, fm, window=w, sinks=s, chunk_size=6), True),
    "chunk64": (lambda q, k, v, fm, w, s: hybrid_attention(q, k, v, fm, window=w, sinks=s, causal=True), True),
    "recurrent": (_recurrent, True),
    "handover_chunk": (_handover_chunk, True),
    "handover_recurrent": (_handover_recurrent, True),
}


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_fast_form_equals_naive_forward_and_backward(name, form):
    fm = _map(name)
    q, k, v = _inputs(name)
    fm.fit(q.detach(), k.detach())  # no-op unless data-dependent (OPRF, FAVOR#, Nystrom)
    fast, causal = FORMS[form]
    window, sinks = 5, [0, 7]
    out = fast(q, k, v, fm, window, sinks)
    ref = naive_hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal)
    assert out.shape == ref.shape and out.dtype == F64
    torch.testing.assert_close(out, ref, **TOL)
    w = randn(*out.shape, seed=5)  # a random cotangent, so no gradient can cancel by symmetry
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        assert b.abs().max() > 0, what
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("window", [0, 1, 9, 29, 100])
@pytest.mark.parametrize("sinks", [3, [0, 5, 27], [1, 28]])
def test_windows_and_sinks_equal_naive(form, window, sinks):
    """Every window size (empty, one key, inside a chunk, across chunks, n - 1, n, > n) and sink
    layout (none, leading, scattered, inside and outside the window) against the reference."""
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    fast, causal = FORMS[form]
    ref = naive_hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal)
    torch.testing.assert_close(fast(q, k, v, fm, window, sinks), ref, **TOL)


def test_negative_sink_positions_count_from_the_end():
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=3, sinks=[0, -1]),
                               hybrid_attention(q, k, v, fm, window=3, sinks=[0, N - 1]), **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [N, 10 * N])
def test_full_window_is_softmax_attention(causal, window):
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    out = hybrid_attention(q, k, v, fm, window=window, causal=causal, chunk_size=8)
    torch.testing.assert_close(out, ka.softmax_attention(q, k, v, causal=causal), **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", ["positive", "trig-sincos", "elu", "taylor"])
def test_empty_window_is_linear_attention(causal, name):
    fm = _map(name)
    q, k, v = _inputs(name, grad=False)
    out = hybrid_attention(q, k, v, fm, window=0, sinks=0, causal=causal, chunk_size=8)
    ref = ka.linear_attention(q, k, v, fm, causal=causal, check=False)
    torch.testing.assert_close(out, ref, **TOL)


def test_recurrent_equals_chunked_step_by_step():
    fm = ka.HyperbolicRF(D, 8, seed=1, dtype=F64)
    q, k, v = _inputs(grad=False)
    ref = chunk_hybrid_attention(q, k, v, fm, window=4, sinks=2, chunk_size=7)
    rnn = RecurrentHybridAttention(fm, window=4, sinks=2)
    sizes = set()
    for t in range(N):
        out = rnn.step(q[..., t, :], k[..., t, :], v[..., t, :])
        torch.testing.assert_close(out, ref[..., t, :], **TOL)
        st = rnn.state
        assert isinstance(st, HybridAttentionState) and st.position == t + 1
        sizes.add((tuple(st.kv.shape), tuple(st.keys.shape), tuple(st.values.shape)))
    assert sizes == {((B, H, 2 * 8, DV + 1), (B, H, 4, D), (B, H, 4, DV))}  # independent of t
    assert rnn.state.sink_keys.shape == (B, H, 2, D)


def test_large_norms_stay_finite_and_match_softmax():
    """Logits of ~+-400: the shared shift keeps every weight <= 1, so nothing overflows, and with a
    window covering everything the result is softmax attention (itself stabilised)."""
    fm = ka.PositiveRF(D, 16, seed=0, dtype=torch.float32)
    q, k, v = (t.float() for t in _inputs(grad=False))
    q, k = q * 40, k * 40
    for causal in (False, True):
        out = hybrid_attention(q, k, v, fm, window=5, sinks=1, causal=causal, chunk_size=8)
        assert out.isfinite().all()
        full = hybrid_attention(q, k, v, fm, window=N, causal=causal)
        torch.testing.assert_close(full, ka.softmax_attention(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("what", ["q", "k", "v"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_non_finite_stays_causal(what, form):
    """A NaN at position j never reaches rows before j (bitwise equal to the clean run), in any
    chunk layout; rows after it are NaN where they depend on it."""
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = (t.float() for t in _inputs(grad=False))
    clean = [t.clone() for t in (q, k, v)]
    j = 17
    {"q": q, "k": k, "v": v}[what][0, 1, j, 0] = float("nan")

    def run(q, k, v):
        if form == "chunk":
            return chunk_hybrid_attention(q, k, v, fm, window=4, sinks=[0, 20], chunk_size=8)
        return _recurrent(q, k, v, fm, 4, [0, 20])

    out, ref = run(q, k, v), run(*clean)
    assert torch.equal(out[0, 1, :j], ref[0, 1, :j])
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0, 0], ref[0, 0])
    assert out[0, 1, j].isnan().any()
    if what != "q":
        assert out[0, 1, j:].isnan().any(-1).all()


def test_16_bit_inputs_are_computed_in_float32():
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(grad=False))
    for causal in (False, True):
        out = hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal)
        assert out.dtype == torch.bfloat16
        ref = hybrid_attention(q.float(), k.float(), v.float(), fm, window=4, sinks=1, causal=causal)
        assert torch.equal(out, ref.to(torch.bfloat16))
    rnn = RecurrentHybridAttention(fm, window=4)
    assert rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :]).dtype == torch.bfloat16


def test_exact_set_mask_convention():
    m = exact_set_mask(6, window=2, sinks=[0], causal=False)
    assert m[3].tolist() == [True, False, True, True, True, False]
    mc = exact_set_mask(6, window=2, sinks=[0], causal=True)
    assert mc[3].tolist() == [True, False, True, True, False, False]
    assert not exact_set_mask(6, window=0).any()
    assert resolve_sinks(torch.tensor([3, 1, 3]), 6, causal=False) == (1, 3)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"window": -1}, ValueError, "window"),
        ({"window": 2.5}, TypeError, "window"),
        ({"window": True}, TypeError, "window"),
        ({"window": 3, "sinks": [N]}, ValueError, "sinks position"),
        ({"window": 3, "sinks": [-N - 1]}, ValueError, "sinks position"),
        ({"window": 3, "sinks": -2}, ValueError, "sinks as a count"),
        ({"window": 3, "sinks": N + 1}, ValueError, "sinks as a count"),
        ({"window": 3, "sinks": -1, "causal": True}, ValueError, "sinks"),
        ({"window": 3, "sinks": [1.5]}, TypeError, "sinks"),
        ({"window": 3, "sinks": "0"}, TypeError, "sinks"),
        ({"window": 3, "chunk_size": 0}, ValueError, "chunk_size"),
        ({"window": 3, "causal": 1}, TypeError, "causal"),
        ({"window": 3, "return_state": True}, ValueError, "causal=True"),
        ({"window": 3, "causal": True, "initial_state": object()}, TypeError, "initial_state"),
    ],
)
def test_bad_arguments_raise(kwargs, exc, match):
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    with pytest.raises(exc, match=match):
        hybrid_attention(q, k, v, fm, **kwargs)


def test_bad_shapes_raise():
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    with pytest.raises(ValueError, match="queries as keys"):
        hybrid_attention(q[..., :5, :], k, v, fm, window=3)
    with pytest.raises(ValueError, match="dim=4"):
        hybrid_attention(q[..., :3], k[..., :3], v, fm, window=3)
    with pytest.raises(ValueError, match="same sequence length"):
        hybrid_attention(q, k, v[..., :5, :], fm, window=3)
    with pytest.raises(TypeError, match="feature_map"):
        hybrid_attention(q, k, v, "positive", window=3)
    _, st = hybrid_attention(q, k, v, fm, window=3, causal=True, return_state=True)
    with pytest.raises(ValueError, match="window=3"):
        hybrid_attention(q, k, v, fm, window=4, causal=True, initial_state=st)
    with pytest.raises(ValueError, match="dv \\+ 1"):
        hybrid_attention(q, k, v[..., :2], fm, window=3, causal=True, initial_state=st)
    rnn = RecurrentHybridAttention(fm, window=3)
    with pytest.raises(ValueError, match="dim=4"):
        rnn.step(q[..., 0, :3], k[..., 0, :], v[..., 0, :])
    with pytest.raises(ValueError, match="window"):
        RecurrentHybridAttention(fm, window=-2)


@pytest.mark.parametrize("window", [1, 3, 9, 10])
@pytest.mark.parametrize("chunk_size", [4, 8, 32])
def test_lengths_that_fill_the_blocks_equal_naive(window, chunk_size):
    """n a multiple of the block size: the non-causal windows are assembled from neighbouring
    blocks (another code path than the padded one), forward and backward."""
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(n=32)
    out = hybrid_attention(q, k, v, fm, window=window, sinks=[0, 3], chunk_size=chunk_size)
    ref = naive_hybrid_attention(q, k, v, fm, window=window, sinks=[0, 3])
    torch.testing.assert_close(out, ref, **TOL)
    with torch.no_grad():  # the in-place path of inference
        torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=window, sinks=[0, 3], chunk_size=chunk_size),
                                   ref.detach(), **TOL)
    w = randn(*out.shape, seed=5)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v)),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("causal, chunk_size", [(False, 4), (False, 64), (True, 1), (True, 6), (True, 64)])
@pytest.mark.parametrize("window, sinks", [(0, [0, 3]), (5, [0, 7, 25]), (9, 2), (29, 0)])
def test_key_padding_equals_naive(causal, chunk_size, window, sinks):
    """Padded keys (a tail, and holes inside windows and at a sink) are in neither the window, nor
    the sinks, nor the remainder: the reference zeroes their columns. Forward and backward; no
    gradient reaches a padded key or value."""
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs()
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 20:] = True
    pad[1, [3, 7, 12]] = True
    out = hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal, chunk_size=chunk_size,
                           key_padding_mask=pad)
    ref = naive_hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal,
                                 key_padding_mask=pad.unsqueeze(1))
    torch.testing.assert_close(out, ref, **TOL)
    w = randn(*out.shape, seed=5)
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    assert (g_fast[1][0, :, 20:] == 0).all() and (g_fast[2][1, :, [3, 7, 12]] == 0).all()


def test_key_padding_with_initial_state_and_float_masks():
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, 15:] = True
    _, st = hybrid_attention(q[..., :9, :], k[..., :9, :], v[..., :9, :], fm, window=4, sinks=1, causal=True,
                             return_state=True)
    out = hybrid_attention(q[..., 9:, :], k[..., 9:, :], v[..., 9:, :], fm, window=4, sinks=1, causal=True,
                           initial_state=st, key_padding_mask=pad[:, 9:])
    ref = naive_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=True, key_padding_mask=pad.unsqueeze(1))
    torch.testing.assert_close(out, ref[..., 9:, :], **TOL)
    additive = torch.zeros(B, N, dtype=F64).masked_fill(pad, float("-inf"))
    torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=4, key_padding_mask=additive),
                               hybrid_attention(q, k, v, fm, window=4, key_padding_mask=pad), **TOL)
    with pytest.raises(ValueError, match="key_padding_mask"):
        hybrid_attention(q, k, v, fm, window=4, key_padding_mask=pad[:, :5])
    with pytest.raises(TypeError, match="key_padding_mask"):
        hybrid_attention(q, k, v, fm, window=4, key_padding_mask=pad.long())


BLOCK_CASES = [(1, 0), (2, [0, 3, 25]), (5, 2), (8, [1, 28]), (10, 0), (15, [0, 20]), (29, 1), (40, 0)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window, sinks", BLOCK_CASES)
@pytest.mark.parametrize("padded", [False, True])
def test_block_window_equals_naive_forward_and_backward(causal, window, sinks, padded):
    """window_mode="block": every block size (one token, dividing n or not, one block, two blocks,
    larger than n), sinks inside and outside the block windows, and key padding, against the
    reference built for the same exact sets (`exact_set_mask(..., window_mode="block")`), forward
    (also the in-place path without autograd) and backward."""
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs()
    pad = None
    if padded:
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[0, 20:] = True
        pad[1, [3, 7, 12]] = True
    kw = {"window": window, "sinks": sinks, "causal": causal, "key_padding_mask": pad}
    out = hybrid_attention(q, k, v, fm, window_mode="block", **kw)
    ref = naive_hybrid_attention(q, k, v, fm, window_mode="block", **{
        **kw, "key_padding_mask": None if pad is None else pad.unsqueeze(1)})
    torch.testing.assert_close(out, ref, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(hybrid_attention(q, k, v, fm, window_mode="block", **kw), ref.detach(), **TOL)
    w = randn(*out.shape, seed=5)
    g_fast = torch.autograd.grad((out * w).sum(), (q, k, v))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        assert b.abs().max() > 0, what
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


@pytest.mark.parametrize("name", ["trig-sincos", "elu", "taylor", "hyperbolic"])
def test_block_window_other_maps_equal_naive(name):
    fm = _map(name)
    q, k, v = _inputs(name, n=32, grad=False)
    for causal in (False, True):
        out = hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode="block")
        ref = naive_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode="block")
        torch.testing.assert_close(out, ref, **TOL)


def test_block_window_limits_and_convention():
    fm = ka.PositiveRF(D, 16, seed=0, dtype=F64)
    q, k, v = _inputs(grad=False)
    for causal in (False, True):  # blocks that cover n: softmax attention
        exact = ka.softmax_attention(q, k, v, causal=causal)
        torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=N, causal=causal, window_mode="block"),
                                   exact, **TOL)
        # window 0: no exact window, as in the token mode
        torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=0, sinks=2, causal=causal,
                                                    window_mode="block"),
                                   hybrid_attention(q, k, v, fm, window=0, sinks=2, causal=causal), **TOL)
    # non-causal: two blocks of 15 cover 29 keys; causal: 15 | 14 covers them too (previous block)
    torch.testing.assert_close(hybrid_attention(q, k, v, fm, window=15, window_mode="block"),
                               ka.softmax_attention(q, k, v), **TOL)
    m = exact_set_mask(8, window=2, window_mode="block")
    assert m[4].tolist() == [False, False, True, True, True, True, True, True]  # blocks 1, 2, 3
    assert m[1].tolist() == [True, True, True, True, False, False, False, False]  # blocks 0, 1
    mc = exact_set_mask(8, window=2, causal=True, window_mode="block")
    assert mc[5].tolist() == [False, False, True, True, True, True, False, False]  # blocks 1, 2 up to 5
    assert mc[4].tolist() == [False, False, True, True, True, False, False, False]
    with pytest.raises(ValueError, match="window_mode"):
        hybrid_attention(q, k, v, fm, window=3, window_mode="tokens")
    with pytest.raises(ValueError, match="window_mode='block' has no state"):
        hybrid_attention(q, k, v, fm, window=3, causal=True, window_mode="block", return_state=True)


@pytest.mark.parametrize("what", ["q", "k", "v"])
def test_block_window_non_finite_stays_causal(what):
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = (t.float() for t in _inputs(grad=False))
    clean = [t.clone() for t in (q, k, v)]
    j = 17
    {"q": q, "k": k, "v": v}[what][0, 1, j, 0] = float("nan")

    def run(q, k, v):
        return hybrid_attention(q, k, v, fm, window=4, sinks=[0, 20], causal=True, window_mode="block")

    out, ref = run(q, k, v), run(*clean)
    assert torch.equal(out[0, 1, :j], ref[0, 1, :j])
    assert torch.equal(out[1], ref[1]) and torch.equal(out[0, 0], ref[0, 0])
    assert out[0, 1, j].isnan().any()


def test_block_window_large_norms_and_16_bit():
    fm = ka.PositiveRF(D, 16, seed=0)
    q, k, v = (t.float() for t in _inputs(grad=False))
    for causal in (False, True):
        out = hybrid_attention(40 * q, 40 * k, v, fm, window=5, sinks=1, causal=causal, window_mode="block")
        assert out.isfinite().all()
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        got = hybrid_attention(qb, kb, vb, fm, window=4, causal=causal, window_mode="block")
        want = hybrid_attention(qb.float(), kb.float(), vb.float(), fm, window=4, causal=causal, window_mode="block")
        assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))


def test_bench_core_hybrid_rows_on_a_small_shape():
    """The hybrid rows of benchmarks.core at a shape that runs in seconds: every time and ratio
    positive and finite, and the memory rows measured in fresh subprocesses."""
    from benchmarks import core as bench_core

    res = bench_core.bench_hybrid(1, 2, 256, 8, 16, torch.device("cpu"), torch.float32, repeats=1, window=16,
                                  rounds=1)
    for kind in ("parallel", "causal"):
        for mode in ("token", "block"):
            val = res[f"hybrid/{kind}_{mode}/linear"]
            assert 0 < val < float("inf")
    mem = bench_core.bench_hybrid_memory(torch.device("cpu"), ns=(512, 2048), B=1, H=2, d=8, r=16, window=16,
                                         tries=1, modes=("block",), causals=(False,))
    assert set(mem) == {"hybrid_mem/parallel_block_peak_mib_n512", "hybrid_mem/parallel_block_peak_mib_n2048",
                        "hybrid_mem/parallel_block_ratio_n2048/n512"}
    assert all(v >= 0 for k, v in mem.items() if "peak" in k)
