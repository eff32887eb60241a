"""Non-causal linear attention in its parallel form."""

from __future__ import annotations

import torch

from ... import backends
from ..._validation import broadcast_shapes, inputs_validated, no_autocast
from ...maps.base import FeatureMap
from .._common import (
    apply_padding,
    check_options,
    den_floor,
    feature_state,
    has_log2_features,
    host_reads,
    key_side,
    log2_state,
    normalise,
    padding_mask,
    per_feature_parallel,
    prepare,
    shared_state,
    signed_lost,
    with_ones,
)
from ..state import LinearAttentionState

#: Width multiple of the value GEMMs ($[V, 1]$ padded with zero columns, see `with_ones`).
_GEMM_COLUMNS = 8


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
    key_padding_mask: torch.Tensor | None = None,
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
        Denominator guard for signed maps, see `kernelapprox.linear_attention`. A signed map's
        rows lost to cancellation (`kernelapprox.attention._common.signed_lost`, with the exact
        bound $|\varphi(q_i)|^\top\sum_j|\psi(k_j)|$, one extra pass over the features) are
        reported: a warning on the CPU, NaN rows on the accelerator path.
    key_padding_mask : Tensor, optional
        Bool, ``True`` = padded key, shape (batch, m) or broadcasting with (..., m); see
        `kernelapprox.linear_attention`. Padded keys have weight 0 in the numerator and the
        denominator and no part in the key scale.

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
    eps = check_options(return_state, eps)
    pad = padding_mask(key_padding_mask, k.shape)
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, False, initial_state)
    k, v = apply_padding(pad, k, v)
    with inputs_validated():
        dv = v.shape[-1]
        recycle = not (torch.is_grad_enabled() or torch.compiler.is_compiling())
        # Positive maps with log2 features: every feature at its own scale over the keys and each
        # query shifted against them (`per_feature_parallel`), so that every denominator is >= 1
        # and neither the forward nor the backward's 1/den can underflow, however peaked the
        # features (with and without autograd: the two give the same rows). Other maps (bounded
        # or signed features): one shared key scale and a per-row query shift.
        log2 = feature_map.positive and has_log2_features(feature_map)
        grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or any(p.requires_grad for p in feature_map.parameters()))
        # On the CPU without autograd the cheaper shared key scale runs first (in place), and the
        # per-feature form only where a denominator fell below `den_floor` (one host read of a
        # CPU value); elsewhere (autograd, states, accelerators, torch.compile) it runs directly.
        cpu_first = (log2 and recycle and not return_state and q.device.type == "cpu"
                     and backends.attention_plan(q.device, q.dtype, n=q.shape[-2], gated=True, grad=grad,
                                                 warn=False).path == "cpu")
        lk = feature_map.key_log2_features(k) if log2 and not cpu_first else None
        lq = None if lk is None else feature_map.query_log2_features(q)
        if lk is not None and lq is not None:
            vo = with_ones(v, _GEMM_COLUMNS)
            st = None
            if initial_state is not None:
                kvs, X0 = log2_state(initial_state, dv, vo.dtype)
                st = (torch.nn.functional.pad(kvs, (0, vo.shape[-1] - kvs.shape[-1])), X0)
            o, kv, t = per_feature_parallel(lq, lk, vo, pad, st)
            out = normalise(o[..., :dv], o[..., dv:dv + 1], True, eps).to(out_dtype)
            if return_state:
                return out, feature_state(kv[..., :dv + 1].contiguous(), t)
            return out
        fk, v1, kv0, g = key_side(feature_map, k, v, shared_state(initial_state), _GEMM_COLUMNS, pad)
        zabs = None
        if not feature_map.positive:
            # the keys' part of the magnitude bound of `signed_lost`: sum_j |psi(k_j)| w_j, (..., F, 1)
            # (and whether any key has weight), before phi(K) and [wV, w] may be recycled below
            with torch.no_grad():
                w = v1[..., dv:dv + 1]
                zabs = torch.matmul(fk.abs().mT, w)
                has_key = w.sum(dim=-2, keepdim=True) > 0
                if kv0 is not None:
                    z0 = kv0[..., dv:dv + 1].abs()
                    zabs = zabs + z0
                    has_key = has_key | (z0 > 0).any(dim=-2, keepdim=True)
        # [S | z] = phi(K)^T [V, 1] in one GEMM: numerator and denominator then share their
        # rounding (a constant v is returned exactly; separate reductions disagree by ~n*eps).
        # The GEMMs run at a width padded to a multiple of 8 (zero columns after the ones).
        kv = torch.matmul(fk.mT, v1)  # (..., F, P)
        if kv0 is not None:
            kv = kv + kv0
        # The per-query scale cancels. Without autograd, phi(Q) may reuse the memory of
        # phi(K) and the product that of [wV, w] (both dead by now): fresh buffers of that
        # size cost page faults on CPU (~0.25 ms per MB).
        if recycle and feature_map.key_features_recyclable():
            fq = feature_map.query_features_into(q, fk)
        else:
            fq = feature_map.query_features(q)
        del fk
    o_shape = (*broadcast_shapes(fq.shape[:-2], kv.shape[:-2]), fq.shape[-2], kv.shape[-1])
    if recycle and v1.shape == o_shape and v1.dtype == fq.dtype == kv.dtype:
        o = torch.matmul(fq, kv, out=v1)
    else:
        o = torch.matmul(fq, kv)  # (..., n, P)
    if cpu_first:
        den = o[..., dv]
        small = den < den_floor(den.dtype)
        if pad is not None:
            small = small & (~pad).any(dim=-1, keepdim=True)
        if bool(small.any()):  # rare: peaked features; the whole call per feature
            lq, lk = feature_map.query_log2_features(q), feature_map.key_log2_features(k)
            if lq is not None and lk is not None:
                st = None
                if initial_state is not None:
                    kvs, X0 = log2_state(initial_state, dv, o.dtype)
                    st = (torch.nn.functional.pad(kvs, (0, o.shape[-1] - kvs.shape[-1])), X0)
                o = per_feature_parallel(lq, lk, with_ones(v, _GEMM_COLUMNS), pad, st)[0]
    lost, host = None, True
    if zabs is not None:  # signed maps: the rows lost to cancellation (`signed_lost`)
        host = host_reads(o.device)
        with torch.no_grad():
            lost = signed_lost(o[..., dv:dv + 1], torch.matmul(fq.detach().abs(), zabs), has_key)
    out = normalise(o[..., :dv], o[..., dv:dv + 1], feature_map.positive, eps, lost, host=host).to(out_dtype)
    if return_state:
        kv = kv[..., :dv + 1].contiguous()
        return out, LinearAttentionState(kv, g.expand(*kv.shape[:-2], 1, 1))
    return out
