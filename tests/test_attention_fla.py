"""The dispatch of causal linear attention (`kernelapprox.backends.attention_plan`) under
monkeypatched capabilities, and the fla adapter against pure-torch functions with fla's exact
contract (``chunk_gla`` / ``chunk_simple_gla``: layout [B, T, H, K], gates in natural log,
``scale``, ``initial_state`` [N, H, K, V], ``output_final_state``, ``cu_seqlens``), run in place
of fla's kernels."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.linear import fla as fla_mod
from kernelapprox.attention.linear.naive_gated import exact_linear_attention
from kernelapprox.backends import AttentionCapabilities, attention_plan

# ------------------------------------------------------------------ fla's contract, in torch


def _recurrence(q, k, v, gate, scale, h0, final, cu_seqlens):
    """S_t = exp(g_t) * S_{t-1} + k_t v_t^T, o_t = scale * q_t^T S_t (per sequence)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        bounds = [(b, 0, T) for b in range(B)]
    else:
        assert B == 1
        c = cu_seqlens.tolist()
        bounds = [(0, c[i], c[i + 1]) for i in range(len(c) - 1)]
    acc = torch.promote_types(torch.float32, v.dtype)  # fla accumulates in float32
    o = torch.zeros(B, T, H, V, dtype=acc)
    states = []
    for i, (b, s, e) in enumerate(bounds):
        S = h0[i].to(acc).clone() if h0 is not None else torch.zeros(H, K, V, dtype=acc)
        for t in range(s, e):
            S = gate(b, t).to(acc).unsqueeze(-1) * S + k[b, t].to(acc).unsqueeze(-1) * v[b, t].to(acc).unsqueeze(-2)
            o[b, t] = scale * (q[b, t].to(acc).unsqueeze(-2) @ S).squeeze(-2)
        states.append(S)
    return o.to(v.dtype), (torch.stack(states) if final else None)


def fake_chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
    assert q.shape == k.shape == g.shape and q.shape[:3] == v.shape[:3]
    assert q.shape[-1] % 2 == 0 and v.shape[-1] % 2 == 0
    assert bool(torch.isfinite(g).all()) and bool((g <= 0).all())
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _recurrence(q, k, v, lambda b, t: torch.exp(g[b, t]), scale, initial_state, output_final_state,
                       cu_seqlens)


def fake_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                          cu_seqlens=None):
    assert q.shape == k.shape and q.shape[:3] == v.shape[:3] and g_gamma is None
    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def gate(b, t):
        one = torch.ones(q.shape[2]) if g is None else torch.exp(g[b, t].float())
        return one.unsqueeze(-1).expand(q.shape[2], q.shape[3])

    return _recurrence(q, k, v, gate, scale, initial_state, output_final_state, cu_seqlens)


@pytest.fixture
def fake_fla(monkeypatch):
    calls = []

    def kernels():
        def gla(*a, **kw):
            calls.append("chunk_gla")
            return fake_chunk_gla(*a, **kw)

        def sgla(*a, **kw):
            calls.append("chunk_simple_gla")
            return fake_chunk_simple_gla(*a, **kw)

        return SimpleNamespace(chunk_gla=gla, chunk_simple_gla=sgla)

    monkeypatch.setattr(fla_mod, "_kernels", kernels)
    return calls


def _bthd(seed, B=2, T=24, H=2, d=4, dv=3, norm=None):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, B, T, H, d, generator=g).unbind(0)
    if norm is not None:
        q = norm * q / q.norm(dim=-1, keepdim=True)
        k = norm * k / k.norm(dim=-1, keepdim=True)
    return q, k, torch.randn(B, T, H, dv, generator=g)


def _ref(q, k, v, fm, pad=None):
    def t(x):
        return (x.transpose(1, 2))
    return t(exact_linear_attention(t(q), t(k), t(v), fm, causal=True, key_padding_mask=pad))


@pytest.mark.parametrize("name", ["positive", "oprf", "hedgehog", "elu", "relu"])
def test_adapter_equals_exact(fake_fla, name):
    est = {e.name: e for e in ka.estimators()}[name]
    q, k, v = _bthd(0, norm=12.0 if name in ("positive", "oprf", "hedgehog") else None)
    fm = est.build(dim=4, num_features=8, seed=0)
    if fm.data_dependent:
        fm.fit(q.transpose(1, 2), k.transpose(1, 2))
    out = fla_mod.fla_linear_attention(q, k, v, fm)
    assert fake_fla == ["chunk_gla" if fla_mod.fla_mode(fm) == "gla" else "chunk_simple_gla"]
    assert (out.double() - _ref(q, k, v, fm)).abs().max() < 1e-4


def test_adapter_padding_cu_seqlens_and_states(fake_fla):
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = _bthd(1, norm=10.0)
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[0, :5] = True  # left padding: the first keys of sequence 0
    pad[1, 20:] = True
    out = fla_mod.fla_linear_attention(q, k, v, fm, key_padding_mask=pad)
    ref = _ref(q, k, v, fm, pad)
    assert (out.double() - ref).abs().max() < 1e-4
    # packed: the two sequences of lengths 24 and 24 in one row, separated by cu_seqlens
    cu = torch.tensor([0, 24, 48])
    packed = fla_mod.fla_linear_attention(
        q.reshape(1, 48, 2, 4), k.reshape(1, 48, 2, 4), v.reshape(1, 48, 2, 3), fm, cu_seqlens=cu)
    assert (packed.reshape(2, 24, 2, 3).double() - _ref(q, k, v, fm)).abs().max() < 1e-4
    # segments: the state of the first half continues in the second (and in the decoder)
    o1, st = fla_mod.fla_linear_attention(q[:, :10], k[:, :10], v[:, :10], fm, return_state=True)
    o2 = fla_mod.fla_linear_attention(q[:, 10:], k[:, 10:], v[:, 10:], fm, initial_state=st)
    full = _ref(q, k, v, fm)
    assert (torch.cat([o1, o2], 1).double() - full).abs().max() < 1e-4
    rnn = ka.RecurrentLinearAttention(fm, state=st)
    dec = torch.stack([rnn.step(q[:, t].transpose(0, 0), k[:, t], v[:, t]) for t in range(10, 24)], dim=1)
    assert (dec.double() - full[:, 10:]).abs().max() < 1e-4
    # and a state from the torch prefill continues on the fla path
    _, st_t = ka.linear_attention(q[:, :10], k[:, :10], v[:, :10], fm, causal=True, return_state=True, layout="bthd")
    o2t = fla_mod.fla_linear_attention(q[:, 10:], k[:, 10:], v[:, 10:], fm, initial_state=st_t)
    assert (o2t.double() - full[:, 10:]).abs().max() < 1e-4
    # packed with initial states per sequence
    _, st2 = fla_mod.fla_linear_attention(q[:, :10], k[:, :10], v[:, :10], fm, return_state=True)
    tail = fla_mod.fla_linear_attention(
        q[:, 10:].reshape(1, 28, 2, 4), k[:, 10:].reshape(1, 28, 2, 4), v[:, 10:].reshape(1, 28, 2, 3), fm,
        cu_seqlens=torch.tensor([0, 14, 28]), initial_state=st2)
    assert (tail.reshape(2, 14, 2, 3).double() - full[:, 10:]).abs().max() < 1e-4


def test_adapter_taylor_lost_rows_are_nan(fake_fla):
    """Taylor (signed features, the ungated path): ordinary rows equal the exact answer; rows lost
    to cancellation (|x| = 1000, every key orthogonal to the query: den / B ~ 1e-12) come back NaN
    (the accelerator's answer, no host read), also packed and continued from a state."""
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    q, k, v = _bthd(5, T=6, H=1)
    q[0, :, 0] = (1e3 * basis[:, 0]).float()
    k[0, :, 0] = (1e3 * basis[:, 1 + torch.arange(6) % 3].mT).float()
    fm = ka.TaylorFeatures(4)
    out = fla_mod.fla_linear_attention(q, k, v, fm, eps=0.0)
    assert fake_fla == ["chunk_simple_gla"]
    assert bool(out[0].isnan().all()) and bool(out[1].isfinite().all())
    assert (out[1].double() - _ref(q[1:], k[1:], v[1:], fm)[0]).abs().max() < 1e-4
    packed = fla_mod.fla_linear_attention(q.reshape(1, 12, 1, 4), k.reshape(1, 12, 1, 4), v.reshape(1, 12, 1, 3),
                                          fm, cu_seqlens=torch.tensor([0, 6, 12]), eps=0.0)
    assert torch.equal(packed.reshape(2, 6, 1, 3).isnan(), out.isnan())
    o1, st = fla_mod.fla_linear_attention(q[:, :3], k[:, :3], v[:, :3], fm, return_state=True, eps=0.0)
    o2 = fla_mod.fla_linear_attention(q[:, 3:], k[:, 3:], v[:, 3:], fm, initial_state=st, eps=0.0)
    assert torch.equal(torch.cat([o1, o2], 1).isnan(), out.isnan())


def test_adapter_backward_matches_torch_path(fake_fla):
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = _bthd(2, T=12)
    w = torch.randn(2, 12, 2, 3, generator=torch.Generator().manual_seed(3))
    grads = []
    for use_fla in (True, False):
        qq, kk, vv = (t.clone().double().requires_grad_() for t in (q, k, v))
        fm64 = ka.PositiveRF(4, 8, seed=0).double()
        if use_fla:
            out = fla_mod.fla_linear_attention(qq, kk, vv, fm64)
        else:
            out = ka.linear_attention(qq, kk, vv, fm64, causal=True, layout="bthd")
        (out * w).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-8)
    del fm


def test_linear_attention_takes_the_fla_path_where_planned(fake_fla, monkeypatch):
    monkeypatch.setattr(backends, "attention_plan", lambda *a, **kw: backends.AttentionPlan("fla"))
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = _bthd(4)
    out = ka.linear_attention(q, k, v, fm, causal=True, layout="bthd")
    assert fake_fla == ["chunk_gla"]
    monkeypatch.undo()
    ref = ka.linear_attention(q, k, v, fm, causal=True, layout="bthd")
    assert (out - ref).abs().max() < 1e-5


# ------------------------------------------------------------------ the dispatch

_H200 = AttentionCapabilities("cuda", (9, 0), "0.6.0", "3.6.0")
_A100 = AttentionCapabilities("cuda", (8, 0), "0.6.0", "3.6.0")


@pytest.mark.parametrize(
    ("device", "dtype", "caps", "gated", "grad", "n", "path", "fallback"),
    [
        ("cpu", torch.float32, AttentionCapabilities("cpu"), True, True, 4096, "cpu", False),
        ("cuda", torch.bfloat16, _H200, True, False, 4096, "fla", False),
        ("cuda", torch.bfloat16, _H200, False, True, 4096, "fla", False),  # ungated trains on Hopper
        ("cuda", torch.bfloat16, _H200, True, True, 4096, "torch", True),  # Triton 3.6 on sm90
        ("cuda", torch.bfloat16, AttentionCapabilities("cuda", (9, 0), "0.6.0", "3.7.1"), True, True, 4096, "fla", False),
        ("cuda", torch.bfloat16, AttentionCapabilities("cuda", (9, 0), "0.6.0", "3.3.1"), True, True, 4096, "fla", False),
        ("cuda", torch.bfloat16, _A100, True, True, 4096, "fla", False),
        ("cuda", torch.float32, _A100, True, True, 4096, "fla", False),
        ("cuda", torch.float64, _A100, True, False, 4096, "torch", True),
        ("cuda", torch.bfloat16, AttentionCapabilities("cuda", (8, 0), None, "3.6.0"), True, False, 4096, "torch", True),
        ("cuda", torch.bfloat16, AttentionCapabilities("cuda", (8, 0), "0.5.2", "3.6.0"), True, False, 4096, "torch", True),
        ("cuda", torch.bfloat16, AttentionCapabilities("cuda", (8, 0), "0.6.0", None), True, False, 4096, "torch", True),
        ("xpu", torch.bfloat16, AttentionCapabilities("xpu", None, "0.6.0", "3.6.0"), True, False, 4096, "torch", True),
        ("cuda", torch.bfloat16, _A100, True, False, 16, "quadratic", False),
    ],
)
def test_dispatch_paths_and_fallback_warnings(monkeypatch, device, dtype, caps, gated, grad, n, path, fallback):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_WARNED", set())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan = attention_plan(device, dtype, n=n, gated=gated, grad=grad, caps=caps)
        again = attention_plan(device, dtype, n=n, gated=gated, grad=grad, caps=caps)
    assert plan == again
    assert plan.path == path
    mine = [w for w in rec if issubclass(w.category, ka.KernelApproxWarning)]
    assert (plan.reason is not None) == fallback
    assert len(mine) == (1 if fallback else 0)  # once per reason
    if fallback:
        assert plan.reason in str(mine[0].message)
    if (caps, gated, grad, path) == (_H200, True, True, "torch"):
        assert "Hopper" in plan.reason and "3.6.0" in plan.reason


@pytest.mark.parametrize(("env", "device", "path"), [
    ("torch", "cuda", "torch"), ("torch", "cpu", "cpu"), ("accelerator", "cpu", "torch"),
    ("fla", "cuda", "fla"), ("auto", "cuda", "fla"),
])
def test_dispatch_env_switch(monkeypatch, env, device, path):
    monkeypatch.setenv(backends.ENV_VAR, env)
    assert attention_plan(device, torch.bfloat16, n=4096, gated=True, grad=False, caps=_A100).path == path


def test_dispatch_env_switch_rejects_unknown(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "triton-please")
    with pytest.raises(ValueError, match="KERNELAPPROX_BACKEND"):
        backends.forced_backend()
