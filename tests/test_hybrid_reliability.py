"""Hybrid attention under faults and limits: a window that covers the sequence is softmax
attention in every mode (no crash, no window-sized allocation), memory follows the tokens seen
(not the window or the sink count), bad ``eps`` is refused by name, and decoding states load
with ``weights_only=True`` and are refused when forged, inconsistent or continued with other
sinks, batches or value widths.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernelapprox as ka
from kernelapprox.attention.hybrid import HybridAttentionState, hybrid_attention
from kernelapprox.attention.hybrid.naive import naive_hybrid_attention
from kernelapprox.attention.hybrid.recurrent import RecurrentHybridAttention

F64 = torch.float64


def _qkv(b=2, n=24, d=4, dv=4, seed=0, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(2, b, n, d, generator=g, dtype=dtype)).unbind(0)
    v = torch.randn(b, n, dv, generator=g, dtype=dtype)
    return q, k, v


# ------------------------------------------------------------------ window >= n is softmax attention
@pytest.mark.parametrize("name", ["elu", "relu", "positive"])
@pytest.mark.parametrize("mode", ["token", "block"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [24, 25, 39, 10**6])
def test_window_covering_the_sequence_is_softmax(name, mode, causal, window):
    # elu/relu have F = d = 4 < dv + 1: the non-causal token form crashed on a too narrow buffer
    fm = ka.get_estimator(name).build(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv()
    if name == "relu":
        q, k = q.abs(), k.abs()
    out = hybrid_attention(q, k, v, fm, window=window, causal=causal, window_mode=mode, sinks=1)
    torch.testing.assert_close(out, ka.softmax_attention(q, k, v, causal=causal), rtol=1e-12, atol=1e-12)


def test_window_covering_the_sequence_with_padding():
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv()
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[1, 20:] = True
    for mode in ("token", "block"):
        for causal in (False, True):
            out = hybrid_attention(q, k, v, fm, window=30, causal=causal, window_mode=mode, key_padding_mask=pad)
            ref = ka.softmax_attention(q, k, v, causal=causal, key_padding_mask=pad)
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op produces under it."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_block_window_does_not_allocate_by_the_window(causal):
    # window 4096 at n = 10 formed a 4096 x 4096 block per batch x head; 100 000 tried 80 GB
    fm = ka.PositiveRF(4, 16, seed=0)
    q, k, v = _qkv(n=10, dtype=torch.float32)
    for window in (4096, 100_000):
        with _LargestTensor() as probe:
            out = hybrid_attention(q, k, v, fm, window=window, window_mode="block", causal=causal)
        assert probe.largest <= 2 * 10 * 10 * 4
        torch.testing.assert_close(out, ka.softmax_attention(q, k, v, causal=causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_block_window_empty_batch(causal):
    fm = ka.PositiveRF(4, 16, seed=0)
    q, k, v = (torch.zeros(0, 12, 4) for _ in range(3))
    for mode in ("token", "block"):
        out = hybrid_attention(q, k, v, fm, window=3, window_mode=mode, causal=causal)
        assert out.shape == (0, 12, 4)


# ------------------------------------------------------------------ memory by the tokens seen
def test_huge_window_and_sink_count_in_decoding():
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=6)
    for window, sinks in ((10**12, 0), (2, 10**12), (10**12, 10**12)):
        rnn = RecurrentHybridAttention(fm, window=window, sinks=sinks)
        outs = torch.stack([rnn.step(q[:, t], k[:, t], v[:, t]) for t in range(6)], -2)
        torch.testing.assert_close(outs, ka.softmax_attention(q, k, v, causal=True), rtol=1e-10, atol=1e-10)
        assert rnn.state.keys.shape[-2] == min(window, 6)
        out, st = hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=True, return_state=True)
        torch.testing.assert_close(out, outs, rtol=1e-10, atol=1e-10)
        assert st.keys.shape[-2] == min(window, 6) and len(st.sink_positions) == min(sinks, 6)


def test_causal_sink_count_larger_than_the_sequence():
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=12)
    for mode in ("token", "block"):
        out = hybrid_attention(q, k, v, fm, window=2, sinks=10**12, causal=True, window_mode=mode)
        torch.testing.assert_close(out, ka.softmax_attention(q, k, v, causal=True), rtol=1e-10, atol=1e-10)


def test_state_handover_with_growing_buffer_matches_one_call():
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=20)
    ref = naive_hybrid_attention(q, k, v, fm, window=8, sinks=[1, 9], causal=True)
    o1, st = hybrid_attention(q[:, :5], k[:, :5], v[:, :5], fm, window=8, sinks=[1, 9], causal=True,
                              return_state=True)
    assert st.keys.shape[-2] == 5
    o2, st = hybrid_attention(q[:, 5:11], k[:, 5:11], v[:, 5:11], fm, window=8, sinks=[1, 9], causal=True,
                              initial_state=st, return_state=True)
    rnn = RecurrentHybridAttention(fm, window=8, sinks=[1, 9], state=st)
    o3 = torch.stack([rnn.step(q[:, t], k[:, t], v[:, t]) for t in range(11, 20)], -2)
    torch.testing.assert_close(torch.cat([o1, o2, o3], -2), ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ eps
BAD_EPS = [(float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError), (0.0, ValueError),
           ("x", TypeError), (None, TypeError), (True, TypeError)]


@pytest.mark.parametrize(("eps", "err"), BAD_EPS)
def test_eps_is_checked(eps, err):
    fm = ka.TrigRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=8)
    for kw in (dict(causal=False), dict(causal=True), dict(causal=False, window_mode="block"),
               dict(causal=True, window_mode="block")):
        with pytest.raises(err, match="eps"):
            hybrid_attention(q, k, v, fm, window=2, eps=eps, **kw)
    with pytest.raises(err, match="eps"):
        RecurrentHybridAttention(fm, window=2, eps=eps)


# ------------------------------------------------------------------ states
def _state(n=7, window=3, sinks=(1,)):
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=n)
    _, st = hybrid_attention(q, k, v, fm, window=window, sinks=list(sinks), causal=True, return_state=True)
    return fm, st


def test_state_loads_with_weights_only():
    fm, st = _state()
    buf = io.BytesIO()
    torch.save({"state": st}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=True)["state"]
    assert isinstance(back, HybridAttentionState)
    assert back.sink_positions == st.sink_positions and back.position == st.position
    for f in ("kv", "log_scale", "keys", "values", "sink_keys", "sink_values"):
        assert torch.equal(getattr(back, f), getattr(st, f))
    q, k, v = _qkv(n=3, seed=5)
    a = hybrid_attention(q, k, v, fm, window=3, sinks=[1], causal=True, initial_state=st)
    b = hybrid_attention(q, k, v, fm, window=3, sinks=[1], causal=True, initial_state=back)
    assert torch.equal(a, b)


def _forge(st, **kw):
    fields = dict(kv=st.kv, log_scale=st.log_scale, keys=st.keys, values=st.values, sink_keys=st.sink_keys,
                  sink_values=st.sink_values, sink_positions=st.sink_positions, position=st.position,
                  window=st.window)
    fields.update(kw)
    return HybridAttentionState(**fields)


@pytest.mark.parametrize(("change", "match"), [
    (dict(position=-1), "position"),
    (dict(window=-2), "window"),
    (dict(position=1.5), "position"),
    (lambda st: dict(keys=st.keys[..., :2, :], values=st.values[..., :2, :]), "ring buffer"),
    (dict(sink_positions=(1, 2)), "sink"),
    (dict(sink_positions=(9,)), "sink_positions"),
    (dict(sink_positions=(-1,)), "sink_positions"),
    (lambda st: dict(sink_keys=st.sink_keys[..., :0, :]), "sink"),
    (lambda st: dict(log_scale=st.log_scale[..., 0, :]), "log_scale"),
    (lambda st: dict(kv=st.kv[..., :-1]), "kv"),
])
def test_forged_states_are_refused(change, match):
    _, st = _state()
    kw = change(st) if callable(change) else change
    with pytest.raises((ValueError, TypeError), match=match):
        _forge(st, **kw)


def test_forged_state_after_loading_is_refused_at_use():
    fm, st = _state()
    object.__setattr__(st, "position", -3)  # as a tampered checkpoint would deliver it
    q, k, v = _qkv(n=3)
    with pytest.raises(ValueError, match="position"):
        hybrid_attention(q, k, v, fm, window=3, sinks=[1], causal=True, initial_state=st)
    with pytest.raises(ValueError, match="position"):
        RecurrentHybridAttention(fm, window=3, sinks=[1], state=st)


@pytest.mark.parametrize("other", [0, 2, [2], [1, 3]])
def test_continuation_with_other_sinks_is_refused(other):
    fm, st = _state(sinks=(1,))
    q, k, v = _qkv(n=3)
    with pytest.raises(ValueError, match="other sinks"):
        hybrid_attention(q, k, v, fm, window=3, sinks=other, causal=True, initial_state=st)
    with pytest.raises(ValueError, match="other sinks"):
        RecurrentHybridAttention(fm, window=3, sinks=other, state=st)


def test_continuation_with_later_sinks_is_allowed():
    fm, st = _state(sinks=(1,))  # position 7: a sink at 9 has not arrived yet
    q, k, v = _qkv(n=3)
    hybrid_attention(q, k, v, fm, window=3, sinks=[1, 9], causal=True, initial_state=st)


def test_recurrent_batch_or_value_width_change_is_refused():
    fm = ka.PositiveRF(4, 16, seed=0, dtype=F64)
    rnn = RecurrentHybridAttention(fm, window=3, sinks=1)
    q, k, v = _qkv(b=2, n=2)
    rnn.step(q[:, 0], k[:, 0], v[:, 0])
    with pytest.raises(ValueError, match="batch"):
        rnn.step(q[:1, 1], k[:1, 1], v[:1, 1])
    q3, k3, v3 = _qkv(b=3, n=1)
    with pytest.raises(ValueError, match="batch"):
        rnn.step(q3[:, 0], k3[:, 0], v3[:, 0])
    with pytest.raises(ValueError, match="v_t"):
        rnn.step(q[:, 1], k[:, 1], torch.randn(2, 5, dtype=F64))
    rnn.step(q[:, 1], k[:, 1], v[:, 1])  # the state is intact after the refusals
    assert rnn.state.position == 2
    assert math.prod(rnn.state.kv.shape[:-2]) == 2


# ------------------------------------------------------------------ no silently wrong rows at large norms
POSITIVE = [e.name for e in ka.estimators() if e.positive]


def _log_reference(q, k, v, fm, window, sinks, mode):
    """Non-causal hybrid attention from the float64 log-domain scores: q.k on the exact set,
    logsumexp_f(log phi_f(q) + log psi_f(k)) elsewhere, softmax over the keys (no overflow at any
    norm)."""
    from kernelapprox.attention.hybrid import exact_set_mask
    from kernelapprox.attention.hybrid.logfeatures import log_features_pair

    fm64 = copy.deepcopy(fm).double()
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[-2]
    S = exact_set_mask(n, window=window, sinks=sinks, window_mode=mode)
    lq, lk = log_features_pair(fm64, q, k)
    rem = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), -1)
    return torch.softmax(torch.where(S, q @ k.mT, rem), -1) @ v


@pytest.mark.parametrize("name", POSITIVE)
def test_non_causal_forms_have_no_wrong_rows_at_large_norms(name):
    # one shared key scale let the remainder's normaliser underflow: zero or wrong rows from
    # |q|^2 = 4 (positive, hyperbolic, fitted maps) in float32 and bfloat16
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 24, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 24, 3, generator=g)
    bad = {}
    for sq_norm in (4, 16, 32, 64, 128):
        q, k = (sq_norm ** 0.5 * dirs).unbind(0)
        if name == "relu":
            q, k = q.abs(), k.abs()
        if fm.data_dependent:
            fm.fit(q, k)
        for mode in ("token", "block"):
            ref = _log_reference(q, k, v, fm, 3, 1, mode)
            for dt in (torch.float32, torch.bfloat16):
                out = hybrid_attention(q.to(dt), k.to(dt), v.to(dt), fm, window=3, sinks=1, window_mode=mode,
                                       chunk_size=8)
                err = (out.double() - ref).abs().amax(-1)
                n_bad = int((~(err <= 0.5)).sum())
                if n_bad:
                    bad[(sq_norm, mode, str(dt))] = n_bad
    assert bad == {}
