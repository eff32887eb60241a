"""Decoding on a CUDA device (skipped without one): a step replayed from a captured CUDA graph
equals the eager step (torch path, fla path where installed, and the step compiled by Inductor),
token after token, outputs and states; fla's fused recurrent decode equals the torch step and the
float64 causal attention. ``python -m pytest -q -m cuda tests/test_gpu_decode.py`` on a GPU
machine (the compiled capture is also ``slow``: ``benchmarks/device_check.sh`` leaves it out).

Tolerances. A replay runs the eager step's kernels (graphed) or Inductor's fusion of them
(compiled): float32 states, 1e-5 of the output's scale (1e-4 compiled, another order of sums).
fla against float64: 1e-4 (float32 inputs), 1e-2 (bfloat16 inputs, rounded once to bf16 at the
output) of the output's scale.
"""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.linear import fla as fla_mod
from kernelapprox.attention.linear.naive_gated import exact_linear_attention

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

B, H, D, F, T = 2, 4, 16, 32, 48


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (0.5 * torch.randn(3, B, H, T, D, generator=g)).unbind(0)
    return [x.to("cuda", dtype) for x in (q, k, v)]


def _map(name):
    return {e.name: e for e in ka.estimators()}[name].build(dim=D, num_features=F, seed=0).to("cuda")


def _fla_or_skip(fm):
    plan = backends.decode_plan("cuda", torch.float32, mode=fla_mod.fla_mode(fm), warn=False)
    if plan.path != "fla":
        pytest.skip(f"fla's decode path is not available: {plan.reason}")


def _twin(rnn, fm):
    return ka.RecurrentLinearAttention(fm, state=ka.LinearAttentionState(
        rnn.state.kv.clone(), rnn.state.log_scale.clone()))


def _replay_equals_eager(fm, compile=False, tol=1e-5):
    q, k, v = _inputs()
    with torch.no_grad():
        _, state = ka.linear_attention(q[..., :16, :], k[..., :16, :], v[..., :16, :], fm, causal=True,
                                       return_state=True)
    rnn = ka.RecurrentLinearAttention(fm, state=state)
    step = rnn.capture(q[..., 16, :], k[..., 16, :], v[..., 16, :], compile=compile)
    eager = _twin(rnn, fm)
    with torch.no_grad():
        for t in range(16, T):
            want = eager.step(q[..., t, :], k[..., t, :], v[..., t, :])
            got = step(q[..., t, :], k[..., t, :], v[..., t, :])
            scale = float(want.abs().max())
            assert (got - want).abs().max() <= tol * scale, t
    assert rnn.steps == eager.steps == T - 16
    assert (rnn.state.z - eager.state.z).abs().max() <= tol * float(eager.state.z.abs().max())
    assert (rnn.state.S - eager.state.S).abs().max() <= tol * float(eager.state.S.abs().max())


@pytest.mark.parametrize("name", ["positive", "elu"])
def test_graphed_torch_step_equals_eager(monkeypatch, name):
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    _replay_equals_eager(_map(name))


@pytest.mark.parametrize("name", ["positive", "elu"])
def test_graphed_fla_step_equals_eager(monkeypatch, name):
    monkeypatch.setenv(backends.ENV_VAR, "fla")
    fm = _map(name)
    _fla_or_skip(fm)
    _replay_equals_eager(fm)


@pytest.mark.slow
def test_compiled_and_graphed_torch_step_equals_eager(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    _replay_equals_eager(_map("positive"), compile=True, tol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["positive", "elu"])
def test_fla_decode_equals_torch_decode_and_float64(monkeypatch, dtype, name):
    fm = _map(name)
    monkeypatch.setenv(backends.ENV_VAR, "fla")
    _fla_or_skip(fm)
    q, k, v = _inputs(dtype, seed=1)
    ref = exact_linear_attention(*(x.double().cpu() for x in (q, k, v)), fm.cpu(), causal=True)
    fm = fm.to("cuda")
    with torch.no_grad():
        _, state = ka.linear_attention(q[..., :16, :], k[..., :16, :], v[..., :16, :], fm, causal=True,
                                       return_state=True)
    outs = {}
    for env in ("fla", "torch"):
        monkeypatch.setenv(backends.ENV_VAR, env)
        rnn = ka.RecurrentLinearAttention(fm, state=state)
        with torch.no_grad():
            outs[env] = torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(16, T)], -2)
        outs[env + " state"] = rnn.state
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    scale = max(1.0, float(ref.abs().max()))
    assert (outs["fla"].double().cpu() - ref[..., 16:, :]).abs().max() <= tol * scale
    assert (outs["fla"].double() - outs["torch"].double()).abs().max() <= tol * scale
    z_f, z_t = outs["fla state"].z.double(), outs["torch state"].z.double()
    assert (z_f - z_t).abs().max() <= 1e-5 * float(z_t.abs().max())
