"""Fits on ``meta`` tensors (a model built on the meta device sets its shapes without data), and
the Nyström landmarks' finiteness checked at construction."""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka


@pytest.mark.parametrize("name", ["oprf", "saderf", "sderf", "nystrom"])
def test_fit_on_meta_tensors(name):
    fm = ka.get_estimator(name).build(8, 16, seed=0, device="meta")
    q = torch.empty(2, 3, 20, 8, device="meta")
    k = torch.empty(2, 3, 24, 8, device="meta")
    assert fm.fit(q, k) is fm
    assert fm.fitted
    out = fm(q)
    f, ls = fm.log_features(q)
    assert out.device.type == "meta" and out.shape == (2, 3, 20, fm.feature_dim)
    assert f.shape == (2, 3, 20, fm.feature_dim) and ls.shape[:-1] == (2, 3)


@pytest.mark.parametrize("name", ["oprf", "saderf", "sderf", "nystrom"])
def test_fit_of_a_cpu_map_on_meta_tensors_is_refused(name):
    fm = ka.get_estimator(name).build(8, 16, seed=0)
    x = torch.empty(2, 20, 8, device="meta")
    with pytest.raises(ValueError, match=r"fit needs q on the map's device \(cpu\), got q on meta"):
        fm.fit(x, x)


def test_nystrom_nan_landmarks_refused_at_construction():
    L = torch.randn(6, 4)
    L[2, 1] = float("nan")
    with pytest.raises(ValueError, match=r"landmarks must be finite, got 1 NaN or Inf entries \(shape \(6, 4\)\)"):
        ka.NystromFeatures(4, landmarks=L)


def test_nystrom_feature_call_reads_no_device_flag():
    """The fitted flag lives on the host: a loaded state dict carries it there."""
    x = torch.randn(40, 4, generator=torch.Generator().manual_seed(0))
    fm = ka.NystromFeatures(4, 8, seed=0).fit(x, x)
    fresh = ka.NystromFeatures(4, 8, seed=1)
    assert not fresh.fitted
    fresh.load_state_dict(fm.state_dict())
    assert fresh.fitted
    torch.testing.assert_close(fresh(x), fm(x))
