r"""Feature maps $\varphi:\mathbb R^d \to \mathbb R^F$ with $\varphi(q)^\top\varphi(k) \approx \exp(q^\top k)$:
one estimator family per module, over the base classes of `kernelapprox.maps.base`.

- `kernelapprox.maps.base`: ``FeatureMap`` (the contract) and ``RandomFeatureMap`` (a drawn projection);
- `kernelapprox.maps.exponential`: ``PositiveRF`` (FAVOR+), ``HyperbolicRF``;
- `kernelapprox.maps.trig`: ``TrigRF`` (sin/cos and cos+offset random Fourier features);
- `kernelapprox.maps.dense_exponential`: ``OptimalPositiveRF`` (FAVOR++), ``SADERF``, ``SDERF`` (FAVOR#);
- `kernelapprox.maps.hybrid`: ``HybridRF``;
- `kernelapprox.maps.deterministic`: ``EluFeatures``, ``ReluFeatures``, ``TaylorFeatures``, ``NystromFeatures``;
- `kernelapprox.maps.hedgehog`: ``HedgehogFeatures`` (fitted by `kernelapprox.training.fit_feature_map`).
- `kernelapprox.maps.spec`: the reading of a ``feature_map=`` argument (`resolve_feature_map`).

Each family's closed forms live in the `kernelapprox.theory` module of the same name.
"""

from __future__ import annotations

# The import order is the registration order of `kernelapprox.estimators()` (the order of the
# studies' grids and tables): the 2021 maps first, then the deterministic, the stronger and the
# learned ones.
# isort: off
from .base import FeatureMap, RandomFeatureMap
from .exponential import HyperbolicRF, PositiveRF
from .trig import TrigRF
from .deterministic import EluFeatures, NystromFeatures, ReluFeatures, TaylorFeatures
from .dense_exponential import SADERF, SDERF, OptimalPositiveRF, optimal_A
from .hybrid import HybridRF, default_num_angular
from .hedgehog import HedgehogFeatures
# isort: on

__all__ = [
    "FeatureMap",
    "RandomFeatureMap",
    "PositiveRF",
    "HyperbolicRF",
    "TrigRF",
    "OptimalPositiveRF",
    "SADERF",
    "SDERF",
    "optimal_A",
    "HybridRF",
    "default_num_angular",
    "EluFeatures",
    "ReluFeatures",
    "TaylorFeatures",
    "NystromFeatures",
    "HedgehogFeatures",
]
