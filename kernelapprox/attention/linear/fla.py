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

Decoding (one token per call, `fla_decode_step`) runs the same recurrence through fla's fused
recurrent kernels, ``fused_recurrent_gla`` (per-feature gate ``gk``) and
``fused_recurrent_simple_gla`` (one gate per row, ``g``), with ``T = 1``: the state
`kernelapprox.LinearAttentionState` is fla's ``initial_state`` [N, H, K, V] as it is, ``K = F``
features by ``V = d_v + 1`` columns $[S \mid z]$ (these kernels mask both widths, so nothing is
padded), and fla's final state (float32) is the next state's ``kv``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from ..._validation import broadcast_shapes
from ...maps.base import FeatureMap
from .._common import feature_state, has_log2_features, log2_state, normalise, signed_lost, with_ones
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


_LOADED: dict[str, Any] = {}


def _recurrent_kernels() -> Any:
    """fla's fused recurrent kernels, imported on first use and kept (a decoding step, compiled
    or captured, then reads one module attribute; tests replace this function)."""
    kern = _LOADED.get("recurrent")
    if kern is None:
        from fla.ops.gla import fused_recurrent_gla
        from fla.ops.simple_gla import fused_recurrent_simple_gla

        kern = _LOADED["recurrent"] = SimpleNamespace(
            fused_recurrent_gla=fused_recurrent_gla, fused_recurrent_simple_gla=fused_recurrent_simple_gla)
    return kern


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


def fla_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    state: LinearAttentionState | None = None,
    key_padding_mask: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, LinearAttentionState]:
    r"""One decoding step by fla's fused recurrent kernels (``T = 1``): the output and the next state.

    Gated maps (`fla_mode` ``"gla"``: positive maps with log2 features). With $a_f$ and $b_f$ the
    key's and the query's log2-features, $\ell_f$ the state's log-scale of feature $f$ and $z_f$
    its mass column, $X_f = \ell_f / \ln 2 + \log_2 z_f$ is the log2 of the feature's true
    mass ($-\infty$ for a feature no key reached, or one whose $z_f$ is below the smallest
    normal float32), and the new scale is $X'_f = \max(X_f, a_f)$. fla then computes, per row,
    $$
    h = e^{g} \odot h_0 + k [v, 1]^\top,\qquad o = q^\top h,
    $$
    with ``gk`` $g_f = (\ell_f / \ln 2 - X'_f) \ln 2 \le -\ln z_f$ (finite: at most
    $126 \ln 2$), keys $k_f = 2^{a_f - X'_f} \le 1$ and queries $q_f = 2^{b_f + X'_f - M}$,
    $M = \max_f (b_f + X'_f)$, so that one term of the denominator is at least 1. The next state
    is ``kv`` $= h$ with the per-feature log-scales $X'_f \ln 2$ (float64; 0 where no key
    reached), the state `kernelapprox.RecurrentLinearAttention` keeps.

    Maps without log2 features whose features are bounded (`fla_mode` ``"plain"``: elu+1, ReLU,
    Taylor): the key's shared log-scale $s$ (`FeatureMap.key_log_features` with
    ``shared=True``) and the state's $G$ give $G' = \max(G, s)$; the key enters as
    $\psi(k) e^{s - G'}$ and the state decays by the row gate ``g`` $= G - G'$ (0 for elu+1 and
    ReLU, whose key scale is 0), as in the torch step.

    Parameters
    ----------
    q, k : Tensor, shape (..., 1, d)
        One token, in the compute dtype, as `kernelapprox.RecurrentLinearAttention.step` prepares
        them (a padded key already zeroed).
    v : Tensor, shape (..., 1, dv)
    feature_map : FeatureMap
        A map with an fla form (`fla_mode` not ``None``).
    state : LinearAttentionState, optional
        ``kv`` (..., F, dv + 1), one or per-feature log-scales; ``None``: nothing seen yet. A
        contiguous float32 ``kv`` of the step's batch shape goes to fla without a copy.
    key_padding_mask : Tensor, optional
        Bool (..., 1), ``True`` where the token is padding: its key and value leave the state's
        content unchanged, its query reads it.
    eps : float, default 1e-6
        Denominator guard of signed maps (Taylor), as in `kernelapprox.linear_attention`.

    Returns
    -------
    out : Tensor, shape (..., 1, dv), float32 (the dtype of ``v`` where wider)
    state : LinearAttentionState
        ``kv`` (..., F, dv + 1) float32, fla's final state reshaped (no copy).

    Examples
    --------
    Runs where ``fla-core`` and a CUDA device are present (see ``docs/gpu.md``); the step of
    `kernelapprox.RecurrentLinearAttention` takes it there.
    """
    mode = fla_mode(feature_map)
    if mode is None:
        raise ValueError(f"{type(feature_map).__name__} has no fla form (see fla_mode)")
    kern = _recurrent_kernels()
    acc = torch.promote_types(torch.float32, v.dtype)
    ninf = float("-inf")
    dv = v.shape[-1]
    P = dv + 1
    pad = key_padding_mask
    v1 = with_ones(v).squeeze(-2).to(acc)  # (..., P)
    if pad is not None:
        v1 = v1.masked_fill(pad, 0.0)
    gate: torch.Tensor | None = None
    if mode == "gla":
        b = feature_map.query_log2_features(q)
        a = feature_map.key_log2_features(k)
        if a is None or b is None:
            raise ValueError(f"{type(feature_map).__name__} returned no log2 features")
        a, b = a.squeeze(-2).to(acc), b.squeeze(-2).to(acc)  # (..., F)
        if pad is not None:
            a = a.masked_fill(pad, ninf)
        Fd = a.shape[-1]
        with torch.no_grad():
            Xn = a.detach()
            if state is not None:
                z = state.kv[..., dv].detach().to(torch.float64)  # (..., F)
                ls2 = state.log_scale.detach().to(torch.float64).squeeze(-1) * (1.0 / _LN2)  # (..., F or 1)
                reached = z >= torch.finfo(torch.float32).tiny
                X = torch.where(reached, ls2 + torch.log2(z), ninf).to(acc)
                Xn = torch.maximum(X, Xn)
            ref = torch.where(Xn == ninf, 0.0, Xn)
            if state is not None:
                # the state's rows enter at the new scale: (l / ln 2 - X') in natural log; a feature
                # with nothing representable is emptied (the lowest float32 gate, e^g = 0)
                g2 = ls2 - ref.to(torch.float64)
                gate = torch.where(reached, g2 * _LN2, torch.finfo(acc).min).to(acc)
            top = (b.detach() + Xn).amax(dim=-1, keepdim=True)
            top = torch.where(top == ninf, 0.0, top)
        kk = torch.exp2(a - ref)
        kq = torch.exp2(b + Xn - top)
        log_scale = (ref.to(torch.float64) * _LN2).unsqueeze(-1)  # (..., F, 1)
    else:
        fq = feature_map.query_features(q).squeeze(-2).to(acc)  # (..., F)
        fk, s = feature_map.key_log_features(k, shared=True)  # (..., 1, F), (..., 1)
        if pad is not None:
            s = s.masked_fill(pad, ninf)
        Fd = fk.shape[-1]
        with torch.no_grad():
            G = s.detach()
            if state is not None:
                old = state.log_scale.detach().to(s.dtype).squeeze(-1)  # (..., 1)
                G = torch.maximum(old, G)
            G = torch.where(G == ninf, 0.0, G)
            if state is not None:
                gate = (old - G).to(acc)  # (..., 1)
        kk = fk.squeeze(-2).to(acc) * torch.exp(s - G).to(acc)
        kq = fq
        log_scale = G.unsqueeze(-1)  # (..., 1, 1)
    lead = broadcast_shapes(kq.shape[:-1], kk.shape[:-1], v1.shape[:-1],
                                  *(() if state is None else (state.kv.shape[:-2],)))
    N = math.prod(lead)

    def rows(x: torch.Tensor, width: int) -> torch.Tensor:
        """(..., width) -> fla's (N, T = 1, H = 1, width): a view where the shape is already ``lead``."""
        return x.expand(*lead, width).reshape(N, 1, 1, width)

    h0 = None if state is None else state.kv.expand(*lead, Fd, P).reshape(N, 1, Fd, P)
    if mode == "gla":
        o, ht = kern.fused_recurrent_gla(
            q=rows(kq, Fd), k=rows(kk, Fd), v=rows(v1, P), gk=None if gate is None else rows(gate, Fd),
            scale=1.0, initial_state=h0, output_final_state=True,
        )
    else:
        o, ht = kern.fused_recurrent_simple_gla(
            q=rows(kq, Fd), k=rows(kk, Fd), v=rows(v1, P),
            g=None if gate is None else gate.expand(*lead, 1).reshape(N, 1, 1),
            scale=1.0, initial_state=h0, output_final_state=True,
        )
    o = o.to(acc)
    out = normalise(o[..., :dv], o[..., dv:], feature_map.positive, eps).reshape(*lead, 1, dv)
    kv = ht.reshape(*lead, Fd, P)
    return out, LinearAttentionState(kv, log_scale.expand(*lead, *log_scale.shape[-2:]))
