"""Non-causal linear attention in its parallel form."""

from __future__ import annotations

import torch

from .._validation import inputs_validated, no_autocast
from ..features import FeatureMap
from ._common import key_side, normalise, prepare, split, with_ones
from .state import LinearAttentionState


@no_autocast
def parallel_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Non-causal linear attention $O = \varphi(Q)\,[\varphi(K)^\top [V, 1]]$, normalised.

    Keys share one log scale (their maximum; there is no causality to respect), queries keep a
    per-row scale that cancels in the ratio. Cost $O(n F d_v)$, memory
    $O(n(F + d_v) + F d_v)$ per head.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
    feature_map : FeatureMap
    initial_state : LinearAttentionState, optional
        Keys and values already summarised (added to this call's).
    return_state : bool, default False
    eps : float, default 1e-6
        Denominator guard for signed maps, see `kernelapprox.linear_attention`.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : LinearAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 2, 50, 8).unbind(0)
    >>> fm = ka.PositiveRF(8, 32, seed=0)
    >>> parallel_linear_attention(q / 2, k / 2, v, fm).shape
    torch.Size([2, 50, 8])
    """
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, False, initial_state)
    with inputs_validated():
        fk, old, g = key_side(feature_map, k, initial_state)
        # [S | z] = phi(K)^T [V, 1] in one GEMM: numerator and denominator then share their
        # rounding (a constant v is returned exactly; separate reductions disagree by ~n*eps).
        kv = torch.matmul(fk.mT, with_ones(v))
        if old is not None:
            w, kv0 = old
            kv = kv * w + kv0
        fq = feature_map.query_features(q)  # the per-query scale cancels
    out = normalise(*split(torch.matmul(fq, kv)), feature_map.positive, eps).to(out_dtype)
    if return_state:
        return out, LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
    return out
