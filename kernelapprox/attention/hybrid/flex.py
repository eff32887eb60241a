r"""Hybrid attention as a window softmax plus a delayed scan, merged in the log domain.

The exact part (window and sinks) is `torch.nn.attention.flex_attention` with a block mask of
the exact sets, returning its log-sum-exp $\ell_i = \log\sum_{j\in S_i} e^{q_i^\top k_j}$. The
remainder of a positive map is a causal linear attention read with a delay: causally, query $i$
reads the keys $j \le p(i)$ outside the sinks, $p(i) = i - w$ (token window) or
$p(i) = (\lfloor i/w\rfloor - 1)w - 1$ (block window), the last key that is not in its exact
set; non-causally, the same prefix plus the mirrored suffix (the global state minus the window).

The remainder is computed on natural-log features ($a_{jf} = \log\psi_f(k_j)$, $b_{if} =
\log\varphi_f(q_i)$, `log_features_pair`) with per-feature log-domain states, so no row
underflows whatever the norms: within a chunk of $C$ tokens the scores are exact log-sum-exps
$\lambda_{ij} = \log\sum_f e^{b_{if} + a_{jf}}$; across chunks the state before chunk $c$ is kept
as $\log\sum_{s<c}\sum_{j\in s} e^{a_{jf}} v_j^{\pm}$ (values split into positive and negative
parts, padded with a 1 for the normaliser) by one `torch.logcumsumexp` over the chunks. In exact
arithmetic this is the running per-feature maximum as a decay gate, $\tilde S_t =
e^{m_{t-1} - m_t}\tilde S_{t-1} + e^{a_t - m_t}[v_t, 1]^\top$; here it is evaluated with a fixed
number of tensor operations (no Python loop over chunks). Each query keeps its own shift
$\sigma_i$ (the largest of its log-scores); the two parts merge as

$$
o_i = \frac{e^{\ell_i - \mu_i} o^{\mathrm{win}}_i + e^{\sigma_i - \mu_i} N_i}
           {e^{\ell_i - \mu_i} + e^{\sigma_i - \mu_i} D_i},\qquad \mu_i = \max(\ell_i, \sigma_i).
$$

The shifts carry no gradient (they cancel). On CPU, eager ``flex_attention`` has a forward and
no backward: the path is taken on accelerators (`kernelapprox.backends.hybrid_path`) or when
forced.

`per_feature_causal` is the same merge for a causal segment that may continue a state (a
preceding window buffer, sinks before it, a linear state at per-feature scales, one more part of
the merge), with the window by ``flex_attention`` or in plain torch: `flex_hybrid_attention`
computes with it the causal calls given ``initial_state`` or ``return_state`` (and ``window = 0``),
so the accelerator's path carries a state with no host read; the causal CPU forms recompute with
it the rows whose normaliser underflows (`kernelapprox.attention.hybrid.rescue`).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..._validation import broadcast_shapes
from ...maps.base import FeatureMap
from .._common import with_ones
from ..linear.chunk_logscan import causal_log_scan
from .core import (
    HybridAttentionState,
    check_hybrid_eps,
    check_hybrid_state,
    check_window,
    check_window_mode,
    finish_state,
    per_feature_scales,
    per_feature_state,
    prepare_hybrid,
    resolve_sinks,
    softmax_path,
    state_batch,
)
from .logfeatures import log_features_pair

__all__ = ["flex_hybrid_attention", "per_feature_causal"]

_NEG = -1e30  # a finite "minus infinity": exp() of it is 0 and its gradients are finite


def _delayed_scan(lq: torch.Tensor, lk: torch.Tensor, v: torch.Tensor, delay: int, block: int, chunk: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Causal remainder read with a delay, per-feature log domain
    (`kernelapprox.attention.linear.chunk_logscan.causal_log_scan` on natural-log features).

    ``lq`` (L, n, F), ``lk`` (L, n, F) with ``_NEG`` for keys out of the remainder, ``v`` (L, n, dv).
    ``block == 0``: query ``i`` reads keys ``j <= i - delay``. ``block > 0``: query ``i`` reads the
    keys of the blocks ``<= i // block - 2`` (``chunk`` is then ``block``).

    Returns ``(num, den, sigma)``: the remainder's numerator (L, n, dv) and normaliser (L, n),
    both times ``exp(-sigma)``, and the shift ``sigma`` (L, n), detached; a row that reads no key
    has ``num = den = 0`` and ``sigma = -inf`` (weight 0 in `_merge`).
    """
    lk = lk.masked_fill(lk <= _NEG, float("-inf"))  # keys out of the remainder take no part
    res = causal_log_scan(lq, lk, v, log2=False, delay=0 if block else delay, block=block, chunk=chunk,
                          tile=chunk)  # exact scores within a chunk
    return res.num, res.den, res.shift


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Merge ``(num, den, shift)`` triples (true values ``exp(shift) * (num, den)``) into ``num / den``."""
    with torch.no_grad():
        mu = parts[0][2]
        for _, _, s in parts[1:]:
            mu = torch.maximum(mu, s)
    num = den = None
    for nm, dn, s in parts:
        wgt = torch.exp(s - mu)
        nm, dn = wgt.unsqueeze(-1) * nm, wgt * dn
        num = nm if num is None else num + nm
        den = dn if den is None else den + dn
    assert num is not None and den is not None
    return num / den.unsqueeze(-1)


#: Query and key tile of the block masks (flex_attention's default sparse block size).
FLEX_BLOCK = 128
_COMPILED_FLEX: list = []  # the compiled flex_attention, made on first use on an accelerator


def _flex_attention(q: torch.Tensor):
    """The flex_attention to call for queries ``q``: compiled (the fused Triton kernel, forward and
    backward) on accelerators for 16- and 32-bit inputs; the eager one on the CPU (where a compiled
    flex_attention returns no log-sum-exp), for float64 (verification) and inside a
    ``torch.compile`` region (which compiles it with the rest of the graph)."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu" or q.dtype == torch.float64 or torch.compiler.is_compiling():
        return flex_attention
    if not _COMPILED_FLEX:
        _COMPILED_FLEX.append(torch.compile(flex_attention))
    return _COMPILED_FLEX[0]


def exact_set_mask_mod(w: int, causal: bool, block: bool, offset: int, sink_pos: torch.Tensor | None,
                       pad: torch.Tensor | None, device: torch.device):
    """``mask_mod(b, h, i, j)`` of the exact sets for `flex_attention`: query ``i`` (its key position
    ``i + offset``) attends key ``j`` when ``j`` is in its token window (causal: ``i - w < j <= i``;
    else ``|i - j| < w``) or block window (blocks of ``w``: its own and the previous one, causal
    with ``j <= i``; else also the next), or is a sink (``sink_pos[j]``; causal: ``j <= i``), and
    is not padded (``pad[b, j]``). Works on index tensors as on ints."""
    # the offset as a device tensor: a compiled flex_attention recompiles for each new Python int
    # it closes over, and a prefill in segments has a new offset per segment
    off = torch.full((), offset, dtype=torch.int64, device=device) if offset else None

    def mask_mod(b, h, i, j):
        if off is not None:
            i = i + off
        if block:
            bd = i // w - j // w
            m = (bd >= 0) & (bd <= 1) & (i >= j) if causal else (bd <= 1) & (bd >= -1)
        else:
            m = ((i - j >= 0) & (i - j < w)) if causal else ((i - j < w) & (j - i < w))
        if sink_pos is not None:
            m = m | (sink_pos[j] & (i >= j)) if causal else m | sink_pos[j]
        if pad is not None:
            m = m & ~pad[b, j]
        return m

    return mask_mod


def window_block_mask(mask_mod, n: int, ne: int, w: int, causal: bool, block: bool, offset: int,
                      sink_pos: torch.Tensor | None, device: torch.device):
    r"""The `BlockMask` of the exact sets (window and sinks) built from their structure, without
    evaluating ``mask_mod`` on the $n \times n_e$ pairs (which `create_block_mask` does, materialising
    an $n \times n_e$ mask in eager mode: 4 GiB at $n = 65536$).

    Query tile $b$ (queries $i \in [bB, (b+1)B)$, key positions $i + $ ``offset``) lists every key
    tile that meets its window -- token window: keys $(i - w, i]$ causal, $|i - j| < w$ otherwise;
    block window of size $w$: key blocks $\lfloor i/w\rfloor - 1 \ldots \lfloor i/w\rfloor$ ($+1$
    non-causal) -- or holds a sink (causal: at a position $\le$ the tile's last query). Every tile
    is partial, so ``mask_mod`` decides each pair inside it: the tiles are a superset of the exact
    sets, and the result equals `create_block_mask`'s. $O((n/B)(n_e/B))$ booleans, no host read.

    Parameters
    ----------
    mask_mod : callable
        ``mask_mod(b, h, i, j)`` of the exact sets (query index ``i`` before ``offset``).
    n, ne : int
        Queries and keys (``ne = offset + n``).
    w : int
        Window (token) or block size (block).
    causal, block : bool
    offset : int
        Keys before the first query.
    sink_pos : Tensor of bool, shape (ne,), or None
    device : torch.device

    Returns
    -------
    torch.nn.attention.flex_attention.BlockMask
        Batch and head dimensions 1 (broadcast over the call's).
    """
    from torch.nn.attention.flex_attention import BlockMask

    B = FLEX_BLOCK
    nq, nk = -(-n // B), -(-ne // B)
    qb = torch.arange(nq, device=device)
    i_lo = qb * B + offset
    i_hi = torch.clamp((qb + 1) * B, max=n) - 1 + offset
    if block:
        ww = max(w, 1)
        lo = (i_lo // ww - 1) * ww
        hi = i_hi if causal else (i_hi // ww + 2) * ww - 1
    else:
        lo = i_lo - w + 1
        hi = i_hi if causal else i_hi + w - 1
    kb = torch.arange(nk, device=device)
    need = (kb * B <= hi.unsqueeze(-1)) & ((kb + 1) * B - 1 >= lo.unsqueeze(-1))  # (nq, nk)
    if sink_pos is not None:
        sink_tile = F.pad(sink_pos, (0, nk * B - ne)).reshape(nk, B)
        if causal:  # the first sink of a tile must come before the query tile's last query
            first = torch.where(sink_tile.any(-1), sink_tile.float().argmax(-1) + kb * B, ne)
            need = need | (first <= i_hi.unsqueeze(-1))
        else:
            need = need | sink_tile.any(-1)
    num = need.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~need).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # needed tiles first
    return BlockMask.from_kv_blocks(num[None, None], idx[None, None], BLOCK_SIZE=B, mask_mod=mask_mod,
                                    seq_lengths=(n, ne))


def _window_term(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, sink_pos: torch.Tensor | None,
                 causal: bool, block: bool, pad: torch.Tensor | None, offset: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """flex_attention over the exact sets: (out (L, n, dv), lse (L, n)). The queries ``q`` (L, n, d)
    are the last ``n`` of the ``offset + n`` keys ``k`` (L, offset + n, d) (``offset`` buffered keys
    of a preceding segment before them); ``sink_pos`` and ``pad`` index the keys."""
    L, n, _ = q.shape
    ne = k.shape[-2]
    mask_mod = exact_set_mask_mod(w, causal, block, offset, sink_pos, pad, q.device)
    bm = window_block_mask(mask_mod, n, ne, w, causal, block, offset, sink_pos, q.device)
    flex = _flex_attention(q)
    # the eager (unfused) flex_attention is taken on purpose on the CPU and for float64 only: its
    # advice to compile is silenced there (inside torch.compile nothing warns, and no filter may be set)
    quiet = contextlib.nullcontext() if torch.compiler.is_compiling() else warnings.catch_warnings()
    with quiet:
        if not torch.compiler.is_compiling():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        try:  # torch >= 2.9 asks for the log-sum-exp through return_aux
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:  # pragma: no cover - older torch
            out, lse = flex(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), block_mask=bm, scale=1.0,
                            return_lse=True)
        else:
            out, aux = flex(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), block_mask=bm, scale=1.0,
                            return_aux=AuxRequest(lse=True))
            assert aux.lse is not None
            lse = aux.lse
    lse = lse.squeeze(1).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return out.squeeze(1), lse.clamp(min=_NEG)


def _torch_window_term(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: int, sink_idx: tuple[int, ...],
                       causal: bool, block: bool, pad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The window term of `_window_term` in plain torch (with a backward on every device): the
    queries in blocks of ``w``, each against the keys of its own and neighbouring blocks (one
    dense ``w x 2w`` product, ``w x 3w`` non-causal) masked to the exact set, plus the sink keys
    outside those blocks. (out (L, n, dv), lse (L, n))."""
    L, n, _ = q.shape
    nb = -(-n // w)
    tail = nb * w - n
    nbr = 2 if causal else 3  # neighbouring blocks read: b-1, b (, b+1)

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (L, n, c) -> (L, nb, w, c)
        return F.pad(x, (0, 0, 0, tail)).reshape(L, nb, w, x.shape[-1])

    def windows(x: torch.Tensor) -> torch.Tensor:  # (L, n, c) -> (L, nb, nbr * w, c)
        xb = F.pad(blocks(x), (0, 0, 0, 0, 1, nbr - 2))
        return torch.cat([xb[:, s:s + nb] for s in range(nbr)], dim=2)

    i = torch.arange(nb * w, device=q.device).reshape(nb, w, 1)
    j = (torch.arange(nb, device=q.device)[:, None, None] - 1) * w + torch.arange(nbr * w, device=q.device)
    if block:
        bd = i // w - j.div(w, rounding_mode="floor")
        m = (bd <= 1) & (bd >= (0 if causal else -1))
    else:
        m = (i - j < w) & (j - i < w)
    m = m & (j >= 0) & (j < n)
    if causal:
        m = m & (j <= i)
    jc = j.clamp(0, n - 1)
    if sink_idx:
        is_sink = torch.zeros(n, dtype=torch.bool, device=q.device)
        is_sink[list(sink_idx)] = True
        m = m | (is_sink[jc] & (j >= 0) & (j < n) & ((j <= i) if causal else True))
    mb = m.expand(L, nb, w, nbr * w)
    if pad is not None:
        mb = mb & ~pad[:, jc]
    scores = (blocks(q) @ windows(k).transpose(-1, -2)).masked_fill(~mb, _NEG)  # (L, nb, w, nbr w)
    scores = scores.reshape(L, nb * w, nbr * w)
    if sink_idx:  # the sinks outside the neighbouring blocks
        idx = torch.tensor(sink_idx, device=q.device)
        ib = torch.arange(nb * w, device=q.device)[:, None] // w
        sb = idx[None, :] // w
        sm = (sb < ib - 1) | (sb > ib + nbr - 2)
        if causal:
            sm = sm & (idx[None, :] <= torch.arange(nb * w, device=q.device)[:, None])
        smb = sm.expand(L, nb * w, len(sink_idx))
        if pad is not None:
            smb = smb & ~pad[:, idx][:, None, :]
        qp = F.pad(q, (0, 0, 0, tail))
        scores = torch.cat([scores, (qp @ k[:, idx].transpose(-1, -2)).masked_fill(~smb, _NEG)], dim=-1)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse.unsqueeze(-1))
    width = nbr * w
    out = (p[..., :width].reshape(L, nb, w, width) @ windows(v)).reshape(L, nb * w, v.shape[-1])
    if sink_idx:
        out = out + p[..., width:] @ v[:, idx]
    return out[:, :n], lse[:, :n]


def flex_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    window_mode: str = "token",
    chunk_size: int = 16,
    window_term: str = "flex",
    initial_state: HybridAttentionState | None = None,
    return_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, HybridAttentionState]:
    r"""Hybrid attention of a positive map as ``flex_attention`` on the exact sets plus a delayed
    per-feature log-domain scan on the remainder (module docstring), one normaliser.

    $$
    \hat o_i = \frac{\sum_{j\in S_i} e^{q_i^\top k_j} v_j + \varphi(q_i)^\top\sum_{j\in R_i}\psi(k_j)v_j^\top}
    {\sum_{j\in S_i} e^{q_i^\top k_j} + \varphi(q_i)^\top\sum_{j\in R_i}\psi(k_j)}
    $$

    with the exact sets $S_i$ of `kernelapprox.attention.hybrid.exact_set_mask`; the same
    result as `kernelapprox.attention.hybrid.hybrid_attention`.

    A causal token-window call may continue a segment (``initial_state``) and return its state
    (``return_state``), as `kernelapprox.attention.hybrid.chunk_hybrid_attention` does, with no
    host read and a fixed number of operations whatever ``n``: the keys are the state's window
    buffer followed by the new ones, the sinks that left the buffer are exact for every query,
    and the carried linear state, read at one scale per feature
    (`kernelapprox.attention.hybrid.core.per_feature_scales`), is one more part of the merge,
    $e^{\log\varphi_f(q_i) + X_f}\tilde S_f$ under the row's largest exponent
    (`per_feature_causal`). The returned state holds the linear part at per-feature scales
    (``log_scale`` (..., F, 1), from the keys' log-features), so that a later segment or a
    decoder reads every feature. No row's normaliser underflows, with or without a state.

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
        A positive map (``feature_map.positive``).
    window : int
        ``w >= 1`` (causal: ``w >= 0``; ``0`` is the remainder alone, the sinks exact).
    sinks : int or sequence of int, default 0
    causal : bool, default False
    key_padding_mask : Tensor, shape (batch, n), optional
    window_mode : {"token", "block"}, default "token"
    chunk_size : int, default 16
        Tokens per chunk of the remainder's scan (token window); the block window uses ``w``.
    window_term : {"flex", "torch"}, default "flex"
        ``"flex"``: the window and sinks by ``flex_attention``; ``"torch"``: by a masked band of
        keys in plain torch (a backward on the CPU too; the causal torch path of positive maps).
    initial_state : HybridAttentionState, optional
        Causal token window only: the state after a preceding segment (one scale or one per
        feature), built with the same ``window`` and sinks; ``sinks`` positions continue its count.
    return_state : bool, default False
        Causal token window only, not with ``key_padding_mask``: also return the state after the
        last token.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : HybridAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = (torch.randn(3, 2, 40, 8, dtype=torch.float64) / 2).unbind(0)
    >>> fm = ka.PositiveRF(dim=8, num_features=16, seed=0, dtype=torch.float64)
    >>> out = flex_hybrid_attention(q, k, v, fm, window=5, sinks=1, causal=True)
    >>> ref = ka.attention.hybrid.naive_hybrid_attention(q, k, v, fm, window=5, sinks=1, causal=True)
    >>> bool((out - ref).abs().max() < 1e-10)
    True

    A prefill in two segments, the state carried between them:

    >>> a, st = flex_hybrid_attention(q[:, :17], k[:, :17], v[:, :17], fm, window=5, sinks=1, causal=True,
    ...                               return_state=True)
    >>> b = flex_hybrid_attention(q[:, 17:], k[:, 17:], v[:, 17:], fm, window=5, sinks=1, causal=True,
    ...                           initial_state=st)
    >>> bool((torch.cat([a, b], dim=1) - ref).abs().max() < 1e-10), st.log_scale.shape
    (True, torch.Size([2, 16, 1]))
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {return_state!r}")
    mode = check_window_mode(window_mode)
    check_hybrid_eps(1e-6)
    stateful = initial_state is not None or return_state
    if stateful and not causal:
        raise ValueError(
            "initial_state and return_state need causal=True (a non-causal window has no state to carry), "
            f"got initial_state={type(initial_state).__name__}, return_state={return_state!r}"
        )
    if stateful and mode == "block" and check_window(window) > 0:
        raise ValueError(
            "window_mode='block' has no state to carry (the recurrent form slides its window): use "
            f"window_mode='token', got initial_state={type(initial_state).__name__}, return_state={return_state!r}"
        )
    if window_term not in ("flex", "torch"):
        raise ValueError(f"window_term must be 'flex' or 'torch', got {window_term!r}")
    q, k, v, out_dtype, cdt, w, C, kpad = prepare_hybrid(q, k, v, feature_map, window, sinks, chunk_size, causal,
                                                   key_padding_mask)
    if not feature_map.positive:
        raise ValueError(f"flex_hybrid_attention needs a positive feature map, got {type(feature_map).__name__}")
    if w < (0 if causal else 1):
        raise ValueError(f"flex_hybrid_attention needs window >= 1 (causal: >= 0), got {w}")
    if stateful or w == 0:  # a segment with a state, or the causal remainder alone (sinks exact)
        if return_state and kpad is not None:
            raise ValueError(
                "return_state=True with a key_padding_mask: the state's window buffer would hold padded keys; "
                "decode unpadded sequences (or drop return_state)"
            )
        return _segment(q, k, v, feature_map, w, sinks, kpad, initial_state, return_state, window_term, cdt,
                        out_dtype)
    n = q.shape[-2]
    if w >= n:
        return softmax_path(q, k, v, feature_map, causal, kpad, out_dtype)
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], feature_map.batch_shape)
    if math.prod(lead) == 0:
        return q.new_zeros(*lead, n, v.shape[-1]).to(out_dtype)
    lq, lk = log_features_pair(feature_map, q, k)
    lq, lk = lq.to(cdt), lk.to(cdt)
    d, dv, Fd = q.shape[-1], v.shape[-1], lq.shape[-1]
    Lb = math.prod(lead)

    def flat(x: torch.Tensor, c: int) -> torch.Tensor:
        return x.expand(*lead, n, c).reshape(Lb, n, c)

    qf, kf, vf = flat(q, d), flat(k, d), flat(v, dv)
    lqf, lkf = flat(lq, Fd), flat(lk, Fd)
    # keys out of the remainder: sinks and padding
    if causal:
        from .sinks import CausalSinks

        sink_idx: tuple[int, ...] = CausalSinks(sinks).within(0, n)
    else:
        sink_idx = resolve_sinks(sinks, n, causal=False)
    sink_pos = None
    drop = torch.zeros(n, dtype=torch.bool, device=q.device)
    if sink_idx:
        sink_pos = torch.zeros(n, dtype=torch.bool, device=q.device)
        sink_pos[list(sink_idx)] = True
        drop = drop | sink_pos
    padf = None
    dropf = drop.expand(Lb, n)
    if kpad is not None:
        padf = kpad.expand(*lead, n).reshape(Lb, n)
        dropf = dropf | padf
    lkf = lkf.masked_fill(dropf.unsqueeze(-1), _NEG).clamp(min=_NEG)
    lqf = lqf.clamp(min=_NEG)
    if window_term == "flex":
        out_w, lse = _window_term(qf, kf, vf, w, sink_pos, causal, mode == "block", padf)
    elif window_term == "torch":
        out_w, lse = _torch_window_term(qf, kf, vf, w, sink_idx, causal, mode == "block", padf)
    else:
        raise ValueError(f"window_term must be 'flex' or 'torch', got {window_term!r}")
    blk = w if mode == "block" else 0
    parts = [(out_w.to(cdt), torch.ones_like(lse), lse)]
    parts.append(_delayed_scan(lqf, lkf, vf, w, blk, C))
    if not causal:  # the mirrored suffix: keys j >= i + w (token), blocks >= b(i) + 2 (block)
        if blk:  # reverse within whole blocks: pad the end to a multiple of w, flip, read, flip back
            tail = -(-n // w) * w - n
            rq = F.pad(lqf, (0, 0, 0, tail), value=_NEG).flip(1)
            rk = F.pad(lkf, (0, 0, 0, tail), value=_NEG).flip(1)
            rv = F.pad(vf, (0, 0, 0, tail)).flip(1)
            nm, dn, s = _delayed_scan(rq, rk, rv, w, blk, C)
            parts.append((nm.flip(1)[:, :n], dn.flip(1)[:, :n], s.flip(1)[:, :n]))
        else:
            nm, dn, s = _delayed_scan(lqf.flip(1), lkf.flip(1), vf.flip(1), w, 0, C)
            parts.append((nm.flip(1), dn.flip(1), s.flip(1)))
    out = _merge(parts)
    return out.reshape(*lead, n, dv).to(out_dtype)


def _segment(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, w: int, sinks: int | Sequence[int],
    kpad: torch.Tensor | None, st: HybridAttentionState | None, return_state: bool, window_term: str,
    cdt: torch.dtype, out_dtype: torch.dtype,
) -> torch.Tensor | tuple[torch.Tensor, HybridAttentionState]:
    """A causal token-window segment that continues ``st`` and/or returns its state
    (`flex_hybrid_attention`): `per_feature_causal` on [the state's window buffer, the new keys]."""
    from .sinks import CausalSinks

    spec = CausalSinks(sinks)
    n, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], fm.batch_shape)
    t0 = b = 0
    ext_sinks: list[int] = []  # sink positions among the extended keys (buffer, then the new keys)
    old = carried = None
    if st is not None:
        check_hybrid_state(st, fm, w, d, dv, spec)
        state_batch(st, lead)
        t0 = st.position
        b = min(w, t0)
        if b:  # the buffered keys in order of position: the key of position p is in slot p mod w
            slots = [p % w for p in range(t0 - b, t0)]
            k = torch.cat((st.keys[..., slots, :].to(cdt).expand(*lead, b, d), k.expand(*lead, n, d)), dim=-2)
            v = torch.cat((st.values[..., slots, :].to(cdt).expand(*lead, b, dv), v.expand(*lead, n, dv)), dim=-2)
        gone = [u for u, p in enumerate(st.sink_positions) if p < t0 - b]  # sinks before the buffer
        ext_sinks += [p - (t0 - b) for p in st.sink_positions if p >= t0 - b]
        if gone:
            old = (st.sink_keys[..., gone, :].to(cdt), st.sink_values[..., gone, :].to(cdt))
        carried = per_feature_scales(st, cdt)
    sink_idx = spec.within(t0, t0 + n)
    ext_sinks += [p - t0 + b for p in sink_idx]
    ne = b + n
    k, v = k.expand(*lead, ne, d), v.expand(*lead, ne, dv)
    Lb = math.prod(lead)
    if Lb == 0:  # an empty batch: the chunked form (nothing to compute)
        from .core import chunk_hybrid_attention

        return chunk_hybrid_attention(q, k[..., b:, :], v[..., b:, :], fm, window=w, sinks=sinks,
                                      initial_state=st, return_state=return_state, key_padding_mask=kpad)
    lq, lk = log_features_pair(fm, q, k)
    lq, lk = lq.to(cdt), lk.to(cdt)
    Fd = lq.shape[-1]

    def flat(x: torch.Tensor, *shape: int) -> torch.Tensor:
        return x.expand(*lead, *shape).reshape(Lb, *shape)

    pad = None if kpad is None else flat(F.pad(kpad.expand(*lead, n), (b, 0), value=False), ne)
    old_f = None
    if old is not None:
        ns = old[0].shape[-2]
        old_f = (flat(old[0], ns, d), flat(old[1], ns, dv))
    state_f = None if carried is None else (flat(carried[0], Fd, dv + 1), flat(carried[1], Fd))
    out = per_feature_causal(flat(q, n, d), flat(k, ne, d), flat(v, ne, dv), flat(lq, n, Fd), flat(lk, ne, Fd),
                             window=w, block=False, sinks=tuple(ext_sinks), pad=pad, old_sinks=old_f, state=state_f,
                             window_term=window_term)
    out = out.reshape(*lead, n, dv).to(out_dtype)
    if not return_state:
        return out
    # the linear part after the last token: the keys e <= ne - 1 - w outside the sinks, and the
    # carried state, at per-feature scales (from the keys' log-features: no host read)
    rem = torch.zeros(ne, dtype=torch.float64, device=q.device)
    if ext_sinks:
        rem[ext_sinks] = float("-inf")
    kv, log_scale = per_feature_state(fm, k, with_ones(v), rem.expand(*lead, ne), ne - w, st, cdt,
                                       key_logs=lk.expand(*lead, ne, Fd))
    return out, finish_state(kv, log_scale, k, v, t0, b, n, w, sink_idx, st, cdt)


_RESCUE_CHUNK = 16  # tokens per chunk of the delayed scan in `per_feature_causal`


def _exact_part(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, active: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax of ``q`` (L, n, d) over ``keys`` (L, s, d) where ``active`` (broadcasting with
    (L, n, s)): ``(out, 1, lse)`` as `_merge` takes it."""
    logits = torch.matmul(q, keys.mT).masked_fill(~active, _NEG)
    lse = torch.logsumexp(logits, dim=-1)
    out = torch.matmul(torch.exp(logits - lse.unsqueeze(-1)), values)
    return out, torch.ones_like(lse), lse


def per_feature_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lq: torch.Tensor, lk: torch.Tensor, *, window: int,
    block: bool, sinks: tuple[int, ...], pad: torch.Tensor | None,
    old_sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
    window_term: str = "torch",
) -> torch.Tensor:
    r"""Causal hybrid attention of a positive map in the log domain, no scale shared between features.

    The queries are the last ``n`` of the ``ne`` keys (the first ``b = ne - n`` are a preceding
    segment's window buffer). Query $e = b + i$ merges, under one shift, the exact part on its
    window (``window_mode`` token: $0 \le e - e' < w$; block: $0 \le \lfloor e/w\rfloor -
    \lfloor e'/w\rfloor \le 1$) and the ``sinks`` $e' \le e$ (log-sum-exp $\ell_i$), the
    sinks before the buffer (``old_sinks``, exact for every query), the remainder
    $\sum_f \varphi_f(q_i)\sum_{e' \le p(e),\, e'\notin\Sigma}\psi_f(k_{e'})[v_{e'}, 1]$ by the
    per-feature delayed scan, and a carried state
    $\sum_f e^{\log\varphi_f(q_i) + X_f}\,\tilde S_f$ ($\tilde S_f$ with unit mass per reached
    feature, $X_f$ its log-scale):

    $$
    o_i = \frac{\sum_p e^{\sigma_{p,i} - \mu_i} N_{p,i}}{\sum_p e^{\sigma_{p,i} - \mu_i} D_{p,i}},
    \qquad \mu_i = \max_p \sigma_{p,i},
    $$

    each part $p$ with a term 1 at its own shift $\sigma_{p,i}$, so the denominator is $\ge 1$
    for a row with any key. Differentiable (the shifts are constants).

    Parameters
    ----------
    q : Tensor, shape (L, n, d)
    k : Tensor, shape (L, ne, d)
    v : Tensor, shape (L, ne, dv)
        Finite values.
    lq : Tensor, shape (L, n, F)
        Natural-log query features on the absolute scale (`log_features_pair`).
    lk : Tensor, shape (L, ne, F)
        Natural-log key features.
    window : int
        ``w >= 0`` (``0``: no window; ``block`` needs ``w >= 1``).
    block : bool
        The block window.
    sinks : tuple of int
        Sink positions among the ``ne`` keys.
    pad : Tensor, shape (L, ne), bool, or None
        Padded keys.
    old_sinks : (Tensor (L, s, d), Tensor (L, s, dv)), optional
    state : (Tensor (L, F, dv + 1), Tensor (L, F)), optional
        $\tilde S$ and $X$ ($-\infty$ or any value where $\tilde S_f = 0$).
    window_term : {"torch", "flex"}, default "torch"
        The window and sinks in plain torch (a backward on every device), or by one
        ``flex_attention`` call (the accelerator's path); the same result.

    Returns
    -------
    Tensor, shape (L, n, dv)
    """
    L, n, d = q.shape
    ne = k.shape[-2]
    b = ne - n
    w = window if block else min(window, ne)  # a token window longer than the keys is all of them
    dev = q.device
    drop = torch.zeros(ne, dtype=torch.bool, device=dev)
    if sinks:
        drop[list(sinks)] = True
    drop = drop.expand(L, ne) if pad is None else drop | pad
    lkm = lk.masked_fill(drop.unsqueeze(-1), _NEG).clamp(min=_NEG)
    lqe = F.pad(lq.clamp(min=_NEG), (0, 0, b, 0), value=_NEG)
    parts = []
    if w >= 1 and window_term == "flex":
        sink_pos = None
        if sinks:
            sink_pos = torch.zeros(ne, dtype=torch.bool, device=dev)
            sink_pos[list(sinks)] = True
        out_w, lse = _window_term(q, k, v, w, sink_pos, True, block, pad, offset=b)
        parts.append((out_w.to(q.dtype), torch.ones_like(lse), lse))
    elif w >= 1:
        out_w, lse = _torch_window_term(F.pad(q, (0, 0, b, 0)), k, v, w, sinks, True, block, pad)
        parts.append((out_w[:, b:], torch.ones_like(lse[:, b:]), lse[:, b:]))
    elif sinks:  # no window: the sinks e' <= e are the exact part
        sidx = torch.tensor(sinks, device=dev)
        active = (b + torch.arange(n, device=dev))[:, None] >= sidx[None, :]
        if pad is not None:
            active = active & ~pad[:, sidx].unsqueeze(-2)
        parts.append(_exact_part(q, k[:, sidx], v[:, sidx], active))
    num, den, sig = _delayed_scan(lqe, lkm, v, w, w if block else 0, _RESCUE_CHUNK)
    parts.append((num[:, b:], den[:, b:], sig[:, b:]))
    if old_sinks is not None:
        sk, sv = old_sinks
        parts.append(_exact_part(q, sk, sv, torch.ones(1, 1, sk.shape[-2], dtype=torch.bool, device=dev)))
    if state is not None:
        kv, X = state
        a = (lq + X.to(lq.dtype).unsqueeze(-2)).clamp(min=_NEG)  # (L, n, F)
        with torch.no_grad():
            s = a.detach().amax(dim=-1)
        out = torch.matmul(torch.exp(a - s.unsqueeze(-1)), kv.to(lq.dtype))
        parts.append((out[..., :-1], out[..., -1], s))
    return _merge(parts)
