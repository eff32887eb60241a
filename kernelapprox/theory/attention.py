r"""Delta-method (first-order) variance of random-feature attention outputs.

Random-feature attention replaces the exact softmax kernel $K_{ij}=e^{q_i^\top k_j}$ by an
unbiased estimate $\hat K_{ij}=\phi(q_i)^\top\phi(k_j)$ and normalises row by row,

$$
\hat o_i=\frac{\sum_j\hat K_{ij}v_j}{\sum_j\hat K_{ij}},\qquad
o_i=\frac{\sum_jK_{ij}v_j}{\sum_jK_{ij}}=\sum_jA_{ij}v_j .
$$

$\hat o_i$ is a ratio of two correlated estimates, so it is biased and has no closed-form
variance. This module gives the first-order (delta-method) variance of every output coordinate,
built from the exact covariances $\mathrm{Cov}(\hat K_{ij},\hat K_{il})$ of two kernel entries
that share the query $q_i$; both are derived for iid Gaussian projections below and in
``docs/theory.md``.

Derivation (DERIVED; checked by Monte Carlo in ``tests/test_theory_attention.py``)
-----------------------------------------------------------------------------------
**Delta method.** Write $D_i=\sum_jK_{ij}$ and $\hat K_{ij}=K_{ij}+\varepsilon_{ij}$.
Expanding $\hat o_i$ to first order in $\varepsilon$,

$$
\hat o_i-o_i\approx\frac1{D_i}\sum_j\varepsilon_{ij}(v_j-o_i),\qquad
\mathrm{Var}(\hat o_{ic})\approx\frac1{D_i^2}\sum_{j,l}
\mathrm{Cov}(\hat K_{ij},\hat K_{il})\,(v_{jc}-o_{ic})(v_{lc}-o_{ic}).
$$

**Covariance of two entries sharing a query.** Each estimator averages r iid per-projection terms,
$\hat K_{ij}=\frac1r\sum_{s=1}^rX_{sj}$, so
$\mathrm{Cov}(\hat K_{ij},\hat K_{il})=\frac1r\big(E[X_jX_l]-K_{ij}K_{il}\big)$. The Gaussian
moment generating function $E e^{\omega^\top a}=e^{\|a\|^2/2}$ (and its real part
$E\cos\omega^\top a=e^{-\|a\|^2/2}$) gives, with $q=q_i$:

* positive, $X_j=e^{\omega^\top(q+k_j)-(\|q\|^2+\|k_j\|^2)/2}$:
  $E[X_jX_l]=e^{-\|q\|^2-(\|k_j\|^2+\|k_l\|^2)/2}\,e^{\|2q+k_j+k_l\|^2/2}
  =e^{\|q\|^2+2q^\top k_j+2q^\top k_l+k_j^\top k_l}$;
* hyperbolic, $X_j=e^{-(\|q\|^2+\|k_j\|^2)/2}\cosh\omega^\top(q+k_j)$; using
  $\cosh a\cosh b=\tfrac12[\cosh(a+b)+\cosh(a-b)]$:
  $E[X_jX_l]=\tfrac12e^{\|q\|^2+2q^\top k_j+2q^\top k_l+k_j^\top k_l}
  +\tfrac12e^{-\|q\|^2-k_j^\top k_l}$;
* trig sin/cos, $X_j=e^{(\|q\|^2+\|k_j\|^2)/2}\cos\omega^\top(q-k_j)$; using
  $\cos a\cos b=\tfrac12[\cos(a+b)+\cos(a-b)]$:
  $E[X_jX_l]=\tfrac12e^{-\|q\|^2+2q^\top k_j+2q^\top k_l-k_j^\top k_l}
  +\tfrac12e^{\|q\|^2+k_j^\top k_l}$;
* trig offset, $X_j=2e^{(\|q\|^2+\|k_j\|^2)/2}\cos(\omega^\top q+b)\cos(\omega^\top k_j+b)
  =e^{(\|q\|^2+\|k_j\|^2)/2}[\cos\omega^\top(q-k_j)+\cos(\omega^\top(q+k_j)+2b)]$; the
  $2b$ terms have mean 0 against the difference terms and
  $E_b[\cos(a+2b)\cos(c+2b)]=\tfrac12\cos(a-c)$, so
  $E[X_jX_l]=\text{(sin/cos)}+\tfrac12e^{\|q\|^2+k_j^\top k_l}$.

At $j=l$ these reduce to Performer Lemma 2 (positive, hyperbolic, trig) and to the
Sutherland–Schneider variance of the offset features (``docs/theory.md`` §1).

Every case is a sum of terms $c\,e^{\alpha\|q\|^2+\beta(q^\top k_j+q^\top k_l)+\gamma k_j^\top
k_l}$ with $(c,\alpha,\beta,\gamma)$ in each estimator's ``EstimatorTheory.attention_pair_terms``
(``kernelapprox.theory.moments``). Because the weights
$a_{jc}=v_{jc}-o_{ic}$ satisfy $\sum_jK_{ij}a_{jc}=0$ exactly, the
$-K_{ij}K_{il}$ part of the covariance drops out of the quadratic form, and

$$
\mathrm{Var}(\hat o_{ic})\approx\frac1r\sum_{\text{terms}}c\sum_{j,l}
e^{u_{ij}+u_{il}}\,e^{-\|k_j-\gamma k_l\|^2/2}\,a_{jc}a_{lc},\qquad
u_{ij}=\log A_{ij}+(\beta-1)q_i^\top k_j+\tfrac12\|k_j\|^2+\tfrac\alpha2\|q_i\|^2,
$$

which is how it is evaluated (log-domain weights shifted by their row maximum, and a kernel matrix
$e^{-\|k_j-\gamma k_l\|^2/2}\in(0,1]$), in float64.

Validity. The delta method neglects terms of higher order in $\hat D_i/D_i-1$; it is
accurate when `normaliser_relative_variance` is below about 0.01 (moderate norms of the
attention-scaled inputs, enough features), and fails when $\hat D_i$ has a heavy tail
(positive features at large $\|q+k\|$: it then over-states the variance) or can be close
to 0 (trig features, whose denominator is not positive). ``docs/theory.md`` shows both regimes against Monte Carlo; use
`kernelapprox.montecarlo.attention_error` there.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kernelapprox._validation import check_floating

from .._validation import broadcast_shapes

if TYPE_CHECKING:  # pragma: no cover
    from kernelapprox.maps.base import FeatureMap

__all__ = ["attention_variance", "kernel_covariance", "normaliser_relative_variance"]

# Bytes of float64 scratch allowed for one block of query rows, (rows, m, dv) tensors.
_BLOCK_BYTES = 64 * 2**20

_PairTerms = tuple[tuple[float, float, float, float], ...]


def pair_terms(fm: object) -> _PairTerms | None:
    """The estimator's attention pair terms (``EstimatorTheory.attention_pair_terms``, see the
    module docstring), ``None`` for a deterministic map; ``NotImplementedError`` where the
    delta-method closed form is not available; ``TypeError`` if ``fm`` is not a feature map."""
    from kernelapprox.maps.base import FeatureMap
    from kernelapprox.registry import estimator_of

    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")
    try:
        est = estimator_of(fm)
    except (LookupError, TypeError) as e:
        raise NotImplementedError(f"attention_variance: {e}; use kernelapprox.montecarlo.attention_error") from None
    if not est.is_random:
        return None
    th = est.theory
    if th is None or th.attention_pair_terms is None:
        raise NotImplementedError(
            f"attention_variance has no closed form for the {est.name!r} estimator; "
            "use kernelapprox.montecarlo.attention_error"
        )
    sampler = getattr(fm, "sampler", None)
    if getattr(sampler, "row_law", None) != "iid":
        raise NotImplementedError(
            f"attention_variance is derived for iid Gaussian projections (sampler='gaussian'); "
            f"got sampler={getattr(sampler, 'name', sampler)!r}. Rows that are orthogonal, structured or "
            "quasi-random are dependent and the pair covariances change; "
            "use kernelapprox.montecarlo.attention_error for them"
        )
    return th.attention_pair_terms


def check_attention_inputs(fm: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
    check_floating("q", q)
    check_floating("k", k)
    dim = getattr(fm, "dim", None)
    for name, x in (("q", q), ("k", k)):
        if x.dim() < 2:
            raise ValueError(f"{name} must have shape (..., n, d), got shape {tuple(x.shape)}")
        if dim is not None and x.shape[-1] != dim:
            raise ValueError(
                f"{name} has last dimension {x.shape[-1]}, expected the feature map's "
                f"dim={dim} (shape {tuple(x.shape)})"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension, got q {tuple(q.shape)} and "
            f"k {tuple(k.shape)}"
        )
    if v is not None:
        check_floating("v", v)
        if v.dim() < 2 or v.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"v must have shape (..., m, dv) with m = k.shape[-2] = {k.shape[-2]}, "
                f"got v {tuple(v.shape)}"
            )


def kernel_covariance(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    r"""Covariance of two kernel estimates that share a query, $\mathrm{Cov}(\hat K_{ij},
    \hat K_{il})$.

    For an estimator averaging $r$ = ``fm.num_features`` iid Gaussian projections
    (positive: r coordinates; hyperbolic and trig sin/cos: 2r; trig offset: r),

    $$
    \mathrm{Cov}(\hat K_{ij},\hat K_{il})=\frac1r\Big(\sum_{\text{terms}}c\,
    e^{\alpha\|q_i\|^2+\beta(q_i^\top k_j+q_i^\top k_l)+\gamma k_j^\top k_l}
    -e^{q_i^\top k_j+q_i^\top k_l}\Big),
    $$

    with the terms of the module docstring (positive: one term
    $(1,1,2,1)$; hyperbolic: $(\tfrac12,1,2,1),(\tfrac12,-1,0,-1)$; trig sin/cos:
    $(\tfrac12,-1,2,-1),(\tfrac12,1,0,1)$; trig offset: $(\tfrac12,-1,2,-1),(1,1,0,1)$).
    The diagonal $j=l$ is the pointwise variance of Performer Lemma 2. Entries in different
    query rows are covariant too, but the attention rows only need this block.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF
        A random feature map with ``sampler="gaussian"``; only its class, ``variant`` and
        ``num_features`` are used (not its drawn projection). Deterministic maps give zeros.
    q : torch.Tensor
        Queries, shape ``(..., n, d)``.
    k : torch.Tensor
        Keys, shape ``(..., m, d)``; leading dimensions broadcast with ``q``'s.

    Returns
    -------
    torch.Tensor
        float64, shape ``(..., n, m, m)``. Memory is $n m^2$ doubles: meant for analysis of
        small blocks (use `attention_variance` for attention, which never forms it).

    Raises
    ------
    NotImplementedError
        For non-Gaussian samplers ("orthogonal", "structured", "qmc") and unsupported maps.

    References
    ----------
    K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, Lemma 2
    (the diagonal). The off-diagonal terms are DERIVED (module docstring).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(dim=4, num_features=64, seed=0)
    >>> q, k = torch.randn(3, 4) / 2, torch.randn(5, 4) / 2
    >>> ka.theory.attention.kernel_covariance(fm, q, k).shape
    torch.Size([3, 5, 5])
    """
    check_attention_inputs(fm, q, k, None)
    terms = pair_terms(fm)
    q = q.to(torch.float64)
    k = k.to(torch.float64)
    qk = q @ k.mT  # (..., n, m)
    shape = qk.shape + (qk.shape[-1],)
    if terms is None:
        return torch.zeros(shape, dtype=torch.float64, device=q.device)
    r = fm.num_features
    qq = (q * q).sum(-1)[..., :, None, None]  # (..., n, 1, 1)
    kk = (k @ k.mT)[..., None, :, :]  # (..., 1, m, m)
    s = qk[..., :, :, None] + qk[..., :, None, :]  # q.k_j + q.k_l
    second = torch.zeros((), dtype=torch.float64, device=q.device)
    for c, a, b, g in terms:
        second = second + c * torch.exp(a * qq + b * s + g * kk)
    return (second - torch.exp(s)) / r


def attention_variance(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
) -> torch.Tensor:
    r"""First-order (delta-method) variance of each random-feature attention output.

    The estimate is $\hat o_i=\sum_j\hat K_{ij}v_j/\sum_j\hat K_{ij}$ with
    $\hat K$ = ``fm.kernel(q, k)``; with $A$ the exact softmax weights,
    $o_i=\sum_jA_{ij}v_j$ and $D_i=\sum_je^{q_i^\top k_j}$,

    $$
    \mathrm{Var}(\hat o_{ic})\approx\frac1{D_i^2}\sum_{j,l}\mathrm{Cov}(\hat K_{ij},
    \hat K_{il})(v_{jc}-o_{ic})(v_{lc}-o_{ic})
    =\frac1r\sum_{\text{terms}}c\sum_{j,l}e^{u_{ij}+u_{il}}e^{-\|k_j-\gamma k_l\|^2/2}
    (v_{jc}-o_{ic})(v_{lc}-o_{ic})
    $$

    (derivation, the covariances and $u_{ij}$ in the module docstring and
    ``docs/theory.md``). With ``causal=True`` the sums run over $j,l\le i$.

    It is a first-order approximation: its relative error is $O(1/r)$ when $\hat D_i$
    concentrates (check with `normaliser_relative_variance`; below about 0.01 is safe).
    The tests find it within 10% of Monte Carlo for attention-scaled rows of norm 0.5 at
    r = 64 (all four maps) and norm 0.75 at r = 256 (positive). At larger norms or smaller r it
    fails: it over-states the (bounded) variance of positive/hyperbolic outputs, by factors of
    3-14 at norm 1.5, and for trigonometric maps the true variance is infinite (the denominator
    has positive density at 0) while the delta value describes the limiting normal law. Raw
    $\mathcal N(0, I_d)$ rows scaled by $d^{-1/4}$ have norm $d^{1/4}$ (2 at
    d = 16): already in the failure regime. See ``docs/theory.md``.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF (``variant`` "sincos" or "offset")
        The estimator, with ``sampler="gaussian"``; ``fm.num_features`` = r projections
        (positive and offset trig: r coordinates; hyperbolic and sin/cos trig: 2r). The drawn
        projection itself is not used. Deterministic maps (``is_random=False``) give zeros.
    q : torch.Tensor
        Queries, shape ``(..., n, d)``.
    k : torch.Tensor
        Keys, shape ``(..., m, d)``.
    v : torch.Tensor
        Values, shape ``(..., m, dv)``; leading dimensions of q, k, v broadcast.
    causal : bool, default False
        Row i attends to keys ``j <= i`` (needs n == m).

    Returns
    -------
    torch.Tensor
        float64, shape ``(..., n, dv)``: the approximate variance of each coordinate of
        $\hat o_i$.

    Raises
    ------
    NotImplementedError
        For samplers other than "gaussian" (orthogonal, structured, QMC) and maps without a
        closed form: use `kernelapprox.montecarlo.attention_error`.
    TypeError, ValueError
        For non-floating tensors or inconsistent shapes.

    References
    ----------
    K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, Lemma 1–2
    (unbiasedness and pointwise variance). The pair covariances and the delta-method expansion
    are DERIVED here.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> d = 16
    >>> q, k, v = torch.randn(3, 32, d, dtype=torch.float64).unbind(0)
    >>> q, k = q / d**0.25, k / d**0.25
    >>> fm = ka.PositiveRF(dim=d, num_features=128, seed=0)
    >>> ka.theory.attention_variance(fm, q, k, v).shape
    torch.Size([32, 16])
    """
    check_attention_inputs(fm, q, k, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return _delta_quadratic(fm, q, k, v, causal)


def normaliser_relative_variance(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
) -> torch.Tensor:
    r"""Relative variance of the attention normaliser, $\mathrm{Var}(\hat D_i)/D_i^2$.

    $\hat D_i=\sum_j\hat K_{ij}$ is the denominator of random-feature attention and
    $D_i=\sum_je^{q_i^\top k_j}$ its mean. Exactly (no approximation),

    $$
    \frac{\mathrm{Var}(\hat D_i)}{D_i^2}=\frac1r\Big(\sum_{\text{terms}}c\sum_{j,l}
    e^{u_{ij}+u_{il}}e^{-\|k_j-\gamma k_l\|^2/2}-1\Big)
    $$

    with the terms and $u_{ij}$ of `attention_variance`. It is the diagnostic of the
    delta method: the first-order expansion of $\hat o_i=\hat N_i/\hat D_i$ is accurate
    when $\hat D_i/D_i$ concentrates, i.e. when this number is small. The Monte Carlo
    comparison in ``docs/theory.md`` (d=16) finds the delta variance within about 10% where
    its maximum over rows is below about 0.01, 15-35% high (positive, hyperbolic) or 10-20% low
    (trigonometric) around 0.02-0.05, and off by factors where it is of order 0.1-1.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF
        As in `attention_variance` (``sampler="gaussian"``).
    q : torch.Tensor
        Queries, shape ``(..., n, d)``.
    k : torch.Tensor
        Keys, shape ``(..., m, d)``.
    causal : bool, default False
        Row i sums over keys ``j <= i`` (needs n == m).

    Returns
    -------
    torch.Tensor
        float64, shape ``(..., n)``.

    Raises
    ------
    NotImplementedError
        For non-Gaussian samplers and maps without a closed form.

    References
    ----------
    DERIVED here from the pair covariances of `kernel_covariance`.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(dim=16, num_features=256, seed=0)
    >>> q, k = torch.randn(2, 32, 16, dtype=torch.float64).unbind(0)
    >>> ka.theory.attention.normaliser_relative_variance(fm, q / 4, k / 4).shape
    torch.Size([32])
    """
    check_attention_inputs(fm, q, k, None)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    return _delta_quadratic(fm, q, k, None, causal)[..., 0]


def _delta_quadratic(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    causal: bool,
) -> torch.Tensor:
    """The delta-method variance (v given, (..., n, dv)) or Var(D_i)/D_i^2 (v None, (..., n, 1))."""
    terms = pair_terms(fm)
    n, m = q.shape[-2], k.shape[-2]
    if causal and n != m:
        raise ValueError(f"causal=True needs as many queries as keys, got n={n} and m={m}")
    q = q.to(torch.float64)
    k = k.to(torch.float64)
    normaliser = v is None
    v = torch.ones(m, 1, dtype=torch.float64, device=q.device) if v is None else v.to(torch.float64)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q = q.expand(batch + q.shape[-2:])
    k = k.expand(batch + k.shape[-2:])
    v = v.expand(batch + v.shape[-2:])
    dv = v.shape[-1]
    if terms is None:
        return torch.zeros(batch + (n, dv), dtype=torch.float64, device=q.device)
    r = fm.num_features

    kk = k @ k.mT  # (..., m, m)
    knorm = torch.diagonal(kk, dim1=-2, dim2=-1)  # (..., m)
    # H^gamma_jl = exp(gamma k_j.k_l - |k_j|^2/2 - |k_l|^2/2) = exp(-|k_j - gamma k_l|^2/2)
    half = 0.5 * (knorm[..., :, None] + knorm[..., None, :])
    kernels = {g: torch.exp(g * kk - half) for g in {t[3] for t in terms}}

    out = torch.empty(batch + (n, dv), dtype=torch.float64, device=q.device)
    rows = max(1, _BLOCK_BYTES // (8 * max(1, m * dv * math.prod(batch))))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        qb = q[..., start:stop, :]
        logits = qb @ k.mT  # (..., b, m)
        mask = None
        if causal:
            idx = torch.arange(start, stop, device=q.device)[:, None]
            mask = torch.arange(m, device=q.device)[None, :] > idx  # j > i
            log_a = torch.log_softmax(logits.masked_fill(mask, -math.inf), dim=-1)
        else:
            log_a = torch.log_softmax(logits, dim=-1)
        if normaliser:
            centred = v[..., None, :, :].expand(log_a.shape + (1,))
        else:
            o = torch.exp(log_a) @ v  # (..., b, dv)
            centred = v[..., None, :, :] - o[..., :, None, :]  # (..., b, m, dv)
        qn = (qb * qb).sum(-1, keepdim=True)  # (..., b, 1)
        var = torch.zeros(log_a.shape[:-1] + (dv,), dtype=torch.float64, device=q.device)
        for c, a, b, g in terms:
            u = log_a + (b - 1.0) * logits + 0.5 * knorm[..., None, :] + 0.5 * a * qn
            if mask is not None:
                u = u.masked_fill(mask, -math.inf)
            shift = u.amax(dim=-1, keepdim=True)  # (..., b, 1), finite: j = 0 is never masked
            w = torch.exp(u - shift)[..., None] * centred  # (..., b, m, dv)
            hw = kernels[g][..., None, :, :] @ w  # (..., b, m, dv) : sum_l H_jl w_l
            quad = (w * hw).sum(-2)  # (..., b, dv)
            var = var + c * torch.exp(2.0 * shift) * quad
        if normaliser:
            var = var - 1.0  # minus (E D_i)^2 / D_i^2
        out[..., start:stop, :] = var / r
    return out.clamp_min(0.0)
