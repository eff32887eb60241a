"""The flex path of hybrid attention (`kernelapprox.attention.hybrid.flex`): flex_attention on
the exact sets plus a delayed per-feature log-domain scan, merged under one normaliser.

On the CPU eager flex_attention has a forward (no backward), so the path is checked here in
float64 against the quadratic reference, at large norms against a float64 log-domain
reference, for a fixed number of operations whatever n, and for the dispatch that chooses it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.hybrid import (
    chunk_hybrid_attention,
    exact_set_mask,
    hybrid_attention,
    naive_hybrid_attention,
)
from kernelapprox.attention.hybrid.flex import flex_hybrid_attention
from kernelapprox.attention.hybrid.logfeatures import log_features_pair

F64 = torch.float64
POSITIVE = [e.name for e in ka.estimators() if e.positive]

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _qkv(b=2, n=37, d=6, dv=5, seed=0, scale=0.5, dtype=F64):
    g = torch.Generator().manual_seed(seed)
    q, k = (scale * torch.randn(2, b, n, d, generator=g, dtype=dtype)).unbind(0)
    v = torch.randn(b, n, dv, generator=g, dtype=dtype)
    return q, k, v


@pytest.fixture
def forced_flex(monkeypatch):
    monkeypatch.setattr(backends, "hybrid_path", lambda device, dtype, requires_grad: "flex")


@pytest.mark.parametrize("n", [23, 64, 101])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_flex_merge_equals_the_dense_hybrid_in_float64(n, causal, mode, forced_flex):
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=n)
    sink_sets = [0, 3, [4, 9]] + ([] if causal else [[-1, 2]])
    worst = 0.0
    for w in (0, 1, 5, 16, n - 1):  # causal window 0: the remainder alone, per feature
        for sinks in sink_sets:
            ref = naive_hybrid_attention(q, k, v, fm, window=w, sinks=sinks, causal=causal, window_mode=mode)
            out = hybrid_attention(q, k, v, fm, window=w, sinks=sinks, causal=causal, window_mode=mode)
            worst = max(worst, float((out - ref).abs().max()))
    assert worst < 1e-10


@pytest.mark.parametrize("causal", [True, False])
def test_flex_merge_with_padding_and_broadcast(causal):
    fm = ka.PositiveRF(6, 16, seed=1, dtype=F64)
    g = torch.Generator().manual_seed(3)
    q = 0.5 * torch.randn(2, 3, 29, 6, generator=g, dtype=F64)
    k = 0.5 * torch.randn(2, 1, 29, 6, generator=g, dtype=F64)
    v = torch.randn(2, 3, 29, 4, generator=g, dtype=F64)
    pad = torch.zeros(2, 29, dtype=torch.bool)
    pad[1, 21:] = True
    for mode in ("token", "block"):
        out = flex_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode=mode,
                                    key_padding_mask=pad[:, None])
        ref = naive_hybrid_attention(q, k, v, fm, window=4, sinks=1, causal=causal, window_mode=mode,
                                     key_padding_mask=pad[:, None])
        real = ~pad[:, None, :, None].expand_as(out)
        assert float((out - ref)[real].abs().max()) < 1e-10


def test_flex_reads_the_state_up_to_the_last_key_outside_the_exact_set():
    # the remainder alone (a map with phi = 1 on every key): query i averages the keys j <= p(i)
    # with p(i) the last key not in its exact set, read off exact_set_mask
    n, w = 19, 4
    S = exact_set_mask(n, window=w, causal=True)
    rem = torch.ones(n, n, dtype=torch.bool).tril() & ~S
    for i in range(n):
        cols = rem[i].nonzero().flatten().tolist()
        assert cols == list(range(0, i - w + 1))


def _log_reference(q, k, v, fm, window, sinks, mode, causal):
    fm64 = copy.deepcopy(fm).double()
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[-2]
    S = exact_set_mask(n, window=window, sinks=sinks, window_mode=mode, causal=causal)
    lq, lk = log_features_pair(fm64, q, k)
    rem = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), -1)
    scores = torch.where(S, q @ k.mT, rem)
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("name", POSITIVE)
def test_flex_path_has_no_wrong_rows_at_large_norms(name, forced_flex):
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 40, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 40, 3, generator=g)
    bad = {}
    for norm in (2, 4, 8, 32, 128):
        q, k = (norm * dirs).unbind(0)
        if name == "relu":
            q, k = q.abs(), k.abs()
        if fm.data_dependent:
            fm.fit(q, k)
        for causal in (True, False):
            for mode in ("token", "block"):
                ref = _log_reference(q, k, v, fm, 3, 1, mode, causal)
                out = hybrid_attention(q, k, v, fm, window=3, sinks=1, window_mode=mode, causal=causal)
                err = (out.double() - ref).abs().amax(-1)
                n_bad = int((~(err <= 0.5)).sum())
                if n_bad:
                    bad[(norm, mode, causal)] = n_bad
    assert bad == {}


class _OpCount(TorchDispatchMode):
    """Counts the operators dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_flex_path_op_count_does_not_grow_with_n(causal, mode, forced_flex, monkeypatch):
    # the window term (one flex_attention call and its block mask) runs outside the mode and
    # counts as one operator: dispatch modes cannot enter flex_attention's higher-order operator
    from torch.utils._python_dispatch import _disable_current_modes

    import kernelapprox.attention.hybrid.flex as flex_mod

    real = flex_mod._window_term

    def window_term(*a, **kw):
        probe.count += 1
        with _disable_current_modes():
            return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "_window_term", window_term)
    fm = ka.PositiveRF(8, 16, seed=0)
    counts = []
    for n in (256, 2048):
        q, k, v = _qkv(b=1, n=n, d=8, dv=8, dtype=torch.float32)
        q, k, v = q[None], k[None], v[None]  # (1, 1, n, d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _OpCount() as probe:
                hybrid_attention(q, k, v, fm, window=16, sinks=1, causal=causal, window_mode=mode)
        counts.append(probe.count)
    assert counts[0] == counts[1], counts


def test_hybrid_path_choice(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    assert backends.hybrid_path("cpu", torch.float32, False) == "torch"
    assert backends.hybrid_path("meta", torch.float32, True) == "torch"
    monkeypatch.setattr(backends, "is_accelerator", lambda device: True)
    assert backends.hybrid_path("cuda", torch.bfloat16, True) == "flex"
    assert backends.hybrid_path("cuda", torch.float32, False) == "flex"
    monkeypatch.setattr(backends, "has_flex_attention", lambda: False)
    assert backends.hybrid_path("cuda", torch.float32, False) == "torch"
    monkeypatch.setattr(backends, "has_flex_attention", lambda: True)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    assert backends.hybrid_path("cuda", torch.float32, True) == "torch"
    monkeypatch.setattr(backends, "is_accelerator", lambda device: False)
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")  # the CPU forward only (no flex backward there)
    assert backends.hybrid_path("cpu", torch.float32, False) == "flex"
    assert backends.hybrid_path("cpu", torch.float32, True) == "torch"


def test_dispatch_takes_flex_only_where_it_applies(monkeypatch):
    import kernelapprox.attention.hybrid.flex as flex_mod

    calls = []
    real = flex_mod.flex_hybrid_attention

    def spy(*a, **kw):
        calls.append(kw)
        return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "flex_hybrid_attention", spy)
    q, k, v = _qkv(n=20)
    pos = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    hybrid_attention(q, k, v, pos, window=3, causal=True)
    assert calls == []  # the CPU takes the torch forms
    monkeypatch.setattr(backends, "hybrid_path", lambda device, dtype, requires_grad: "flex")
    hybrid_attention(q, k, v, pos, window=3, causal=True)
    assert len(calls) == 1
    trig = ka.get_estimator("trig").build(6, 16, seed=0, dtype=F64) if "trig" in [
        e.name for e in ka.estimators()] else None
    if trig is not None:  # signed maps keep the torch forms
        hybrid_attention(q, k, v, trig, window=3, causal=True)
    hybrid_attention(q, k, v, pos, window=0)  # non-causal, no window: the parallel form (per-feature shifts)
    assert len(calls) == 1
    # a causal token-window segment with a state takes it too, and a causal call without a window (the
    # remainder per feature, the sinks exact); the calls it cannot take raise in the torch forms
    _, st = hybrid_attention(q, k, v, pos, window=3, causal=True, return_state=True)
    hybrid_attention(q, k, v, pos, window=3, causal=True, initial_state=st)
    assert len(calls) == 3 and calls[1]["return_state"] and calls[2]["initial_state"] is st
    hybrid_attention(q, k, v, pos, window=0, sinks=1, causal=True)
    assert len(calls) == 4
    calls.clear()
    with pytest.raises(ValueError, match="causal=True"):
        hybrid_attention(q, k, v, pos, window=3, return_state=True)
    with pytest.raises(ValueError, match="block"):
        hybrid_attention(q, k, v, pos, window=3, causal=True, window_mode="block", initial_state=st)
    with pytest.raises(ValueError, match="padded"):
        hybrid_attention(q, k, v, pos, window=3, causal=True, return_state=True,
                         key_padding_mask=torch.zeros(2, 20, dtype=torch.bool))
    assert calls == []


def test_flex_refuses_what_it_cannot_compute():
    q, k, v = _qkv(n=12)
    with pytest.raises(ValueError, match="window"):
        flex_hybrid_attention(q, k, v, ka.PositiveRF(6, 16, seed=0, dtype=F64), window=0)
    signed = [e for e in ka.estimators() if not e.positive]
    if signed:
        fm = signed[0].build(6, 16, seed=0, dtype=F64)
        with pytest.raises(ValueError, match="positive"):
            flex_hybrid_attention(q, k, v, fm, window=2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_torch_window_term_forward_and_backward_equal_the_dense_hybrid(causal, mode):
    # window_term="torch": the same merge with the window in plain torch, differentiable on the CPU
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=45)
    pad = torch.zeros(2, 45, dtype=torch.bool)
    pad[1, 40:] = True
    for w, sinks in ((1, 0), (4, 2), (7, [3, 20, 33])):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = flex_hybrid_attention(*leaves, fm, window=w, sinks=sinks, causal=causal, window_mode=mode,
                                    key_padding_mask=pad, window_term="torch")
        ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        ref = naive_hybrid_attention(*ref_leaves, fm, window=w, sinks=sinks, causal=causal, window_mode=mode,
                                     key_padding_mask=pad)
        real = ~pad[:, :, None].expand_as(out)
        assert float((out - ref)[real].abs().max()) < 1e-10
        g = torch.randn_like(out) * real
        grads = torch.autograd.grad((out * g).sum(), leaves)
        ref_grads = torch.autograd.grad((ref * g).sum(), ref_leaves)
        for a, b in zip(grads, ref_grads, strict=True):
            assert float((a - b).abs().max()) < 1e-9


@pytest.mark.parametrize("name", ["positive", "saderf", "sderf", "oprf"])
def test_torch_window_term_has_no_wrong_causal_rows_at_large_norms(name):
    if name not in POSITIVE:
        pytest.skip(f"{name} is not a registered positive map")
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 40, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 40, 3, generator=g)
    bad = {}
    for norm in (2, 8, 32, 128):
        q, k = (norm * dirs).unbind(0)
        if fm.data_dependent:
            fm.fit(q, k)
        for mode in ("token", "block"):
            for dt in (torch.float32, torch.bfloat16):
                # float64 on the inputs the call receives (bf16 rounding moves logits of ~|q||k| by ~1%)
                ref = _log_reference(q.to(dt), k.to(dt), v.to(dt), fm, 3, 1, mode, True)
                out = flex_hybrid_attention(q.to(dt), k.to(dt), v.to(dt), fm, window=3, sinks=1, causal=True,
                                            window_mode=mode, window_term="torch")
                err = (out.double() - ref).abs().amax(-1)
                n_bad = int((~(err <= 0.5)).sum())
                if n_bad:
                    bad[(norm, mode, str(dt))] = n_bad
    assert bad == {}


@pytest.mark.parametrize("name", ["oprf", "saderf", "sderf"])
def test_flex_causal_remainder_alone_has_no_wrong_rows_at_large_norms(name, forced_flex, monkeypatch):
    # window = 0 (linear attention with exact sinks) on the accelerator's path, no host read as on a
    # device: per feature, as with a window (the shared-scale chunked form it took before, unrescued
    # there, lost 7 to 48 rows of 48 of the fitted maps here)
    from kernelapprox.attention.hybrid import core

    monkeypatch.setattr(core, "_host_checks", lambda q: False)
    g = torch.Generator().manual_seed(0)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    dirs = torch.randn(2, 2, 24, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 24, 3, generator=g)
    bad = {}
    for norm in (16.0, 128.0):
        q, k = (norm * dirs).unbind(0)
        fm.fit(q, k)
        for dt in (torch.float32, torch.bfloat16):
            for sinks in (0, 1):
                ref = _log_reference(q.to(dt), k.to(dt), v.to(dt), fm, 0, sinks, "token", True)
                out = hybrid_attention(q.to(dt), k.to(dt), v.to(dt), fm, window=0, sinks=sinks, causal=True)
                err = (out.double() - ref).abs().amax(-1)
                if not bool((err <= 0.5).all()):
                    bad[(norm, str(dt), sinks)] = int((~(err <= 0.5)).sum())
    assert bad == {}


# ------------------------------------------------------------------------------ segments with a state
def _segments(q, k, v, fm, cuts, window_term="flex", **kw):
    """The flex form over the segments ``[0, c1), [c1, c2), ..., [c_last, n)``, the state carried;
    the outputs concatenated and the last state."""
    outs, st, prev = [], None, 0
    for c in [*cuts, q.shape[-2]]:
        sl = slice(prev, c)
        out, st = flex_hybrid_attention(q[..., sl, :], k[..., sl, :], v[..., sl, :], fm, causal=True,
                                        initial_state=st, return_state=True, window_term=window_term, **kw)
        outs.append(out)
        prev = c
    return torch.cat(outs, dim=-2), st


@pytest.mark.parametrize("window_term", ["flex", "torch"])
def test_flex_segments_equal_the_dense_hybrid_and_the_chunked_state_in_float64(window_term):
    # windows shorter and longer than a segment (10**12: the buffer follows the tokens seen), sinks
    # inside a segment, inside the carried window buffer and before it; cuts at 1 token and near the end
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=41)
    worst = worst_state = 0.0
    for w in (0, 1, 3, 8, 10**12):
        for sinks in (0, 2, [0, 3, 9, 20, 33]):
            ref = naive_hybrid_attention(q, k, v, fm, window=w, sinks=sinks, causal=True)
            _, ref_st = chunk_hybrid_attention(q, k, v, fm, window=w, sinks=sinks, return_state=True)
            for cuts in ((1,), (17,), (3, 9, 30), (40,)):
                out, st = _segments(q, k, v, fm, cuts, window_term, window=w, sinks=sinks)
                worst = max(worst, float((out - ref).abs().max()))
                a, b = st.kv * st.log_scale.exp(), ref_st.kv * ref_st.log_scale.exp()
                worst_state = max(worst_state, float((a - b).abs().max() / b.abs().max()))
                assert st.log_scale.shape == (2, 16, 1) and st.position == 41 and st.keys.shape[-2] == min(w, 41)
                assert torch.equal(st.keys, ref_st.keys) and torch.equal(st.values, ref_st.values)
                assert st.sink_positions == ref_st.sink_positions and torch.equal(st.sink_keys, ref_st.sink_keys)
    assert worst < 1e-10 and worst_state < 1e-10


def test_flex_segment_with_padding_broadcast_a_shared_scale_state_and_a_decoder():
    fm = ka.PositiveRF(6, 16, seed=1, dtype=F64)
    g = torch.Generator().manual_seed(3)
    q = 0.5 * torch.randn(2, 3, 29, 6, generator=g, dtype=F64)
    k = 0.5 * torch.randn(2, 1, 29, 6, generator=g, dtype=F64)
    v = torch.randn(2, 3, 29, 4, generator=g, dtype=F64)
    pad = torch.zeros(2, 1, 29, dtype=torch.bool)
    pad[1, :, 24:] = True
    kw = dict(window=4, sinks=1, causal=True)
    ref = naive_hybrid_attention(q, k, v, fm, key_padding_mask=pad, **kw)
    a, st = flex_hybrid_attention(q[..., :10, :], k[..., :10, :], v[..., :10, :], fm, return_state=True, **kw)
    b = flex_hybrid_attention(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], fm, initial_state=st,
                              key_padding_mask=pad[..., 10:], **kw)
    real = ~pad[..., None].expand(2, 3, 29, 4)
    assert float((torch.cat([a, b], dim=-2) - ref)[real].abs().max()) < 1e-10
    # a state at one scale (an older checkpoint), and decoding from the flex form's state
    ref = naive_hybrid_attention(q, k, v, fm, **kw)[..., 10:, :]
    G = st.log_scale.amax(dim=-2, keepdim=True)
    shared = ka.attention.hybrid.HybridAttentionState(st.kv * (st.log_scale - G).exp(), G, st.keys, st.values,
                                                       st.sink_keys, st.sink_values, st.sink_positions,
                                                       st.position, st.window)
    b = flex_hybrid_attention(q[..., 10:, :], k[..., 10:, :], v[..., 10:, :], fm, initial_state=shared, **kw)
    assert float((b - ref).abs().max()) < 1e-10
    rnn = ka.attention.hybrid.RecurrentHybridAttention(fm, window=4, sinks=1, state=st)
    dec = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(10, 29)], dim=-2)
    assert float((dec - ref).abs().max()) < 1e-10


def test_flex_segment_gradients_equal_the_dense_hybrid():
    # the torch window term (a backward on the CPU; flex_attention's backward runs on accelerators)
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=30)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    kw = dict(window=4, sinks=[0, 7], causal=True, window_term="torch")
    a, st = flex_hybrid_attention(*(t[:, :11] for t in leaves), fm, return_state=True, **kw)
    b, st = flex_hybrid_attention(*(t[:, 11:] for t in leaves), fm, initial_state=st, return_state=True, **kw)
    ref_leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = naive_hybrid_attention(*ref_leaves, fm, window=4, sinks=[0, 7], causal=True)
    _, ref_st = chunk_hybrid_attention(*ref_leaves, fm, window=4, sinks=[0, 7], return_state=True)
    g = torch.randn_like(ref)
    gs = torch.randn_like(ref_st.kv)
    loss = (torch.cat([a, b], dim=1) * g).sum() + (st.kv * st.log_scale.exp() * gs).sum()
    ref_loss = (ref * g).sum() + (ref_st.kv * ref_st.log_scale.exp() * gs).sum()
    for x, y in zip(torch.autograd.grad(loss, leaves), torch.autograd.grad(ref_loss, ref_leaves), strict=True):
        assert float((x - y).abs().max()) < 1e-9


def test_flex_refuses_states_it_cannot_carry():
    fm = ka.PositiveRF(6, 16, seed=0, dtype=F64)
    q, k, v = _qkv(n=12)
    _, st = flex_hybrid_attention(q, k, v, fm, window=3, causal=True, return_state=True)
    with pytest.raises(ValueError, match="causal=True"):
        flex_hybrid_attention(q, k, v, fm, window=3, initial_state=st)
    with pytest.raises(ValueError, match="block"):
        flex_hybrid_attention(q, k, v, fm, window=3, causal=True, window_mode="block", return_state=True)
    with pytest.raises(ValueError, match="padded"):
        flex_hybrid_attention(q, k, v, fm, window=3, causal=True, return_state=True,
                              key_padding_mask=torch.zeros(2, 12, dtype=torch.bool))
    with pytest.raises(TypeError, match="return_state"):
        flex_hybrid_attention(q, k, v, fm, window=3, causal=True, return_state=1)
    with pytest.raises(ValueError, match="window=3"):
        flex_hybrid_attention(q, k, v, fm, window=4, causal=True, initial_state=st)


def test_flex_segment_op_count_does_not_grow_with_n(forced_flex, monkeypatch):
    from torch.utils._python_dispatch import _disable_current_modes

    import kernelapprox.attention.hybrid.flex as flex_mod

    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = (t[None] for t in _qkv(b=1, n=40, d=8, dv=8, dtype=torch.float32))
    _, st = hybrid_attention(q, k, v, fm, window=16, sinks=[0, 30], causal=True, return_state=True)
    real = flex_mod._window_term

    def window_term(*a, **kw):
        probe.count += 1
        with _disable_current_modes():
            return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "_window_term", window_term)
    counts = []
    for n in (256, 2048):
        q, k, v = (t[None] for t in _qkv(b=1, n=n, d=8, dv=8, dtype=torch.float32))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with _OpCount() as probe:
                hybrid_attention(q, k, v, fm, window=16, sinks=[0, 30], causal=True, initial_state=st,
                                 return_state=True)
        counts.append(probe.count)
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("name", ["sderf", pytest.param("oprf", marks=pytest.mark.slow)])  # a compile: ~4 s a dtype
def test_compiled_flex_segments_have_no_wrong_rows_at_large_norms(name, forced_flex):
    # torch.compile(fullgraph=True): the segmented prefill and its state in one graph, no host read
    # (the chunked form it took before does not compile with fullgraph, and unrescued it returned
    # wrong rows of the fitted maps at these norms)
    from kernelapprox.attention.hybrid.naive import exact_hybrid_attention

    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(2, 2, 24, 4, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 24, 3, generator=g)
    fm = ka.get_estimator(name).build(4, 16, seed=0)
    kw = dict(window=4, sinks=1, causal=True, chunk_size=4)

    def segmented(q, k, v):
        a, st = hybrid_attention(q[:, :9], k[:, :9], v[:, :9], fm, return_state=True, **kw)
        b = hybrid_attention(q[:, 9:], k[:, 9:], v[:, 9:], fm, initial_state=st, **kw)
        return torch.cat([a, b], dim=1)

    torch._dynamo.reset()
    compiled = torch.compile(segmented, fullgraph=True, backend="aot_eager")
    bad = {}
    for norm in (16.0, 128.0):
        q, k = (norm * dirs).unbind(0)
        fm.fit(q, k)
        for dt in (torch.float32, torch.bfloat16):
            qq, kk, vv = q.to(dt), k.to(dt), v.to(dt)
            ref = exact_hybrid_attention(qq, kk, vv, fm, window=4, sinks=1, causal=True)
            with torch.no_grad():
                out = compiled(qq, kk, vv)
            err = (out.double() - ref).abs().amax(-1)
            if not bool((err <= 0.5).all()):
                bad[(norm, str(dt))] = int((~(err <= 0.5)).sum())
    torch._dynamo.reset()
    assert bad == {}


@pytest.mark.parametrize("sinks", [0, [0, 5, 37]])
@pytest.mark.parametrize("grad", [False, True])
def test_flex_segments_do_not_sync(sinks, grad, forced_flex, monkeypatch):
    # a causal call with a state on the accelerator's path: the state's window buffer, its sinks and its
    # per-feature linear part read on the device, the next state built there, no value read into Python
    # (tests/test_host_sync_hybrid.py's rule: the ops of tests/_sync.py and the data-dependent shapes).
    # flex_attention itself runs outside the counter (a dispatch mode cannot enter its higher-order
    # operator); with a gradient the CPU takes the torch window term, counted whole.
    from _sync import HostSyncCounter
    from torch.utils._python_dispatch import _disable_current_modes

    import kernelapprox.attention.hybrid.flex as flex_mod

    data_dependent = {"aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique2"}

    class Counter(HostSyncCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if func._schema.name in data_dependent:
                self.syncs[func._schema.name] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    real = flex_mod._window_term

    def window_term(*a, **kw):
        with _disable_current_modes():
            return real(*a, **kw)

    monkeypatch.setattr(flex_mod, "_window_term", window_term)
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = _qkv(b=2, n=40, d=8, dv=8, dtype=torch.float32)
    kw = dict(window=4, sinks=sinks, causal=True)
    _, st = hybrid_attention(q[:, :13], k[:, :13], v[:, :13], fm, return_state=True, **kw)
    q, k, v = (t[:, 13:].clone().requires_grad_(grad) for t in (q, k, v))
    with Counter() as c:
        if grad:
            out, st = flex_hybrid_attention(q, k, v, fm, initial_state=st, return_state=True, window_term="torch", **kw)
            (out.sum() + st.kv.sum()).backward()
        else:
            hybrid_attention(q, k, v, fm, initial_state=st, return_state=True, **kw)
    assert dict(c.syncs) == {}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["oprf", "sderf"])
def test_flex_segments_on_the_device_at_large_norms(name, dtype):
    # a segmented prefill on the device (no host read, so no rescue: the flex form carries the state)
    # against the float64 log-domain reference, and its gradients at |q| = |k| = 16
    from kernelapprox.attention.hybrid.naive import exact_hybrid_attention

    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(2, 2, 96, 8, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 96, 4, generator=g)
    fm = ka.get_estimator(name).build(8, 32, seed=0)
    kw = dict(window=8, sinks=1, causal=True)
    for norm in (16.0, 128.0):
        q, k = (norm * dirs).unbind(0)
        fm.fit(q, k)
        q, k, v = (t.to(dtype) for t in (q, k, v))
        leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        ref = exact_hybrid_attention(*leaves, fm, **kw)
        w_out = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        ref_grads = torch.autograd.grad((ref * w_out).sum(), leaves)
        fm_d = copy.deepcopy(fm).cuda()
        qd, kd, vd = (t.cuda().requires_grad_(True) for t in (q, k, v))
        a, st = hybrid_attention(qd[:, :37], kd[:, :37], vd[:, :37], fm_d, return_state=True, **kw)
        b = hybrid_attention(qd[:, 37:], kd[:, 37:], vd[:, 37:], fm_d, initial_state=st, **kw)
        out = torch.cat([a, b], dim=1)
        assert bool(((out.double().cpu() - ref.detach()).abs().amax(-1) <= 0.5).all())
        if norm > 16:  # the gradients where every weight is still a normal number in float32
            continue
        grads = torch.autograd.grad((out.double() * w_out.cuda()).sum(), (qd, kd, vd))
        for gd, gr in zip(grads, ref_grads, strict=True):
            assert torch.isfinite(gd).all()
            assert float((gd.double().cpu() - gr).abs().max()) <= 1e-2 * max(1.0, float(gr.abs().max()))


# ------------------------------------------------------------------------------ block masks
def _window_cases():
    # (n, offset, w, causal, block, sinks, padded): tiles of 128, windows inside a tile and across
    # several, a segment after buffered keys, sinks in the first and in a later tile
    for n, off in ((100, 0), (300, 0), (513, 0), (200, 77), (260, 300)):
        for w in (1, 16, 130, 300):
            for causal in (True, False):
                for block in (False, True):
                    if off and not causal:
                        continue
                    yield n, off, w, causal, block, (0, 5, 140), off == 0 and n == 300


@pytest.mark.parametrize("case", list(_window_cases()))
def test_window_block_mask_covers_every_exact_pair(case):
    """The structural block mask lists a superset of the tiles `create_block_mask` finds (every
    tile holding a pair of the exact sets), and eager flex_attention over it gives the same output
    and log-sum-exp in float64."""
    from torch.nn.attention.flex_attention import create_block_mask

    from kernelapprox.attention.hybrid.flex import _window_term, exact_set_mask_mod, window_block_mask

    n, off, w, causal, block, sinks, padded = case
    ne = off + n
    g = torch.Generator().manual_seed(n + w)
    L = 2
    q = torch.randn(L, n, 8, generator=g, dtype=torch.float64)
    k = torch.randn(L, ne, 8, generator=g, dtype=torch.float64)
    v = torch.randn(L, ne, 4, generator=g, dtype=torch.float64)
    sink_pos = torch.zeros(ne, dtype=torch.bool)
    sink_pos[[s for s in sinks if s < ne]] = True
    pad = None
    if padded:
        pad = torch.zeros(L, ne, dtype=torch.bool)
        pad[1, 150:170] = True

    mask_mod = exact_set_mask_mod(w, causal, block, off, sink_pos, pad, torch.device("cpu"))

    ref = create_block_mask(mask_mod, L if pad is not None else None, None, n, ne, device="cpu")
    ours = window_block_mask(mask_mod, n, ne, w, causal, block, off, sink_pos, torch.device("cpu"))
    theirs = ref.to_dense().any(0).any(0)  # (q tiles, kv tiles): tiles with a pair of the exact sets
    mine = ours.to_dense()[0, 0].bool()
    assert mine.shape == theirs.shape
    assert not (theirs.bool() & ~mine).any(), "a tile with exact pairs is missing"
    # and flex_attention over it: the window term equals the dense one
    out, lse = _window_term(q, k, v, w, sink_pos, causal, block, pad, offset=off)
    A = torch.full((L, n, ne), float("-inf"), dtype=torch.float64)
    i = torch.arange(n).view(n, 1)
    j = torch.arange(ne).view(1, ne)
    keep = torch.stack([mask_mod(torch.tensor(b), 0, i, j).expand(n, ne) for b in range(L)])
    A = torch.where(keep, q @ k.mT, A)
    lse_ref = torch.logsumexp(A, -1)
    out_ref = torch.nan_to_num(torch.softmax(A, -1)) @ v
    seen = torch.isfinite(lse_ref)
    assert torch.allclose(out[seen], out_ref[seen], atol=1e-12, rtol=1e-10)
    assert torch.allclose(lse[seen], lse_ref[seen].to(lse.dtype), atol=1e-10)


def test_flex_attention_is_compiled_on_accelerators():
    """On an accelerator (a meta tensor stands in) the window term calls a compiled flex_attention,
    made once (the eager one materialises the n x n scores); on the CPU, for float64 and inside
    torch.compile, the eager one."""
    from torch.nn.attention.flex_attention import flex_attention

    from kernelapprox.attention.hybrid import flex as fx

    dev = fx._flex_attention(torch.empty(1, device="meta"))
    assert dev is not flex_attention and fx._flex_attention(torch.empty(1, device="meta")) is dev
    assert fx._flex_attention(torch.empty(1, device="meta", dtype=torch.bfloat16)) is dev
    assert fx._flex_attention(torch.empty(1)) is flex_attention
    assert fx._flex_attention(torch.empty(1, device="meta", dtype=torch.float64)) is flex_attention


@pytest.mark.parametrize("block", [False, True])
def test_window_term_compiles_with_fullgraph(block):
    """The flex window term (structural block mask, flex_attention) traces into one graph, as it
    must inside a compiled model on a device; its output and log-sum-exp equal the eager ones."""
    from kernelapprox.attention.hybrid.flex import _window_term

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 300, 8, generator=g) for _ in range(3))
    sink = torch.zeros(300, dtype=torch.bool)
    sink[0] = True
    ref = _window_term(q, k, v, 16, sink, True, block, None)
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: _window_term(q, k, v, 16, sink, True, block, None), backend="aot_eager",
                      fullgraph=True)
    out = f(q, k, v)
    torch._dynamo.reset()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
