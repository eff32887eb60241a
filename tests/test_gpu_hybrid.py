"""Hybrid attention on a CUDA device: the flex path (flex_attention window + delayed per-feature
log-domain scan) against float64, forward and backward, in bfloat16 and float32. Skipped
without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.hybrid import hybrid_attention, naive_hybrid_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16 inputs are computed in float32 (the library's dtype policy); float32 GEMMs may run as TF32
TOL = {torch.bfloat16: (5e-3, 1e-2), torch.float32: (1e-3, 5e-3)}


def _case(dtype, causal, mode, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(2, 2, 3, 200, 16, generator=g, dtype=torch.float64)).unbind(0)
    v = torch.randn(2, 3, 200, 16, generator=g, dtype=torch.float64)
    fm = ka.PositiveRF(16, 32, seed=0, dtype=torch.float64)
    ref = naive_hybrid_attention(q, k, v, fm, window=16, sinks=1, causal=causal, window_mode=mode)
    return q, k, v, fm, ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_flex_path_forward_and_backward_against_float64(dtype, causal, mode):
    assert backends.hybrid_path(torch.device("cuda"), dtype, True) == "flex"
    q, k, v, fm, _ = _case(dtype, causal, mode)
    q, k, v = (t.to(dtype).double() for t in (q, k, v))  # float64 on the rounded inputs
    q64, k64, v64 = (t.clone().requires_grad_(True) for t in (q, k, v))
    ref = naive_hybrid_attention(q64, k64, v64, fm, window=16, sinks=1, causal=causal, window_mode=mode)
    g_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * g_out).sum(), (q64, k64, v64))

    fm_d = copy.deepcopy(fm).float().cuda()
    qd, kd, vd = (t.to("cuda", dtype).requires_grad_(True) for t in (q, k, v))
    out = hybrid_attention(qd, kd, vd, fm_d, window=16, sinks=1, causal=causal, window_mode=mode)
    grads = torch.autograd.grad((out.double() * g_out.cuda()).sum(), (qd, kd, vd))
    f_tol, g_tol = TOL[dtype]
    assert float((out.double().cpu() - ref.detach()).abs().max()) < f_tol
    for gd, gr in zip(grads, ref_grads, strict=True):
        assert float((gd.double().cpu() - gr).abs().max()) < g_tol * max(1.0, float(gr.abs().max()))


@pytest.mark.parametrize("causal", [True, False])
def test_flex_path_equals_the_torch_path_on_the_device(causal, monkeypatch):
    q, k, v, fm, _ = _case(torch.float32, causal, "token")
    fm_d = copy.deepcopy(fm).float().cuda()
    qd, kd, vd = (t.to("cuda", torch.float32) for t in (q, k, v))
    flex = hybrid_attention(qd, kd, vd, fm_d, window=16, sinks=1, causal=causal)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    torch_path = hybrid_attention(qd, kd, vd, fm_d, window=16, sinks=1, causal=causal)
    assert float((flex - torch_path).abs().max()) < 1e-3


def test_flex_path_at_large_norms_on_the_device():
    g = torch.Generator().manual_seed(0)
    dirs = torch.randn(2, 2, 128, 16, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    v = torch.randn(2, 128, 8, generator=g)
    fm = ka.PositiveRF(16, 32, seed=0)
    for norm in (4, 32, 128):
        q, k = (norm * dirs).unbind(0)
        fm64 = copy.deepcopy(fm).double()
        from kernelapprox.attention.hybrid import exact_set_mask
        from kernelapprox.attention.hybrid.logfeatures import log_features_pair

        lq, lk = log_features_pair(fm64, q.double(), k.double())
        S = exact_set_mask(128, window=8, sinks=1, causal=True)
        scores = torch.where(S, q.double() @ k.double().mT, torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), -1))
        scores = scores.masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf"))
        ref = torch.softmax(scores, -1) @ v.double()
        out = hybrid_attention(q.cuda(), k.cuda(), v.cuda(), copy.deepcopy(fm).cuda(), window=8, sinks=1, causal=True)
        assert bool(((out.double().cpu() - ref).abs().amax(-1) <= 0.5).all())


def test_window_term_memory_is_linear_in_n_on_the_device():
    # the compiled flex_attention over the structural block mask: at n = 32768 an n x n float32
    # mask or score matrix would need 4 GiB per sequence; the window term's peak stays within
    # 64 MiB above its inputs and outputs, and it equals eager flex_attention on a prefix
    from kernelapprox.attention.hybrid.flex import _window_term

    n, d = 32768, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, n, d, device="cuda", generator=g) for _ in range(3))
    q = q / d**0.5  # logits of order 1 (float32 GEMMs may run as TF32)
    sink = torch.zeros(n, dtype=torch.bool, device="cuda")
    sink[0] = True
    _window_term(q, k, v, 64, sink, True, False, None)  # compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, lse = _window_term(q, k, v, 64, sink, True, False, None)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * 4 - lse.numel() * 4
    assert extra < 64 * 2**20, extra / 2**20
    m = 1024
    ref, ref_lse = _window_term(q[:, :m].double(), k[:, :m].double(), v[:, :m].double(), 64, sink[:m], True, False,
                                None)  # float64: the eager flex_attention
    assert float((out[:, :m].double() - ref).abs().max()) < 5e-3
    assert float((lse[:, :m].double() - ref_lse).abs().max()) < 5e-3
