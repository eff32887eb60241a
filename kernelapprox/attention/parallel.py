"""Non-causal linear attention in its parallel form."""

from __future__ import annotations

import torch

from ..features import FeatureMap
from ._common import key_side, normalise, prepare
from .state import LinearAttentionState


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

    Cost :math:`O(n F d_v)`, memory :math:`O(n(F + d_v) + F d_v)` per head. See
    :func:`kernelapprox.linear_attention` for the parameters.
    """
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, False, initial_state)
    fk, v1, kv0, g = key_side(feature_map, k, v, initial_state)
    kv = torch.matmul(fk.mT, v1)
    if kv0 is not None:
        kv = kv + kv0
    fq, _ = feature_map.log_features(q)
    out = normalise(torch.matmul(fq, kv), feature_map.positive, eps).to(out_dtype)
    if return_state:
        return out, LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
    return out
