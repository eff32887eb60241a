"""The accelerator's causal forms of positive maps with log2 features, on CPU tensors through
``KERNELAPPROX_BACKEND=accelerator``: the chunked log-domain scan
(`kernelapprox.attention.linear.chunk_logscan`) above ``backends.SHORT_CALL_N`` and the quadratic
form (`kernelapprox.attention.linear.quadratic`) below it.

Each form is held to the exact float64 answer (`exact_linear_attention`) forward and to the plain
float64 quadratic formula forward (1e-10) and backward (1e-8), with padding and with states
(a segmented prefill equals the whole); a survey at norms 4, 16, 128 in float32 and bfloat16 finds
no row off by more than 0.5; the scan compiles with ``fullgraph=True``; a causal call has the same
number of aten operations at n = 256 and n = 4096 and reads nothing on the host; the dispatch
takes the quadratic form below ``SHORT_CALL_N`` and the scan from it on.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
import torch
from _sync import host_syncs
from conftest import F64, randn
from torch.utils._python_dispatch import TorchDispatchMode

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention._common import shared_state
from kernelapprox.attention.linear import chunk
from kernelapprox.attention.linear.chunk_logscan import causal_log_scan
from kernelapprox.attention.linear.naive_gated import exact_linear_attention, naive_gated_linear_attention
from kernelapprox.attention.linear.quadratic import quadratic_log_attention

LOG2_MAPS = ["positive", "hyperbolic", "oprf", "saderf", "sderf", "hedgehog"]
FORMS = ["scan", "quadratic"]


@pytest.fixture
def accelerator(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")


def _force(monkeypatch, form: str) -> None:
    """Every call of the test takes ``form`` (``SHORT_CALL_N`` moved below or above it)."""
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")
    monkeypatch.setattr(backends, "SHORT_CALL_N", 0 if form == "scan" else 10**9)


def _map(name: str, d: int = 4, dtype=F64):
    est = ka.get_estimator(name)
    fm = est.build(d, 16, seed=3, dtype=dtype)
    if est.data_dependent:
        fm.fit(randn(2, 3, 30, d, seed=20, scale=0.5, dtype=dtype), randn(2, 3, 30, d, seed=21, scale=0.5, dtype=dtype))
    return fm


def _leaves(n=37, seed=11, scale=0.5):
    q = randn(2, 3, n, 4, seed=seed, scale=scale)
    k = randn(2, 3, n, 4, seed=seed + 1, scale=scale)
    v = randn(2, 3, n, 3, seed=seed + 2)
    return [t.clone().requires_grad_(True) for t in (q, k, v)]


def _check(out, ref, leaves, tol=1e-10):
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    w = randn(*out.shape, seed=5)  # a random cotangent: no gradient cancels by symmetry
    g_fast = torch.autograd.grad((out * w).sum(), leaves)
    g_ref = torch.autograd.grad((ref * w).sum(), leaves)
    for a, b, what in zip(g_fast, g_ref, "qkv", strict=True):
        assert b.abs().max() > 0, what
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=f"d/d{what}")


def _masked_reference(fm, q, k, v, pad):
    A = fm(q) @ fm.key_features(k).mT
    n = q.shape[-2]
    A = A * torch.ones(n, n, dtype=F64).tril() * (~pad)[:, None, None, :]
    return (A @ v) / A.sum(-1, keepdim=True).clamp_min(1e-300)


# ------------------------------------------------------------------------------ the forms themselves
@pytest.mark.parametrize("form", [causal_log_scan, quadratic_log_attention])
def test_forms_equal_the_gated_recurrence_with_every_option(form):
    """Log-features of spread +-60 (features 2^60 apart), float64: the forms against the gated
    recurrence written plainly, in natural and base-2 logs, with padding, states and batch
    broadcasting; the returned state is the recurrence's."""
    g = torch.Generator().manual_seed(0)
    n = 45
    lq = 20 * torch.randn(2, 1, n, 6, generator=g, dtype=F64)
    lk = 20 * torch.randn(1, 3, n, 6, generator=g, dtype=F64)
    v = torch.randn(2, 3, n, 4, generator=g, dtype=F64)
    pad = torch.zeros(2, 1, n, dtype=torch.bool)
    pad[0, 0, :5] = True
    pad[1, 0, 17:30] = True
    kw = dict(chunk=16, tile=4) if form is causal_log_scan else dict(tile=4)
    res = form(lq, lk, v, log2=False, key_padding_mask=pad, return_state=True, **kw)
    ref, (S, m) = naive_gated_linear_attention(lq, lk.masked_fill(pad.unsqueeze(-1), -math.inf), v)
    den = res.den.unsqueeze(-1)
    out = torch.where(den > 0, res.num / den.clamp_min(1e-300), 0.0)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    assert bool((res.den[..., 5:] >= 1).all()) and bool((res.den[0, :, :5] == 0).all())
    assert bool((res.shift[0, :, :5] == -math.inf).all())
    assert res.state is not None
    true = res.state.kv * res.state.log_scale.exp()
    torch.testing.assert_close(true, S * m.exp().unsqueeze(-1), rtol=1e-10, atol=1e-200)
    res2 = form(lq / math.log(2), lk / math.log(2), v, log2=True, key_padding_mask=pad, **kw)
    torch.testing.assert_close(res2.num / res2.den.clamp_min(1e-300).unsqueeze(-1),
                               res.num / res.den.clamp_min(1e-300).unsqueeze(-1), rtol=1e-9, atol=1e-9)
    # segmented: the state after 20 tokens continues the call
    a = form(lq[..., :20, :], lk[..., :20, :], v[..., :20, :], log2=False, key_padding_mask=pad[..., :20],
             return_state=True, **kw)
    b = form(lq[..., 20:, :], lk[..., 20:, :], v[..., 20:, :], log2=False, key_padding_mask=pad[..., 20:],
             initial_state=a.state, **kw)
    seg = torch.cat([a.num / a.den.clamp_min(1e-300).unsqueeze(-1), b.num / b.den.unsqueeze(-1)], dim=-2)
    torch.testing.assert_close(seg, out, rtol=1e-10, atol=1e-10)


def test_scan_delay_and_block_read_the_right_keys():
    """``delay``: query i reads keys j <= i - delay; ``block``: the blocks <= i // block - 2."""
    g = torch.Generator().manual_seed(1)
    n, w = 29, 4
    lq, lk = torch.randn(2, 2, n, 5, generator=g, dtype=F64).unbind(0)
    v = torch.randn(2, n, 3, generator=g, dtype=F64)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    for kw, keep in ((dict(delay=w, chunk=8, tile=4), j <= i - w), (dict(block=w), j // w <= i // w - 2)):
        res = causal_log_scan(lq, lk, v, log2=False, **kw)
        A = torch.logsumexp(lq[:, :, None] + lk[:, None], dim=-1).masked_fill(~keep, -math.inf)
        top = A.amax(-1, keepdim=True)
        wgt = torch.where(top > -math.inf, torch.exp(A - top.clamp(min=-1e300)), 0.0)
        ref = torch.where(top > -math.inf, (wgt @ v) / wgt.sum(-1, keepdim=True).clamp_min(1e-300), 0.0)
        out = torch.where(res.den.unsqueeze(-1) > 0, res.num / res.den.clamp_min(1e-300).unsqueeze(-1), 0.0)
        torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="initial_state and return_state"):
        causal_log_scan(lq, lk, v, delay=2, return_state=True)
    with pytest.raises(ValueError, match="chunk must be an int >= 1"):
        causal_log_scan(lq, lk, v, chunk=0)


# ------------------------------------------------------------------------------ through linear_attention
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", LOG2_MAPS)
def test_forms_equal_the_quadratic_reference_forward_and_backward(monkeypatch, form, name):
    """n = 37 (chunks of 16 in tiles of 8, a partial one): the exact float64 answer forward, the
    plain quadratic formula forward (1e-10) and backward (1e-8)."""
    _force(monkeypatch, form)
    fm = _map(name)
    q, k, v = _leaves()
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16)
    exact = exact_linear_attention(q, k, v, fm, causal=True)
    torch.testing.assert_close(out.detach(), exact, rtol=1e-10, atol=1e-10)
    _check(out, ka.naive_linear_attention(q, k, v, fm, causal=True), (q, k, v))


@pytest.mark.parametrize("form", FORMS)
def test_forms_with_padding_forward_and_backward(monkeypatch, form):
    """Padded keys take no part; rows before the first valid key are 0 with finite gradients."""
    _force(monkeypatch, form)
    fm = _map("oprf")
    q, k, v = _leaves()
    pad = torch.zeros(2, 37, dtype=torch.bool)
    pad[0, :3] = True
    pad[1, [4, 9, 10, 22, 36]] = True
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16, key_padding_mask=pad)
    assert torch.equal(out[0, :, :3], torch.zeros_like(out[0, :, :3]))
    torch.testing.assert_close(out.detach(), exact_linear_attention(q, k, v, fm, causal=True, key_padding_mask=pad),
                               rtol=1e-10, atol=1e-10)
    _check(out, _masked_reference(fm, q, k, v, pad), (q, k, v))


@pytest.mark.parametrize("second", FORMS)
@pytest.mark.parametrize("first", FORMS)
def test_segmented_prefill_equals_the_whole(monkeypatch, first, second):
    """A prefix by one form, its state (per-feature scales, and the same brought to one shared
    scale) into the other: the whole sequence, forward and backward (through the state too)."""
    fm = _map("positive")
    q, k, v = _leaves(seed=31)
    split = 13
    _force(monkeypatch, first)
    o1, st = ka.linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, causal=True,
                                 chunk_size=8, return_state=True)
    assert st.log_scale.shape == (2, 3, 16, 1)
    _force(monkeypatch, second)
    o2 = ka.linear_attention(q[..., split:, :], k[..., split:, :], v[..., split:, :], fm, causal=True,
                             chunk_size=16, initial_state=st)
    ref = ka.naive_linear_attention(q, k, v, fm, causal=True)
    _check(torch.cat([o1, o2], -2), ref, (q, k, v))
    shared = shared_state(st.detach())
    assert shared is not None and shared.log_scale.shape == (2, 3, 1, 1)
    o2s = ka.linear_attention(q[..., split:, :], k[..., split:, :], v[..., split:, :], fm, causal=True,
                              initial_state=shared)
    torch.testing.assert_close(o2s, o2, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_decoding_continues_the_returned_state(monkeypatch, form):
    fm = _map("oprf")
    q, k, v = (t.detach() for t in _leaves(seed=51))
    _force(monkeypatch, form)
    split = 30
    o1, st = ka.linear_attention(q[..., :split, :], k[..., :split, :], v[..., :split, :], fm, causal=True,
                                 chunk_size=8, return_state=True)
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    o2 = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(split, q.shape[-2])], -2)
    ref = exact_linear_attention(q, k, v, fm, causal=True)
    torch.testing.assert_close(torch.cat([o1, o2], -2), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_returned_state_equals_the_cpu_paths(monkeypatch, form):
    fm = _map("sderf")
    q, k, v = (t.detach() for t in _leaves(seed=41))
    _force(monkeypatch, form)
    _, st = ka.linear_attention(q, k, v, fm, causal=True, return_state=True)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    _, ref = ka.linear_attention(q, k, v, fm, causal=True, return_state=True)
    torch.testing.assert_close(st.S, ref.S, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(st.z, ref.z, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ norms up to 128
_N, _D = 40, 4


def _survey_inputs(norm, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 2, _N, _D, generator=g).unbind(0)
    v = torch.randn(2, _N, 3, generator=g)
    return norm * q / q.norm(dim=-1, keepdim=True), norm * k / k.norm(dim=-1, keepdim=True), v


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", LOG2_MAPS)
def test_no_row_off_at_norms_up_to_128(monkeypatch, form, name):
    """Rule of the survey in test_attention_gated.py: no row off the float64 exact answer by more
    than 0.5 (values N(0, 1)) or non-finite, at |q| = |k| = 4, 16, 128, float32 and bfloat16
    inputs, with finite gradients."""
    _force(monkeypatch, form)
    est = ka.get_estimator(name)
    fm = est.build(dim=_D, num_features=16, seed=0)
    bad = []
    for i, norm in enumerate((4.0, 16.0, 128.0)):
        q, k, v = _survey_inputs(norm, i)
        if fm.data_dependent:
            fm.fit(q, k)
        for dt in (torch.float32, torch.bfloat16):
            qq, kk, vv = q.to(dt).detach().requires_grad_(), k.to(dt).detach().requires_grad_(), v.to(dt)
            out = ka.linear_attention(qq, kk, vv, fm, causal=True, chunk_size=16)
            ref = exact_linear_attention(qq, kk, vv, fm, causal=True)
            err = (out.detach().double() - ref).abs().amax(-1)
            wrong = (err > 0.5) | ~torch.isfinite(err)
            if wrong.any():
                bad.append((norm, str(dt), int(wrong.sum()), float(err[wrong].max())))
            out.float().sum().backward()
            assert qq.grad is not None and kk.grad is not None
            if not (bool(qq.grad.isfinite().all()) and bool(kk.grad.isfinite().all())):
                bad.append((norm, str(dt), "gradient not finite"))
    assert not bad, bad


# ------------------------------------------------------------------------------ device properties
def test_scan_compiles_with_fullgraph(monkeypatch):
    _force(monkeypatch, "scan")
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = (randn(1, 2, 40, 8, seed=s, dtype=torch.float32) * 0.5 for s in (1, 2, 3))
    pad = torch.zeros(1, 40, dtype=torch.bool)
    pad[0, :3] = True

    def fn(q, k, v):
        return ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16, key_padding_mask=pad)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = fn(*ref_leaves)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    ref.sum().backward()
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert a.grad is not None and b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


class _OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def test_causal_call_has_the_same_op_count_at_n_256_and_4096(accelerator):
    """Forward and backward of a causal call on the accelerator path (the scan above
    ``SHORT_CALL_N``): the same aten operations, as many, at both lengths."""
    fm = ka.PositiveRF(8, 16, seed=0)
    counts = []
    for n in (256, 4096):
        q, k, v = (randn(1, 1, n, 8, seed=s, dtype=torch.float32).mul(0.5).requires_grad_() for s in (1, 2, 3))
        with _OpCount() as probe:
            out = ka.linear_attention(q, k, v, fm, causal=True)
            out.sum().backward()
        counts.append(probe.ops)
    assert counts[0] == counts[1], (counts[0] - counts[1]) + (counts[1] - counts[0])
    assert sum(counts[0].values()) < 500  # 393 today, views included


@pytest.mark.parametrize("form", FORMS)
def test_forms_have_no_host_sync(monkeypatch, form):
    _force(monkeypatch, form)
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = (randn(2, 2, 50, 8, seed=s, dtype=torch.float32) * 0.5 for s in (1, 2, 3))
    pad = torch.zeros(2, 50, dtype=torch.bool)
    pad[1, :4] = True
    assert not host_syncs(ka.linear_attention, q, k, v, fm, causal=True)
    _, st = ka.linear_attention(q, k, v, fm, causal=True, return_state=True)
    qg = q.clone().requires_grad_()

    def train():
        out, _ = ka.linear_attention(qg, k, v, fm, causal=True, key_padding_mask=pad, initial_state=st,
                                     return_state=True)
        out.sum().backward()

    assert not host_syncs(train)


def test_dispatch_short_calls_quadratic_longer_ones_the_scan(accelerator, monkeypatch):
    N = backends.SHORT_CALL_N
    assert backends.attention_plan("cpu", torch.float32, n=N - 1, gated=True, grad=True).path == "quadratic"
    assert backends.attention_plan("cpu", torch.float32, n=N, gated=True, grad=True).path == "torch"
    called = []
    real_q, real_s = chunk.quadratic_log_attention, chunk.causal_log_scan
    monkeypatch.setattr(chunk, "quadratic_log_attention", lambda *a, **kw: called.append("quadratic") or real_q(*a, **kw))
    monkeypatch.setattr(chunk, "causal_log_scan", lambda *a, **kw: called.append("scan") or real_s(*a, **kw))
    fm = ka.PositiveRF(8, 16, seed=0)
    for n in (N - 1, N):
        q, k, v = (randn(1, n, 8, seed=s, dtype=torch.float32) * 0.5 for s in (1, 2, 3))
        ka.linear_attention(q, k, v, fm, causal=True)
    assert called == ["quadratic", "scan"]
    with pytest.MonkeyPatch.context() as mp:  # the CPU's own algorithms without the switch
        mp.delenv(backends.ENV_VAR)
        ka.linear_attention(q, k, v, fm, causal=True)
    assert called == ["quadratic", "scan"]


def test_float64_map_in_float32_inputs_keeps_float64(monkeypatch):
    """The forms compute in the promoted dtype (float64 map: float64 features and shifts)."""
    _force(monkeypatch, "scan")
    fm = copy.deepcopy(_map("positive"))
    q, k, v = (t.detach().float() for t in _leaves())
    out = ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact_linear_attention(q, k, v, fm, causal=True), rtol=1e-6, atol=1e-6)
