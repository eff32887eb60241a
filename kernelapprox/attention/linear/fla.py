r"""Causal linear attention through flash-linear-attention's chunked kernels (``fla-core``,
optional, imported lazily; pinned to `kernelapprox.backends.FLA_VERSION`).

The library's log-domain stabilisation is a gated linear recurrence (see
`kernelapprox.attention.linear.naive_gated.naive_gated_linear_attention`): with key
log-features $a_{t,f}$ and their running maximum $m_{t,f}$ (per sequence, detached), keys enter
as $e^{a_t - m_t}$, the state decays by $e^{g_t}$ with $g_t = m_{t-1} - m_t \le 0$ (finite:
the first gate of a sequence is 0, and a padded key takes the smallest log-feature of its
sequence, so no maximum starts at $-\infty$, which would turn fla's chunk-local cumulative sum of
gates into NaN), queries enter as $e^{b_t + m_t - M_t}$ with $M_t = \max_f(b_{t,f} + m_{t,f})$, and
the values are padded to $[v, 1, 0, \dots]$ (an even width) so that the one scan gives the
numerator and the denominator. That is fla's ``chunk_gla`` (per-feature gates, ``g`` of shape
[B, T, H, K]) with ``scale=1.0``. Maps without log2 features whose features are bounded (elu+1,
ReLU, Taylor) run ungated through ``chunk_simple_gla(g=None)``. fla's ``normalize=True`` is never
used (its key sums are kept in bf16). Layout [B, T, H, K] throughout.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ...maps.base import FeatureMap
from .._common import feature_state, has_log2_features, log2_state, normalise, signed_lost
from ..state import LinearAttentionState

_LN2 = 0.6931471805599453


def fla_mode(feature_map: FeatureMap) -> str | None:
    """``"gla"`` (per-feature gates: positive maps with log2 features), ``"plain"`` (no gate:
    bounded features, elu+1, ReLU, Taylor) or ``None`` (the map has no fla form: exponential
    signed maps, whose features need a scale per row).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fla_mode(ka.PositiveRF(4, 8, seed=0)), fla_mode(ka.EluFeatures(4)), fla_mode(ka.TrigRF(4, 8, seed=0))
    ('gla', 'plain', None)
    """
    if feature_map.positive and has_log2_features(feature_map):
        return "gla"
    if type(feature_map).__name__ in ("EluFeatures", "ReluFeatures", "TaylorFeatures"):
        return "plain"
    return None


def _kernels() -> Any:
    """fla's kernels, imported on first use (tests replace this function)."""
    from fla.ops.gla import chunk_gla  # type: ignore[import-not-found]
    from fla.ops.simple_gla import chunk_simple_gla  # type: ignore[import-not-found]

    return SimpleNamespace(chunk_gla=chunk_gla, chunk_simple_gla=chunk_simple_gla)


def _even(n: int) -> int:
    return n + (n % 2)


def _segment_cummax(a: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Running maximum over dimension 1 (T) of ``a`` (B, T, H, F), restarted at each sequence of
    ``cu_seqlens`` (B = 1): each sequence is lifted above the previous ones by a multiple of the
    span of ``a`` (float64, exact), so one cummax serves all without a host read."""
    if cu_seqlens is None:
        return torch.cummax(a, dim=1).values
    T = a.shape[1]
    pos = torch.arange(T, device=a.device)
    seg = (torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1).to(torch.float64)
    a64 = a.double()
    lo, hi = a64.amin(), a64.amax()
    span = hi - lo + 1.0
    lift = (seg * span).view(1, T, *([1] * (a.dim() - 2)))
    return (torch.cummax(a64 - lo + lift, dim=1).values - lift + lo).to(a.dtype)


def _segment_cumsum(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Inclusive sums over dimension 1 (T) of ``x`` (B, T, ...), restarted at each sequence of
    ``cu_seqlens`` (B = 1), without a host read."""
    c = torch.cumsum(x, dim=1)
    if cu_seqlens is None:
        return c
    T = x.shape[1]
    pos = torch.arange(T, device=x.device)
    start = cu_seqlens.to(pos.dtype)[torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1]
    before = torch.cat([torch.zeros_like(c[:, :1]), c], dim=1)[:, start]  # sum of the tokens before it
    return c - before


def _plain_lost(
    den: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, pad: torch.Tensor | None, h0: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None, dv: int, acc: torch.dtype, terms: torch.dtype,
) -> torch.Tensor:
    r"""The lost rows (B, T, H, 1) of a signed map on the ungated path
    (`kernelapprox.attention._common.signed_lost`): the bound
    $B_t = |\varphi(q_t)|^\top(\sum_{s \le t}|\varphi(k_s)| + |z_0|)$ by a cumulative sum
    over the sequence (restarted at each of ``cu_seqlens``; $|z_0|$ the initial state's summed
    key features in absolute value), at the tolerance of ``terms``, the dtype of the kernel's
    operands. No host read."""
    with torch.no_grad():
        zabs = _segment_cumsum(fk.detach().abs().to(acc), cu_seqlens)  # (B, T, H, K)
        valid = torch.ones_like(den[..., 0, 0]) if pad is None else (~pad).to(acc)  # (B, T)
        has_key = (_segment_cumsum(valid.unsqueeze(-1), cu_seqlens) > 0).unsqueeze(-1)  # (B, T, 1, 1)
        if h0 is not None:
            z0 = h0[..., dv].abs()  # (N, H, K)
            if cu_seqlens is None:
                z0 = z0.unsqueeze(1)  # (B, 1, H, K)
            else:
                pos = torch.arange(fk.shape[1], device=fk.device)
                z0 = z0[torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1].unsqueeze(0)
            zabs = zabs + z0
            has_key = has_key | (z0 > 0).any(dim=-1, keepdim=True)
        bound = (fq.detach().abs().to(acc) * zabs).sum(dim=-1, keepdim=True)
        return signed_lost(den, bound, has_key, dtype=terms)


def fla_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Causal linear attention by fla's chunked kernels, layout [B, T, H, d].

    Parameters
    ----------
    q, k : Tensor, shape (B, T, H, d)
    v : Tensor, shape (B, T, H, dv)
    feature_map : FeatureMap
        A map with an fla form (`fla_mode` not ``None``).
    initial_state : LinearAttentionState, optional
        ``kv`` (B, H, F, dv + 1) (N sequences with ``cu_seqlens``), one or per-feature scales.
    return_state : bool, default False
        Also return the state after the last token (per-feature scales for gated maps).
    key_padding_mask : Tensor, optional
        Bool (B, T), ``True`` = padded key: a zero row of $[v, 1]$ and no part in any maximum.
    cu_seqlens : Tensor, optional
        Packed sequences: int64 (N + 1,) offsets into T, with B = 1 (fla's varlen convention).
    eps : float, default 1e-6
        Denominator guard of signed maps (Taylor), as in `kernelapprox.linear_attention`. Rows
        lost to cancellation (`_plain_lost`, at the tolerance of the kernel's operand dtype) are
        NaN.

    Returns
    -------
    out : Tensor, shape (B, T, H, dv), dtype of ``v``
    state : LinearAttentionState, if ``return_state``

    Examples
    --------
    Runs where ``fla-core`` and a CUDA device are present (see ``docs/attention.md``).
    """
    mode = fla_mode(feature_map)
    if mode is None:
        raise ValueError(f"{type(feature_map).__name__} has no fla form (exponential signed features)")
    kern = _kernels()
    acc = torch.promote_types(torch.float32, v.dtype)  # statistics and gates: float32 (float64 kept)
    B, T, H, _ = q.shape
    dv = v.shape[-1]
    P = _even(dv + 1)
    pad = key_padding_mask
    v1 = torch.cat([v, torch.ones_like(v[..., :1]), v.new_zeros(*v.shape[:-1], P - dv - 1)], dim=-1)
    if pad is not None:
        v1 = v1.masked_fill(pad.view(B, T, 1, 1), 0.0)
    # maps with one projection per head, or fitted per sequence, read (..., H, T, d)
    per_head = bool(getattr(feature_map, "batch_shape", ())) or feature_map.data_dependent

    def feats(fn: Any, x: torch.Tensor) -> torch.Tensor:
        # per-row maps read (B, T, H, d) as rows directly; a map with one projection per head
        # needs the heads at dimension -3 (a transposed view, and a copy of its output)
        if per_head:
            return fn(x.transpose(1, 2)).transpose(1, 2)
        return fn(x)

    h0 = None
    if mode == "plain":
        fq = feats(feature_map.query_features, q)
        fk = feats(feature_map.key_features, k)
        if pad is not None:
            fk = fk.masked_fill(pad.view(B, T, 1, 1), 0.0)
        Fd = fq.shape[-1]
        K = _even(Fd)
        fq, fk = F.pad(fq, (0, K - Fd)), F.pad(fk, (0, K - Fd))
        if initial_state is not None:
            st = initial_state.kv * torch.exp(initial_state.log_scale).to(initial_state.kv.dtype)
            h0 = F.pad(st, (0, P - st.shape[-1], 0, K - Fd)).to(acc)
        o, ht = kern.chunk_simple_gla(
            q=fq.to(v.dtype), k=fk.to(v.dtype), v=v1, g=None, scale=1.0, initial_state=h0,
            output_final_state=return_state, cu_seqlens=cu_seqlens,
        )
        den = o[..., dv:dv + 1].to(acc)
        lost = None
        if not feature_map.positive:  # Taylor: rows lost to cancellation come back NaN (no host read)
            lost = _plain_lost(den, fq, fk, pad, h0, cu_seqlens, dv, acc, v.dtype)
        out = normalise(o[..., :dv].to(acc), den, feature_map.positive, eps, lost, host=False).to(v.dtype)
        if return_state:
            return out, LinearAttentionState(ht[..., :Fd, :dv + 1], ht.new_zeros(*ht.shape[:-2], 1, 1))
        return out
    b = feats(feature_map.query_log2_features, q).to(acc) * _LN2  # natural logs
    a = feats(feature_map.key_log2_features, k).to(acc) * _LN2
    Fd = a.shape[-1]
    with torch.no_grad():
        if pad is not None:
            # a padded key raises no maximum: the smallest log-feature of its sequence (finite)
            fill = a.masked_fill(pad.view(B, T, 1, 1), float("inf")).amin(dim=(1, 3), keepdim=True)
            fill = torch.where(torch.isfinite(fill), fill, torch.zeros_like(fill))
            a = torch.where(pad.view(B, T, 1, 1), fill, a)
        X0 = None
        if initial_state is not None:
            kvs, X0l2 = log2_state(initial_state, dv, acc)
            X0 = X0l2 * _LN2  # (N, H, F), -inf where the state holds nothing
            h0 = F.pad(kvs, (0, P - kvs.shape[-1])).to(acc)
        m = _segment_cummax(a, cu_seqlens)  # (B, T, H, F)
        if X0 is not None:
            start = X0.unsqueeze(1)  # (N, 1, H, F)
            if cu_seqlens is not None:
                pos = torch.arange(T, device=a.device)
                seg = torch.searchsorted(cu_seqlens.to(pos.dtype), pos, right=True) - 1
                start = X0[seg].unsqueeze(0)  # (1, T, H, F)
            m = torch.maximum(m, start)
        # the gate: g_t = m_{t-1} - m_t, 0 at each sequence's first token unless a state precedes
        prev = torch.cat([m[:, :1], m[:, :-1]], dim=1)
        if cu_seqlens is not None:
            first = torch.zeros(T, dtype=torch.bool, device=a.device)
            first[cu_seqlens[:-1].clamp(max=T - 1)] = True
            prev = torch.where(first.view(1, T, 1, 1), m, prev)
        if X0 is not None:
            s0 = X0.unsqueeze(1) if cu_seqlens is None else X0.unsqueeze(0)  # (N or 1, 1 or N, H, F)
            if cu_seqlens is None:
                prev[:, :1] = torch.where(torch.isfinite(s0), s0, m[:, :1])
            else:
                idx = cu_seqlens[:-1].clamp(max=T - 1)
                prev[:, idx] = torch.where(torch.isfinite(s0), s0, m[:, idx])
        g = prev - m  # <= 0, finite
        top = (b + m).amax(dim=-1, keepdim=True)
    K = _even(Fd)
    kq = F.pad(torch.exp(b + m - top), (0, K - Fd))
    kk = F.pad(torch.exp(a - m), (0, K - Fd))
    gg = F.pad(g, (0, K - Fd))
    if h0 is not None and K != Fd:
        h0 = F.pad(h0, (0, 0, 0, K - Fd))
    o, ht = kern.chunk_gla(
        q=kq.to(v.dtype), k=kk.to(v.dtype), v=v1, g=gg, scale=1.0, initial_state=h0,
        output_final_state=return_state, cu_seqlens=cu_seqlens,
    )
    out = normalise(o[..., :dv].to(acc), o[..., dv:dv + 1].to(acc), True, eps).to(v.dtype)
    if return_state:
        if cu_seqlens is not None:
            ends = (cu_seqlens[1:] - 1).clamp(min=0)
            last = m[0, ends]  # (N, H, F)
        else:
            last = m[:, -1]  # (B, H, F)
        return out, feature_state(ht[..., :Fd, :dv + 1], last / _LN2)
    return out
