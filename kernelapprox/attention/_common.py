"""Pieces shared by the parallel, chunked and recurrent forms of linear attention."""

from __future__ import annotations

import torch

from .._validation import broadcast_batch, compute_dtype
from ..exact import check_qkv
from ..features import FeatureMap
from .state import LinearAttentionState


def check_feature_map(feature_map: object) -> FeatureMap:
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    return feature_map


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, torch.dtype]:
    """Validate the inputs of an attention call once, and cast them to the compute dtype.

    Returns ``q, k, v`` in ``compute_dtype(q, k, v, feature map)`` (at least float32), the output
    dtype ``promote(q, k, v)`` and the compute dtype. The feature map is then called inside
    `kernelapprox._validation.inputs_validated`, so nothing is checked twice.
    """
    check_feature_map(feature_map)
    check_qkv(q, k, v, causal=causal)
    if q.shape[-1] != feature_map.dim:
        raise ValueError(
            f"q and k have last dimension {q.shape[-1]}, but the feature map expects dim={feature_map.dim}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        broadcast_batch(name, t.shape[:-2], feature_map.batch_shape)
    if initial_state is not None:
        if not isinstance(initial_state, LinearAttentionState):
            raise TypeError(f"initial_state must be a LinearAttentionState, got {type(initial_state).__name__}")
        check_state(initial_state, feature_map.feature_dim, v.shape[-1], "initial_state")
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype, feature_map.param_dtype)
    return q.to(cdt), k.to(cdt), v.to(cdt), out_dtype, cdt


def check_state(state: LinearAttentionState, feature_dim: int, dv: int, name: str) -> None:
    """Raise ``ValueError`` unless ``state.kv`` has shape (..., feature_dim, dv + 1)."""
    if tuple(state.kv.shape[-2:]) != (feature_dim, dv + 1):
        raise ValueError(
            f"{name} has kv of shape {tuple(state.kv.shape)}, expected (..., {feature_dim}, {dv + 1}) "
            f"= (..., feature_dim, dv + 1) for this feature map and v"
        )


def key_side(
    feature_map: FeatureMap,
    k: torch.Tensor,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor]:
    """Key features with one shared scale, and the old state brought to a common scale.

    Returns ``fk (..., m, F)``; ``None`` without an initial state, else ``(w, kv0)``: ``w
    (..., 1, 1)`` the factor by which this segment's key terms must be multiplied and ``kv0 (...,
    F, dv+1)`` the rescaled initial state; and the common ``log_scale (..., 1, 1)``.
    """
    fk, gk = feature_map.key_log_features(k, shared=True)  # gk: (..., 1)
    gk = gk.unsqueeze(-1)  # (..., 1, 1)
    if initial_state is None:
        return fk, None, gk
    old_kv = initial_state.kv.to(fk.dtype)
    old_ls = initial_state.log_scale.to(gk.dtype)
    # The scales are stabilisers only: their choice is a constant for autograd.
    g = torch.maximum(gk, old_ls).detach()
    dt = fk.dtype
    return fk, (torch.exp(gk - g).to(dt), old_kv * torch.exp(old_ls - g).to(dt)), g


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """``[v, 1]`` (..., m, dv + 1): numerator and denominator share one GEMM (and its rounding)."""
    return torch.cat((v, v.new_ones(*v.shape[:-1], 1)), dim=-1)


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
