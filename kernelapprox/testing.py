r"""A battery of checks every feature map of the library passes, for your own maps too.

`check_feature_map` runs them all on one estimator; `feature_map_checks` yields
``(estimator, check)`` pairs for ``pytest.mark.parametrize`` (in the manner of scikit-learn's
``parametrize_with_checks``), so each check of each estimator is one test. The suite runs them
over ``ka.estimators()`` (``tests/test_estimator_checks.py``).

The checks (each raises ``AssertionError`` with the estimator's name on failure):

- ``check_kernel_is_feature_product``: ``fm.kernel(q, k)`` equals $\varphi(q)\psi(k)^\top$
  (``fm(q) @ fm.key_features(k).mT``) in float64 to a relative 1e-10;
- ``check_unbiased``: where the map claims it (random features from an unbiased sampler, see
  `claims_unbiased`), $E\hat K = e^{q^\top k}$ by a Monte Carlo z-test over ``S`` independent
  draws (``batch_shape=(S, 1, 1)``), $|z| < 4.5$, with the power guard $\mathrm{se} \le 1\%$
  of $K$ (so a bias of 4.5 % of the kernel fails);
- ``check_dtype_rule``: float16/bfloat16 inputs are computed in float32 and returned in the
  input dtype (bitwise the float32 result of the upcast input, rounded);
- ``check_autocast``: under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the features and the
  kernel match the float32 result to bfloat16 rounding;
- ``check_state_dict``: ``state_dict`` → ``torch.save`` → ``torch.load(weights_only=True)`` →
  a map built the same way with another seed gives identical outputs (fitted maps included);
  ``copy.deepcopy`` gives identical outputs; ``redraw`` changes a random map's projection and
  leaves a deterministic map's outputs unchanged;
- ``check_batch_shape``: a map with ``batch_shape=(3, 1)`` broadcasts against inputs ``(2, n, d)``
  and each input row gives the same features alone;
- ``check_empty_batch``: inputs with a zero-sized batch give empty features, kernels and
  attention outputs (parallel and causal);
- ``check_finite_gradients``: gradients of parallel and causal attention w.r.t. ``q`` and
  ``k`` are finite (float32, moderate norms).

The Monte Carlo test. For ``S`` iid draws $X_s$ of $\hat K_{ij}$, $z = (\bar X - K)/\mathrm{se}$
with $\mathrm{se} = \mathrm{sd}(X)/\sqrt S$; under unbiasedness $z \approx \mathcal N(0,1)$ and
$P(|z| > 4.5) = 6.8\cdot 10^{-6}$ per entry. Inputs have $\|q\|, \|k\| \le 0.5$
($\|q+k\|^2 \le 1$), where every map's per-draw error is light-tailed enough for the normal
approximation at ``S = 4000``; the seed is fixed, so the check is deterministic.

Examples
--------
Check your own estimator, registered once with `kernelapprox.register_estimator`:

>>> import kernelapprox as ka
>>> from kernelapprox.testing import check_feature_map
>>> class ScaledPositiveRF(ka.PositiveRF):
...     '''FAVOR+ under another class (say, with instrumentation).'''
>>> est = ka.register_estimator(ScaledPositiveRF, name="scaled-positive", feature_dim="r")
>>> check_feature_map(est)        # raises AssertionError on the first failing check
>>> ka.unregister_estimator("scaled-positive")

In a pytest file, one test per (estimator, check):

>>> from kernelapprox.testing import feature_map_checks
>>> pairs = list(feature_map_checks([ka.get_estimator("positive")]))
>>> [check.__name__ for _, check in pairs][:2]
['check_kernel_is_feature_product', 'check_unbiased']
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ._validation import broadcast_shapes
from .maps.base import FeatureMap, RandomFeatureMap
from .registry import Estimator, estimators

__all__ = [
    "check_autocast",
    "check_batch_shape",
    "check_dtype_rule",
    "check_empty_batch",
    "check_feature_map",
    "check_finite_gradients",
    "check_kernel_is_feature_product",
    "check_state_dict",
    "check_unbiased",
    "claims_unbiased",
    "feature_map_checks",
]

#: What the battery accepts: a registered estimator (built with iid rows, ``sampler="gaussian"``,
#: when it is random), a map (rebuilt from ``get_params()``), or a
#: factory ``factory(**kwargs) -> FeatureMap`` accepting ``seed``, ``batch_shape`` and ``dtype``.
Subject = Estimator | FeatureMap | Callable[..., FeatureMap]

_DIM, _R = 4, 8
Z_MAX = 4.5


class _Builder:
    """Uniform ``build(**kwargs)`` over the accepted subjects."""

    def __init__(self, subject: Subject) -> None:
        if isinstance(subject, Estimator):
            self.name = subject.name
            # iid rows, the reference the checks are written for (`Estimator.build` would draw
            # the library's default, orthogonal rows)
            iid: dict[str, Any] = {"sampler": "gaussian"} if subject.is_random else {}
            self._build: Callable[..., FeatureMap] = lambda **kw: subject.build(_DIM, _R, **{**iid, **kw})
        elif isinstance(subject, FeatureMap):
            params = subject.get_params()
            self.name = type(subject).__name__
            self._build = lambda **kw: type(subject)(**{**params, **kw})
        elif callable(subject):
            self.name = getattr(subject, "__name__", repr(subject))
            self._build = subject
        else:
            raise TypeError(
                f"expected a registered Estimator, a FeatureMap or a factory, got {type(subject).__name__}"
            )

    def build(self, **kwargs: Any) -> FeatureMap:
        fm = self._build(**kwargs)
        if not isinstance(fm, FeatureMap):
            raise TypeError(f"{self.name}: the factory returned {type(fm).__name__}, not a FeatureMap")
        return fm


def _data(dim: int, n: int, scale: float, seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64)
    return (x / x.norm(dim=-1, keepdim=True) * scale).to(dtype)


def _fitted(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> FeatureMap:
    return fm.fit(q, k) if fm.data_dependent else fm


def claims_unbiased(fm: FeatureMap) -> bool:
    """Whether ``fm`` claims $E\\,\\varphi(q)^\\top\\psi(k) = e^{q^\\top k}$: random features drawn by a
    sampler whose ``unbiased`` flag is set (data-dependent maps: given their fitted parameters).

    Parameters
    ----------
    fm : FeatureMap
        Any feature map.

    Returns
    -------
    bool

    Examples
    --------
    >>> import kernelapprox as ka
    >>> claims_unbiased(ka.PositiveRF(4, 8)), claims_unbiased(ka.EluFeatures(4))
    (True, False)
    """
    return bool(fm.is_random and getattr(getattr(fm, "sampler", None), "unbiased", False))


# ----------------------------------------------------------------------------------- the checks
def check_kernel_is_feature_product(subject: Subject) -> None:
    r"""``fm.kernel(q, k)`` equals $\varphi(q)\psi(k)^\top$ in float64 (relative 1e-10).

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When ``fm.kernel(q, k)`` (shape ``(n, m)``) differs from ``fm(q) @ fm.key_features(k).mT``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_kernel_is_feature_product(ka.get_estimator("positive"))
    >>> check_kernel_is_feature_product(ka.TrigRF(4, 8, variant="offset", seed=0))
    """
    b = _Builder(subject)
    q, k = _data(_DIM, 5, 0.8, 1), _data(_DIM, 9, 0.8, 2)
    fm = _fitted(b.build(seed=0, dtype=torch.float64), q, k)
    with torch.no_grad():
        K = fm.kernel(q, k)
        P = fm(q) @ fm.key_features(k).mT
    err = float((K - P).abs().max() / P.abs().max())
    assert err <= 1e-10, f"{b.name}: kernel differs from phi(q) psi(k)^T by {err:.2e} (relative)"


def check_unbiased(subject: Subject) -> None:
    r"""Monte Carlo z-test of $E\hat K = e^{q^\top k}$ where `claims_unbiased` (module docstring).

    ``S = 4000`` draws at once (``batch_shape=(S, 1, 1)``); per entry $|z| < 4.5$ and
    $\mathrm{se} \le 0.01\,K$. A no-op for maps that do not claim unbiasedness.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When an entry of the ``(3, 3)`` kernel has $|z| \ge 4.5$, or the draws are too noisy to
        detect a 4.5 % bias.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_unbiased(ka.get_estimator("positive"))
    >>> check_unbiased(ka.get_estimator("elu"))  # biased, and says so: nothing to test
    """
    b = _Builder(subject)
    probe = b.build(seed=0, dtype=torch.float64)
    if not claims_unbiased(probe):
        return
    S = 4000
    q, k = _data(_DIM, 3, 0.5, 3), _data(_DIM, 3, 0.5, 4)
    fm = _fitted(b.build(seed=5, batch_shape=(S, 1, 1), dtype=torch.float64), q, k)
    X = fm.kernel(q, k).reshape(S, 3, 3)
    K = torch.exp(q @ k.mT)
    se = X.std(dim=0) / S**0.5
    z = (X.mean(dim=0) - K) / se
    assert bool((se <= 0.01 * K).all()), f"{b.name}: power guard, se/K up to {float((se / K).max()):.3g} > 0.01"
    assert bool((z.abs() < Z_MAX).all()), f"{b.name}: biased kernel, |z| up to {float(z.abs().max()):.2f}"


def check_dtype_rule(subject: Subject) -> None:
    """float16/bfloat16 inputs are computed in float32 and come back in their own dtype.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When half-precision features are not the float32 features of the upcast input, rounded.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_dtype_rule(ka.get_estimator("positive"))
    """
    b = _Builder(subject)
    q32, k32 = _data(_DIM, 8, 0.8, 6, torch.float32), _data(_DIM, 8, 0.8, 7, torch.float32)
    fm = _fitted(b.build(seed=0, dtype=torch.float32), q32, k32)
    for dt in (torch.float16, torch.bfloat16):
        q, k = q32.to(dt), k32.to(dt)
        out = fm(q)
        assert out.dtype == dt, f"{b.name}: features of {dt} input came back as {out.dtype}"
        ref = fm(q.float()).to(dt)
        assert torch.equal(out, ref), f"{b.name}: {dt} features differ from the float32 computation"
        K = fm.kernel(q, k)
        assert K.dtype == dt, f"{b.name}: kernel of {dt} inputs came back as {K.dtype}"


def check_autocast(subject: Subject) -> None:
    """Under CPU bfloat16 autocast, features and kernel match float32 to bfloat16 rounding.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When features or kernel under autocast differ from float32 by more than bfloat16 rounding.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_autocast(ka.get_estimator("elu"))
    """
    b = _Builder(subject)
    q, k = _data(_DIM, 8, 0.8, 8, torch.float32), _data(_DIM, 8, 0.8, 9, torch.float32)
    fm = _fitted(b.build(seed=0, dtype=torch.float32), q, k)
    with torch.no_grad():
        ref_f, ref_k = fm(q), fm.kernel(q, k, compute_dtype=torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            f, K = fm(q), fm.kernel(q, k, compute_dtype=torch.float32)
    tol = 2.0**-7  # two bfloat16 roundings
    for name, a, r in (("features", f, ref_f), ("kernel", K, ref_k)):
        err = float((a.float() - r).abs().max() / r.abs().max().clamp_min(1e-30))
        assert err <= tol, f"{b.name}: {name} under autocast differ from float32 by {err:.2e} > {tol:.2e}"


def check_state_dict(subject: Subject) -> None:
    """Checkpoint round trip (weights-only load into a fresh map), deepcopy and redraw.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When a reloaded or copied map gives other outputs, or ``redraw`` misbehaves.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_state_dict(ka.get_estimator("positive"))
    """
    b = _Builder(subject)
    q, k = _data(_DIM, 20, 0.8, 10), _data(_DIM, 20, 0.8, 11)
    fm = _fitted(b.build(seed=0, dtype=torch.float64), q, k)
    ref = (fm(q), fm.kernel(q, k))
    buf = io.BytesIO()
    torch.save(fm.state_dict(), buf)
    buf.seek(0)
    fresh = b.build(seed=1, dtype=torch.float64)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for name, a, r in (("features", fresh(q), ref[0]), ("kernel", fresh.kernel(q, k), ref[1])):
        assert torch.equal(a, r), f"{b.name}: {name} differ after state_dict round trip"
    if hasattr(fm, "fitted"):
        assert fresh.fitted == fm.fitted, f"{b.name}: fitted flag lost on load"
    twin = copy.deepcopy(fm)
    assert torch.equal(twin.kernel(q, k), ref[1]), f"{b.name}: deepcopy changes the kernel"
    twin.redraw(seed=123)
    if isinstance(fm, RandomFeatureMap) and isinstance(twin, RandomFeatureMap):
        assert not torch.equal(fm.weight, twin.weight), f"{b.name}: redraw kept the projection"
    else:
        assert torch.equal(twin.kernel(q, k), ref[1]), f"{b.name}: redraw changed a deterministic map"


def check_batch_shape(subject: Subject) -> None:
    """``batch_shape=(3, 1)`` broadcasts against inputs (2, n, d); rows agree when taken alone.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When features of shape ``(3, 2, n, feature_dim)`` are not produced, or a row differs alone.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_batch_shape(ka.get_estimator("positive"))
    """
    b = _Builder(subject)
    x = torch.stack([_data(_DIM, 8, 0.8, 12), _data(_DIM, 8, 0.8, 13)])  # (2, n, d)
    fm = _fitted(b.build(seed=0, batch_shape=(3, 1), dtype=torch.float64), x, x)
    with torch.no_grad():
        out = fm(x)
    lead = broadcast_shapes(x.shape[:-2], fm.batch_shape)
    assert out.shape == (*lead, 8, fm.feature_dim), f"{b.name}: features of shape {tuple(out.shape)}"
    if fm.data_dependent:
        return  # fitted per input row: the rows are different maps
    with torch.no_grad():
        alone = fm(x[:1])
    assert torch.allclose(alone, out[..., :1, :, :], rtol=1e-10, atol=1e-12 * float(out.abs().max())), (
        f"{b.name}: an input row gives other features alone than in its batch"
    )
    K = fm.kernel(x, x)
    assert K.shape == (*lead, 8, 8), f"{b.name}: kernel of shape {tuple(K.shape)}"


def check_empty_batch(subject: Subject) -> None:
    """Zero-sized batches give empty features, kernels and attention outputs.

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When inputs of shape ``(0, n, d)`` do not give empty outputs of the right shapes.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_empty_batch(ka.get_estimator("trig-sincos"))
    """
    from .attention import linear_attention

    b = _Builder(subject)
    q, k = _data(_DIM, 20, 0.8, 14, torch.float32), _data(_DIM, 20, 0.8, 15, torch.float32)
    fm = _fitted(b.build(seed=0, dtype=torch.float32), q, k)
    x = torch.zeros(0, 2, 20, _DIM)
    v = torch.zeros(0, 2, 20, 3)
    lead = broadcast_shapes(x.shape[:-2], fm.batch_shape)
    assert fm(x).shape == (*lead, 20, fm.feature_dim), f"{b.name}: empty features of wrong shape"
    assert fm.kernel(x, x).shape == (*lead, 20, 20), f"{b.name}: empty kernel of wrong shape"
    for causal in (False, True):
        o = linear_attention(x, x, v, fm, causal=causal, check=False)
        assert isinstance(o, torch.Tensor)
        assert o.shape == (0, 2, 20, 3), f"{b.name}: empty attention (causal={causal}) of shape {tuple(o.shape)}"


def check_finite_gradients(subject: Subject) -> None:
    """Finite ``q.grad`` and ``k.grad`` through parallel and causal attention (float32).

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator, a map or a factory, as in `check_feature_map`.

    Raises
    ------
    AssertionError
        When a gradient entry is NaN or infinite.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_finite_gradients(ka.get_estimator("positive"))
    """
    from .attention import linear_attention

    b = _Builder(subject)
    g = torch.Generator().manual_seed(16)
    q0 = torch.randn(2, 24, _DIM, generator=g) * 0.8
    k0 = torch.randn(2, 24, _DIM, generator=g) * 0.8
    v = torch.randn(2, 24, 3, generator=g)
    fm = b.build(seed=0, dtype=torch.float32)
    for causal in (False, True):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        out = linear_attention(q, k, v, fm, causal=causal, fit=fm.data_dependent, check=False)
        assert isinstance(out, torch.Tensor)
        assert bool(out.isfinite().all()), f"{b.name}: non-finite attention output (causal={causal})"
        out.square().sum().backward()
        for name, t in (("q", q), ("k", k)):
            assert t.grad is not None and bool(t.grad.isfinite().all()), (
                f"{b.name}: non-finite {name}.grad (causal={causal})"
            )


CHECKS: tuple[Callable[[Subject], None], ...] = (
    check_kernel_is_feature_product,
    check_unbiased,
    check_dtype_rule,
    check_autocast,
    check_state_dict,
    check_batch_shape,
    check_empty_batch,
    check_finite_gradients,
)


def feature_map_checks(subjects: Iterable[Subject] | None = None) -> Iterator[tuple[Subject, Callable[[Subject], None]]]:
    """``(subject, check)`` pairs for ``pytest.mark.parametrize``, every check for every subject.

    Parameters
    ----------
    subjects : iterable of Estimator, FeatureMap or factory, optional
        Default: every registered estimator (``ka.estimators()``).

    Yields
    ------
    (subject, check) : the check is called as ``check(subject)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> n = len(list(feature_map_checks([ka.get_estimator("elu"), ka.get_estimator("positive")])))
    >>> n == 2 * len(CHECKS)
    True
    """
    for s in estimators() if subjects is None else subjects:
        for check in CHECKS:
            yield s, check


def check_feature_map(subject: Subject) -> None:
    r"""Run every check of the battery on one estimator (module docstring).

    Parameters
    ----------
    subject : Estimator, FeatureMap or callable
        A registered estimator (built with ``build(4, 8, ...)``), a map (rebuilt from
        ``type(fm)(**fm.get_params(), ...)``), or a factory ``f(**kwargs) -> FeatureMap`` that
        accepts ``seed``, ``batch_shape`` and ``dtype``.

    Raises
    ------
    AssertionError
        At the first failing check, naming the estimator and what failed.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> check_feature_map(ka.get_estimator("elu"))
    >>> check_feature_map(lambda **kw: ka.PositiveRF(4, 8, **kw))
    """
    for check in CHECKS:
        check(subject)
