"""The estimator registry: ONE registration per estimator, used by every study.

To add an estimator to every study, add one ``register(EstimatorSpec(...))`` call below (or in
your own code before running).  Studies pick estimators with :func:`select` by family / sampler /
randomness, so a new spec shows up in each study whose selection it matches.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

FAMILY_CLASS = {
    "trig-sincos": ("TrigRF", {"variant": "sincos"}),
    "trig-offset": ("TrigRF", {"variant": "offset"}),
    "positive": ("PositiveRF", {}),
    "hyperbolic": ("HyperbolicRF", {}),
    "elu": ("EluFeatures", {}),
    "relu": ("ReluFeatures", {}),
}
RANDOM_FAMILIES = ("trig-sincos", "trig-offset", "positive", "hyperbolic")
SAMPLERS = ("gaussian", "orthogonal", "structured", "qmc")
FAMILY_LABEL = {
    "trig-sincos": "trig sin/cos",
    "trig-offset": "trig cos+offset",
    "positive": "positive",
    "hyperbolic": "hyperbolic",
    "elu": "elu+1",
    "relu": "relu",
}
SAMPLER_LABEL = {
    "gaussian": "iid",
    "orthogonal": "orthogonal",
    "structured": "SORF",
    "qmc": "QMC",
}
# closed-form MSE in ka.theory (issue 3): iid and chi-norm orthogonal rows for every random
# family; deterministic maps have a closed-form (bias-only) error.  SORF / QMC: none.
_THEORY = {(f, s) for f in RANDOM_FAMILIES for s in ("gaussian", "orthogonal")} | {
    ("elu", None),
    ("relu", None),
}


@dataclass(frozen=True)
class EstimatorSpec:
    """How to build one estimator of exp(q.k).

    Attributes:
        key: unique id, e.g. ``"positive-orthogonal"``, ``"trig-sincos-gaussian"``, ``"elu"``.
        label: legend label.
        family: ``"trig-sincos" | "trig-offset" | "positive" | "hyperbolic" | "elu" | "relu"``.
        sampler: ``"gaussian" | "orthogonal" | "structured" | "qmc"``, or None (deterministic).
        is_random: whether the features are random (False for elu/relu).
        has_theory: whether ``ka.theory.mse`` has a closed form for it.
        kwargs: extra constructor keyword arguments (e.g. a sampler object's options).
    """

    key: str
    label: str
    family: str
    sampler: str | None
    is_random: bool = True
    has_theory: bool = False
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    def build(
        self,
        dim: int,
        num_features: int,
        *,
        batch_shape: tuple[int, ...] = (),
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ) -> torch.nn.Module:
        """The feature map: ``batch_shape`` independent draws (one projection each) from ``seed``.

        Deterministic maps (elu/relu) ignore ``num_features``, ``batch_shape`` and ``seed``;
        their output has no batch dimensions and broadcasts against the random ones.
        """
        import kernelapprox as ka

        cls_name, fixed = FAMILY_CLASS[self.family]
        cls = getattr(ka, cls_name)
        kw: dict[str, Any] = {**fixed, **self.kwargs}
        if not self.is_random:
            params = inspect.signature(cls).parameters
            if "num_features" in params and params["num_features"].default is inspect.Parameter.empty:
                kw["num_features"] = num_features
            opt = {"dtype": dtype, "device": device}
            kw.update({k: v for k, v in opt.items() if k in params})
            return cls(dim, **kw).to(device=device, dtype=dtype)
        return cls(
            dim,
            num_features,
            sampler=self.sampler,
            seed=seed,
            batch_shape=tuple(batch_shape),
            dtype=dtype,
            device=device,
            **kw,
        )


ESTIMATORS: dict[str, EstimatorSpec] = {}


def register(spec: EstimatorSpec) -> EstimatorSpec:
    """Add ``spec`` to :data:`ESTIMATORS` (replacing one with the same key) and return it."""
    ESTIMATORS[spec.key] = spec
    return spec


def select(
    families: Iterable[str] | str | None = None,
    samplers: Iterable[str | None] | str | None = None,
    random: bool | None = None,
    keys: Iterable[str] | None = None,
) -> list[EstimatorSpec]:
    """Registered specs filtered by family, sampler, randomness and/or key (registration order)."""
    fam = {families} if isinstance(families, str) else (set(families) if families else None)
    smp = {samplers} if isinstance(samplers, str) else (set(samplers) if samplers else None)
    ks = set(keys) if keys else None
    out = []
    for s in ESTIMATORS.values():
        if fam is not None and s.family not in fam:
            continue
        if smp is not None and s.sampler not in smp:
            continue
        if random is not None and s.is_random != random:
            continue
        if ks is not None and s.key not in ks:
            continue
        out.append(s)
    return out


def get(key: str) -> EstimatorSpec:
    """The spec registered under ``key``."""
    return ESTIMATORS[key]


for _fam in RANDOM_FAMILIES:
    for _smp in SAMPLERS:
        register(
            EstimatorSpec(
                key=f"{_fam}-{_smp}",
                label=f"{FAMILY_LABEL[_fam]} ({SAMPLER_LABEL[_smp]})",
                family=_fam,
                sampler=_smp,
                is_random=True,
                has_theory=(_fam, _smp) in _THEORY,
            )
        )
for _fam in ("elu", "relu"):
    register(
        EstimatorSpec(
            key=_fam,
            label=FAMILY_LABEL[_fam],
            family=_fam,
            sampler=None,
            is_random=False,
            has_theory=True,
        )
    )

__all__ = ["ESTIMATORS", "EstimatorSpec", "get", "register", "select"]
