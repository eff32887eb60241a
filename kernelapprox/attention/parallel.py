"""Non-causal linear attention in its parallel form."""

from __future__ import annotations

import torch

from ..features import FeatureMap
from ._common import check_state_dv, key_side, normalise, prepare
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
    check_state_dv(initial_state, v)
    fk, w, kv0, g = key_side(feature_map, k, initial_state)
    # S = phi(K)^T V and z = phi(K)^T 1 separately: keeps the big GEMMs aligned to dv.
    S = torch.matmul(fk.mT, v)
    z = fk.sum(dim=-2)
    if kv0 is not None:
        S = S * w + kv0[..., :-1]
        z = z * w.squeeze(-1) + kv0[..., -1]
    fq, _ = feature_map.log_features(q)
    num = torch.matmul(fq, S)
    den = torch.matmul(fq, z.unsqueeze(-1))
    out = normalise(num, den, feature_map.positive, eps).to(out_dtype)
    if return_state:
        kv = torch.cat((S, z.unsqueeze(-1)), dim=-1)
        return out, LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
    return out
