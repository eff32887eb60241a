"""Non-causal linear attention in its parallel form."""

from __future__ import annotations

import torch

from .._validation import no_autocast
from ..features import FeatureMap
from ._common import check_state_dv, key_side, normalise, prepare, split
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
    r"""Non-causal linear attention :math:`O = \varphi(Q)\,[\varphi(K)^\top [V, 1]]`, normalised.

    Keys share one log scale (their maximum; there is no causality to respect), queries keep a
    per-row scale that cancels in the ratio. Cost :math:`O(n F d_v)`, memory
    :math:`O(n(F + d_v) + F d_v)` per head.

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
        Denominator guard for signed maps, see :func:`kernelapprox.linear_attention`.

    Returns
    -------
    out : Tensor, shape (..., n, dv)
    state : LinearAttentionState, if ``return_state``
    """
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, False, initial_state)
    check_state_dv(initial_state, v)
    fk, w, kv0, g = key_side(feature_map, k, initial_state)
    # [S | z] = phi(K)^T [V, 1] in one GEMM: numerator and denominator then share their rounding
    # (a constant v is returned exactly; separate reductions disagree by ~n*eps at long n).
    v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), dim=-1)
    kv = torch.matmul(fk.mT, v1)
    if kv0 is not None:
        kv = kv * w + kv0
    fq = feature_map._query_features(q)  # the per-query scale cancels
    out = normalise(*split(torch.matmul(fq, kv)), feature_map.positive, eps).to(out_dtype)
    if return_state:
        return out, LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
    return out
