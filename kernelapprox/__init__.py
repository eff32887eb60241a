r"""kernelapprox: random-feature approximations of the softmax kernel $\exp(q^\top k)$.

The $\varphi$ inside linear attention, its theory, and the evidence.

>>> import torch, kernelapprox as ka
>>> fm = ka.PositiveRF(dim=16, num_features=128, sampler="orthogonal", seed=0)
>>> q, k = torch.randn(2, 10, 16).unbind(0)
>>> K_hat, K = fm.kernel(q / 2, k / 2), ka.softmax_kernel(q / 2, k / 2)
"""

from __future__ import annotations

from . import hf, maps, nn, samplers  # noqa: F401  (maps: registration; hf imports transformers lazily; kernelapprox.sklearn needs the [sklearn] extra and is imported explicitly)
from .attention import (
    HybridAttentionState,
    LinearAttentionState,
    RecurrentHybridAttention,
    RecurrentLinearAttention,
    chunk_linear_attention,
    hybrid_attention,
    linear_attention,
    naive_linear_attention,
    naive_recurrent_linear_attention,
    parallel_linear_attention,
)
from .diagnose import Diagnosis, KernelApproxWarning, diagnose
from .exact import softmax_attention, softmax_kernel
from .maps import (
    SADERF,
    SDERF,
    EluFeatures,
    FeatureMap,
    HedgehogFeatures,
    HybridRF,
    HyperbolicRF,
    NystromFeatures,
    OptimalPositiveRF,
    PositiveRF,
    RandomFeatureMap,
    ReluFeatures,
    TaylorFeatures,
    TrigRF,
)
from .registry import (
    DEFAULT_SAMPLER,
    Estimator,
    EstimatorTheory,
    estimator_of,
    estimators,
    get_estimator,
    register_estimator,
    unregister_estimator,
)
from .samplers import (
    GaussianSampler,
    OrthogonalSampler,
    QMCSampler,
    StructuredSampler,
    get_sampler,
)
from .training import distillation_loss, fit_feature_map

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_SAMPLER",
    "Estimator",
    "EstimatorTheory",
    "register_estimator",
    "unregister_estimator",
    "get_estimator",
    "estimator_of",
    "estimators",
    "FeatureMap",
    "RandomFeatureMap",
    "TrigRF",
    "PositiveRF",
    "HyperbolicRF",
    "EluFeatures",
    "ReluFeatures",
    "OptimalPositiveRF",
    "SADERF",
    "SDERF",
    "diagnose",
    "Diagnosis",
    "KernelApproxWarning",
    "HybridRF",
    "TaylorFeatures",
    "NystromFeatures",
    "HedgehogFeatures",
    "fit_feature_map",
    "distillation_loss",
    "samplers",
    "GaussianSampler",
    "OrthogonalSampler",
    "StructuredSampler",
    "QMCSampler",
    "get_sampler",
    "softmax_kernel",
    "softmax_attention",
    "linear_attention",
    "parallel_linear_attention",
    "chunk_linear_attention",
    "naive_linear_attention",
    "naive_recurrent_linear_attention",
    "RecurrentLinearAttention",
    "LinearAttentionState",
    "hybrid_attention",
    "RecurrentHybridAttention",
    "HybridAttentionState",
    "theory",
    "montecarlo",
    "plotting",
    "testing",
]


def __getattr__(name: str):
    # theory and montecarlo import scipy-heavy code, plotting matplotlib (on use), testing the
    # check battery: load on first use.
    if name in ("theory", "montecarlo", "plotting", "testing"):
        import importlib

        mod = importlib.import_module(f".{name}", __name__)
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'kernelapprox' has no attribute {name!r}")
