"""Pieces shared by the parallel, chunked and recurrent forms of linear attention."""

from __future__ import annotations

import torch

from .._validation import broadcast_batch, compute_dtype
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        broadcast_batch(name, t.shape[:-2], feature_map.batch_shape)
    if initial_state is not None and not isinstance(initial_state, LinearAttentionState):
        raise TypeError(f"initial_state must be a LinearAttentionState, got {type(initial_state).__name__}")
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype)
    return q.to(cdt), k.to(cdt), v.to(cdt), out_dtype, cdt


def key_side(
    feature_map: FeatureMap,
    k: torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Key features with one shared scale, and the old state brought to a common scale.

    Returns ``fk (..., m, F)``; ``w (..., 1, 1)``, the factor by which this segment's key terms
    must be multiplied (``None`` if 1); ``kv0 (..., F, dv+1)``, the rescaled initial state (or
    ``None``); and the common ``log_scale (..., 1, 1)``.
    """
    fk, gk = feature_map.log_features(k, shared=True)  # gk: (..., 1)
    gk = gk.unsqueeze(-1)  # (..., 1, 1)
    if initial_state is None:
        return fk, None, None, gk
    if initial_state.kv.shape[-2] != fk.shape[-1]:
        raise ValueError(
            f"initial_state has kv of shape {tuple(initial_state.kv.shape)}, expected "
            f"(..., {fk.shape[-1]}, dv + 1) for a feature map with feature_dim={fk.shape[-1]}"
        )
    old_kv = initial_state.kv.to(fk.dtype)
    old_ls = initial_state.log_scale.to(gk.dtype)
    # The scales are stabilisers only: their choice is a constant for autograd.
    g = torch.maximum(gk, old_ls).detach()
    dt = fk.dtype
    return fk, torch.exp(gk - g).to(dt), old_kv * torch.exp(old_ls - g).to(dt), g


def check_state_dv(initial_state: LinearAttentionState | None, v: torch.Tensor) -> None:
    if initial_state is not None and initial_state.kv.shape[-1] != v.shape[-1] + 1:
        raise ValueError(
            f"initial_state has kv of shape {tuple(initial_state.kv.shape)}, expected last dimension "
            f"dv + 1 = {v.shape[-1] + 1} for v of shape {tuple(v.shape)}"
        )


def split(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num | den]`` (..., n, dv+1) -> ``num`` (..., n, dv), ``den`` (..., n, 1)."""
    return out[..., :-1], out[..., -1:]


def normalise(num: torch.Tensor, den: torch.Tensor, positive: bool, eps: float) -> torch.Tensor:
    """``num / den`` (num (..., n, dv), den (..., n, 1)), guarding vanishing denominators.

    Positive maps: a denominator can only vanish by underflow; it is clamped to the smallest normal
    number. Signed maps (trigonometric): ``den + 2 eps`` where ``|den| <= eps`` (the Performer guard).
    """
    if positive:
        den = den.clamp_min(torch.finfo(den.dtype).tiny)
    else:
        den = den + 2 * eps * (den.abs() <= eps).to(den.dtype)
    return num / den
