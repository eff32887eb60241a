"""Pieces shared by the parallel, chunked and recurrent forms of linear attention."""

from __future__ import annotations

import torch

from .._validation import compute_dtype
from ..exact import check_qkv
from ..features import FeatureMap
from .state import LinearAttentionState


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, torch.dtype]:
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    check_qkv(q, k, v, causal=causal)
    if q.shape[-1] != feature_map.dim:
        raise ValueError(
            f"q and k have last dimension {q.shape[-1]}, but the feature map expects dim={feature_map.dim}"
        )
    if initial_state is not None and not isinstance(initial_state, LinearAttentionState):
        raise TypeError(f"initial_state must be a LinearAttentionState, got {type(initial_state).__name__}")
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype)
    return q.to(cdt), k.to(cdt), v.to(cdt), out_dtype, cdt


def key_side(
    feature_map: FeatureMap,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Key features with one shared scale, values augmented with a ones column, and the old state
    rescaled to the common scale.

    Returns ``fk (..., m, F)``, ``v1 (..., m, dv+1)``, ``kv0 (..., F, dv+1) or None`` and the
    common ``log_scale (..., 1, 1)``.
    """
    fk, gk = feature_map.log_features(k, shared=True)  # gk: (..., 1)
    gk = gk.unsqueeze(-1)  # (..., 1, 1)
    v1 = torch.cat((v, v.new_ones(*v.shape[:-1], 1)), dim=-1)
    if initial_state is None:
        return fk, v1, None, gk
    if initial_state.kv.shape[-2] != fk.shape[-1] or initial_state.kv.shape[-1] != v1.shape[-1]:
        raise ValueError(
            f"initial_state has kv of shape {tuple(initial_state.kv.shape)}, expected "
            f"(..., {fk.shape[-1]}, {v1.shape[-1]}) for feature_dim={fk.shape[-1]} and dv={v.shape[-1]}"
        )
    old_kv = initial_state.kv.to(fk.dtype)
    old_ls = initial_state.log_scale.to(fk.dtype)
    g = torch.maximum(gk, old_ls)
    # The scales are stabilisers only: treat their choice as constant for autograd.
    with torch.no_grad():
        g = g.detach()
    v1 = v1 * torch.exp(gk - g)
    kv0 = old_kv * torch.exp(old_ls - g)
    return fk, v1, kv0, g


def normalise(out: torch.Tensor, positive: bool, eps: float) -> torch.Tensor:
    """Split ``[num | den]`` (..., n, dv+1) and divide, guarding vanishing denominators.

    Positive maps: a denominator can only vanish by underflow; it is clamped to the smallest normal
    number. Signed maps (trigonometric): ``den + 2 eps`` where ``|den| <= eps`` (the Performer guard).
    """
    num, den = out[..., :-1], out[..., -1:]
    if positive:
        den = den.clamp_min(torch.finfo(den.dtype).tiny)
    else:
        den = den + 2 * eps * (den.abs() <= eps).to(den.dtype)
    return num / den
