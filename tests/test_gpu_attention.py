"""Linear attention on a CUDA device (skipped without one): every form against a float64 CPU
reference, forward and backward, in bfloat16 and float32; the fla path against the torch path.
One command on a GPU machine: ``python -m pytest -q tests/test_gpu_attention.py``."""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.linear.naive_gated import exact_linear_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# bf16 outputs within 5e-3 of float64, gradients within 1e-2 (relative to their scale)
TOL = {torch.bfloat16: (5e-3, 1e-2), torch.float32: (1e-4, 1e-4)}


def _inputs(dtype, B=2, H=4, n=512, d=16):
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(3, B, H, n, d, generator=g)).unbind(0)
    return [t.to("cuda", dtype) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["positive", "hedgehog", "elu"])
@pytest.mark.parametrize("form", ["parallel", "causal", "recurrent"])
@pytest.mark.parametrize("env", ["auto", "torch"])
def test_forms_match_float64(monkeypatch, dtype, name, form, env):
    monkeypatch.setenv(backends.ENV_VAR, env)
    est = {e.name: e for e in ka.estimators()}[name]
    fm = est.build(dim=16, num_features=32, seed=0).to("cuda")
    q, k, v = _inputs(dtype)
    if form == "recurrent":
        q, k, v = (t[..., :64, :] for t in (q, k, v))
    causal = form != "parallel"
    ref = exact_linear_attention(q.cpu(), k.cpu(), v.cpu(), fm.cpu(), causal=causal)
    fm = fm.to("cuda")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    if form == "recurrent":
        rnn = ka.RecurrentLinearAttention(fm)
        out = torch.stack([rnn.step(qg[..., t, :], kg[..., t, :], vg[..., t, :]) for t in range(q.shape[-2])], -2)
    else:
        out = ka.linear_attention(qg, kg, vg, fm, causal=causal)
    fwd, bwd = TOL[dtype]
    assert (out.double().cpu() - ref).abs().max() < fwd * max(1.0, float(ref.abs().max()))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    (out * w).sum().backward()
    q64, k64, v64 = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref_out = ka.linear_attention(q64, k64, v64, fm.cpu().double(), causal=causal)
    (ref_out * w.cpu().double()).sum().backward()
    for a, b in ((qg, q64), (kg, k64), (vg, v64)):
        scale = float(b.grad.abs().max())
        assert (a.grad.double().cpu() - b.grad).abs().max() < bwd * max(1.0, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["positive", "elu"])
def test_fla_path_matches_torch_path(monkeypatch, dtype, name):
    pytest.importorskip("fla")
    est = {e.name: e for e in ka.estimators()}[name]
    fm = est.build(dim=16, num_features=32, seed=0).to("cuda")
    q, k, v = _inputs(dtype, n=1024)
    monkeypatch.setenv(backends.ENV_VAR, "fla")
    fast = ka.linear_attention(q, k, v, fm, causal=True)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    slow = ka.linear_attention(q, k, v, fm, causal=True)
    assert (fast.float() - slow.float()).abs().max() < TOL[dtype][0] * 4
