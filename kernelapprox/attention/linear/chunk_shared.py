r"""Causal linear attention, chunk-wise, with one key scale shared by each group of chunks.

Keys enter as $\psi(k_j) = f_j e^{s_j}$ (features and one log-scale per key,
`FeatureMap.key_log_features`). Chunks of $C$ tokens are taken in groups; group $g$ works at the
reference $R_g$ = the largest key log-scale *before* the group (the initial state's, or the first
key's, for the first group): a scale every query of the group has already seen, so a later key
never shifts an earlier output's scale, and each query's own running maximum is $\ge R_g$. Keys
are weighted $w_j = e^{s_j - R_g}$, which is safe while no key exceeds its reference by more than
`_SPREAD` (30) nats (no overflow, and nothing a query depends on can underflow; `clean_mask`
finds where that holds). The chunk states are then a plain prefix sum. With
$W_c = [w \circ V_c, w_c]$ and the state entering the group $S_{\text{in}}$ (brought to $R_g$ by
$e^{R_{g-1} - R_g}$), for every chunk $c$ of the group

$$
Y_c = S_{\text{in}} + \sum_{c' < c} \varphi(K_{c'})^\top W_{c'}, \qquad
O_c = \varphi(Q_c)\, Y_c + \operatorname{tril}\big(\varphi(Q_c)\varphi(K_c)^\top\big) W_c ,
$$

the states $Y$ by one batched GEMM and one in-place scan over chunks, the products by batched
GEMMs (`chunked_forward`).

The backward (`ChunkedCausal`) saves the inputs only and recomputes: the states entering each
group by forward re-accumulation (one $F \times d_v$ state per group), then, group by group in
reverse, the states $Y_c$ (for $\partial\varphi(Q)$) and the reverse accumulation
$T_c = \partial S_{\text{out}} + \sum_{c' > c} \varphi(Q_{c'})^\top \partial O_{c'}$ (for
$\partial\varphi(K)$ and $\partial W$), the standard linear-attention backward [Kat20]_
(flash-linear-attention's chunked kernels [Yan24]_ do the same on GPUs). Nothing of size
$n_c \times F \times d_v$ outlives its group; autograd through the forward would keep every
intra-chunk score and state (the group stacks are bounded by the size of the features).

Groups have a fixed number of chunks (`group_chunks`: their states never outweigh the features of
`_GROUP_TOKENS` tokens), capped by the sequence's own chunk count, so that a prefix of a sequence
is cut into the same groups as the whole sequence and a short sequence pays for its own tokens
only.

References
----------
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
   autoregressive transformers with linear attention", ICML 2020 (Section 3.3.1, the gradients
   of causal linear attention by cumulative sums).
.. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers with
   hardware-efficient training", ICML 2024 (the chunk-wise form).
.. [Ble90] G. E. Blelloch. "Prefix sums and their applications", Technical Report
   CMU-CS-90-190, 1990.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..state import LinearAttentionState

# Largest excess (in nats) of a key log-scale over its group's reference scale for which this
# path runs: key weights stay <= e^30 (no overflow in float32, whose range is e^88), and every
# query's own running maximum is >= the reference, so nothing it depends on underflows.
_SPREAD = 30.0

# Tokens whose features a group's stack of chunk states may match: groups have a fixed number of
# chunks (so a prefix of a sequence is cut into the same groups as the whole sequence).
_GROUP_TOKENS = 16384


def _flat(t: torch.Tensor) -> torch.Tensor:
    """(L, g, a, b) -> (L * g, a, b): a view when ``t`` is contiguous, else a copy."""
    return t.reshape(-1, *t.shape[-2:])


def _scan_(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    r"""In-place inclusive prefix sums along dim 1 (suffix sums if ``reverse``).

    The work-efficient two-sweep scan [Ble90]_: $2\lceil\log_2 g\rceil$ strided in-place
    additions over whole chunk states, each element added once per sweep (``torch.cumsum``
    along a middle dimension is several times slower on CPU, and there is no reverse cumsum).
    Element $i$ only ever receives elements before it (after it if ``reverse``)."""
    g = x.shape[1]
    d = 1
    while d < g:  # up-sweep: x[i] += x[i - d] for i = 2d - 1, 4d - 1, ...
        if reverse:  # the mirror image j = g - 1 - i, as an increasing progression
            if g >= 2 * d:
                a = (g - 2 * d) % (2 * d)
                x[:, a:g - 2 * d + 1:2 * d] += x[:, a + d:g - d + 1:2 * d]
        else:
            x[:, 2 * d - 1::2 * d] += x[:, d - 1:g - d:2 * d]
        d *= 2
    d //= 2
    while d >= 1:  # down-sweep: x[i] += x[i - d] for i = 3d - 1, 5d - 1, ...
        if reverse:
            if g >= 3 * d:
                a = (g - 3 * d) % (2 * d)
                x[:, a:g - 3 * d + 1:2 * d] += x[:, a + d:g - 2 * d + 1:2 * d]
        else:
            x[:, 3 * d - 1::2 * d] += x[:, 2 * d - 1:g - d:2 * d]
        d //= 2
    return x


def _inclusive_states(S: torch.Tensor, fk: torch.Tensor, vw: torch.Tensor) -> torch.Tensor:
    """States after each chunk of a group, (L, g, F, dv1): ``S + kv_0 + ... + kv_c`` with
    ``kv_c = fk_c^T vw_c``, by one batched GEMM and one in-place scan over chunks."""
    kv = torch.matmul(fk.mT, vw)
    kv[:, 0] += S
    return _scan_(kv)


def _add_shifted(o: torch.Tensor, x: torch.Tensor, y: torch.Tensor, edge: torch.Tensor, last: bool) -> None:
    """``o[:, c] += x[:, c] @ y[:, c - 1]`` (or ``y[:, c + 1]`` if ``last``) for all chunks, with
    ``edge`` (L, a, b) in place of the missing neighbour of the first (last) chunk; all (L, g, ., .).

    In the flattened batch (L * g) the neighbour is one batch entry away, so one GEMM on views does
    every chunk; the rows of the edge chunk (which that GEMM pairs with another head's state) are
    then recomputed from their saved value."""
    L, g = o.shape[:2]
    o3, x3, y3 = (t.view(L * g, *t.shape[-2:]) for t in (o, x, y))
    e = -1 if last else 0
    fixed = o[:, e].baddbmm(x[:, e], edge)
    if g > 1:
        if last:
            o3[:-1].baddbmm_(x3[:-1], y3[1:])
        else:
            o3[1:].baddbmm_(x3[1:], y3[:-1])
    o[:, e] = fixed


#: Bytes of chunk states formed at once in the forward: the sequences (L) are taken in blocks
#: whose states fit this budget, so that these buffers are reused from the heap and stay in the
#: last-level cache instead of being fresh, page-faulting allocations of the whole batch.
_BLOCK_BYTES = 8 * 2**20


def chunked_forward(
    fq: torch.Tensor, fk: torch.Tensor, vw: torch.Tensor, S: torch.Tensor,
    decay: tuple[torch.Tensor | None, ...], bounds: tuple[tuple[int, int], ...], mask: torch.Tensor,
    overwrite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``O`` (L, nc, C, dv1) and the final state (L, F, dv1); see the module docstring.

    The sequences are processed in blocks of ``Lb`` whose chunk states, ``Lb x g x F x dv1``
    for the largest group ``g``, fit `_BLOCK_BYTES` (every sequence is independent; the values
    are those of one block of all ``L``). ``overwrite`` (no autograd, ``vw`` contiguous and
    owned by the caller): ``O`` is written into the memory of ``vw``, each block once its
    values are no longer read (one fresh (L, n, dv1) buffer less)."""
    L, nc, C, dv1 = vw.shape
    if L == 0:  # empty batch: nothing to accumulate (the blocks below would be an empty list)
        return vw.new_zeros(vw.shape), S.clone()
    g_max = max(b - a for a, b in bounds)
    per_seq = g_max * fq.shape[-1] * dv1 * fq.element_size()
    block = max(1, _BLOCK_BYTES // per_seq)
    if block >= L and not overwrite:
        return _forward_block(fq, fk, vw, S, decay, bounds, mask)
    if overwrite and len(bounds) == 1 and vw.is_contiguous():
        # one group: block l's O is formed in a block-sized scratch buffer (reused from the heap)
        # and copied over block l of vw, which nothing reads afterwards
        S_out = []
        for l0 in range(0, L, block):
            l1 = min(L, l0 + block)
            dec = tuple(None if d is None else d[l0:l1] for d in decay)
            o, S_b = _forward_block(fq[l0:l1], fk[l0:l1], vw[l0:l1], S[l0:l1], dec, bounds, mask)
            vw[l0:l1] = o
            del o
            S_out.append(S_b)
        return vw, torch.cat(S_out, dim=0)
    out = vw.new_empty(L, nc, C, dv1)
    S_out = []
    for l0 in range(0, L, block):
        l1 = min(L, l0 + block)
        dec = tuple(None if d is None else d[l0:l1] for d in decay)
        o, S_b = _forward_block(fq[l0:l1], fk[l0:l1], vw[l0:l1], S[l0:l1], dec, bounds, mask, out=out[l0:l1])
        S_out.append(S_b)
    return out, torch.cat(S_out, dim=0)


def _forward_block(
    fq: torch.Tensor, fk: torch.Tensor, vw: torch.Tensor, S: torch.Tensor,
    decay: tuple[torch.Tensor | None, ...], bounds: tuple[tuple[int, int], ...], mask: torch.Tensor,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_forward` on one block of sequences; written into ``out`` (Lb, nc, C, dv1) if given."""
    L, _, C, _ = fq.shape
    outs = []
    for gi, (a, b) in enumerate(bounds):
        dec = decay[gi]
        if dec is not None:
            S = S * dec
        fq_g, fk_g, vw_g = (t[:, a:b].contiguous() for t in (fq, fk, vw))  # views for one group
        incl = _inclusive_states(S, fk_g, vw_g)
        A = torch.bmm(_flat(fq_g), _flat(fk_g).mT).masked_fill_(~mask, 0.0)  # causal scores
        if out is not None and out[:, a:b].is_contiguous():
            o = out[:, a:b]
            torch.bmm(A, _flat(vw_g), out=o.view(L * (b - a), C, -1))
        else:
            o = torch.bmm(A, _flat(vw_g)).view(L, b - a, C, -1)
        del A
        _add_shifted(o, fq_g, incl, S, last=False)  # + fq_c Y_c, Y_c = state entering chunk c
        S = incl[:, -1].clone()
        if out is not None and o.data_ptr() != out[:, a:b].data_ptr():
            out[:, a:b] = o
        outs.append(o)
    if out is not None:
        return out, S
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), S


def chunked_backward(
    fq: torch.Tensor, fk: torch.Tensor, vw: torch.Tensor, S0: torch.Tensor,
    decay: tuple[torch.Tensor | None, ...], bounds: tuple[tuple[int, int], ...], mask: torch.Tensor,
    dout: torch.Tensor, dS: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `chunked_forward` w.r.t. ``fq, fk, vw, S0`` by recomputation (module docstring)."""
    if fq.shape[0] == 0:  # empty batch
        return torch.zeros_like(fq), torch.zeros_like(fk), torch.zeros_like(vw), torch.zeros_like(S0)
    # forward re-accumulation: the state entering each group (one F x dv1 state per group)
    S_in = []
    S = S0
    for gi, (a, b) in enumerate(bounds):
        dec = decay[gi]
        if dec is not None:
            S = S * dec
        S_in.append(S)
        if gi + 1 < len(bounds):
            S = _inclusive_states(S, fk[:, a:b], vw[:, a:b])[:, -1].clone()
    grads = []
    L, _, C, _ = fq.shape
    for gi in reversed(range(len(bounds))):
        a, b = bounds[gi]
        g = b - a
        fq_g, fk_g, vw_g, do_g = (t[:, a:b].contiguous() for t in (fq, fk, vw, dout))
        fq3, fk3, vw3, do3 = (_flat(t) for t in (fq_g, fk_g, vw_g, do_g))
        # intra-chunk part: A = tril(fq fk^T), O += A W
        A = torch.bmm(fq3, fk3.mT).masked_fill_(~mask, 0.0)
        dA = torch.bmm(do3, vw3.mT).masked_fill_(~mask, 0.0)
        dvw_g = torch.bmm(A.mT, do3).view(L, g, C, -1)
        del A
        dfk_g = torch.bmm(dA.mT, fq3).view(L, g, C, -1)
        dfq_g = torch.bmm(dA, fk3).view(L, g, C, -1)
        del dA
        # prefix states: dfq_c += dO_c Y_c^T
        incl = _inclusive_states(S_in[gi], fk_g, vw_g)
        _add_shifted(dfq_g, do_g, incl.mT, S_in[gi].mT, last=False)
        del incl
        # reverse accumulation: T_c = dS_out + sum_{c' > c} fq_{c'}^T dO_{c'} = U_{c+1}, with the
        # suffix sums U_c = dS_out + sum_{c' >= c} fq_{c'}^T dO_{c'}
        dS_out = dS
        U = torch.bmm(fq3.mT, do3).view(L, g, *S0.shape[-2:])
        U[:, -1] += dS_out
        _scan_(U, reverse=True)
        dS = U[:, 0].clone()  # gradient of the state entering the group
        _add_shifted(dfk_g, vw_g, U.mT, dS_out.mT, last=True)  # kv_c = fk_c^T W_c receives T_c
        _add_shifted(dvw_g, fk_g, U, dS_out, last=True)
        del U
        grads.append((dfq_g, dfk_g, dvw_g))
        dec = decay[gi]
        if dec is not None:
            dS = dS * dec
    grads.reverse()
    if len(grads) == 1:
        return (*grads[0], dS)
    dfq, dfk, dvw = (torch.cat(gs, dim=1) for gs in zip(*grads, strict=True))
    return dfq, dfk, dvw, dS


class ChunkedCausal(torch.autograd.Function):
    """`chunked_forward` with a backward that saves only its inputs (`chunked_backward`)."""

    @staticmethod
    def forward(ctx, fq, fk, vw, S0, decay, bounds, mask):  # noqa: D102
        out, S = chunked_forward(fq, fk, vw, S0, decay, bounds, mask)
        ctx.save_for_backward(fq, fk, vw, S0, mask)
        ctx.decay, ctx.bounds = decay, bounds
        return out, S

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dS):  # noqa: D102
        fq, fk, vw, S0, mask = ctx.saved_tensors
        dfq, dfk, dvw, dS0 = chunked_backward(fq, fk, vw, S0, ctx.decay, ctx.bounds, mask,
                                              dout.contiguous(), dS)
        return dfq, dfk, dvw, dS0 if ctx.needs_input_grad[3] else None, None, None, None


def group_chunks(Fd: int, dv1: int) -> int:
    r"""Chunks per group: their states ($F \times d_v+1$ each) never outweigh the features
    ($F + d_v + 1$ per token) of ``_GROUP_TOKENS`` tokens."""
    return max(1, (_GROUP_TOKENS * (Fd + dv1)) // (Fd * dv1))


def _per_token(R: torch.Tensor, span: int, n: int) -> torch.Tensor:
    """Group references (L, groups) repeated over the ``span`` tokens of each group, (L, n); with
    one group, the (L, 1) column itself (it broadcasts: no per-token copy)."""
    if R.shape[-1] == 1:
        return R
    return R.repeat_interleave(span, dim=-1)[:, :n]


def _references(
    sd: torch.Tensor, span: int, initial_state: LinearAttentionState | None, lead: torch.Size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per group of ``span`` tokens of ``sd`` (L, n): its largest key log-scale ``gmax`` and the
    reference ``R`` = the largest before it (initial state and first key for the first group),
    both (L, groups); and the initial state's scale (L, 1) or ``None``."""
    L = sd.shape[0]
    R0, G0 = sd[:, :1], None
    if initial_state is not None:
        ls = initial_state.log_scale.detach().to(sd.dtype)
        G0 = ls.reshape(*ls.shape[:-2], 1).expand(*lead, 1).reshape(L, 1)
        R0 = torch.maximum(R0, G0)
    gmax = torch.stack([sd[:, a:a + span].amax(-1) for a in range(0, sd.shape[-1], span)], dim=-1)
    R = torch.cummax(torch.cat((R0, gmax[:, :-1]), dim=-1), dim=-1).values
    return gmax, R, G0


def row_scales(
    s: torch.Tensor, Fd: int, dv1: int, C: int, initial_state: LinearAttentionState | None, lead: torch.Size
) -> torch.Tensor:
    r"""Each token's scale on this path, the reference $R_g$ of its group, (*lead, n), detached:
    the ``[num | den]`` rows of `shared_scale_attention` (on features of width ``Fd``, ``[v, 1]``
    of width ``dv1``, chunks of ``C``) are the true rows times $e^{-R_g}$ (and the per-query
    feature factor)."""
    n = s.shape[-1]
    L = math.prod(lead)
    sd = s.detach().expand(*lead, n).reshape(L, n)
    span = min(group_chunks(Fd, dv1), -(-n // C)) * C
    _, R, _ = _references(sd, span, initial_state, lead)
    return _per_token(R, span, n).expand(L, n).reshape(*lead, n)


def clean_mask(
    fq: torch.Tensor, v1: torch.Tensor, s: torch.Tensor,
    initial_state: LinearAttentionState | None, C: int, lead: torch.Size,
) -> torch.Tensor | None:
    """Tokens this path may take, (L, n) bool: in each sequence (row of ``L``), those
    before its first token with a non-finite value or key scale, or a key scale more than
    ``_SPREAD`` above its group's reference; ``None`` when that is every token (one host read).

    Non-finite features need no cut: a query's reach only its own row, and a key's enter the
    intra-chunk scores of later rows only (masked scores are replaced, not multiplied by 0) and
    the states of later chunks; a non-finite value would reach earlier rows of its chunk through
    0 * Inf in the intra-chunk product, and a non-finite key scale the group's weights."""
    n = s.shape[-1]
    L = math.prod(lead)
    sd = s.detach().expand(*lead, n).reshape(L, n)
    span = min(group_chunks(fq.shape[-1], v1.shape[-1]), -(-n // C)) * C
    gmax, R, _ = _references(sd, span, initial_state, lead)
    ok = torch.isfinite(R).all() & (gmax - R <= _SPREAD).all() & torch.isfinite(v1.sum())
    if bool(ok.item()):
        return None
    R_tok = _per_token(R, span, n)
    bad = ~(sd - R_tok <= _SPREAD)  # NaN and +Inf scales too; -Inf (weight 0) is fine
    bad = bad | ~torch.isfinite(v1).all(-1).expand(*lead, n).reshape(L, n)
    return torch.cumsum(bad, dim=-1) == 0


def shared_scale_attention(
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, s: torch.Tensor, mask: torch.Tensor,
    initial_state: LinearAttentionState | None, cdt: torch.dtype, lead: torch.Size,
) -> tuple[torch.Tensor, LinearAttentionState]:
    r"""The causal product with one key scale per group of chunks (module docstring), on inputs
    that `clean_mask` accepts.

    Keys are weighted $e^{s_j - R_g}$ (values and the ones column, so the per-query factor
    cancels in the ratio); training runs `ChunkedCausal` (its backward saves the inputs only),
    inference `chunked_forward`, whose output may take the memory of the weighted values.

    Parameters
    ----------
    fq : Tensor, shape (..., n, F)
        Query features (any per-query scale: it cancels).
    fk : Tensor, shape (..., n, F)
    v1 : Tensor, shape (..., n, P)
        $[v, 1]$ with zero columns up to ``P``; without autograd, weighted in place when it is
        contiguous (the caller's own buffer).
    s : Tensor, shape (..., n)
        Key log-scales (float64).
    mask : Tensor, shape (C, C), bool
        The causal mask of one chunk; ``C`` is the chunk size.
    initial_state : LinearAttentionState, optional
        With ``kv`` of shape (..., F, P).
    cdt : torch.dtype
        Compute dtype.
    lead : torch.Size
        The broadcast batch shape of the inputs.

    Returns
    -------
    out : Tensor, shape (*lead, n, P)
        ``[num | den]``, not normalised.
    state : LinearAttentionState
        After the last token, at the running maximum of the key log-scales.
    """
    n, Fd, dv1 = fq.shape[-2], fq.shape[-1], v1.shape[-1]
    C = mask.shape[-1]
    nc = (n + C - 1) // C
    pad = nc * C - n
    if pad:
        fq, fk, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v1))
        s = F.pad(s, (0, pad), value=float("-inf"))
    L = math.prod(lead)
    fq = fq.expand(*lead, nc * C, Fd).reshape(L, nc, C, Fd)
    fk = fk.expand(*lead, nc * C, Fd).reshape(L, nc, C, Fd)
    v1 = v1.expand(*lead, nc * C, dv1).reshape(L, nc * C, dv1)
    s = s.expand(*lead, nc * C).reshape(L, nc * C)
    group = min(group_chunks(Fd, dv1), nc)  # a short sequence: one group of its own chunks
    bounds = tuple((a, min(nc, a + group)) for a in range(0, nc, group))
    gmax, R, G0 = _references(s.detach(), group * C, initial_state, lead)
    R_tok = _per_token(R, group * C, nc * C)
    w = torch.exp(s - R_tok).to(cdt)  # key weights <= e^_SPREAD; gradients reach s
    if (torch.is_grad_enabled() and (v1.requires_grad or w.requires_grad)) or not v1.is_contiguous():
        # (not contiguous: v1 broadcasts over the batch, one memory location per broadcast row)
        vw = (v1 * w.unsqueeze(-1)).view(L, nc, C, dv1)
    else:  # v1 is this call's own [v, 1] (or a masked copy of it), not used after this path
        vw = v1.mul_(w.unsqueeze(-1)).view(L, nc, C, dv1)
    if initial_state is None:
        S0 = fq.new_zeros(L, Fd, dv1)
    else:
        kv0 = initial_state.kv.to(cdt).expand(*lead, Fd, dv1).reshape(L, Fd, dv1)
        S0 = kv0 * torch.exp(cast(torch.Tensor, G0) - R[:, :1]).to(cdt).unsqueeze(-1)  # set with a state
    decay = (None, *(torch.exp(R[:, g - 1] - R[:, g]).to(cdt).view(L, 1, 1) for g in range(1, len(bounds))))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (fq, fk, vw, S0)):
        out, S = ChunkedCausal.apply(fq, fk, vw, S0, decay, bounds, mask)
    else:  # vw is this call's own buffer (see above): the output may take its memory
        out, S = chunked_forward(fq, fk, vw, S0, decay, bounds, mask, overwrite=True)
    out = out.reshape(*lead, nc * C, dv1)[..., :n, :]
    Gf = torch.maximum(R[:, -1:], gmax[:, -1:])  # running maximum after the last key
    S = S * torch.exp(R[:, -1:] - Gf).to(cdt).unsqueeze(-1)
    return out, LinearAttentionState(S.reshape(*lead, Fd, dv1), Gf.reshape(*lead, 1, 1))
