"""No host sync in the default call of any registered feature map.

A host sync (``.item()``, ``bool(tensor)``, a copy to the CPU, a Python branch on a device value)
is free on a CPU tensor but stalls an accelerator, breaks CUDA graphs and ends a
``torch.compile(fullgraph=True)`` graph. `tests._sync.host_syncs` counts them through a dispatch
mode on any device, so this runs on CPU. Fits may sync (they read fitted statistics once, off the
hot path): they run first, outside the count.
"""

from __future__ import annotations

import pytest
import torch

import kernelapprox as ka
from tests._sync import host_syncs

NAMES = [est.name for est in ka.estimators()]


def _map(name: str, d: int = 8) -> ka.FeatureMap:
    fm = ka.get_estimator(name).build(d, 16, seed=0)
    if fm.data_dependent:
        x = torch.randn(2, 40, d, generator=torch.Generator().manual_seed(3)) / 2
        fm.fit(x, x)
    return fm


CALLS = {
    "forward": lambda fm, q, k: fm(q),
    "log_features": lambda fm, q, k: fm.log_features(q),
    "log_features_shared": lambda fm, q, k: fm.log_features(q, shared=True),
    "query_features": lambda fm, q, k: fm.query_features(q),
    "key_log_features": lambda fm, q, k: fm.key_log_features(k),
    "key_features": lambda fm, q, k: fm.key_features(k),
    "kernel": lambda fm, q, k: fm.kernel(q, k),
    "query_log2_features": lambda fm, q, k: fm.query_log2_features(q),
    "key_log2_features": lambda fm, q, k: fm.key_log2_features(k),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("name", NAMES)
def test_map_call_has_no_host_sync(name, call):
    fm = _map(name)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 8, generator=g) / 2
    k = torch.randn(2, 11, 8, generator=g) / 2
    syncs = host_syncs(CALLS[call], fm, q, k)
    assert not syncs, f"{name}.{call}: host syncs {dict(syncs)}"
