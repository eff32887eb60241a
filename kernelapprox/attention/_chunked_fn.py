r"""The chunked causal product with a shared scale per group of chunks, and its memory-lean backward.

Inputs are chunked: ``fq, fk`` (L, nc, C, F), ``vw`` (L, nc, C, dv1) (values with a ones column,
already multiplied by the key weights $e^{s_j - R}$ of their group's reference scale $R$), the
state entering the first group ``S0`` (L, F, dv1) at that group's scale, and per later group the
factor $e^{R_{g-1} - R_g}$ that brings the carried state to the group's scale. For every chunk $c$

$$
Y_c = S_{\text{in}} + \sum_{c' < c} \varphi(K_{c'})^\top W_{c'}, \qquad
O_c = \varphi(Q_c)\, Y_c + \operatorname{tril}\big(\varphi(Q_c)\varphi(K_c)^\top\big) W_c ,
$$

with $W_c$ = ``vw`` of the chunk (chunks of one group at once: the states $Y$ by one cumulative
sum over chunks, the products by batched GEMMs).

The backward (`ChunkedCausal`) saves the inputs only and recomputes: the states entering each
group by forward re-accumulation (one $F \times d_v$ state per group), then, group by group in
reverse, the states $Y_c$ (for $\partial\varphi(Q)$) and the reverse accumulation
$T_c = \partial S_{\text{out}} + \sum_{c' > c} \varphi(Q_{c'})^\top \partial O_{c'}$ (for
$\partial\varphi(K)$ and $\partial W$), the standard linear-attention backward [Kat20]_
(flash-linear-attention's chunked kernels [Yan24]_ do the same on GPUs). Nothing of size
$n_c \times F \times d_v$ outlives its group; autograd through the forward would keep every
intra-chunk score and state (the group stacks are bounded by the size of the features).

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

import torch
from torch.autograd.function import once_differentiable


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
