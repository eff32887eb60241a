"""nn.Module behaviour: buffers, state_dict, .to(dtype/device), redraw and seeds, from_projection."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import F64, randn, warns_unfitted

import kernelapprox as ka

# every registered random estimator (iid rows), plus FAVOR+ with each other sampler
MAKERS = {e.name: (lambda e=e, **kw: e.build(5, 12, **kw)) for e in ka.estimators(random=True)}
MAKERS.update({
    f"positive_{smp}": (lambda smp=smp, **kw: ka.PositiveRF(5, 12, sampler=smp, **kw))
    for smp in ("orthogonal", "structured", "qmc")
})
CUDA = torch.cuda.is_available()


def x5(dtype=torch.float32):
    return randn(2, 7, 5, seed=0, scale=0.5).to(dtype)


@pytest.mark.parametrize("name", list(MAKERS))
def test_projection_is_a_buffer_not_a_parameter(name):
    fm = MAKERS[name](seed=0)
    assert list(fm.parameters()) == []
    buffers = list(fm.buffers())
    assert buffers
    # the projection (dense W, or the SORF sign diagonals) lives in buffers
    assert sum(b.numel() for b in buffers) >= 12 * 5 or name == "positive_structured"
    assert fm.state_dict()  # and is saved
    if name == "trig-offset":
        assert any(torch.equal(b, fm.offsets) for b in buffers)
        assert fm.offsets.shape == (12,)
        assert (fm.offsets >= 0).all() and (fm.offsets < 2 * torch.pi).all()


@pytest.mark.parametrize("name", list(MAKERS))
def test_state_dict_round_trip(name):
    a = MAKERS[name](seed=0)
    b = MAKERS[name](seed=1)
    x = x5()
    with warns_unfitted(a):  # data-dependent maps round-trip unfitted (data-free parameters)
        assert (a(x) - b(x)).abs().max() > 1e-3
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert torch.equal(a(x), b(x))
    assert torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("name", list(MAKERS))
def test_to_dtype(name):
    fm = MAKERS[name](seed=0)
    x = x5(F64)
    ref64 = MAKERS[name](seed=0, dtype=F64)
    with warns_unfitted(ref64):
        ref = ref64(x)
    fm.to(torch.float64)
    assert fm.weight.dtype == F64
    with warns_unfitted(fm):
        out = fm(x)
    assert out.dtype == F64
    # float32 -> float64 of a projection drawn in float64 loses the float32 rounding only
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    fm.double().float()
    assert fm.weight.dtype == torch.float32
    assert fm(x5()).dtype == torch.float32
    fm.to(torch.bfloat16)
    out16 = fm(x5(torch.bfloat16))
    assert out16.dtype == torch.bfloat16 and torch.isfinite(out16).all()


@pytest.mark.parametrize("name", list(MAKERS))
def test_device_argument_and_move(name):
    fm = MAKERS[name](seed=0, device="cpu")
    assert fm.weight.device.type == "cpu"
    fm.to("cpu")
    with warns_unfitted(fm):
        assert fm(x5()).device.type == "cpu"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(MAKERS))
def test_same_seed_same_projection_on_gpu(name):
    cpu = MAKERS[name](seed=3, dtype=F64)
    gpu = MAKERS[name](seed=3, dtype=F64, device="cuda")
    assert gpu.weight.device.type == "cuda"
    assert torch.equal(gpu.weight.cpu(), cpu.weight)
    x = x5(F64)
    torch.testing.assert_close(gpu(x.cuda()).cpu(), cpu(x), rtol=1e-12, atol=1e-12)
    moved = MAKERS[name](seed=3, dtype=F64).to("cuda")
    torch.testing.assert_close(moved(x.cuda()).cpu(), cpu(x), rtol=1e-12, atol=1e-12)
    v = randn(2, 7, 3, seed=1).cuda()
    for causal in (False, True):
        out = ka.linear_attention(x.cuda(), x.cuda(), v, gpu, causal=causal, chunk_size=4)
        ref = ka.linear_attention(x, x, v.cpu(), cpu, causal=causal, chunk_size=4)
        assert out.device.type == "cuda"
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(MAKERS))
def test_redraw(name):
    fm = MAKERS[name](seed=0, dtype=F64, batch_shape=(2,))
    w0 = fm.weight.clone()
    fm.redraw(seed=7)
    w7 = fm.weight.clone()
    assert (w7 - w0).abs().max() > 1e-3
    assert fm.weight.dtype == F64 and fm.weight.shape == (2, 12, 5)
    fm.redraw(seed=8)
    assert (fm.weight - w7).abs().max() > 1e-3
    fm.redraw(seed=7)
    assert torch.equal(fm.weight, w7)  # reproducible
    assert torch.equal(
        MAKERS[name](seed=7, dtype=F64, batch_shape=(2,)).weight, w7
    )  # = constructing with seed 7
    if name == "trig-offset":
        off7 = fm.offsets.clone()
        fm.redraw(seed=8)
        assert (fm.offsets - off7).abs().max() > 1e-3
        fm.redraw(seed=7)
        assert torch.equal(fm.offsets, off7)
    fm.redraw()  # fresh randomness
    assert (fm.weight - w7).abs().max() > 1e-3
    g1, g2 = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    assert torch.equal(fm.redraw(generator=g1).weight.clone(), fm.redraw(generator=g2).weight)


def test_redraw_returns_self_and_is_noop_for_deterministic_maps():
    fm = ka.PositiveRF(4, 8, seed=0)
    assert fm.redraw(seed=1) is fm
    elu = ka.EluFeatures(4)
    x = torch.randn(3, 4)
    before = elu(x)
    assert elu.redraw(seed=1) is elu
    assert torch.equal(elu(x), before)
    assert list(elu.parameters()) == []


def test_redraw_keeps_module_registered():
    """After redraw the new projection must still be what state_dict saves and .to() moves."""
    fm = ka.PositiveRF(4, 8, seed=0)
    fm.redraw(seed=5)
    sd = fm.state_dict()
    assert any(torch.equal(t, fm.weight) for t in sd.values())
    fm.to(F64)
    assert fm.weight.dtype == F64


@pytest.mark.parametrize("cls", [ka.PositiveRF, ka.HyperbolicRF, ka.TrigRF])
def test_from_projection_uses_given_W(cls):
    W = randn(3, 12, 5, seed=9)
    fm = cls.from_projection(W)
    assert torch.equal(fm.weight, W)
    assert fm.dim == 5 and fm.num_features == 12 and fm.batch_shape == (3,)
    assert fm.weight.dtype == F64
    x = x5(F64)
    u = x.unsqueeze(-3) @ W.mT  # (2, 3, 7, 12)... broadcast x (2, 7, 5) against batch (3,)
    assert fm(x.unsqueeze(1)).shape[:2] == (2, 3)
    if cls is ka.PositiveRF:
        expected = torch.exp(u - 0.5 * (x * x).sum(-1, keepdim=True).unsqueeze(-3)) / 12**0.5
        torch.testing.assert_close(fm(x.unsqueeze(1)), expected, rtol=1e-12, atol=0)
    # the map holds its own copy: later changes to W do not leak in
    W.add_(1.0)
    assert not torch.equal(fm.weight, W)


def test_from_projection_offsets():
    W, b = randn(12, 5, seed=1), torch.rand(12, dtype=F64) * 6.0
    fm = ka.TrigRF.from_projection(W, variant="offset", offsets=b)
    assert torch.equal(fm.offsets, b)
    x = x5(F64)
    expected = torch.exp(0.5 * (x * x).sum(-1, keepdim=True)) * (2 / 12) ** 0.5 * torch.cos(x @ W.T + b)
    torch.testing.assert_close(fm(x), expected, rtol=1e-12, atol=0)


def test_offset_phases_are_uniform_on_the_full_circle():
    """b ~ U[0, 2 pi). Halving the range leaves phi(x).phi(y) unchanged in law (2b stays uniform
    mod 2 pi), so no kernel test can see it, but it breaks the features' own law: E cos(w.x + b)
    = 0 only for the full circle. A Kolmogorov-Smirnov test on 20 000 phases: under the null its
    p-value is uniform (the threshold 1e-6 is a false alarm once in a million seeds); U[0, pi)
    gives D = 0.5 and p ~ 0 (checked below on the same sample size, so the test has the power)."""
    from scipy import stats

    fm = ka.TrigRF(4, 500, variant="offset", batch_shape=(40,), seed=0, dtype=F64)
    b = (fm.offsets / (2 * torch.pi)).flatten().numpy()
    assert b.size == 20_000
    assert stats.kstest(b, "uniform").pvalue > 1e-6
    assert stats.kstest(b / 2, "uniform").pvalue < 1e-100  # what the half-range bug would give
