r"""Quadratic references for hybrid attention: the ground truth of the fast forms' tests.

`naive_hybrid_attention`: the exact kernel $e^{q_i^\top k_j}$ and the estimate
$\varphi(q_i)^\top\varphi(k_j)$ are both materialised ($n \times n$), combined by the exact-set
mask of `kernelapprox.attention.hybrid.exact_set_mask`, and the rows normalised. No log-domain
stabilisation and no guard: use moderate inputs, in float64.

`exact_hybrid_attention`: the same estimator at any norm, in float64 and in the log domain (the
remainder's $\log\varphi(q_i)^\top\psi(k_j)$ by a log-sum-exp over the features, each row
normalised by a log-sum-exp over its keys): the reference of the survey tests, where a float32
form must not return a row off it. $O(n^2 F)$ memory, for tests and small problems only.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from ..._validation import compute_dtype, no_autocast
from ...exact import check_qkv
from ...maps.base import FeatureMap
from .._common import padding_mask
from .core import exact_set_mask
from .logfeatures import log_features_pair

__all__ = ["exact_hybrid_attention", "naive_hybrid_attention", "signed_hybrid_weights"]


@no_autocast
def naive_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window_mode: str = "token",
) -> torch.Tensor:
    r"""Materialise $\hat A_{ij} = e^{q_i^\top k_j}$ on the exact set, $\varphi(q_i)^\top\varphi(k_j)$
    elsewhere (zero for $j > i$ if causal), and normalise its rows.

    $$
    o_i = \frac{\sum_j \hat A_{ij} v_j}{\sum_j \hat A_{ij}},\qquad
    \hat A_{ij} = \begin{cases} e^{q_i^\top k_j} & j \in S_i \\
    \varphi(q_i)^\top\varphi(k_j) & j \notin S_i \end{cases}
    $$

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
    window : int
    sinks : int or sequence of int, default 0
    causal : bool, default False
    key_padding_mask : Tensor, shape (batch, n), optional
        ``True`` where the key is padding: its column of $\hat A$ is zero.
    window_mode : {"token", "block"}, default "token"
        The exact sets of `kernelapprox.attention.hybrid.exact_set_mask`.

    Returns
    -------
    Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = (torch.randn(3, 6, 4, dtype=torch.float64) / 2).unbind(0)
    >>> out = naive_hybrid_attention(q, k, v, ka.EluFeatures(4), window=6)
    >>> torch.allclose(out, ka.softmax_attention(q, k, v))
    True
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    check_qkv(q, k, v, causal=True)  # hybrid attention needs n == m
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype, feature_map.param_dtype)
    q, k, v = q.to(cdt), k.to(cdt), v.to(cdt)
    n = q.shape[-2]
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=q.device, window_mode=window_mode)
    approx = feature_map(q) @ feature_map.key_features(k).mT
    A = torch.where(S, torch.exp(q @ k.mT), approx)
    if causal:
        A = A.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), 0.0)
    pad = padding_mask(key_padding_mask, k.shape)
    if pad is not None:
        A = A.masked_fill(pad.unsqueeze(-2), 0.0)
    return ((A @ v) / A.sum(-1, keepdim=True)).to(out_dtype)


def _keys_attended(n: int, causal: bool, pad: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    keep = torch.ones(n, n, dtype=torch.bool, device=device)
    if causal:
        keep = keep.tril()
    if pad is not None:
        keep = keep & ~pad.unsqueeze(-2)
    return keep


def signed_hybrid_weights(
    feature_map: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window_mode: str = "token",
) -> torch.Tensor:
    r"""The hybrid weights $\hat A_{ij}$ of any map up to a positive factor per row, zero outside
    the keys query $i$ attends to: $e^{q_i^\top k_j - m_i}$ on the exact set $S_i$,
    $f(q_i)^\top f(k_j)\,e^{s(q_i) + s(k_j) - m_i}$ elsewhere (``feature_map.log_features``,
    $\varphi(x) = f(x)e^{s(x)}$), with $m_i$ the largest of the exact logits and
    $s(q_i) + \max_{j \in R_i} s(k_j)$: nothing overflows, and a signed map's weights keep their
    signs (for its conditioning $\sum_j|\hat A_{ij}| / |\sum_j \hat A_{ij}|$). The map is
    evaluated in the inputs' dtype (float32 inputs: its float32 features), everything after it in
    float64.

    Parameters
    ----------
    feature_map : FeatureMap
    q, k : Tensor, shape (..., n, d)
    window, sinks, causal, key_padding_mask, window_mode
        As in `naive_hybrid_attention`.

    Returns
    -------
    Tensor, shape (..., n, n), float64.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.TrigRF(4, 8, seed=0).double()
    >>> q, k = (torch.randn(2, 6, 4, dtype=torch.float64) / 2).unbind(0)
    >>> A = signed_hybrid_weights(fm, q, k, window=2, causal=True)
    >>> B = torch.where(exact_set_mask(6, window=2, causal=True), torch.exp(q @ k.T), fm(q) @ fm(k).T).tril()
    >>> torch.allclose(A / A.sum(-1, keepdim=True), B / B.sum(-1, keepdim=True))
    True
    """
    n = q.shape[-2]
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=q.device, window_mode=window_mode)
    keep = _keys_attended(n, causal, padding_mask(key_padding_mask, k.shape), q.device)
    fq, sq = (t.double() for t in feature_map.log_features(q))
    fk, sk = (t.double() for t in feature_map.key_log_features(k))
    q, k = q.double(), k.double()
    ninf = float("-inf")
    logits = (q @ k.mT).masked_fill(~(S & keep), ninf)
    srem = sk.unsqueeze(-2).masked_fill(~(keep & ~S), ninf)  # (..., n, n)
    base = sq.unsqueeze(-1) + srem.amax(-1, keepdim=True)
    m = torch.maximum(logits.amax(-1, keepdim=True), base)
    m = torch.where(m == ninf, torch.zeros_like(m), m)
    rem = (fq @ fk.mT) * torch.exp(sq.unsqueeze(-1) + srem - m)
    return torch.where(S, torch.exp(logits - m), rem)


@no_autocast
def exact_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window_mode: str = "token",
) -> torch.Tensor:
    r"""The exact answer of hybrid attention, in float64 (log domain for positive maps).

    $$
    o_i = \frac{\sum_{j\in J_i} e^{\ell_{ij}} v_j}{\sum_{j\in J_i} e^{\ell_{ij}}},\qquad
    \ell_{ij} = \begin{cases} q_i^\top k_j & j\in S_i \\
    \log\sum_f e^{\log\varphi_f(q_i) + \log\psi_f(k_j)} & j \notin S_i \end{cases}
    $$

    ($J_i$: the unpadded keys query $i$ attends to, $S_i$ its exact set,
    `kernelapprox.attention.hybrid.exact_set_mask`): a softmax over $j$ of exact logits and of
    log-sum-exps over the features, on one absolute scale (`log_features_pair`), so that a row is
    exact whatever the size of its weights. Signed maps: $\hat A$ of `signed_hybrid_weights` in
    float64. A row without any key gives 0. The map is evaluated on a float64 copy of itself;
    the result is differentiable with respect to ``q``, ``k`` and ``v`` (the reference of the
    forms' gradients; not with respect to the map's parameters), the shifts being constants.

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
    window : int
    sinks : int or sequence of int, default 0
    causal : bool, default False
    key_padding_mask : Tensor, shape (batch, n), optional
        ``True`` where the key is padding.
    window_mode : {"token", "block"}, default "token"

    Returns
    -------
    Tensor, shape (..., n, dv), float64.

    Examples
    --------
    At $\|q\| = \|k\| = 40$ the float64 quadratic reference overflows; the log-domain one does not.

    >>> import kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = torch.randn(3, 8, 4, generator=g, dtype=torch.float64).unbind(0)
    >>> q, k = 40 * q / q.norm(dim=-1, keepdim=True), 40 * k / k.norm(dim=-1, keepdim=True)
    >>> fm = ka.PositiveRF(4, 16, seed=0)
    >>> kw = dict(window=2, sinks=1, causal=True)
    >>> bool(naive_hybrid_attention(q, k, v, fm, **kw).isnan().any())
    True
    >>> bool(exact_hybrid_attention(q, k, v, fm, **kw).isfinite().all())
    True
    >>> small = (q / 20, k / 20, v)
    >>> torch.allclose(exact_hybrid_attention(*small, fm, **kw), naive_hybrid_attention(*small, fm, **kw))
    True
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    check_qkv(q, k, v, causal=True)
    fm = copy.deepcopy(feature_map).to(torch.float64)
    fm.requires_grad_(False)
    q64, k64, v64 = q.double(), k.double(), v.double()
    n = q.shape[-2]
    pad = padding_mask(key_padding_mask, k.shape)
    if not fm.positive:
        A = signed_hybrid_weights(fm, q64, k64, window=window, sinks=sinks, causal=causal,
                                  key_padding_mask=key_padding_mask, window_mode=window_mode)
        den = A.sum(-1, keepdim=True)
        num = A @ v64
        return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, 1.0, den))
    S = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=q.device, window_mode=window_mode)
    keep = _keys_attended(n, causal, pad, q.device)
    lq, lk = log_features_pair(fm, q64, k64)
    rem = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), dim=-1)
    ell = torch.where(S, q64 @ k64.mT, rem).masked_fill(~keep, float("-inf"))
    top = ell.detach().amax(-1, keepdim=True)
    empty = top == float("-inf")
    wts = torch.exp(ell - torch.where(empty, 0.0, top))
    out = (wts @ v64) / torch.where(empty, 1.0, wts.sum(-1, keepdim=True))
    return torch.where(empty, torch.zeros_like(out), out)
