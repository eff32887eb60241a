"""Causal linear attention computed chunk-wise: masked products inside a chunk plus a carried state."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..features import FeatureMap
from ._common import check_state_dv, key_side, normalise, prepare, split
from .state import LinearAttentionState


def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Causal linear attention, chunked.

    With chunks :math:`c` of ``chunk_size`` tokens, :math:`A_c = \operatorname{tril}(\varphi(Q_c)\varphi(K_c)^\top)`
    and the state before the chunk :math:`S_{<c} = S_0 + \sum_{c' < c}\varphi(K_{c'})^\top [V_{c'}, 1]`:

    .. math::
        [\text{num}, \text{den}]_c = \varphi(Q_c)\, S_{<c} + A_c\,[V_c, 1].

    Chunk states are formed for groups of chunks at a time, the group sized so that they never
    outweigh the features: peak memory :math:`O(n(F + d_v) + F d_v)` per head for any
    ``chunk_size``, and no :math:`(n, F, d_v)` tensor. Cost
    :math:`O(nFd_v + n\,C(F + d_v))` for chunk size :math:`C`.
    See :func:`kernelapprox.linear_attention` for the parameters.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (a number of tokens), got {chunk_size!r}")
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, True, initial_state)
    check_state_dv(initial_state, v)
    fk, w, kv0, g = key_side(feature_map, k, initial_state)
    v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), dim=-1)
    if w is not None:
        v1 = v1 * w
    fq, _ = feature_map.log_features(q)
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v1.shape[:-2])
    n, Fd, dv1 = fq.shape[-2], fq.shape[-1], v1.shape[-1]
    C = chunk_size
    nc = math.ceil(n / C)
    pad = nc * C - n
    if pad:
        fq = F.pad(fq, (0, 0, 0, pad))
        fk = F.pad(fk, (0, 0, 0, pad))
        v1 = F.pad(v1, (0, 0, 0, pad))
    fq = fq.expand(*lead, *fq.shape[-2:]).reshape(*lead, nc, C, Fd)
    fk = fk.expand(*lead, *fk.shape[-2:]).reshape(*lead, nc, C, Fd)
    v1 = v1.expand(*lead, *v1.shape[-2:]).reshape(*lead, nc, C, dv1)
    state = fq.new_zeros(*lead, Fd, dv1) if kv0 is None else kv0.expand(*lead, Fd, dv1)
    # Chunks per group: the group's chunk states (group * F * dv1) stay within the size of its
    # features (group * C * (F + dv1)), up to one chunk at least.
    group = max(1, (nc * C * (Fd + dv1)) // (Fd * dv1))
    mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()
    outs = []
    for s in range(0, nc, group):
        e = min(nc, s + group)
        fq_g, fk_g, v1_g = fq[..., s:e, :, :], fk[..., s:e, :, :], v1[..., s:e, :, :]
        kv_c = torch.matmul(fk_g.mT, v1_g)  # (..., g, F, dv1)
        incl = torch.cumsum(kv_c, dim=-3) + state.unsqueeze(-3)
        excl = torch.cat((state.unsqueeze(-3), incl[..., :-1, :, :]), dim=-3)
        A = torch.matmul(fq_g, fk_g.mT).masked_fill(~mask, 0.0)
        outs.append(torch.matmul(fq_g, excl) + torch.matmul(A, v1_g))
        state = incl[..., -1, :, :]
    out = torch.cat(outs, dim=-3).reshape(*lead, nc * C, dv1)[..., :n, :]
    out = normalise(*split(out), feature_map.positive, eps).to(out_dtype)
    if return_state:
        return out, LinearAttentionState(state, g.expand(*lead, 1, 1))
    return out
