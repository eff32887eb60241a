r"""Closed-form error of hybrid attention: exact softmax on a set $S_i$, random features on the rest.

Hybrid attention (`kernelapprox.attention.hybrid.hybrid_attention`) estimates, for query $i$,

$$
\hat D_i = \sum_{j\in S_i} K_{ij} + \sum_{j\in R_i}\hat K_{ij},\qquad
\hat N_i = \sum_{j\in S_i} K_{ij}v_j + \sum_{j\in R_i}\hat K_{ij}v_j,\qquad \hat o_i = \hat N_i/\hat D_i,
$$

with $K_{ij} = e^{q_i^\top k_j}$, $\hat K_{ij} = \varphi(q_i)^\top\varphi(k_j)$ and $R_i$ the keys
query $i$ attends to outside $S_i$. The exact part is a constant, so every moment comes from the
remainder alone.

Derivation (DERIVED; checked by Monte Carlo in ``tests/test_theory_hybrid_attention.py``)
--------------------------------------------------------------------------------------------
**Kernel level.** For a weight vector $a$ ($a \equiv 1$ for $\hat D_i$, $a_j = v_{jc}$ for
$\hat N_{ic}$),

$$
\mathrm{Var}\Big(\sum_{j\in R_i}\hat K_{ij}a_j\Big) = \sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})\,a_ja_l
= \frac1r\Big(\sum_{\text{terms}} c\sum_{j,l\in R_i} e^{\alpha\|q_i\|^2+\beta(q_i^\top k_j+q_i^\top k_l)
+\gamma k_j^\top k_l}a_ja_l - \Big(\sum_{j\in R_i}K_{ij}a_j\Big)^2\Big),
$$

the pair covariances of `kernelapprox.theory.attention.kernel_covariance` (terms
$(c, \alpha, \beta, \gamma)$ of each estimator) summed over the remainder only. Unbiased maps
have MSE = variance; deterministic maps have variance 0 and MSE = squared bias
$(\sum_{j\in R_i}(\hat K_{ij} - K_{ij})a_j)^2$.

**Output, first order (delta method).** With $\hat K_{ij} = K_{ij} + \varepsilon_{ij}$ on $R_i$
and $o_i$ the exact softmax output, $\hat o_i - o_i \approx D_i^{-1}\sum_{j\in R_i}
\varepsilon_{ij}(v_j - o_i)$, so

$$
\mathrm{Var}(\hat o_{ic}) \approx \frac1{D_i^2}\sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})
(v_{jc}-o_{ic})(v_{lc}-o_{ic}).
$$

Unlike full random-feature attention the $-K_{ij}K_{il}$ part no longer cancels (the weights
$v_j - o_i$ sum to zero against $K$ over all keys, not over $R_i$), so it is kept.

**Exact error identity.** Let $p_i = \sum_{j\in S_i}K_{ij}/D_i$ (`exact_mass`), $o_S$, $o_R$ the
exact outputs over $S_i$ and $R_i$, $\hat o_R = \sum_R\hat K v/\sum_R\hat K$ and
$\hat D_R = D_R(1 + \delta)$. Then $o = p\,o_S + (1-p)\,o_R$,
$\hat o = (p\,o_S + (1-p)(1+\delta)\hat o_R)/(1 + (1-p)\delta)$, and

$$
\hat o - o = (1-p)(\hat o_R - o_R) + \frac{p(1-p)\,\delta}{1 + (1-p)\delta}(\hat o_R - o_S)
$$

(`hybrid_error_identity`): exactly $(1-p)(\hat o_R - o_R)$ when the remainder mass is
estimated exactly ($\delta = 0$).

References
----------
K. Choromanski et al., "Rethinking Attention with Performers", ICLR 2021, Lemma 1-2 (the
pointwise moments). B. Chen et al., "Scatterbrain: unifying sparse and low-rank attention
approximation", NeurIPS 2021 (the sparse + low-rank estimator). The remainder sums and the identity
are DERIVED here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kernelapprox.attention.hybrid import exact_set_mask
from kernelapprox.maps.base import FeatureMap
from kernelapprox.theory.attention import check_attention_inputs, pair_terms

from .._validation import broadcast_shapes

__all__ = [
    "exact_mass",
    "hybrid_normaliser_variance",
    "hybrid_numerator_variance",
    "hybrid_normaliser_mse",
    "hybrid_numerator_mse",
    "hybrid_attention_variance",
    "hybrid_error_identity",
]

_BLOCK_BYTES = 64 * 2**20


def _check_map(fm: object) -> None:
    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")


def _masks(n: int, m: int, window: int, sinks: object, causal: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(attended, exact) boolean (n, n) masks."""
    if n != m:
        raise ValueError(f"hybrid attention needs as many queries as keys, got n={n} and m={m}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=device)
    att = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        att = att.tril()
    return att, S & att


def exact_mass(
    q: torch.Tensor, k: torch.Tensor, *, window: int, sinks: int | Sequence[int] = 0, causal: bool = False
) -> torch.Tensor:
    r"""$p_i$, the softmax attention mass inside the exact set $S_i$.

    $$
    p_i = \frac{\sum_{j\in S_i} e^{q_i^\top k_j}}{\sum_{j} e^{q_i^\top k_j}}\qquad (j \le i \text{ if causal}).
    $$

    $1 - p_i$ multiplies the remainder's error in the hybrid output (`hybrid_error_identity`).

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    window : int
    sinks : int or sequence of int, default 0
    causal : bool, default False
        Window and sinks as in `kernelapprox.attention.hybrid.hybrid_attention`.

    Returns
    -------
    Tensor, shape (..., n), float64.

    Examples
    --------
    >>> import torch
    >>> q = k = torch.zeros(4, 2)
    >>> exact_mass(q, k, window=1)  # uniform attention, one key of four exact
    tensor([0.2500, 0.2500, 0.2500, 0.2500], dtype=torch.float64)
    """
    check_attention_inputs(None, q, k, None)
    n, m = q.shape[-2], k.shape[-2]
    att, S = _masks(n, m, window, sinks, causal, q.device)
    logits = (q.double() @ k.double().mT).masked_fill(~att, -math.inf)
    log_a = torch.log_softmax(logits, dim=-1)
    return torch.exp(torch.logsumexp(log_a.masked_fill(~S, -math.inf), dim=-1))


def _remainder_quadratic(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, a: torch.Tensor | None, window: int, sinks: object,
    causal: bool, centre: bool,
) -> torch.Tensor:
    r"""$\frac1{D_i^2}\sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})a_{jc}a_{lc}$, (..., n, c).

    ``a`` (..., m, c) the weights (``None``: ones); ``centre``: use $a_j - o_i$ with $o_i$ the exact
    softmax output of ``a`` (the delta method)."""
    terms = pair_terms(fm)
    n, m = q.shape[-2], k.shape[-2]
    att, S = _masks(n, m, window, sinks, causal, q.device)
    R = att & ~S
    q = q.to(torch.float64)
    k = k.to(torch.float64)
    a = torch.ones(m, 1, dtype=torch.float64, device=q.device) if a is None else a.to(torch.float64)
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], a.shape[:-2])
    q, k, a = q.expand(batch + q.shape[-2:]), k.expand(batch + k.shape[-2:]), a.expand(batch + a.shape[-2:])
    c_dim = a.shape[-1]
    if terms is None:
        return torch.zeros(batch + (n, c_dim), dtype=torch.float64, device=q.device)
    r = fm.num_features
    kk = k @ k.mT
    knorm = torch.diagonal(kk, dim1=-2, dim2=-1)
    half = 0.5 * (knorm[..., :, None] + knorm[..., None, :])
    kernels = {g: torch.exp(g * kk - half) for g in {t[3] for t in terms}}
    out = torch.empty(batch + (n, c_dim), dtype=torch.float64, device=q.device)
    rows = max(1, _BLOCK_BYTES // (8 * max(1, m * c_dim * math.prod(batch))))
    for start in range(0, n, rows):
        stop = min(n, start + rows)
        qb = q[..., start:stop, :]
        logits = qb @ k.mT  # (..., b, m)
        log_a = torch.log_softmax(logits.masked_fill(~att[start:stop], -math.inf), dim=-1)
        Rb = R[start:stop]
        if centre:
            o = torch.exp(log_a) @ a
            w_base = a[..., None, :, :] - o[..., :, None, :]  # (..., b, m, c)
        else:
            w_base = a[..., None, :, :].expand(log_a.shape + (c_dim,))
        # the -K K part: (sum_{j in R} A_ij a_j)^2
        lin = (torch.exp(log_a.masked_fill(~Rb, -math.inf))[..., None] * w_base).sum(-2)  # (..., b, c)
        qn = (qb * qb).sum(-1, keepdim=True)
        second = torch.zeros(log_a.shape[:-1] + (c_dim,), dtype=torch.float64, device=q.device)
        for c, al, be, ga in terms:
            u = log_a + (be - 1.0) * logits + 0.5 * knorm[..., None, :] + 0.5 * al * qn
            u = u.masked_fill(~Rb, -math.inf)
            shift = u.amax(dim=-1, keepdim=True)
            shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # empty remainder
            w = torch.exp(u - shift)[..., None] * w_base
            hw = kernels[ga][..., None, :, :] @ w
            second = second + c * torch.exp(2.0 * shift) * (w * hw).sum(-2)
        out[..., start:stop, :] = (second - lin**2) / r
    return out.clamp_min(0.0)


def _log_normaliser(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    logits = q.double() @ k.double().mT
    if causal:
        n = logits.shape[-1]
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -math.inf)
    return torch.logsumexp(logits, dim=-1)  # (..., n)


def hybrid_normaliser_variance(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, *, window: int, sinks: int | Sequence[int] = 0,
    causal: bool = False, relative: bool = False,
) -> torch.Tensor:
    r"""$\mathrm{Var}(\hat D_i)$ of hybrid attention: the pair covariances summed over the remainder.

    $$
    \mathrm{Var}(\hat D_i) = \sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})
    = \frac1r\Big(\sum_{\text{terms}}c\sum_{j,l\in R_i}e^{\alpha\|q_i\|^2+\beta(q_i^\top k_j+q_i^\top k_l)
    +\gamma k_j^\top k_l} - D_{R,i}^2\Big)
    $$

    (module docstring). Exact, not an approximation.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF
        With ``sampler="gaussian"`` (the pair covariances are derived for iid projections);
        deterministic maps give zeros.
    q, k : Tensor, shape (..., n, d)
    window, sinks, causal
        The exact set, as in `kernelapprox.attention.hybrid.hybrid_attention`.
    relative : bool, default False
        Divide by $D_i^2$ (the squared exact normaliser over all attended keys).

    Returns
    -------
    Tensor, shape (..., n), float64.

    Raises
    ------
    NotImplementedError
        Samplers other than "gaussian" and maps without closed-form pair terms.

    References
    ----------
    Choromanski et al. 2021, Lemma 2 (the diagonal); the remainder sum is DERIVED (module docstring).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(8, 64, seed=0)
    >>> q, k = (torch.randn(2, 16, 8, dtype=torch.float64) / 3).unbind(0)
    >>> full = hybrid_normaliser_variance(fm, q, k, window=0, relative=True)
    >>> part = hybrid_normaliser_variance(fm, q, k, window=4, sinks=1, relative=True)
    >>> bool((part < full).all())
    True
    """
    check_attention_inputs(fm, q, k, None)
    rel = _remainder_quadratic(fm, q, k, None, window, sinks, causal, False)[..., 0]
    return rel if relative else rel * torch.exp(2.0 * _log_normaliser(q, k, causal))


def hybrid_numerator_variance(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
    sinks: int | Sequence[int] = 0, causal: bool = False, relative: bool = False,
) -> torch.Tensor:
    r"""$\mathrm{Var}(\hat N_{ic}) = \sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})v_{jc}v_{lc}$.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF
        As in `hybrid_normaliser_variance`.
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    window, sinks, causal
        The exact set.
    relative : bool, default False
        Divide by $D_i^2$.

    Returns
    -------
    Tensor, shape (..., n, dv), float64.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(8, 64, seed=0)
    >>> q, k, v = (torch.randn(3, 16, 8, dtype=torch.float64) / 3).unbind(0)
    >>> hybrid_numerator_variance(fm, q, k, v, window=4).shape
    torch.Size([16, 8])
    """
    check_attention_inputs(fm, q, k, v)
    rel = _remainder_quadratic(fm, q, k, v, window, sinks, causal, False)
    return rel if relative else rel * torch.exp(2.0 * _log_normaliser(q, k, causal)).unsqueeze(-1)


def _remainder_bias(fm, q, k, a, window, sinks, causal) -> torch.Tensor:
    """$\\sum_{j\\in R_i}(E\\hat K_{ij} - K_{ij}) a_j$ for deterministic maps (..., n, c), zeros for unbiased ones."""
    n, m = q.shape[-2], k.shape[-2]
    att, S = _masks(n, m, window, sinks, causal, q.device)
    R = att & ~S
    if fm.is_random:
        pair_terms(fm)  # raises where there is no closed form
        shape = broadcast_shapes(q.shape[:-2], k.shape[:-2], a.shape[:-2]) + (n, a.shape[-1])
        return torch.zeros(shape, dtype=torch.float64, device=q.device)
    err = (fm.kernel(q.double(), k.double()) - torch.exp(q.double() @ k.double().mT)).masked_fill(~R, 0.0)
    return err @ a.double()


def hybrid_normaliser_mse(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, *, window: int, sinks: int | Sequence[int] = 0,
    causal: bool = False,
) -> torch.Tensor:
    r"""$E(\hat D_i - D_i)^2$: the variance of `hybrid_normaliser_variance` (unbiased maps), or the
    squared bias $(\sum_{j\in R_i}\hat K_{ij} - K_{ij})^2$ (deterministic maps: Taylor, Nyström,
    elu, ReLU, fitted Hedgehog).

    Parameters
    ----------
    fm : FeatureMap
        A Gaussian-sampler PositiveRF, HyperbolicRF, TrigRF, or any deterministic map.
    q, k : Tensor, shape (..., n, d)
    window, sinks, causal
        The exact set.

    Returns
    -------
    Tensor, shape (..., n), float64.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> q, k = (torch.randn(2, 16, 4, dtype=torch.float64) / 2).unbind(0)
    >>> bool((hybrid_normaliser_mse(ka.TaylorFeatures(4), q, k, window=16) == 0).all())  # all exact
    True
    """
    _check_map(fm)
    check_attention_inputs(fm, q, k, None)
    ones = torch.ones(k.shape[-2], 1, dtype=torch.float64, device=q.device)
    bias = _remainder_bias(fm, q, k, ones, window, sinks, causal)[..., 0]
    var = hybrid_normaliser_variance(fm, q, k, window=window, sinks=sinks, causal=causal)
    return var + bias**2


def hybrid_numerator_mse(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
    sinks: int | Sequence[int] = 0, causal: bool = False,
) -> torch.Tensor:
    r"""$E(\hat N_{ic} - N_{ic})^2$ = `hybrid_numerator_variance` + squared bias (see `hybrid_normaliser_mse`).

    Parameters
    ----------
    fm : FeatureMap
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    window, sinks, causal
        The exact set.

    Returns
    -------
    Tensor, shape (..., n, dv), float64.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> q, k, v = (torch.randn(3, 16, 4, dtype=torch.float64) / 2).unbind(0)
    >>> hybrid_numerator_mse(ka.EluFeatures(4), q, k, v, window=3).shape
    torch.Size([16, 4])
    """
    _check_map(fm)
    check_attention_inputs(fm, q, k, v)
    bias = _remainder_bias(fm, q, k, v, window, sinks, causal)
    return hybrid_numerator_variance(fm, q, k, v, window=window, sinks=sinks, causal=causal) + bias**2


def hybrid_attention_variance(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
    sinks: int | Sequence[int] = 0, causal: bool = False,
) -> torch.Tensor:
    r"""First-order (delta-method) variance of each hybrid attention output.

    $$
    \mathrm{Var}(\hat o_{ic}) \approx \frac1{D_i^2}\sum_{j,l\in R_i}\mathrm{Cov}(\hat K_{ij},\hat K_{il})
    (v_{jc}-o_{ic})(v_{lc}-o_{ic}),
    $$

    $o_i$ the exact softmax output (module docstring). The approximation is first order in
    $\hat D_i/D_i - 1$, as `kernelapprox.theory.attention_variance` (``window = 0``, no sinks, is
    that function); the exact set only removes terms, so it is accurate where the full form is.

    Parameters
    ----------
    fm : PositiveRF, HyperbolicRF or TrigRF
        ``sampler="gaussian"``; deterministic maps give zeros.
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    window, sinks, causal
        The exact set.

    Returns
    -------
    Tensor, shape (..., n, dv), float64.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(16, 128, seed=0)
    >>> q, k, v = torch.randn(3, 32, 16, dtype=torch.float64).unbind(0)
    >>> var = hybrid_attention_variance(fm, q / 4, k / 4, v, window=4, sinks=1)
    >>> var.shape
    torch.Size([32, 16])
    """
    check_attention_inputs(fm, q, k, v)
    return _remainder_quadratic(fm, q, k, v, window, sinks, causal, True)


def hybrid_error_identity(
    p: torch.Tensor, o_exact: torch.Tensor, o_remainder: torch.Tensor, o_remainder_hat: torch.Tensor,
    delta: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    r"""The hybrid output error from the remainder's: an exact identity.

    $$
    \hat o - o = (1-p)(\hat o_R - o_R) + \frac{p(1-p)\,\delta}{1 + (1-p)\delta}(\hat o_R - o_S),
    $$

    $p$ the exact set's mass (`exact_mass`), $o_S$ and $o_R$ the exact outputs over the exact set
    and the remainder, $\hat o_R$ the estimate over the remainder alone and
    $\delta = \hat D_R/D_R - 1$ the remainder mass's relative error (derivation in the module
    docstring). With $\delta = 0$: $(1-p)(\hat o_R - o_R)$.

    Parameters
    ----------
    p : Tensor, shape (..., n)
    o_exact, o_remainder, o_remainder_hat : Tensor, shape (..., n, dv)
    delta : Tensor of shape (..., n), or float, default 0.0

    Returns
    -------
    Tensor, shape (..., n, dv): $\hat o - o$.

    Examples
    --------
    >>> import torch
    >>> p = torch.tensor([0.75])
    >>> hybrid_error_identity(p, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    tensor([[0.2500]])
    """
    for name, t in (("p", p), ("o_exact", o_exact), ("o_remainder", o_remainder),
                    ("o_remainder_hat", o_remainder_hat)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    p = p.unsqueeze(-1)
    dl = torch.as_tensor(delta, dtype=p.dtype, device=p.device)
    if dl.dim():
        dl = dl.unsqueeze(-1)
    return (1 - p) * (o_remainder_hat - o_remainder) + p * (1 - p) * dl / (1 + (1 - p) * dl) * (
        o_remainder_hat - o_exact
    )
