"""Data-dependent maps used before ``fit``: one ``UserWarning`` per map, none once fitted.

`NystromFeatures` (data-free fallback landmarks) and the dense-exponential maps
(`OptimalPositiveRF`, `SADERF`, `SDERF`: A = 0 and no rotation, i.e. FAVOR+) warn the first time
an unfitted map computes features, naming the map and ``fit(q, k)``; a fitted map (or an
`OptimalPositiveRF` given ``A``) is silent, and a second call does not warn again.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import kernelapprox as ka

X = 0.5 * torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(0))
MAPS = {
    "NystromFeatures": lambda: ka.NystromFeatures(8, 6, seed=0),
    "OptimalPositiveRF": lambda: ka.OptimalPositiveRF(8, 16, seed=0),
    "SADERF": lambda: ka.SADERF(8, 16, seed=0),
    "SDERF": lambda: ka.SDERF(8, 16, seed=0),
}


@pytest.mark.parametrize("name", sorted(MAPS))
def test_unfitted_map_warns_once(name):
    fm = MAPS[name]()
    with pytest.warns(UserWarning, match=rf"{name} used before fit\(q, k\)"):
        fm(X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fm(X)  # once per map
        fm.key_features(X)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_fitted_map_is_silent(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fm = MAPS[name]().fit(X, X)
        fm(X)
        ka.linear_attention(X, X, X, MAPS[name](), fit=True)
        if name == "OptimalPositiveRF":
            ka.OptimalPositiveRF(8, 16, seed=0, A=-0.1)(X)
