"""The studies' view of the estimator registry: every registered estimator x every sampler.

There is no second registry here. A study estimator (an :class:`EstimatorSpec`) is a registered
``kernelapprox`` estimator (:func:`kernelapprox.estimators`) drawn with one sampler
(:data:`kernelapprox.samplers.SAMPLERS`); deterministic maps take no sampler. The list is built
anew at every :func:`select`, so an estimator registered with ``ka.register_estimator`` (in your
own code, before running the studies) appears in every study whose selection matches it, by
estimator name, sampler, randomness or closed form.

Keys: ``"<estimator>-<sampler>"`` for random maps (``"positive-orthogonal"``,
``"trig-sincos-gaussian"``), the estimator's name for deterministic ones (``"elu"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

import kernelapprox as ka
from kernelapprox.samplers import SAMPLERS as _SAMPLER_CLASSES

#: Sampler names, in the order the studies show them.
SAMPLERS = tuple(_SAMPLER_CLASSES)
#: Legend labels of the samplers (``Sampler.label``).
SAMPLER_LABEL = {name: cls().label for name, cls in _SAMPLER_CLASSES.items()}


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator with one sampler: what a study cell builds.

    Attributes:
        estimator: the registered :class:`kernelapprox.Estimator`.
        sampler: a sampler name (``"gaussian" | "orthogonal" | "structured" | "qmc"``), or None
            for a deterministic map.
    """

    estimator: ka.Estimator
    sampler: str | None

    @property
    def key(self) -> str:
        """Unique id: ``"<estimator>-<sampler>"``, or the estimator's name if deterministic."""
        return self.name if self.sampler is None else f"{self.name}-{self.sampler}"

    @property
    def name(self) -> str:
        """The estimator's canonical name (``"trig-sincos"``, ``"positive"``, ``"elu"``, ...)."""
        return self.estimator.name

    @property
    def label(self) -> str:
        """Legend label, e.g. ``"positive (orthogonal)"``."""
        if self.sampler is None:
            return self.estimator.label
        return f"{self.estimator.label} ({SAMPLER_LABEL.get(self.sampler, self.sampler)})"

    @property
    def is_random(self) -> bool:
        return self.estimator.is_random

    @property
    def positive(self) -> bool:
        """Whether the features are non-negative (signed maps can have attention denominators <= 0)."""
        return self.estimator.positive

    @property
    def data_dependent(self) -> bool:
        """Whether the map chooses parameters from the data (``fm.fit(q, k)`` before use)."""
        return bool(getattr(self.estimator, "data_dependent", False))

    @property
    def learned(self) -> bool:
        """Whether the map has trainable parameters (fitted by ``ka.fit_feature_map``)."""
        return bool(getattr(self.estimator, "learned", False))

    def closed_forms(self) -> frozenset[str]:
        """The closed forms ``kernelapprox.theory`` has for this estimator with this sampler."""
        return self.estimator.closed_forms(self.sampler)

    @property
    def has_theory(self) -> bool:
        """Whether ``ka.theory.mse`` has a closed form (moments, or the exact error of a deterministic map)."""
        return bool(self.closed_forms() & {"moments", "exact_error"})

    def build(
        self,
        dim: int,
        num_features: int,
        *,
        batch_shape: tuple[int, ...] = (),
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        device: str | torch.device = "cpu",
    ) -> ka.FeatureMap:
        """The feature map: ``batch_shape`` independent draws (one projection each) from ``seed``.

        Deterministic maps ignore ``num_features``, ``batch_shape`` and ``seed``; their output has
        no batch dimensions and broadcasts against the random ones.
        """
        kw: dict[str, Any] = {"seed": seed, "batch_shape": tuple(batch_shape), "dtype": dtype, "device": device}
        if self.sampler is not None:
            kw["sampler"] = self.sampler
        return self.estimator.build(dim, num_features, **kw)

    def ready(
        self,
        fm: ka.FeatureMap,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        steps: int = 200,
        seed: int | None = 0,
        lr: float | None = None,
    ) -> ka.FeatureMap:
        """Ready a built map on calibration data ``(q, k)``, in place; returns ``fm``.

        ``fm.fit(q, k)`` if the estimator is data-dependent (FAVOR++, FAVOR#, Nyström: the
        parameters are chosen from this batch), ``ka.fit_feature_map(fm, q, k,
        steps=steps, seed=seed, progress=False)`` (and ``lr`` when given) if it is learned
        (Hedgehog); nothing else, so any other map is returned unchanged.

        Raises
        ------
        NotImplementedError
            A learned estimator while ``kernelapprox.training.fit_feature_map`` does not exist.
        """
        if self.data_dependent:
            fit = getattr(fm, "fit", None)
            if fit is not None:
                fit(q, k)
        if self.learned:
            fit_feature_map = getattr(getattr(ka, "training", None), "fit_feature_map", None)
            if fit_feature_map is None:
                raise NotImplementedError(
                    f"{self.key} is a learned map but kernelapprox.training.fit_feature_map is not "
                    "available: it cannot be trained"
                )
            kw: dict[str, Any] = {"steps": steps, "seed": seed, "progress": False}
            if lr is not None:
                kw["lr"] = lr
            fit_feature_map(fm, q, k, **kw)
        return fm


def specs() -> list[EstimatorSpec]:
    """Every registered estimator x sampler, in registration order (samplers in :data:`SAMPLERS` order)."""
    out = []
    for est in ka.estimators():
        if est.is_random:
            out.extend(EstimatorSpec(est, smp) for smp in SAMPLERS)
        else:
            out.append(EstimatorSpec(est, None))
    return out


def _as_set(x: Iterable[Any] | Any | None) -> set | None:
    if x is None:
        return None
    if isinstance(x, str):
        return {x}
    return set(x)


def select(
    estimators: Iterable[str] | str | None = None,
    samplers: Iterable[str | None] | str | None = None,
    random: bool | None = None,
    keys: Iterable[str] | None = None,
    closed_form: str | None = None,
) -> list[EstimatorSpec]:
    """Specs filtered by estimator name, sampler, randomness, key and/or closed form."""
    fam, smp, ks = _as_set(estimators), _as_set(samplers), _as_set(keys)
    out = []
    for s in specs():
        if fam is not None and s.name not in fam:
            continue
        if smp is not None and s.sampler not in smp:
            continue
        if random is not None and s.is_random != random:
            continue
        if ks is not None and s.key not in ks:
            continue
        if closed_form is not None and closed_form not in s.closed_forms():
            continue
        out.append(s)
    return out


def get(key: str) -> EstimatorSpec:
    """The spec with this key (``KeyError`` naming the valid keys otherwise)."""
    for s in specs():
        if s.key == key:
            return s
    raise KeyError(f"no study estimator {key!r}; valid keys: {[s.key for s in specs()]}")


__all__ = ["SAMPLERS", "SAMPLER_LABEL", "EstimatorSpec", "get", "select", "specs"]
