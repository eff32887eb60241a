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


# ------------------------------------------------------------------ decoding: fla's fused recurrent kernels


def _fused_recurrent(q, k, v, g, gk, scale, h0, final):
    """fla's ``fused_recurrent`` (fla/ops/common/fused_recurrent.py): per sequence and head,
    ``h = h * exp(g) * exp(gk)[:, None] + k v^T``, ``o = (scale q)^T h``, the state in float32
    ([N, H, K, V], loaded from any dtype), ``o`` computed in float32 and returned in q's dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert k.shape == q.shape and v.shape[:3] == q.shape[:3]
    assert gk is None or gk.shape == q.shape
    assert g is None or g.shape == q.shape[:3]
    assert h0 is None or tuple(h0.shape) == (B, H, K, V)
    acc = torch.promote_types(torch.float32, q.dtype)  # float32 in the kernel; float64 kept for verification
    o = torch.zeros(B, T, H, V, dtype=acc)
    h = torch.zeros(B, H, K, V, dtype=acc) if h0 is None else h0.to(acc)
    for t in range(T):
        if g is not None:
            h = h * torch.exp(g[:, t].to(acc))[..., None, None]
        if gk is not None:
            h = h * torch.exp(gk[:, t].to(acc))[..., None]
        h = h + k[:, t].to(acc)[..., None] * v[:, t].to(acc)[..., None, :]
        o[:, t] = ((q[:, t].to(acc) * scale)[..., None] * h).sum(-2)
    return o.to(q.dtype), (h if final else None)


def fake_fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                             reverse=False, cu_seqlens=None):
    assert gv is None and not reverse and cu_seqlens is None
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return _fused_recurrent(q, k, v, None, gk, scale, initial_state, output_final_state)


def fake_fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                                    output_final_state=False, reverse=False, cu_seqlens=None):
    assert g_gamma is None and not reverse and cu_seqlens is None
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    return _fused_recurrent(q, k, v, g, None, scale, initial_state, output_final_state)


@pytest.fixture
def fake_fla_decode(monkeypatch):
    """fla's fused recurrent kernels replaced by the functions above, and the decoding dispatch
    pointed at them; records each call's kernel and arguments."""
    calls = []

    def kernels():
        def gla(**kw):
            calls.append(("fused_recurrent_gla", kw))
            return fake_fused_recurrent_gla(**kw)

        def sgla(**kw):
            calls.append(("fused_recurrent_simple_gla", kw))
            return fake_fused_recurrent_simple_gla(**kw)

        return SimpleNamespace(fused_recurrent_gla=gla, fused_recurrent_simple_gla=sgla)

    monkeypatch.setattr(fla_mod, "_recurrent_kernels", kernels)
    monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("fla"))
    return calls


DECODE_MAPS = ["positive", "oprf", "hedgehog", "elu", "relu", "taylor"]


def _decode(rnn, q, k, v, pad=None):
    """Steps over the tokens of (B, H, T, d) inputs: outputs (B, H, T, dv)."""
    outs = []
    for t in range(q.shape[-2]):
        kpm = None if pad is None else pad[..., t]
        outs.append(rnn.step(q[..., t, :], k[..., t, :], v[..., t, :], key_padding_mask=kpm))
    return torch.stack(outs, dim=-2)


def _decode_inputs(seed, name, B=2, H=3, T=10, d=4, dv=3):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, B, H, T, d, generator=g).unbind(0)
    if name in ("positive", "oprf", "hedgehog"):  # large norms: the per-feature scales matter
        q, k = (8.0 * x / x.norm(dim=-1, keepdim=True) for x in (q, k))
    return q, k, torch.randn(B, H, T, dv, generator=g)


def _map_for(name, q, k):
    fm = {e.name: e for e in ka.estimators()}[name].build(dim=4, num_features=8, seed=0)
    if fm.data_dependent:
        fm.fit(q, k)
    return fm


def _torch_path(monkeypatch):
    monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("torch"))


@pytest.mark.parametrize("name", DECODE_MAPS)
def test_fla_decode_equals_torch_step_and_exact(fake_fla_decode, monkeypatch, name):
    """From nothing and from a prompt's state, fla's decode gives the torch step's outputs and
    states (S, z) and the float64 causal attention's rows."""
    q, k, v = _decode_inputs(0, name)
    fm = _map_for(name, q, k)
    mode = fla_mod.fla_mode(fm)
    exact = exact_linear_attention(q, k, v, fm, causal=True)
    _, prompt = ka.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], fm, causal=True, return_state=True)
    runs = {}
    for path in ("fla", "torch"):
        if path == "torch":
            _torch_path(monkeypatch)
        fresh = ka.RecurrentLinearAttention(fm)
        cont = ka.RecurrentLinearAttention(fm, state=prompt)
        with torch.no_grad():  # (Hedgehog's parameters record autograd)
            runs[path] = (_decode(fresh, q, k, v), fresh.state,
                          _decode(cont, q[..., 4:, :], k[..., 4:, :], v[..., 4:, :]), cont.state)
    kernels = {c[0] for c in fake_fla_decode}
    assert kernels == {"fused_recurrent_gla" if mode == "gla" else "fused_recurrent_simple_gla"}
    assert len(fake_fla_decode) == 10 + 6
    (o_f, s_f, c_f, cs_f), (o_t, s_t, c_t, cs_t) = runs["fla"], runs["torch"]
    for got, want in ((o_f, o_t), (c_f, c_t), (o_f.double(), exact), (c_f.double(), exact[..., 4:, :])):
        assert (got.double() - want.double()).abs().max() < 1e-4 * max(1.0, float(want.abs().max()))
    for a, b in ((s_f, s_t), (cs_f, cs_t)):
        z = b.z.double()
        assert (a.z.double() - z).abs().max() < 1e-5 * float(z.abs().max())
        S = b.S.double()
        assert (a.S.double() - S).abs().max() < 1e-5 * max(1.0, float(S.abs().max()))
    if mode == "gla":  # per-feature scales, as the torch step keeps them
        assert s_f.log_scale.shape == (2, 3, fm.feature_dim, 1) and s_f.log_scale.dtype == torch.float64


def test_fla_decode_maps_the_state_without_copies(fake_fla_decode):
    """A contiguous float32 state of the step's batch shape is fla's initial_state as it is (a view),
    and fla's final state is the next state's kv (a view); gates finite, fla's layout [N, 1, H, K]."""
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = _decode_inputs(1, "positive")
    rnn = ka.RecurrentLinearAttention(fm)
    rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    kv = rnn.state.kv
    assert kv.is_contiguous() and kv.dtype == torch.float32
    rnn.step(q[..., 1, :], k[..., 1, :], v[..., 1, :])
    _, kw = fake_fla_decode[-1]
    assert kw["initial_state"].data_ptr() == kv.data_ptr() and kw["initial_state"].shape == (6, 1, 8, 4)
    assert kw["q"].shape == kw["k"].shape == kw["gk"].shape == (6, 1, 1, 8) and kw["v"].shape == (6, 1, 1, 4)
    assert kw["scale"] == 1.0 and kw["output_final_state"] is True
    assert bool(torch.isfinite(kw["gk"]).all()) and bool((kw["k"] <= 1).all())
    # the returned state is fla's final state, reshaped
    assert rnn.state.kv.shape == (2, 3, 8, 4)


def test_fla_decode_padding_and_shared_scale_states(fake_fla_decode, monkeypatch):
    """A padded token leaves the state's content unchanged and its query reads it; a state with one
    shared scale (..., 1, 1) continues as the torch step continues it."""
    fm = ka.PositiveRF(4, 8, seed=0)
    q, k, v = _decode_inputs(2, "positive")
    pad = torch.zeros(2, 3, 10, dtype=torch.bool)
    pad[0, :, 3] = True
    pad[1, :, 0] = True  # the first token of a row: nothing seen yet
    _, prompt = ka.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], fm, causal=True, return_state=True)
    shared = ka.LinearAttentionState(*_shared(prompt))
    outs = {}
    for path in ("fla", "torch"):
        if path == "torch":
            _torch_path(monkeypatch)
        rnn = ka.RecurrentLinearAttention(fm)
        outs[path] = [_decode(rnn, q, k, v, pad), rnn.state]
        rnn2 = ka.RecurrentLinearAttention(fm, state=shared)
        outs[path] += [_decode(rnn2, q[..., 4:, :], k[..., 4:, :], v[..., 4:, :]), rnn2.state]
    exact = exact_linear_attention(q, k, v, fm, causal=True, key_padding_mask=pad)
    for i in (0, 2):
        assert (outs["fla"][i] - outs["torch"][i]).abs().max() < 1e-4
    assert (outs["fla"][0].double() - exact).abs().max() < 1e-4
    for i in (1, 3):
        assert (outs["fla"][i].z - outs["torch"][i].z).abs().max() < 1e-5 * float(outs["torch"][i].z.abs().max())
    # a padded step: the state is the same sum
    monkeypatch.undo()
    fake_kernels(monkeypatch)
    rnn = ka.RecurrentLinearAttention(fm, state=prompt)
    before = (rnn.state.S.clone(), rnn.state.z.clone())
    rnn.step(q[..., 5, :], k[..., 5, :], v[..., 5, :], key_padding_mask=torch.ones(2, 3, dtype=torch.bool))
    assert (rnn.state.S - before[0]).abs().max() < 1e-5 * float(before[0].abs().max())
    assert (rnn.state.z - before[1]).abs().max() < 1e-5 * float(before[1].abs().max())


def _shared(st):
    """A per-feature state brought to one shared log scale (..., 1, 1)."""
    G = st.log_scale.amax(dim=-2, keepdim=True)
    return st.kv * torch.exp(st.log_scale - G).to(st.kv.dtype), G


def fake_kernels(monkeypatch):
    monkeypatch.setattr(fla_mod, "_recurrent_kernels", lambda: SimpleNamespace(
        fused_recurrent_gla=fake_fused_recurrent_gla, fused_recurrent_simple_gla=fake_fused_recurrent_simple_gla))
    monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("fla"))


def test_fla_decode_backward_matches_torch_step(fake_fla_decode, monkeypatch):
    """Gradients of q, k, v through three fla decode steps (float64, the fake's accumulation) equal
    the torch step's."""
    fm = ka.PositiveRF(4, 8, seed=0).double()
    q, k, v = (t.double() for t in _decode_inputs(3, "elu", T=3))
    w = torch.randn(2, 3, 3, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    grads = []
    for path in ("fla", "torch"):
        if path == "torch":
            _torch_path(monkeypatch)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        rnn = ka.RecurrentLinearAttention(fm)
        (_decode(rnn, qq, kk, vv) * w).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads, strict=True):
        assert torch.allclose(a, b, atol=1e-10)


def test_fla_decode_rejects_maps_without_an_fla_form():
    fm = ka.TrigRF(4, 8, seed=0)
    x = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="TrigRF has no fla form"):
        fla_mod.fla_decode_step(x, x, x[..., :3], fm)


# ------------------------------------------------------------------ the decoding dispatch


@pytest.mark.parametrize(
    ("device", "dtype", "caps", "mode", "path", "fallback"),
    [
        ("cpu", torch.float32, AttentionCapabilities("cpu", None, "0.6.0", "3.6.0"), "gla", "torch", False),
        ("cuda", torch.float32, _H200, "gla", "fla", False),
        ("cuda", torch.float32, _H200, "plain", "fla", False),
        ("cuda", torch.float32, _A100, "gla", "fla", False),
        ("cuda", torch.float32, _H200, None, "torch", False),  # no fla form: no warning unless asked
        ("cuda", torch.float64, _H200, "gla", "torch", True),
        ("cuda", torch.float32, AttentionCapabilities("cuda", (9, 0), None, "3.6.0"), "gla", "torch", True),
        ("cuda", torch.float32, AttentionCapabilities("cuda", (9, 0), "0.5.2", "3.6.0"), "gla", "torch", True),
        ("cuda", torch.float32, AttentionCapabilities("cuda", (9, 0), "0.6.0", None), "gla", "torch", True),
        ("xpu", torch.float32, AttentionCapabilities("xpu", None, "0.6.0", "3.6.0"), "gla", "torch", True),
    ],
)
def test_decode_plan_paths_and_fallback_warnings(monkeypatch, device, dtype, caps, mode, path, fallback):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_WARNED", set())
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan = backends.decode_plan(device, dtype, mode=mode, caps=caps)
        again = backends.decode_plan(device, dtype, mode=mode, caps=caps)
    assert plan == again and plan.path == path
    mine = [w for w in rec if issubclass(w.category, ka.KernelApproxWarning)]
    assert len(mine) == (1 if fallback else 0)  # once per reason
    if fallback:
        assert plan.reason in str(mine[0].message) and "decoding falls back to the torch step" in str(mine[0].message)


@pytest.mark.parametrize(("env", "device", "mode", "path", "warns"), [
    ("torch", "cuda", "gla", "torch", False), ("accelerator", "cuda", "gla", "torch", False),
    ("fla", "cuda", "gla", "fla", False), ("auto", "cuda", "plain", "fla", False),
    ("fla", "cpu", "gla", "torch", True),  # asked for, cannot run: said so
    ("fla", "cuda", None, "torch", True),
])
def test_decode_plan_env_switch(monkeypatch, env, device, mode, path, warns):
    monkeypatch.setenv(backends.ENV_VAR, env)
    monkeypatch.setattr(backends, "_WARNED", set())
    caps = _H200 if device == "cuda" else AttentionCapabilities("cpu", None, "0.6.0", "3.6.0")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        plan = backends.decode_plan(device, torch.float32, mode=mode, caps=caps)
    assert plan.path == path
    assert any(issubclass(w.category, ka.KernelApproxWarning) for w in rec) == warns


def test_decode_plan_reads_the_capabilities_once_per_device(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(backends, "_CAPS_CACHE", {})
    reads = []

    def caps(device):
        reads.append(str(device))
        return _H200

    monkeypatch.setattr(backends, "attention_capabilities", caps)
    for _ in range(3):
        assert backends.decode_plan("cuda", torch.float32, mode="gla").path == "fla"
    assert reads == ["cuda"]


def test_the_step_takes_the_torch_path_on_cpu(monkeypatch):
    """Without a plan of its own the CPU step never calls fla (which is absent here)."""
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    monkeypatch.setattr(fla_mod, "_recurrent_kernels", lambda: pytest.fail("fla called on the CPU"))
    rnn = ka.RecurrentLinearAttention(ka.PositiveRF(4, 8, seed=0))
    q, k, v = _decode_inputs(5, "positive", T=2)
    _decode(rnn, q, k, v)
    assert rnn.steps == 2
