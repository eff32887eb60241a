"""Default calls of linear attention read no device value on the host (no ``.item()``,
``bool(tensor)``): the non-causal form under autograd, a decoding step and the layer everywhere;
the non-causal form without autograd and the causal form on the accelerator path (forced on CPU tensors through ``KERNELAPPROX_BACKEND=accelerator``). The CPU's
own causal algorithms decide on the host (shared-scale coverage, underflow rescue), where reading a
CPU value costs no stall; so does the signed maps' check of lost rows on the CPU (one read, for its
warning), which the accelerator path replaces by NaN rows. And ``torch.compile(fullgraph=True)`` of a causal call."""

from __future__ import annotations

import pytest
import torch
from _sync import host_syncs

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.linear.naive_gated import exact_linear_attention

MAPS = ["positive", "oprf", "hedgehog", "elu", "trig-sincos"]


def _map(name):
    est = {e.name: e for e in ka.estimators()}[name]
    return est.build(dim=8, num_features=16, seed=0)


def _qkv(seed=0, n=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 4, n, 8, generator=g).unbind(0)


@pytest.mark.parametrize("name", MAPS)
def test_parallel_and_decoding_step_have_no_host_sync(name, monkeypatch):
    fm = _map(name)
    q, k, v = _qkv()
    if fm.data_dependent:
        fm.fit(q, k)
    if not fm.positive:
        # a signed map's CPU call reads one value, the number of lost rows (a warning names it);
        # the accelerator path reads none (its lost rows are NaN)
        assert host_syncs(ka.linear_attention, q, k, v, fm) == {"aten::_local_scalar_dense": 1}
        monkeypatch.setenv(backends.ENV_VAR, "accelerator")
    assert not host_syncs(ka.linear_attention, q, k, v, fm)
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")  # the CPU's no-grad path reads CPU values
    with torch.no_grad():
        assert not host_syncs(ka.linear_attention, q, k, v, fm)
    if fm.positive:
        monkeypatch.delenv(backends.ENV_VAR)
    rnn = ka.RecurrentLinearAttention(fm)
    rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    assert not host_syncs(rnn.step, q[..., 1, :], k[..., 1, :], v[..., 1, :])


@pytest.mark.parametrize("name", MAPS)
def test_causal_accelerator_path_has_no_host_sync(name, monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")
    fm = _map(name)
    q, k, v = _qkv(1)
    if fm.data_dependent:
        fm.fit(q, k)
    assert not host_syncs(ka.linear_attention, q, k, v, fm, causal=True)
    assert not host_syncs(ka.linear_attention, q, k, v, fm, causal=True, return_state=True)
    # and it gives the rows of the CPU algorithms: to 1e-4, or for a signed map (whose
    # cancelled rows carry the float32 features' error into both) as close to the float64
    # answer as they are
    out = ka.linear_attention(q, k, v, fm, causal=True)
    monkeypatch.setenv(backends.ENV_VAR, "torch")
    ref = ka.linear_attention(q, k, v, fm, causal=True)
    if fm.positive:
        assert (out - ref).abs().max() < 1e-4
    else:
        exact = exact_linear_attention(q, k, v, fm, causal=True)
        err, err_cpu = (out.double() - exact).abs().max(), (ref.double() - exact).abs().max()
        assert err <= err_cpu + 1e-3, (float(err), float(err_cpu))


@pytest.mark.parametrize("causal", [False, True])
def test_layer_forward_has_no_host_sync(causal, monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "accelerator")
    layer = ka.nn.LinearAttention(16, heads=2, causal=causal, check=False, seed=0)
    x = torch.randn(2, 32, 16)
    layer(x)
    assert not host_syncs(layer, x)


def test_compiled_causal_call_fullgraph():
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = _qkv(2, n=48)

    def fn(q, k, v):
        return ka.linear_attention(q, k, v, fm, causal=True, chunk_size=16)

    out = torch.compile(fn, fullgraph=True, backend="eager")(q, k, v)
    assert (out - fn(q, k, v)).abs().max() < 1e-5
