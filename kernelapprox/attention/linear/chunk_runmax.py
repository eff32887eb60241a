r"""Causal linear attention, chunk-wise, at each query's running maximum of the key log-scales.

Keys enter as $\psi(k_j) = f_j e^{s_j}$ (features and one log-scale per key,
`FeatureMap.key_log_features`). Query $i$ works at the scale
$M_i = \max(G_0, \max_{j \le i} s_j)$ (with $G_0$ the initial state's), which no later key can
change, so no output depends on a future key's scale and nothing underflows or overflows for
finite inputs. With chunks $c$ of $C$ tokens, the state after chunk $c$ is kept at
$G_c = \max(G_{c-1}, \max_{j \in c} s_j)$:

$$
S_c = S_{c-1}\, e^{G_{c-1} - G_c} + \sum_{j \in c} f_j^\top [v_j, 1]\, e^{s_j - G_c},
$$

and the output of query $i$ in chunk $c$ is

$$
[\text{num}, \text{den}]_i = e^{G_{c-1} - M_i}\, \varphi(q_i) S_{c-1}
    + \sum_{j \in c,\ j \le i} \varphi(q_i)^\top f_j\, e^{s_j - M_i}\, [v_j, 1]
$$

(the per-query factor of $\varphi(q_i)$ cancels in the ratio). This is the chunk-wise form of
causal linear attention [Kat20]_ [Yan24]_ with the carried state rescaled to the running
maximum, as in `RecurrentLinearAttention`. It takes any map (signed maps included: their
denominators can nearly cancel, and this path keeps one order of operations in eager and compiled
code) and any device, and is the path of ``torch.compile``, where the loop over chunks unrolls
into one graph that compiles forward and backward.

Chunks are processed in groups whose stacked states ($F \times (d_v + 1)$ per chunk) never
outweigh the sequence's features. In training (eager) each group is a run of at most
`_RECOMPUTE_CHUNKS` chunks under non-reentrant `torch.utils.checkpoint.checkpoint`: autograd keeps
the run's arguments and the state entering it, and the backward reruns one run at a time; with
``recompute=False``, autograd through every chunk.

References
----------
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
   autoregressive transformers with linear attention", ICML 2020.
.. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers with
   hardware-efficient training", ICML 2024 (the chunk-wise form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..state import LinearAttentionState

#: Chunks per recomputed run in training (at most; groups are split): 8 chunks of 64 tokens.
_RECOMPUTE_CHUNKS = 8


def _exp_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(a - b)`` with ``a = -inf`` read as weight 0 (an empty past, a padded key), also when
    ``b = -inf``; NaN and ``+inf`` propagate."""
    out = torch.exp(a - b)
    return torch.where(a == float("-inf"), torch.zeros_like(out), out).to(dtype)


def _run(
    a: int, b: int, state: torch.Tensor,
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, v1_finite: torch.Tensor, v_poison: torch.Tensor | None,
    w_state: torch.Tensor, E: torch.Tensor, w_inter: torch.Tensor, decay: torch.Tensor, mask: torch.Tensor,
    *, grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``a:b``: their outputs ``[num | den]`` (..., b - a, C, dv1) and the state after
    chunk ``b - 1`` (..., F, dv1).

    ``state`` is the state entering chunk ``a`` (at the scale $G_{a-1}$); the other tensors are
    the chunked ones of `running_max_attention`, over all chunks (..., nc, ...): features
    ``fq, fk``, ``[v, 1]`` raw (``v1``, for the states) and with non-finite entries zeroed
    (``v1_finite``, for the intra-chunk product), the rows to poison (``v_poison``) or ``None``,
    the weights ``w_state``, ``E``, ``w_inter``, the per-chunk ``decay`` and the causal ``mask``.
    A function of its arguments only, so that training can run it under
    `torch.utils.checkpoint.checkpoint`. ``grad``: autograd records (the score product is then not
    done in place).

    The scan over chunks is a plain Python loop: ``torch.compile`` unrolls it into one graph (for
    a given number of chunks), and its backward is ordinary autograd.
    """
    kv_c = torch.matmul(fk[..., a:b, :, :].mT, v1[..., a:b, :, :] * w_state[..., a:b, :, :])
    states = []
    for c in range(a, b):  # sequential scan over chunks: O(F dv) per chunk
        states.append(state)
        state = state * decay[..., c, None, None] + kv_c[..., c - a, :, :]
    excl = torch.stack(states, dim=-3)  # (..., g, F, dv1) at scales G_excl
    fq_g = fq[..., a:b, :, :]
    A = torch.matmul(fq_g, fk[..., a:b, :, :].mT)
    if grad:
        A = (A * E[..., a:b, :, :]).masked_fill(~mask, 0.0)
    else:
        A = A.mul_(E[..., a:b, :, :]).masked_fill_(~mask, 0.0)
    intra = torch.matmul(A, v1_finite[..., a:b, :, :])
    if v_poison is not None:
        intra = intra.masked_fill(v_poison[..., a:b, :, :], float("nan"))
    return torch.matmul(fq_g, excl) * w_inter[..., a:b, :, :] + intra, state


def row_scales(s: torch.Tensor, initial_state: LinearAttentionState | None) -> torch.Tensor:
    r"""Each query's scale on this path, $M_i = \max(G_0, \max_{j \le i} s_j)$, (..., n), detached:
    the ``[num | den]`` rows of `running_max_attention` are the true rows times $e^{-M_i}$ (and
    the per-query feature factor)."""
    M = torch.cummax(s.detach(), dim=-1).values
    if initial_state is not None:
        G = initial_state.log_scale.detach().to(M.dtype).reshape(*initial_state.log_scale.shape[:-2], 1)
        M = torch.maximum(M, G)
    return M


def running_max_attention(
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, s: torch.Tensor, mask: torch.Tensor,
    initial_state: LinearAttentionState | None, cdt: torch.dtype, lead: torch.Size, *, recompute: bool,
    host_reads: bool = True,
) -> tuple[torch.Tensor, LinearAttentionState]:
    r"""The causal product at each query's running maximum (module docstring).

    Parameters
    ----------
    fq : Tensor, shape (..., n, F)
        Query features (any per-query scale: it cancels).
    fk : Tensor, shape (..., n, F)
    v1 : Tensor, shape (..., n, P)
        $[v, 1]$ with zero columns up to ``P``.
    s : Tensor, shape (..., n)
        Key log-scales (float64; gradients flow through them, the stabilisers are detached).
    mask : Tensor, shape (C, C), bool
        The causal mask of one chunk (``tril``); ``C`` is the chunk size.
    initial_state : LinearAttentionState, optional
        With ``kv`` of shape (..., F, P).
    cdt : torch.dtype
        Compute dtype.
    lead : torch.Size
        The broadcast batch shape of the inputs.
    recompute : bool
        In training (eager), runs of `_RECOMPUTE_CHUNKS` chunks under activation checkpointing.
    host_reads : bool, default True
        On the CPU, skip the masking of non-finite values when their sum is finite (one host
        read); ``False`` (the accelerator path) always masks, without reading any value.

    Returns
    -------
    out : Tensor, shape (*lead, n, P)
        ``[num | den]``, not normalised.
    state : LinearAttentionState
        After the last token, ``kv`` (*lead, F, P).
    """
    n, Fd, dv1 = fq.shape[-2], fq.shape[-1], v1.shape[-1]
    C = mask.shape[-1]
    compiling = torch.compiler.is_compiling()
    # Under torch.compile the sequence length may be symbolic (dynamic=True): integer arithmetic
    # only and padding applied unconditionally (a zero pad is a no-op); the loop over chunks then
    # fixes the number of chunks of a graph (one graph per chunk count).
    nc = (n + C - 1) // C  # ceil(n / C)
    pad = nc * C - n
    if compiling or pad:
        fq = F.pad(fq, (0, 0, 0, pad))
        fk = F.pad(fk, (0, 0, 0, pad))
        v1 = F.pad(v1, (0, 0, 0, pad))
        s = F.pad(s, (0, pad), value=float("-inf"))
    fq = fq.expand(*lead, *fq.shape[-2:]).reshape(*lead, nc, C, Fd)
    fk = fk.expand(*lead, *fk.shape[-2:]).reshape(*lead, nc, C, Fd)
    v1 = v1.expand(*lead, *v1.shape[-2:]).reshape(*lead, nc, C, dv1)
    s = s.expand(*lead, s.shape[-1]).reshape(*lead, nc, C)
    sd = s.detach()

    # Causality for non-finite values. Inside a chunk, products with masked (future) entries are
    # formed before the mask applies, and 0 * NaN = NaN: a NaN/Inf at position j would reach rows
    # i < j. Keys: the masked scores are replaced (masked_fill), not multiplied by 0. Values: the
    # intra-chunk product uses finite values only, and row i of column c is set to NaN where a
    # value at a position <= i of its chunk is non-finite (earlier chunks reach it through the
    # carried state, which keeps the raw values).
    # The value masking costs ~10% of the call: on CPU (where reading a scalar is free) it is
    # skipped when the values are all finite (a finite sum implies finite entries; an overflowing
    # sum only takes the exact path). On other devices (and with ``host_reads=False``: the
    # accelerator path forced on the CPU) it always runs, so there is no host sync.
    v_finite = host_reads and v1.device.type == "cpu" and not compiling and bool(torch.isfinite(v1.sum()))
    if v_finite:
        v1_finite, v_poison = v1, None
    else:
        v_bad = ~torch.isfinite(v1)
        v_poison = torch.cumsum(v_bad, dim=-2, dtype=torch.int32) > 0  # (..., nc, C, dv1)
        v1_finite = v1.masked_fill(v_bad, 0.0)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (fq, fk, s, v1))

    # Scales: G0 (initial state), running max within each chunk, and across chunks.
    if initial_state is None:
        state = fq.new_zeros(*lead, Fd, dv1)
        G = sd.new_full((*lead, 1), float("-inf"))
    else:
        state = initial_state.kv.to(cdt).expand(*lead, Fd, dv1)
        G = initial_state.log_scale.detach().to(sd.dtype).reshape(*initial_state.log_scale.shape[:-2], 1)
        G = G.expand(*lead, 1)
    m_in = torch.cummax(sd, dim=-1).values  # (..., nc, C): max_{j<=i in chunk} s_j
    g_c = m_in[..., -1]  # (..., nc): chunk maxima
    G_incl = torch.cummax(torch.maximum(g_c, G), dim=-1).values  # scale of the state after chunk c
    G_excl = torch.cat((G, G_incl[..., :-1]), dim=-1)  # scale of the state before chunk c
    M = torch.maximum(m_in, G_excl.unsqueeze(-1))  # per-query scale, (..., nc, C)

    # Chunk contributions at their own (inclusive) scale: v rows weighted by exp(s_j - G_incl).
    w_state = _exp_diff(s, G_incl.unsqueeze(-1), cdt).unsqueeze(-1)  # (..., nc, C, 1)
    # Intra-chunk weights exp(s_j - M_i), j <= i (masked before the product too, so that an
    # overflowing future weight cannot turn a zero gradient into NaN).
    E = _exp_diff(s.unsqueeze(-2).expand(*s.shape, C), M.unsqueeze(-1), cdt)
    E = E.masked_fill(~mask, 0.0)  # (..., nc, C_i, C_j)
    w_inter = _exp_diff(G_excl.unsqueeze(-1), M, cdt).unsqueeze(-1)  # (..., nc, C, 1)
    decay = _exp_diff(G_excl, G_incl, cdt)  # (..., nc): rescales the carried state

    parts = (fq, fk, v1, v1_finite, v_poison, w_state, E, w_inter, decay, mask)
    if compiling:
        # all chunks in one group, autograd through every chunk (the compiler plans the memory)
        out, state = _run(0, nc, state, *parts, grad=grad)
    else:
        group = max(1, (nc * C * (Fd + dv1)) // (Fd * dv1))
        checkpointed = grad and recompute
        if checkpointed:
            # recomputed runs of at most _RECOMPUTE_CHUNKS chunks: the backward's transient is
            # one run's chunk states, not one group's
            group = min(group, _RECOMPUTE_CHUNKS)
        outs = []
        for a in range(0, nc, group):
            if checkpointed:
                # the graph keeps the arguments only (the tensors above and the state entering the
                # group); the backward reruns the group for what it saves, one group at a time
                o, state = checkpoint(
                    _run, a, min(nc, a + group), state, *parts, grad=True,
                    use_reentrant=False, preserve_rng_state=False,  # no randomness inside
                )
            else:
                o, state = _run(a, min(nc, a + group), state, *parts, grad=grad)
            outs.append(o)
        out = torch.cat(outs, dim=-3)
    out = out.reshape(*lead, nc * C, dv1)[..., :n, :]
    g_last = G_incl[..., -1:]
    g_last = torch.where(torch.isfinite(g_last), g_last, torch.zeros_like(g_last))
    return out, LinearAttentionState(state, g_last.unsqueeze(-1))
