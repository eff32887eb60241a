r"""Theory of the random-feature estimators: pointwise moments, concentration, uniform bounds.

* `.moments` — the generic machinery of closed-form bias, variance and MSE of every entry of
  ``fm.kernel(q, k)``: `bias`, `variance`, `mse`, `relative_mse` dispatch on a feature map
  through its registered identity (`kernelapprox.estimator_of`) and the closed forms it declares
  (`kernelapprox.EstimatorTheory`: ``POSITIVE_THEORY``, ``TRIG_SINCOS_THEORY``, ...).
* One module per estimator family, beside its map in `kernelapprox.maps`: `.exponential`
  (positive, hyperbolic), `.trig`, `.dense_exponential` (FAVOR++, FAVOR#), `.hybrid`, and
  `.simplex` (simplex rows, for every family).
* `.concentration` — Chebyshev / CLT / Hoeffding / Bernstein bounds on
  $P(|\hat K - K| \ge \varepsilon K)$ and `required_features` inverting them.
* `.uniform` — uniform convergence over the ball $B(R)$ (Rahimi–Recht,
  Sutherland–Schneider, Sriperumbudur–Szabó, Performer Thm 4) and
  `required_features_uniform`.
* `.attention` — delta-method variance of normalised attention outputs.

Every formula carries a source tag in its docstring: SOURCE (read in the paper), DERIVED
(derived here and checked by Monte Carlo in ``tests/``) or RECALLED (constants from memory).
"""

from __future__ import annotations

from .attention import attention_variance, kernel_covariance, normaliser_relative_variance
from .concentration import failure_probability, required_features
from .dense_exponential import oprf_mse, oprf_optimal_A
from .exponential import (
    HYPERBOLIC_THEORY,
    POSITIVE_THEORY,
    hyperbolic_bias,
    hyperbolic_mse,
    performer_theorem2_bound,
    positive_bias,
    positive_mse,
    smreg_kernel,
)
from .hybrid_attention import (
    exact_mass,
    hybrid_attention_variance,
    hybrid_error_identity,
    hybrid_normaliser_mse,
    hybrid_normaliser_variance,
    hybrid_numerator_mse,
    hybrid_numerator_variance,
)
from .moments import (
    Components,
    Moments,
    bias,
    deterministic_error,
    estimator_moments,
    feature_map_kind,
    mse,
    orf_pair_count,
    relative_mse,
    variance,
)
from .trig import (
    TRIG_OFFSET_THEORY,
    TRIG_SINCOS_THEORY,
    fixed_norm_trig_kernel,
    trig_bias,
    trig_offset_mse,
    trig_sincos_mse,
)
from .uniform import (
    CONSTANT_NOTES,
    CONSTANT_STATUS,
    UNIFORM_BOUNDS,
    derived_sincos_failure_probability,
    derived_sincos_features,
    performer_theorem4_features,
    rahimi_recht_features,
    required_features_uniform,
    sriperumbudur_szabo_features,
    sutherland_schneider_features,
)

__all__ = [
    "Components",
    "Moments",
    "POSITIVE_THEORY",
    "HYPERBOLIC_THEORY",
    "TRIG_SINCOS_THEORY",
    "TRIG_OFFSET_THEORY",
    "bias",
    "variance",
    "mse",
    "relative_mse",
    "estimator_moments",
    "feature_map_kind",
    "orf_pair_count",
    "trig_sincos_mse",
    "trig_offset_mse",
    "positive_mse",
    "oprf_mse",
    "oprf_optimal_A",
    "hyperbolic_mse",
    "trig_bias",
    "positive_bias",
    "hyperbolic_bias",
    "smreg_kernel",
    "fixed_norm_trig_kernel",
    "performer_theorem2_bound",
    "deterministic_error",
    "failure_probability",
    "required_features",
    "UNIFORM_BOUNDS",
    "rahimi_recht_features",
    "sutherland_schneider_features",
    "sriperumbudur_szabo_features",
    "performer_theorem4_features",
    "derived_sincos_features",
    "derived_sincos_failure_probability",
    "CONSTANT_STATUS",
    "CONSTANT_NOTES",
    "required_features_uniform",
    "attention_variance",
    "kernel_covariance",
    "normaliser_relative_variance",
    "exact_mass",
    "hybrid_normaliser_variance",
    "hybrid_numerator_variance",
    "hybrid_normaliser_mse",
    "hybrid_numerator_mse",
    "hybrid_attention_variance",
    "hybrid_error_identity",
]
