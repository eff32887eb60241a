r"""One reading of a feature-map argument, with one set of defaults, for `kernelapprox.nn`,
`kernelapprox.hf.linearize` and `kernelapprox.sklearn`.

A map is given as

* an estimator **name** (``"positive"``, ``"hedgehog"``, ..., `kernelapprox.estimators`): built
  with the defaults below;
* a `FeatureMap` **instance**: taken as given;
* a **factory**: called with the caller's arguments (``(dim_head, heads)`` in `kernelapprox.nn`,
  ``(layer, heads, dim_head)`` in `kernelapprox.hf.linearize`) and checked to return a map;
* a **mapping** layer -> `FeatureMap` (per-layer maps, where the caller has layers).

Defaults of a map built by name: ``num_features`` $= \lfloor d \ln d\rfloor$ projections for a
random map (performer-pytorch's ``nb_features``), the library's one default sampler,
``DEFAULT_SAMPLER = "orthogonal"`` [Cho21]_ (`kernelapprox.registry.DEFAULT_SAMPLER`), one
draw (or one learned weight) per head (``batch_shape=(heads,)``), ``seed`` as given (layer
``l`` of a model: ``seed * 1000003 + l``). ``options`` override them.

References
----------
.. [Cho21] K. Choromanski et al. "Rethinking attention with Performers", ICLR 2021.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .._validation import check_positive_int
from ..registry import DEFAULT_SAMPLER, get_estimator
from .base import FeatureMap

__all__ = ["default_num_features", "resolve_feature_map", "DEFAULT_SAMPLER", "layer_seed"]


def default_num_features(dim_head: int) -> int:
    r"""Default number of random projections per head: $r = \lfloor d_h \ln d_h \rfloor$ (at least 1).

    The default of performer-pytorch's ``FastAttention`` (``nb_features``), kept so that a
    migrated model has the same cost.

    Parameters
    ----------
    dim_head : int
        $d_h$, the dimension of one head.

    Returns
    -------
    int

    Examples
    --------
    >>> default_num_features(64)
    266
    """
    d = check_positive_int("dim_head", dim_head)
    return max(1, int(d * math.log(d)))


def layer_seed(seed: int | None, layer: int | None) -> int | None:
    """The seed of the map of ``layer``: ``seed * 1000003 + layer`` (``seed`` itself without a layer).

    Examples
    --------
    >>> layer_seed(0, 3), layer_seed(5, None), layer_seed(None, 2)
    (3, 5, None)
    """
    if seed is None or layer is None:
        return seed
    return seed * 1_000_003 + layer


def _describe(factory_args: tuple[Any, ...]) -> str:
    return "feature_map(" + ", ".join(map(str, factory_args)) + ")"


def resolve_feature_map(
    spec: object,
    *,
    dim: int,
    heads: int | None = None,
    layer: int | None = None,
    num_features: int | None = None,
    sampler: object = None,
    seed: int | None = None,
    options: Mapping[str, Any] | None = None,
    factory_args: tuple[Any, ...] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    name: str = "feature_map",
) -> FeatureMap:
    r"""The feature map a ``feature_map=`` argument stands for (name, instance, factory or per-layer mapping).

    Parameters
    ----------
    spec : str, FeatureMap, callable or mapping int -> FeatureMap
        The argument.
    dim : int
        Input dimension $d$ of the map (the head dimension).
    heads : int, optional
        Heads of the layer: a map built by name gets ``batch_shape=(heads,)`` (none without).
    layer : int, optional
        The layer (mappings are indexed by it; the seed is derived from it, `layer_seed`).
    num_features : int, optional
        Projections of a map built by name (default: `default_num_features` for a random map,
        the estimator's own otherwise).
    sampler : str or Sampler, optional
        Projection sampler of a map built by name (default: ``DEFAULT_SAMPLER``, the registry's).
    seed : int, optional
    options : mapping, optional
        Further constructor arguments of a map built by name (they override the defaults).
    factory_args : tuple, optional
        The arguments a factory is called with (default ``(dim, heads)``).
    device, dtype : optional
        Where a map built by name lives; an instance or a factory's map is moved there.
    name : str, default "feature_map"
        The argument's name in error messages.

    Returns
    -------
    FeatureMap

    Examples
    --------
    >>> fm = resolve_feature_map("positive", dim=8, heads=2, seed=0)
    >>> fm.num_features, tuple(fm.batch_shape)
    (16, (2,))
    """
    if options is not None and not isinstance(options, Mapping):
        raise TypeError(f"{name}_kwargs must be a mapping or None, got {type(options).__name__}")
    if isinstance(spec, FeatureMap):
        fm = spec
        if device is not None or dtype is not None:
            fm = fm.to(device=device, dtype=dtype)
        return fm
    if isinstance(spec, str):
        est = get_estimator(spec)
        r = num_features
        if r is None and est.is_random:
            r = default_num_features(dim)
        kwargs: dict[str, Any] = {
            "sampler": DEFAULT_SAMPLER if sampler is None else sampler,
            "seed": layer_seed(seed, layer),
            "device": device,
            "dtype": dtype,
        }
        if heads is not None:
            kwargs["batch_shape"] = (heads,)  # one draw (or one learned weight) per head
        kwargs.update(options or {})
        return est.build(dim, r, **kwargs)
    if isinstance(spec, Mapping):
        if layer not in spec:
            raise KeyError(f"{name} has no map for layer {layer} (keys {sorted(spec)})")
        fm = spec[layer]
        if not isinstance(fm, FeatureMap):
            raise TypeError(f"{name}[{layer}] must be a FeatureMap, got {type(fm).__name__}")
        return fm
    if callable(spec):
        args = (dim, heads) if factory_args is None else factory_args
        fm = spec(*args)
        if not isinstance(fm, FeatureMap):
            raise TypeError(
                f"{name} factory must return a kernelapprox FeatureMap, got {type(fm).__name__} (called as "
                f"{_describe(args)})"
            )
        if device is not None or dtype is not None:
            fm = fm.to(device=device, dtype=dtype)
        return fm
    raise TypeError(
        f"{name} must be an estimator name (e.g. 'positive'), a kernelapprox FeatureMap, a factory or a "
        f"mapping layer -> FeatureMap, got {type(spec).__name__}"
    )

