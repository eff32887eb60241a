"""The fused Triton feature maps (`kernelapprox.maps.fused_exponential`) against the torch maps,
run on CPU tensors by Triton's interpreter (``TRITON_INTERPRET=1``) in float32 and float16 (the
interpreter's bfloat16 ``tl.dot`` is not exact: bfloat16 is checked on a GPU by
tests/test_gpu_maps.py). Skipped where Triton is not installed."""

from __future__ import annotations

import copy
import importlib
import os
import sys

import pytest
import torch

import kernelapprox as ka
from kernelapprox import backends

# Triton reads TRITON_INTERPRET when it is imported: set it at collection, before any test
# imports Triton (torch.compile's inductor does); where Triton came first, the module skips.
_INTERPRETING = False
if backends.has_module("triton") and not torch.cuda.is_available():
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
    _INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not backends.has_module("triton"), reason="Triton is not installed"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run on CPU-only machines"),
    pytest.mark.skipif(backends.has_module("triton") and not torch.cuda.is_available() and not _INTERPRETING,
                       reason="Triton was imported before TRITON_INTERPRET=1 was set: run this module alone"),
]

MAPS = ("positive", "hyperbolic", "trig-sincos", "trig-offset", "oprf", "saderf", "sderf")


@pytest.fixture(scope="module")
def fx():
    return importlib.import_module("kernelapprox.maps.fused_exponential")


def _map(name: str, d: int, r: int, batch_shape=()) -> ka.FeatureMap:
    fm = ka.get_estimator(name).build(d, r, seed=0, batch_shape=batch_shape)
    if fm.data_dependent:
        x = torch.randn(2, 3, 40, d, generator=torch.Generator().manual_seed(1)) / 2
        fm.fit(x, x * 0.8)
    return fm


def _phi(f: torch.Tensor, ls: torch.Tensor) -> torch.Tensor:
    return f.double() * torch.exp(ls.double()).unsqueeze(-1)


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> None:
    """|a - b| <= tol times the largest |b| of the row (features live on their row's scale)."""
    scale = b.abs().amax(dim=-1, keepdim=True).clamp_min(1e-300)
    err = float(((a - b).abs() / scale).max())
    assert err <= tol, f"max row-relative error {err:.3e} > {tol:.1e}"


def _inputs(dtype, d=16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(2, 3, 37, d, generator=g) / d ** 0.25).to(dtype)


@pytest.mark.parametrize("key", [False, True])
@pytest.mark.parametrize("name", MAPS)
def test_fused_float32_matches_float64(fx, name, key):
    """float32: the kernel (float32 operands, IEEE dot) against the float64 torch map, <= 1e-5."""
    fm = _map(name, 16, 24, batch_shape=(3,) if name in ("positive", "trig-offset") else ())
    x = _inputs(torch.float32)
    ref64 = copy.deepcopy(fm).double()
    fr, lr = (ref64.key_log_features if key else ref64.log_features)(x.double())
    f, ls = fx.log_features(fm, x, key=key)
    assert f.dtype == torch.float32 and ls.dtype == torch.float32
    _close(_phi(f, ls), _phi(fr, lr), 1e-5)
    fs, lss = fx.log_features(fm, x, shared=True, key=key)
    _close(_phi(fs, lss), _phi(fr, lr), 1e-5)
    plain = fx.features(fm, x, key=key)
    _close(plain.double(), (ref64.key_features if key else ref64)(x.double()), 1e-5)


@pytest.mark.parametrize("name", ("trig-sincos", "trig-offset"))
def test_trig_maps_have_no_16bit_fused_form(fx, name):
    """16-bit inputs of the trigonometric maps take the torch path (float32 GEMM: 16-bit angles
    ruin the sines); float32 inputs take the kernel."""
    fm = _map(name, 16, 24)
    assert fx.log_features(fm, _inputs(torch.float16)) is None
    assert fx.log_features(fm, _inputs(torch.float32)) is not None


@pytest.mark.parametrize("name", [m for m in MAPS if not m.startswith("trig")])
def test_fused_float16_matches_policy_path(fx, name):
    """float16: the kernel against the torch path under the accelerator policy (the same 16-bit
    operands; features rounded to float16, 2^-11), <= 2e-3 of the row's largest feature."""
    fm = _map(name, 16, 24)
    x = _inputs(torch.float16)
    with backends.accelerator_dtypes():
        fr, lr = fm.log_features(x)
    f, ls = fx.log_features(fm, x)
    assert f.dtype == torch.float16 and ls.dtype == torch.float32
    _close(_phi(f, ls), _phi(fr, lr), 2e-3)


@pytest.mark.parametrize("name", MAPS)
def test_fused_backward_matches_torch(fx, name):
    fm = _map(name, 16, 24)
    x = _inputs(torch.float32)
    g = torch.Generator().manual_seed(5)
    wf = torch.randn(2, 3, 37, fm.feature_dim, generator=g)
    wl = torch.randn(2, 3, 37, generator=g)

    def loss(fn):
        xr = x.clone().requires_grad_(True)
        f, ls = fn(xr)
        ((f * wf).sum() + (ls.expand(wl.shape) * wl).sum()).backward()
        return xr.grad

    torch.testing.assert_close(loss(lambda t: fx.log_features(fm, t)), loss(fm.log_features), rtol=1e-4, atol=1e-5)


def test_unsupported_shapes_fall_back(fx):
    """A projection beyond one program's reach, a subclass, a float64 map: no fused form."""
    x = _inputs(torch.float32)
    assert fx.log_features(ka.PositiveRF(16, fx.MAX_R + 1, seed=0), x) is None
    assert fx.log_features(ka.PositiveRF(16, 256, seed=0), x) is not None  # 16 KiB tile
    assert fx.log_features(ka.PositiveRF(128, 512, seed=0), _inputs(torch.float32, d=128)) is None  # 256 KiB tile

    class Sub(ka.PositiveRF):
        pass

    assert fx.log_features(Sub(16, 8, seed=0), x) is None
    assert fx.log_features(ka.PositiveRF(16, 8, seed=0, dtype=torch.float64), x) is None


@pytest.mark.parametrize("name", MAPS)
def test_maps_dispatch_to_the_kernel(fx, name, monkeypatch):
    """With `backends.use_fused_maps` answering yes (as on CUDA), every public call of the map
    runs the kernel once, and its backward (the torch map under `backends.torch_path`) does not
    re-enter it."""
    real = backends.use_fused_maps
    monkeypatch.setattr(backends, "use_fused_maps",
                        lambda x: isinstance(x, torch.Tensor) and not backends._TORCH_PATH.forced)
    calls = {"n": 0}
    launch = fx._launch

    def counted(*a, **k):
        calls["n"] += 1
        return launch(*a, **k)

    monkeypatch.setattr(fx, "_launch", counted)
    fm = _map(name, 16, 24)
    x = _inputs(torch.float32).requires_grad_(True)
    f, ls = fm.log_features(x)
    fk, lk = fm.key_log_features(x)
    plain = fm(x)
    assert calls["n"] == 3
    (f.sum() + ls.sum() + fk.sum() + lk.sum() + plain.sum()).backward()
    assert calls["n"] == 3 and x.grad is not None and bool(torch.isfinite(x.grad).all())
    monkeypatch.setattr(backends, "use_fused_maps", real)
    with backends.torch_path():
        fr, lr = fm.log_features(x.detach())
    _close(_phi(f.detach(), ls.detach()), _phi(fr, lr), 1e-5)
