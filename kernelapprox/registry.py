r"""One estimator identity: every feature map class declares who it is here, once.

An `Estimator` is the identity of one estimator of $\exp(q^\top k)$: a short
canonical name (``"positive"``, ``"trig-sincos"``, ...), the `kernelapprox.FeatureMap`
class that computes it and the constructor arguments that select it (``TrigRF`` is two estimators,
``variant="sincos"`` and ``variant="offset"``), a legend label, the rule giving ``feature_dim``
from ``(r, d)``, and its closed-form theory (an `EstimatorTheory`, or none). Whether it is
random and whether its features are positive are read from the class (``is_random``,
``positive``), where the code that depends on them lives.

Everything that needs to know *which* estimator a feature map is -- `kernelapprox.theory`,
`kernelapprox.montecarlo`, the studies, the tests -- asks this registry
(`estimator_of`, `get_estimator`, `estimators`); nothing dispatches on class
names. Adding an estimator is one class, its theory functions (optional) and one
`register_estimator` call; it then appears in every study whose selection matches.

The default sampler. Every entry point that builds a random map with a sampler choice --
`Estimator.build` here, `kernelapprox.maps.spec.resolve_feature_map` (hence the
`kernelapprox.nn` layers and ``kernelapprox.hf.linearize``), ``kernelapprox.sklearn.RandomFeatures``
and `kernelapprox.diagnose` -- draws its projection with `DEFAULT_SAMPLER` ``= "orthogonal"``
unless ``sampler=`` is given: independent blocks of $d$ orthogonal directions (Haar, the sign of
QR corrected) with independent $\chi_d$ row norms, so every row is marginally
$\mathcal N(0, I_d)$, every estimator stays unbiased and the variance is lower than with iid rows
[Yu16]_ [Cho21]_. Closed forms that exist for iid rows only (the delta-method attention
variance, the uniform bounds, the moments of ``"sderf"`` and ``"hybrid"``) need
``sampler="gaussian"``, the iid reference, passed explicitly; so does `estimators` when it
filters by those closed forms. `diagnose` falls back to iid rows for an estimator whose moments
are not known for orthogonal ones (its ``sampler`` column says which). A map class called
directly (``ka.PositiveRF(d, r)``) keeps its own constructor default, ``"gaussian"``.

References
----------
.. [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072 (ORF eq. 2, SORF eq. 5).
.. [Cho21] K. Choromanski et al. "Rethinking attention with Performers", ICLR 2021.

Examples
--------
>>> import kernelapprox as ka
>>> class MyPositiveRF(ka.PositiveRF):
...     '''FAVOR+ under another name (say, instrumented): a different estimator until registered.'''
>>> est = ka.register_estimator(MyPositiveRF, name="my-positive", label="my positive",
...                             feature_dim="r", theory=ka.get_estimator("positive").theory)
>>> fm = est.build(4, 8, seed=0)
>>> ka.estimator_of(fm).name, fm.feature_dim, fm.sampler.name == ka.DEFAULT_SAMPLER
('my-positive', 8, True)
>>> sorted(est.closed_forms("orthogonal")), sorted(est.closed_forms("gaussian"))
(['moments'], ['attention_variance', 'moments'])
>>> ka.unregister_estimator("my-positive")
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from ._validation import check_bool
from .maps.base import FeatureMap

if TYPE_CHECKING:  # pragma: no cover
    from .samplers import Sampler

__all__ = [
    "Estimator",
    "EstimatorTheory",
    "register_estimator",
    "unregister_estimator",
    "get_estimator",
    "estimator_of",
    "estimators",
    "CLOSED_FORMS",
    "DEFAULT_SAMPLER",
]

#: The sampler of every random map built with a sampler choice and without ``sampler=``
#: (`Estimator.build`, `kernelapprox.maps.spec.resolve_feature_map`, the `kernelapprox.nn`
#: layers, ``kernelapprox.sklearn.RandomFeatures``, `kernelapprox.diagnose`): block-orthogonal
#: rows with $\chi_d$ norms (`kernelapprox.samplers.OrthogonalSampler`) [Yu16]_ [Cho21]_.
DEFAULT_SAMPLER = "orthogonal"

#: Names of the closed forms an `EstimatorTheory` can provide.
#:
#: * ``"moments"``: bias, variance and MSE of every kernel entry (``ka.theory.bias/variance/mse``),
#:   for the row laws listed in ``EstimatorTheory.row_laws``;
#: * ``"attention_variance"``: the delta-method variance of attention outputs (iid rows);
#: * ``"bounded_terms"``: per-projection terms bounded, so Hoeffding and Bernstein bounds apply;
#: * ``"uniform"``: uniform-convergence bounds over a ball (``ka.theory.required_features_uniform``);
#: * ``"exact_error"``: a deterministic map, whose error against $e^{q^\top k}$ is computed
#:   exactly (no randomness, bias only).
CLOSED_FORMS = ("moments", "attention_variance", "bounded_terms", "uniform", "exact_error")


@dataclass(frozen=True)
class EstimatorTheory:
    r"""The closed forms of one random estimator, as functions the generic theory code calls.

    The estimator is $\hat K = \frac1r\sum_{i=1}^r X_i$, an average of per-projection terms
    (see `kernelapprox.theory.moments`).

    Attributes
    ----------
    components : callable, optional
        ``components(geo, orthogonal) -> kernelapprox.theory.moments.Components``: the scale,
        per-projection variance, same-block pair covariance, relative bias and
        $\log e^{q^\top k}$ of every entry, for the row law ``orthogonal`` (``None`` = iid,
        ``"chi"``, ``"fixed"``). ``None``: no closed-form moments.
    row_laws : frozenset of str
        The `Sampler.row_law <kernelapprox.samplers.Sampler.row_law>` values covered by
        ``components`` (``"iid"``, ``"orthogonal-chi"``, ``"orthogonal-fixed"``, ``"simplex"``).
    attention_pair_terms : tuple of (c, alpha, beta, gamma), optional
        $E[X_jX_l]$ for two keys sharing a query, iid Gaussian rows:
        $\sum c\,e^{\alpha\|q\|^2+\beta(q^\top k_j+q^\top k_l)+\gamma k_j^\top k_l}$
        (`kernelapprox.theory.attention`).
    term_bound : callable, optional
        ``term_bound(components) -> a / K``, a bound on $|X_i|$ relative to the kernel, when
        the per-projection terms are bounded (Hoeffding and Bernstein bounds then apply).
    uniform_variant : str, optional
        ``"sincos"`` or ``"offset"``: the uniform-convergence bounds of
        `kernelapprox.theory.uniform` cover this estimator.
    prepare : callable, optional
        ``prepare(fm, q, k) -> (q, k, params)`` for estimators with (fitted) parameters: the
        inputs the closed forms see (float64 NumPy arrays; e.g. SADERF's $\Psi q$ and
        $\Psi^{-1}k$) and keyword arguments passed on to ``components`` (e.g. OPRF's ``A``).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> th = ka.get_estimator("positive").theory
    >>> sorted(th.row_laws)
    ['iid', 'orthogonal-chi', 'orthogonal-fixed', 'simplex']
    >>> sorted(th.closed_forms("iid")), sorted(th.closed_forms(None))
    (['attention_variance', 'moments'], [])
    """

    components: Callable[..., Any] | None = None
    row_laws: frozenset[str] = frozenset()
    attention_pair_terms: tuple[tuple[float, float, float, float], ...] | None = None
    term_bound: Callable[..., Any] | None = None
    uniform_variant: str | None = None
    prepare: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        for name in ("components", "term_bound", "prepare"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable or None, got {value!r} ({type(value).__name__})")

    def closed_forms(self, row_law: str | None) -> frozenset[str]:
        """The closed forms available for projections drawn with ``row_law`` (``None``: unknown)."""
        out = set()
        if self.components is not None and row_law in self.row_laws:
            out.add("moments")
            if self.term_bound is not None:
                out.add("bounded_terms")
        if self.attention_pair_terms is not None and row_law == "iid":
            out.add("attention_variance")
        if self.uniform_variant is not None and row_law == "iid":
            out.add("uniform")
        return frozenset(out)


_FEATURE_DIM_RULES: dict[str, Callable[[int, int], int]] = {
    "r": lambda r, d: r,
    "2r": lambda r, d: 2 * r,
    "d": lambda r, d: d,
}


@dataclass(frozen=True, eq=False)
class Estimator:
    """The identity of one estimator (see the module docstring). Build it with
    `register_estimator`.

    Attributes
    ----------
    name : str
        Canonical short name, unique, e.g. ``"trig-sincos"``.
    cls : type
        The `kernelapprox.FeatureMap` subclass.
    params : Mapping
        Constructor arguments that select this estimator within ``cls`` (e.g.
        ``{"variant": "offset"}``); a map *is* this estimator when its attributes equal them.
    label : str
        Legend label for figures and tables.
    feature_dim_rule : str
        ``"r"``, ``"2r"``, ``"d"`` or ``"custom"``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> est = ka.get_estimator("trig-sincos")
    >>> est
    Estimator('trig-sincos', TrigRF, variant='sincos')
    >>> est.is_random, est.positive, est.feature_dim(16, 4)
    (True, False, 32)
    >>> est.matches(ka.TrigRF(4, 16, variant="sincos")), est.matches(ka.TrigRF(4, 16, variant="offset"))
    (True, False)
    """

    name: str
    cls: type
    params: Mapping[str, Any] = field(default_factory=dict)
    label: str = ""
    feature_dim_rule: str = "r"
    _feature_dim: Callable[[int, int], int] | None = field(default=None, repr=False)
    _theory: EstimatorTheory | str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cls, type):
            raise TypeError(f"cls must be a class (a FeatureMap subclass), got {self.cls!r} "
                            f"({type(self.cls).__name__})")

    # ------------------------------------------------------------------ facts read from the class
    @property
    def is_random(self) -> bool:
        """Whether the features are random (drawn projections)."""
        return bool(getattr(self.cls, "is_random"))  # noqa: B009 - cls is a FeatureMap subclass

    @property
    def positive(self) -> bool:
        """Whether the features are always non-negative (attention denominators cannot vanish)."""
        return bool(getattr(self.cls, "positive"))  # noqa: B009

    @property
    def data_dependent(self) -> bool:
        """Whether the map chooses parameters from the data (``fm.fit(q, k)`` before use)."""
        return bool(getattr(self.cls, "data_dependent", False))

    @property
    def learned(self) -> bool:
        """Whether the map has trainable parameters (fitted by ``ka.fit_feature_map``)."""
        return bool(getattr(self.cls, "learned", False))

    # ------------------------------------------------------------------ declared here
    def feature_dim(self, num_features: int, dim: int) -> int:
        """``feature_dim`` of the map with ``r = num_features`` projections on inputs of ``dim``."""
        fn = self._feature_dim or _FEATURE_DIM_RULES[self.feature_dim_rule]
        return int(fn(int(num_features), int(dim)))

    @property
    def theory(self) -> EstimatorTheory | None:
        """The closed forms (imported on first use: the theory modules need scipy)."""
        th = self._theory
        if isinstance(th, str):
            module, _, attr = th.partition(":")
            th = getattr(importlib.import_module(module), attr)
            if not isinstance(th, EstimatorTheory):
                raise TypeError(f"theory of {self.name!r} ({self._theory}) is not an EstimatorTheory")
            object.__setattr__(self, "_theory", th)
        return th

    def closed_forms(self, sampler: object = None) -> frozenset[str]:
        """The closed forms available for this estimator with projections from ``sampler``.

        Parameters
        ----------
        sampler : str or Sampler, optional
            A sampler name or object (its ``row_law`` decides). Ignored for deterministic maps.

        Returns
        -------
        frozenset of str
            A subset of `CLOSED_FORMS`.
        """
        if not self.is_random:
            # a learned map approximates attention weights after normalisation, not e^{q.k}:
            # its error against the kernel is not a meaningful closed form
            return frozenset() if self.learned else frozenset({"exact_error"})
        th = self.theory
        if th is None:
            return frozenset()
        from .samplers import get_sampler

        law = None if sampler is None else get_sampler(cast("str | Sampler", sampler)).row_law
        return th.closed_forms(law)

    def matches(self, fm: object) -> bool:
        """Whether ``fm`` is this estimator: exactly of class ``cls``, with ``params`` matching."""
        return type(fm) is self.cls and all(getattr(fm, k, _MISSING) == v for k, v in self.params.items())

    def build(self, dim: int, num_features: int | None = None, **kwargs: Any) -> FeatureMap:
        r"""Construct the feature map: ``cls(dim, num_features, **params, **kwargs)``.

        Deterministic maps accept (and ignore) the random maps' arguments, so generic code can
        build any estimator the same way.

        A random map draws its projection with `DEFAULT_SAMPLER` (``"orthogonal"``: block-orthogonal
        rows with $\chi_d$ norms, unbiased, lower variance [Yu16]_ [Cho21]_) unless a ``sampler``
        is given (``None`` stands for the default), as every entry point that builds a map by name
        does (module docstring). Pass ``sampler="gaussian"`` for iid rows, the reference of the
        closed forms that exist for iid rows only (``closed_forms("gaussian")`` versus
        ``closed_forms("orthogonal")``).

        Examples
        --------
        >>> import kernelapprox as ka
        >>> fm = ka.get_estimator("trig-offset").build(4, 16, seed=0)
        >>> type(fm).__name__, fm.variant, fm.feature_dim, fm.sampler.name
        ('TrigRF', 'offset', 16, 'orthogonal')
        >>> ka.get_estimator("positive").build(4, 16, sampler="gaussian", seed=0).sampler.row_law
        'iid'
        """
        if self.is_random and kwargs.get("sampler") is None:
            kwargs["sampler"] = DEFAULT_SAMPLER
        return self.cls(dim, num_features, **{**self.params, **kwargs})

    def __repr__(self) -> str:
        params = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"Estimator({self.name!r}, {self.cls.__name__}{params})"


_MISSING = object()
_REGISTRY: dict[str, Estimator] = {}


def register_estimator(
    cls: type,
    *,
    name: str,
    label: str | None = None,
    params: Mapping[str, Any] | None = None,
    feature_dim: str | Callable[[int, int], int] = "r",
    theory: EstimatorTheory | str | None = None,
    replace: bool = False,
) -> Estimator:
    """Register a feature map class (with the constructor ``params`` that select it) as an estimator.

    One call per estimator: it then has an identity (`estimator_of`), its theory is found by
    `kernelapprox.theory`, and the studies select it by name, randomness and closed forms.

    Parameters
    ----------
    cls : type
        A `kernelapprox.FeatureMap` subclass whose constructor takes ``(dim, num_features,
        **kwargs)`` like the built-in maps.
    name : str
        Canonical short name: lower case, words joined by ``-`` (e.g. ``"my-rf"``).
    label : str, optional
        Legend label (default: ``name``).
    params : Mapping, optional
        Constructor arguments that select this estimator within ``cls``.
    feature_dim : {"r", "2r", "d"} or callable, default "r"
        ``feature_dim`` as a function of ``(r, d)``.
    theory : EstimatorTheory or str, optional
        Closed forms, or ``"module:attribute"`` naming one (imported on first use).
    replace : bool, default False
        Allow replacing an estimator registered under the same name.

    Returns
    -------
    Estimator

    Raises
    ------
    TypeError
        ``cls`` is not a FeatureMap subclass, or ``theory`` has the wrong type.
    ValueError
        Bad ``name`` or ``feature_dim``, or ``name`` (or the same ``cls`` and ``params``) already
        registered without ``replace=True``.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> class HalfTrigRF(ka.TrigRF):
    ...     '''Trig features under another class: its own estimator once registered.'''
    >>> est = ka.register_estimator(HalfTrigRF, name="half-trig", params={"variant": "sincos"},
    ...                             feature_dim="2r")
    >>> fm = est.build(4, 8, seed=0)
    >>> ka.estimator_of(fm).name, fm.feature_dim, fm(torch.randn(3, 4)).shape
    ('half-trig', 16, torch.Size([3, 16]))
    >>> ka.unregister_estimator("half-trig")
    """
    if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
        raise TypeError(f"cls must be a FeatureMap subclass, got {cls!r}")
    if not isinstance(name, str) or not name or name != name.strip().lower() or " " in name or "_" in name:
        raise ValueError(
            f"name must be a non-empty lower-case string with words joined by '-', got {name!r}"
        )
    if theory is not None and not isinstance(theory, (EstimatorTheory, str)):
        raise TypeError(f"theory must be an EstimatorTheory or 'module:attribute', got {type(theory).__name__}")
    params = dict(params or {})
    if callable(feature_dim):
        rule, fn = "custom", feature_dim
    elif feature_dim in _FEATURE_DIM_RULES:
        rule, fn = feature_dim, None
    else:
        raise ValueError(f"feature_dim must be one of {sorted(_FEATURE_DIM_RULES)} or a callable, got {feature_dim!r}")
    est = Estimator(
        name=name,
        cls=cls,
        params=params,
        label=label or name,
        feature_dim_rule=rule,
        _feature_dim=fn,
        _theory=theory,
    )
    if not replace:
        if name in _REGISTRY:
            raise ValueError(f"an estimator named {name!r} is already registered ({_REGISTRY[name]!r}); pass replace=True")
        for other in _REGISTRY.values():
            if other.cls is cls and dict(other.params) == params:
                raise ValueError(
                    f"{cls.__name__} with params {params} is already registered as {other.name!r}"
                )
    if name in _REGISTRY:
        _forget(_REGISTRY[name])
    _REGISTRY[name] = est
    # the class carries its own registrations: FeatureMap.estimator and feature_dim read them
    # there, so the maps need not import this module
    cls.registrations = (*cls.__dict__.get("registrations", ()), est)
    return est


def _forget(est: Estimator) -> None:
    """Remove ``est`` from its class's ``registrations``."""
    cls = cast("type[FeatureMap]", est.cls)
    cls.registrations = tuple(e for e in cls.__dict__.get("registrations", ()) if e is not est)


def unregister_estimator(name: str) -> None:
    """Remove the estimator registered under ``name`` (``ValueError`` if there is none).

    Parameters
    ----------
    name : str
        A name given to `register_estimator`.

    Raises
    ------
    ValueError
        No estimator is registered under ``name`` (the message lists the registered names).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> class MyElu(ka.EluFeatures):
    ...     '''elu+1 under another class.'''
    >>> _ = ka.register_estimator(MyElu, name="my-elu", feature_dim="d")
    >>> ka.unregister_estimator("my-elu")
    >>> "my-elu" in [e.name for e in ka.estimators()]
    False
    """
    if name not in _REGISTRY:
        raise ValueError(f"no estimator named {name!r}; registered: {sorted(_REGISTRY)}")
    _forget(_REGISTRY.pop(name))


def get_estimator(name: str | Estimator) -> Estimator:
    """The estimator registered under ``name`` (an `Estimator` is returned as is).

    Parameters
    ----------
    name : str or Estimator
        A registered name (see `estimators`).

    Returns
    -------
    Estimator

    Raises
    ------
    ValueError
        No estimator is registered under ``name`` (the message lists the registered names).
    TypeError
        ``name`` is neither a str nor an `Estimator`.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> ka.get_estimator("positive").cls.__name__
    'PositiveRF'
    """
    if isinstance(name, Estimator):
        return name
    if not isinstance(name, str):
        raise TypeError(f"estimator name must be a str, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown estimator {name!r}; registered: {sorted(_REGISTRY)}") from None


def estimator_of(fm: object) -> Estimator:
    """The registered identity of a feature map (exact class and params match).

    Parameters
    ----------
    fm : FeatureMap
        A feature map instance.

    Returns
    -------
    Estimator
        The one whose ``cls`` is ``type(fm)`` and whose ``params`` equal ``fm``'s attributes.

    Raises
    ------
    TypeError
        ``fm`` is not a FeatureMap.
    LookupError
        Its class (with its params) is not registered; a subclass of a registered map is a
        different estimator until registered itself.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> ka.estimator_of(ka.TrigRF(4, 8, variant="offset")).name
    'trig-offset'
    >>> ka.estimator_of(ka.PositiveRF(4, 8)).label == ka.get_estimator("positive").label
    True
    """
    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")
    return fm.estimator


def estimators(
    *,
    random: bool | None = None,
    closed_form: str | None = None,
    sampler: object = None,
    names: Iterable[str] | None = None,
) -> list[Estimator]:
    """Registered estimators in registration order, optionally filtered.

    Parameters
    ----------
    random : bool, optional
        Keep random (True) or deterministic (False) maps only.
    closed_form : str, optional
        Keep estimators with this closed form (one of `CLOSED_FORMS`) for ``sampler``.
    sampler : str or Sampler, optional
        The sampler ``closed_form`` refers to (default: `DEFAULT_SAMPLER`, the sampler `Estimator.build`
        draws with; ``"gaussian"`` for the closed forms of iid rows).
    names : iterable of str, optional
        Keep these names only.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> [e.name for e in ka.estimators(closed_form="uniform", sampler="gaussian")]
    ['trig-sincos', 'trig-offset']
    >>> [e.name for e in ka.estimators(closed_form="uniform")]  # orthogonal rows: no uniform bound
    []
    """
    if random is not None:
        check_bool("random", random)
    if closed_form is not None and closed_form not in CLOSED_FORMS:
        raise ValueError(f"closed_form must be one of {CLOSED_FORMS}, got {closed_form!r}")
    keep = None if names is None else set(names)
    out = []
    for est in _REGISTRY.values():
        if random is not None and est.is_random != random:
            continue
        if keep is not None and est.name not in keep:
            continue
        law = DEFAULT_SAMPLER if sampler is None else sampler
        if closed_form is not None and closed_form not in est.closed_forms(law):
            continue
        out.append(est)
    return out
