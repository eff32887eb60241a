r"""Pointwise bias, variance and MSE of every estimator of $\mathrm{SM}(x, y) = e^{x^\top y}$.

Each random map estimates $\mathrm{SM}(x, y)$ by $\hat K = \varphi(x)^\top\varphi(y)
= \frac1r\sum_{i=1}^r X_i$, an average of ``r = num_features`` per-projection terms
$X_i$ (one per row $w_i$ of the projection). This module holds the generic machinery: the
derivation below, `estimator_moments` (by estimator name) and `bias`, `variance`, `mse`,
`relative_mse` (on a feature map), which dispatch through the registry
(`kernelapprox.estimator_of`) to the closed forms each estimator declares (its
`kernelapprox.EstimatorTheory`). The closed forms live beside their family:
`kernelapprox.theory.exponential` (positive, hyperbolic), `kernelapprox.theory.trig`,
`kernelapprox.theory.dense_exponential` (FAVOR++, FAVOR#), `kernelapprox.theory.hybrid`,
`kernelapprox.theory.simplex` (simplex rows). The four estimators of [Cho21]_:

- trig sin/cos: per-projection term $X_i$: $C\cos(w_i^\top\Delta)$; feature coordinates: ``2r``
- trig offset: per-projection term $X_i$: $2C\cos(w_i^\top x+b_i)\cos(w_i^\top y+b_i)$; feature coordinates: ``r``
- positive (FAVOR+): per-projection term $X_i$: $\Lambda\, e^{w_i^\top z}$; feature coordinates: ``r``
- hyperbolic: per-projection term $X_i$: $\Lambda\cosh(w_i^\top z)$; feature coordinates: ``2r``

Notation (``docs/theory.md``, Notation): $z = x+y$, $\Delta = x-y$, $t=\|z\|^2$,
$s=\|\Delta\|^2$, $\Lambda=e^{-(\|x\|^2+\|y\|^2)/2}$, $C = 1/\Lambda$, so that
$\mathrm{SM}=\Lambda e^{t/2} = C e^{-s/2}$.

General structure (DERIVED, elementary). With $\mu = E X_i$, $m_2 = E X_i^2$ and, for
two distinct rows of the same orthogonal block, $p_2 = E X_iX_j$,

$$
\mathrm{bias} = \mu - \mathrm{SM},\qquad
\mathrm{Var}\,\hat K = \frac{m_2-\mu^2}{r} + \frac{P}{r^2}\,(p_2-\mu^2),\qquad
\mathrm{MSE} = \mathrm{bias}^2 + \mathrm{Var}\,\hat K,
$$

where $P$ is the number of *ordered* pairs $(i\ne j)$ of rows in the same block
(`orf_pair_count`): $P = 0$ for iid rows, and for ``r = b d + r'`` block-orthogonal
rows (``b`` full blocks, one partial block of ``r'`` rows), $P = b\,d(d-1) + r'(r'-1)$.
Rows of different blocks are independent. For a single block this is Performer's
$\frac{m-1}{m}$ factor; the partial-block count is DERIVED here and checked by Monte Carlo.

The ingredients, for $\omega \sim \mathcal N(0, I_d)$ (iid rows and χ-norm ORF rows are
marginally Gaussian):

* $E e^{\omega^\top a} = e^{\|a\|^2/2}$, $E\cos(\omega^\top a) = e^{-\|a\|^2/2}$
  (Gaussian MGF) — this gives Performer Lemma 2 [SOURCE] and the offset variance of
  Sutherland–Schneider [DERIVED, MC ✓].
* Two distinct rows of one χ-norm ORF block: $w_i \pm w_j = \rho u$ with
  $\rho^2\sim\chi^2_{2d}$ independent of $u$ uniform on $S^{d-1}$; averaging
  $E_u e^{\rho u^\top a} = {}_0F_1(;\tfrac d2;\rho^2\|a\|^2/4)$ over
  $E\rho^{2k} = 2^k(d)_k$ gives
  $E\, e^{(w_i\pm w_j)^\top a} = {}_1F_1\big(d;\tfrac d2;\tfrac{\|a\|^2}{2}\big)$ and
  $E\cos\big((w_i\pm w_j)^\top a\big) = {}_1F_1\big(d;\tfrac d2;-\tfrac{\|a\|^2}{2}\big)$
  [DERIVED; ``docs/theory.md`` §1, MC ✓]. Since $w_i$ and $-w_j$ are also an
  orthogonal pair, $E\cosh(w_i^\top z)\cosh(w_j^\top z) = {}_1F_1(d;\tfrac d2;\tfrac t2)$
  — the hyperbolic pair moment equals the positive one — and the random phases of the offset
  variant average out of $E X_iX_j$, leaving the sin/cos pair moment.
* Fixed-norm ORF (rows of norm $\sqrt d$, Yu's ORF′ / Performer's SMREG):
  $E e^{w^\top a} = {}_0F_1(;\tfrac d2;\tfrac{d\|a\|^2}{4})$ and
  $\|w_i \pm w_j\|^2 = 2d$, so $E e^{(w_i\pm w_j)^\top a} = {}_0F_1(;\tfrac d2;
  \tfrac{d\|a\|^2}{2})$ ($a \to ia$ for cosines, a normalised Bessel function) [DERIVED,
  MC ✓]. The estimator is biased: it estimates SMREG (positive/hyperbolic,
  `smreg_kernel`) or a Bessel kernel (trig, `fixed_norm_trig_kernel`).

Numerics. Every quantity is computed in float64 from a log-scale and an $O(1)$ bracket, so
the result is ``inf`` only where the true value overflows float64. $s$ and $t$ are
recomputed from the coordinates where $x\approx\pm y$ (no cancellation), the ORF pair
excesses ${}_1F_1(d;\tfrac d2;z) - e^{2z}$ are summed as series where they would cancel,
and ${}_0F_1$ uses the Bessel forms (``scipy.special.ive``/``jv``) with a series or an
``mpmath`` fallback where ``scipy.special.hyp0f1`` is inaccurate (large ``d``, negative
argument). ``scipy.special.hyp1f1(d, d/2, z)`` was checked against mpmath to 1e-11 relative for
``d`` up to 1024 and $-3000 \le z \le 600$ (``tests/test_theory_moments.py``).

Inputs and outputs. ``q`` of shape ``(..., n, d)`` and ``k`` of shape ``(..., m, d)`` (NumPy
arrays or torch tensors; leading dimensions broadcast) give ``(..., n, m)`` arrays, like
``fm.kernel(q, k)``. NumPy in → NumPy float64 out; a torch tensor in → a float64 torch tensor
on the input's device.

Structured (SORF) and QMC projections have no closed form here: `bias`, `variance`,
`mse` raise ``NotImplementedError`` pointing to `kernelapprox.montecarlo.kernel_error`.

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 2, eq. 8; Theorem 2, eq. 10; SMREG §2.3).
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072 (Lemma 1; ORF′ eq. 4).
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015,
   arXiv:1506.02785.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from kernelapprox.registry import Estimator, estimator_of

from ._common import (
    _LAW_TO_ORTHOGONAL,
    Components,
    _check_r,
    _core,
    _deprecated_keywords,
    _finish,
    _fm_geometry,
    _geometry,
    _law_code,
    _out,
    _prepare,
    _theory_for,
    orf_pair_count,
)

__all__ = [
    "Components",
    "Moments",
    "orf_pair_count",
    "estimator_moments",
    "deterministic_error",
    "feature_map_kind",
    "bias",
    "variance",
    "mse",
    "relative_mse",
]

_NO_CLOSED_FORM = (
    "no closed form for the {name!r} sampler ({what}): its rows are dependent in a way this module "
    "does not model, and using the iid formula would be silently wrong; estimate the error by "
    "Monte Carlo with ka.montecarlo.kernel_error(fm, q, k, draws=...)"
)

class Moments(NamedTuple):
    r"""Bias, variance and MSE of every kernel entry, each of shape ``(..., n, m)``.

    $\mathrm{MSE} = \mathrm{bias}^2 + \mathrm{variance}$, entrywise, for $\hat K_{ij}$ against
    $e^{q_i^	op k_j}$.

    Attributes
    ----------
    bias : ndarray or Tensor, shape (..., n, m)
        $E\hat K - K$ (a Tensor when the inputs were tensors, on their device; float64).
    variance : ndarray or Tensor, shape (..., n, m)
        $\mathrm{Var}\,\hat K$.
    mse : ndarray or Tensor, shape (..., n, m)
        $E(\hat K - K)^2$.

    Examples
    --------
    >>> import numpy as np, kernelapprox as ka
    >>> g = np.random.default_rng(0)
    >>> q, k = 0.3 * g.standard_normal((2, 3, 4)), 0.3 * g.standard_normal((2, 5, 4))
    >>> m = ka.theory.estimator_moments("trig-offset", q, k, 16)
    >>> m.mse.shape, bool(np.abs(m.bias).max() == 0.0)
    ((2, 3, 5), True)
    >>> np.allclose(m.mse, m.bias**2 + m.variance)
    True
    """

    bias: Any
    variance: Any
    mse: Any


@_deprecated_keywords(kind="estimator", orthogonal="row_law")
def estimator_moments(
    estimator: str | Estimator,
    q: Any,
    k: Any,
    num_features: int,
    *,
    row_law: str = "iid",
    **params: Any,
) -> Moments:
    r"""Bias, variance and MSE of every entry of a random-feature estimate of $e^{q^\top k}$.

    See the module docstring for the formulas; the per-estimator functions
    (`positive_mse`, ...) document each one.

    Parameters
    ----------
    estimator : str or Estimator
        A registered estimator with closed-form moments, by name (``"trig-sincos"``,
        ``"trig-offset"``, ``"positive"``, ``"hyperbolic"``, or any estimator registered with an
        `kernelapprox.EstimatorTheory`).
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)
    num_features : int
        ``r``, the number of random projections.
    row_law : {"iid", "orthogonal-chi", "orthogonal-fixed", "simplex"}, default "iid"
        ``"iid"``: iid Gaussian rows; ``"orthogonal-chi"``: block-orthogonal rows with χ norms;
        ``"orthogonal-fixed"``: block-orthogonal rows of norm $\sqrt d$; ``"simplex"``: simplex
        blocks (SimRF, `kernelapprox.theory.simplex`); the values of
        `kernelapprox.samplers.Sampler.row_law`. The former ``orthogonal={None, "chi", "fixed",
        "simplex"}`` (and ``kind=`` for ``estimator``) are deprecated.
    **params
        Parameters of a parametric estimator's closed form (e.g. ``A=`` for ``"oprf"``).

    Returns
    -------
    Moments
        ``(bias, variance, mse)``, each of shape ``(..., n, m)``, float64.

    Examples
    --------
    >>> import numpy as np
    >>> x = np.array([[0.3, -0.2, 0.1, 0.4]]); y = np.array([[0.1, 0.2, -0.3, 0.2]])
    >>> from kernelapprox.theory import positive_mse
    >>> m = estimator_moments("positive", x, y, 8, row_law="orthogonal-chi")
    >>> bool(m.bias[0, 0] == 0.0 and m.mse[0, 0] < positive_mse(x, y, 8)[0, 0])
    True
    """
    r = _check_r(num_features)
    orthogonal = _law_code(row_law)
    qa, ka, dev = _prepare(q, k)
    core = _core(estimator, _geometry(qa, ka), r, orthogonal, **params)
    return Moments(*(_out(_finish(core, w), dev) for w in ("bias", "variance", "mse")))


# ----------------------------------------------------------------------------------------------
# feature-map dispatch
# ----------------------------------------------------------------------------------------------


def feature_map_kind(fm: Any) -> tuple[str, str | None]:
    """``(estimator name, orthogonal)`` of a feature map with closed-form moments, or
    ``(name, None)`` for a deterministic map (its error is exact, see `deterministic_error`).

    The identity comes from the registry (`kernelapprox.estimator_of`), the row law from
    ``fm.sampler.row_law``.

    Parameters
    ----------
    fm : FeatureMap
        A registered feature map.

    Returns
    -------
    (str, str or None)
        The estimator's name and the row law in `estimator_moments`' former spelling: ``None``
        (iid), ``"chi"``, ``"fixed"`` or ``"simplex"``; ``None`` also for a deterministic map.

    Raises
    ------
    TypeError
        ``fm`` is not a registered feature map.
    NotImplementedError
        The estimator has no closed-form moments, or not for its sampler (``structured``, ``qmc``,
        a projection of unknown provenance).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> feature_map_kind(ka.TrigRF(4, 8, sampler="orthogonal", seed=0))
    ('trig-sincos', 'chi')
    """
    try:
        est = estimator_of(fm)
    except LookupError as e:
        raise TypeError(str(e)) from None
    if not est.is_random:
        return est.name, None
    th = _theory_for(est)
    law = getattr(fm.sampler, "row_law", None)
    if law not in th.row_laws:
        name = getattr(fm.sampler, "name", type(fm.sampler).__name__)
        what = {
            "structured": "SORF rows are biased (Yu et al. 2016 Thm 3)",
            "qmc": "rows are negatively dependent low-discrepancy points",
            "given": "the projection was supplied by the caller, its distribution is unknown",
        }.get(name, f"row law {law!r} is not covered by the {est.name!r} theory")
        raise NotImplementedError(_NO_CLOSED_FORM.format(name=name, what=what))
    return est.name, _LAW_TO_ORTHOGONAL[law]


def deterministic_error(fm: Any, q: Any, k: Any) -> Any:
    r"""Error $\varphi(q)^\top\varphi(k) - e^{q^\top k}$ of a deterministic map (elu+1, ReLU, ...).

    These maps are not random: the error is a pure bias (variance 0), computed in float64 from
    ``fm.kernel`` (log domain) and the exact kernel.

    Parameters
    ----------
    fm : FeatureMap
        A deterministic map (``fm.is_random`` false).
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> x = torch.zeros(1, 3, dtype=torch.float64)
    >>> float(deterministic_error(ka.EluFeatures(3), x, x)[0, 0])  # (1,1,1).(1,1,1) - e^0
    2.0
    """
    from kernelapprox.maps.base import FeatureMap

    if not isinstance(fm, FeatureMap) or fm.is_random:
        raise TypeError(f"fm must be a deterministic FeatureMap (is_random false), got {type(fm).__name__}")
    qa, ka, dev = _prepare(q, k)
    if qa.shape[-1] != fm.dim:
        raise ValueError(f"q has last dimension {qa.shape[-1]}, expected fm.dim={fm.dim}")
    qt, kt = torch.from_numpy(qa), torch.from_numpy(ka)
    est = fm.kernel(qt, kt, compute_dtype=torch.float64).cpu().numpy()
    with np.errstate(over="ignore"):
        exact = np.exp(np.matmul(qa, np.swapaxes(ka, -1, -2)))
    return _out(est - exact, dev)


def _dispatch(fm: Any, q: Any, k: Any, what: str) -> Any:
    kind, orthogonal = feature_map_kind(fm)
    if not fm.is_random:
        err = deterministic_error(fm, q, k)
        if what == "bias":
            return err
        if what == "variance":
            return err * 0.0
        if what == "mse":
            return err**2
        qa, ka, _ = _prepare(q, k)
        with np.errstate(over="ignore"):
            sm = np.exp(np.matmul(qa, np.swapaxes(ka, -1, -2)))
        rel = (np.asarray(err.cpu() if isinstance(err, torch.Tensor) else err) / sm) ** 2
        return _out(rel, err.device if isinstance(err, torch.Tensor) else None)
    qa, ka, dev = _prepare(q, k)
    if qa.shape[-1] != fm.dim:
        raise ValueError(f"q has last dimension {qa.shape[-1]}, expected fm.dim={fm.dim}")
    geo, params = _fm_geometry(fm, kind, qa, ka)
    core = _core(kind, geo, int(fm.num_features), orthogonal, **params)
    return _out(_finish(core, what), dev)


def bias(fm: Any, q: Any, k: Any) -> Any:
    r"""Bias $E\hat K - e^{q^\top k}$ of every entry of ``fm.kernel(q, k)``.

    Zero for iid and χ-norm ORF random maps; `positive_bias` / `trig_bias` for
    fixed-norm ORF; `deterministic_error` for elu/relu.

    Parameters
    ----------
    fm : FeatureMap
        ``TrigRF``, ``PositiveRF``, ``HyperbolicRF`` (sampler ``gaussian`` or ``orthogonal``),
        ``EluFeatures`` or ``ReluFeatures``.
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(4, 8, sampler="orthogonal", seed=0)
    >>> x = torch.full((1, 4), 0.2, dtype=torch.float64)
    >>> float(bias(fm, x, x)[0, 0])
    0.0
    """
    return _dispatch(fm, q, k, "bias")


def variance(fm: Any, q: Any, k: Any) -> Any:
    r"""Variance of every entry of ``fm.kernel(q, k)`` over the draw of the projection.

    Reads ``type(fm)``, ``fm.variant``, ``fm.num_features``, ``fm.dim``, ``fm.sampler.name`` and
    ``fm.sampler.norms``; see `trig_sincos_mse`, `trig_offset_mse`,
    `positive_mse`, `hyperbolic_mse` for the formulas. 0 for elu/relu.

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.TrigRF(4, 16, seed=0)
    >>> x = torch.full((1, 4), 0.2, dtype=torch.float64)
    >>> float(variance(fm, x, x)[0, 0])
    0.0
    """
    return _dispatch(fm, q, k, "variance")


def mse(fm: Any, q: Any, k: Any) -> Any:
    r"""Mean squared error $E(\hat K - e^{q^\top k})^2 = \mathrm{bias}^2 + \mathrm{Var}$ of every entry.

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(4, 64, seed=0)
    >>> q = torch.randn(3, 4, dtype=torch.float64) / 2
    >>> mse(fm, q, q).shape
    torch.Size([3, 3])
    """
    return _dispatch(fm, q, k, "mse")


def relative_mse(fm: Any, q: Any, k: Any) -> Any:
    r"""Relative MSE $\mathrm{MSE}/e^{2q^\top k}$ of every entry (computed in the log domain).

    For iid positive features this is $(e^{\|q+k\|^2}-1)/r$ (Performer Lemma 2).

    Parameters
    ----------
    fm : FeatureMap
    q : array or Tensor, shape (..., n, d)
    k : array or Tensor, shape (..., m, d)

    Returns
    -------
    array or Tensor, shape (..., n, m), float64

    Raises
    ------
    NotImplementedError
        For ``structured``/``qmc`` samplers (no closed form; use ``ka.montecarlo.kernel_error``).

    Examples
    --------
    >>> import math, torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(2, 10, seed=0)
    >>> x = torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    >>> round(float(relative_mse(fm, x, x)[0, 0]), 12) == round((math.e - 1) / 10, 12)
    True
    """
    return _dispatch(fm, q, k, "relative_mse")
