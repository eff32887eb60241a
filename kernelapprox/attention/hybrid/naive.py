r"""Plain quadratic reference for hybrid attention: the ground truth of the fast forms' tests.

The exact kernel $e^{q_i^\top k_j}$ and the estimate $\varphi(q_i)^\top\varphi(k_j)$ are
both materialised ($n \times n$), combined by the exact-set mask of
`kernelapprox.attention.hybrid.exact_set_mask`, and the rows normalised. No log-domain
stabilisation and no guard: use moderate inputs, in float64. $O(n^2)$ memory, for tests and
small problems only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._validation import compute_dtype, no_autocast
from ...exact import check_qkv
from ...maps.base import FeatureMap
from .._common import padding_mask
from .core import exact_set_mask

__all__ = ["naive_hybrid_attention"]


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
