"""Causal linear attention computed chunk-wise: masked products inside a chunk plus a carried state."""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .._validation import inputs_validated, no_autocast
from ..maps.base import FeatureMap
from ._common import normalise, prepare, with_ones
from .parallel import _GEMM_COLUMNS
from .state import LinearAttentionState


def _exp_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(a - b)`` with ``a = -inf`` read as weight 0 (an empty past, a padded key), also when
    ``b = -inf``; NaN and ``+inf`` propagate."""
    out = torch.exp(a - b)
    return torch.where(a == float("-inf"), torch.zeros_like(out), out).to(dtype)


def _scan_states(
    state: torch.Tensor, decay: torch.Tensor, kv: torch.Tensor, dim: int, length: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The scan over chunks as one operator, for ``torch.compile`` (one traced step whatever the
    number of chunks): ``state = state * decay[c] + kv[c]`` for the chunks ``c`` along ``dim`` of
    ``decay`` (..., nc) and ``kv`` (..., nc, F, dv1). Returns the final state and the states
    before each chunk (..., nc, F, dv1): the eager loop's values, in the same order of operations.

    ``length`` is any tensor whose last dimension is the sequence length ``n``. The step reads
    its size (a no-op test) so that the compiler passes the symbol of ``n`` into the step's graph:
    with a dynamic length the chunk count $\lceil n / C\rceil$ is an expression in it, and
    Inductor's lowering of scan (torch 2.13) fails to size the stacked output otherwise.
    ``torch._higher_order_ops.scan`` is a prototype, imported on first use.
    """
    from torch._higher_order_ops.scan import scan

    def step(st: torch.Tensor, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        dc, kc = x
        if length.shape[-1] < 0:  # never true; see above
            raise AssertionError
        return st * dc[..., None, None] + kc, st.clone()

    return scan(step, state, (decay, kv), dim=dim)


# Largest excess (in nats) of a key log-scale over its group's reference scale for which the
# shared-scale path runs: key weights stay <= e^30 (no overflow in float32, whose range is e^88),
# and every query's own running maximum is >= the reference, so nothing it depends on underflows.
_SPREAD = 30.0
# False forces the running-maximum path (autograd through every chunk): for benchmarks and tests.
_SHARED_SCALE = True
# In training, each group of chunks of the running-maximum path runs under activation
# checkpointing (recomputed in the backward); False: plain autograd, for benchmarks and tests.
_RECOMPUTE_GROUPS = True
# Chunks per recomputed run (at most; groups are split): 8 chunks of 64 tokens = 512 tokens.
_RECOMPUTE_CHUNKS = 8


# Tokens whose features a group's stack of chunk states may match: groups have a fixed number of
# chunks (so a prefix of a sequence is cut into the same groups as the whole sequence).
_GROUP_TOKENS = 16384


def _group_chunks(Fd: int, dv1: int) -> int:
    """Chunks per group: their states ($F \times d_v+1$ each) never outweigh the features
    ($F + d_v + 1$ per token) of ``_GROUP_TOKENS`` tokens."""
    return max(1, (_GROUP_TOKENS * (Fd + dv1)) // (Fd * dv1))


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


def _clean_mask(
    fq: torch.Tensor, v1: torch.Tensor, s: torch.Tensor,
    initial_state: LinearAttentionState | None, C: int, lead: torch.Size,
) -> torch.Tensor | None:
    """Tokens the shared-scale path may take, (L, n) bool: in each sequence (row of ``L``), those
    before its first token with a non-finite value or key scale, or a key scale more than
    ``_SPREAD`` above its group's reference; ``None`` when that is every token (one host read).

    Non-finite features need no cut: a query's reach only its own row, and a key's enter the
    intra-chunk scores of later rows only (masked scores are replaced, not multiplied by 0) and
    the states of later chunks; a non-finite value would reach earlier rows of its chunk through
    0 * Inf in the intra-chunk product, and a non-finite key scale the group's weights."""
    n = s.shape[-1]
    L = math.prod(lead)
    sd = s.detach().expand(*lead, n).reshape(L, n)
    span = _group_chunks(fq.shape[-1], v1.shape[-1]) * C
    gmax, R, _ = _references(sd, span, initial_state, lead)
    ok = torch.isfinite(R).all() & (gmax - R <= _SPREAD).all() & torch.isfinite(v1.sum())
    if bool(ok.item()):
        return None
    R_tok = R.repeat_interleave(span, dim=-1)[:, :n]
    bad = ~(sd - R_tok <= _SPREAD)  # NaN and +Inf scales too; -Inf (weight 0) is fine
    bad = bad | ~torch.isfinite(v1).all(-1).expand(*lead, n).reshape(L, n)
    return torch.cumsum(bad, dim=-1) == 0


def _shared_scale_path(
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, s: torch.Tensor, mask: torch.Tensor,
    initial_state: LinearAttentionState | None, cdt: torch.dtype, lead: torch.Size,
) -> tuple[torch.Tensor, LinearAttentionState]:
    r"""The causal product with one key scale per group of chunks (on a prefix from `_clean_prefix`).

    ``fq, fk`` (..., n, F), ``v1`` (..., n, dv1), ``s`` (..., n). Group $g$ uses the reference
    $R_g$ = the largest key log-scale *before* the group (the initial state's and the first
    key's for the first group): a scale every query of the group has already seen, so a later key
    never shifts an earlier output's scale. Keys are weighted $e^{s_j - R_g} \le e^{30}$
    (values and the ones column, so the per-query factor cancels in the ratio), and the chunk
    states are then a plain prefix sum (`._chunked_fn`). Returns ``[num | den]`` (*lead, n, dv1)
    and the state after the last token.
    """
    from ._chunked_fn import ChunkedCausal, chunked_forward

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
    group = _group_chunks(Fd, dv1)
    bounds = tuple((a, min(nc, a + group)) for a in range(0, nc, group))
    gmax, R, G0 = _references(s.detach(), group * C, initial_state, lead)
    R_tok = R.repeat_interleave(group * C, dim=-1)[:, : nc * C]
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


def _running_max_chunks(
    a: int, b: int, state: torch.Tensor,
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, v1_finite: torch.Tensor, v_poison: torch.Tensor | None,
    w_state: torch.Tensor, E: torch.Tensor, w_inter: torch.Tensor, decay: torch.Tensor, mask: torch.Tensor,
    s_in: torch.Tensor, *, grad: bool, compiling: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``a:b`` of the running-maximum path of `chunk_linear_attention`: their outputs
    ``[num | den]`` (..., b - a, C, dv1) and the state after chunk ``b - 1`` (..., F, dv1).

    ``state`` is the state entering chunk ``a`` (at scale ``G_excl`` of that chunk); the other
    tensors are the chunked ones of the caller, over all chunks (..., nc, ...): features ``fq, fk``,
    ``[v, 1]`` raw (``v1``, for the states) and with non-finite entries zeroed (``v1_finite``,
    for the intra-chunk product), the rows to poison (``v_poison``) or ``None``, the weights
    ``w_state``, ``E``, ``w_inter``, the per-chunk ``decay`` and the causal ``mask``; ``s_in``
    carries the sequence length (`_scan_states`). A function of its arguments only, so that
    training can run it under `torch.utils.checkpoint.checkpoint`. ``grad``: autograd records
    (the score product is then not done in place); ``compiling``: the scan is one operator.
    """
    kv_c = torch.matmul(fk[..., a:b, :, :].mT, v1[..., a:b, :, :] * w_state[..., a:b, :, :])
    if compiling:
        # the same recurrence, as one operator over a (possibly symbolic) number of chunks
        state, excl = _scan_states(state, decay, kv_c, decay.dim() - 1, s_in)
    else:
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


@no_autocast
def chunk_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Causal linear attention, chunked.

    With chunks $c$ of ``chunk_size`` tokens, $A_c = \operatorname{tril}(\varphi(Q_c)\varphi(K_c)^\top)$
    and the state before the chunk $S_{<c} = S_0 + \sum_{c' < c}\varphi(K_{c'})^\top [V_{c'}, 1]$:

    $$
    [\text{num}, \text{den}]_c = \varphi(Q_c)\, S_{<c} + A_c\,[V_c, 1].
    $$

    Causal stabilisation: every key keeps its own log scale $s_j$, and no output may depend on
    a later key's scale (a global key maximum would let one large future key underflow the
    past). Two paths, equal to rounding:

    - *Shared scale per group of chunks* (eager, CPU, positive maps: a signed
      map's denominators can nearly cancel, and there the order of operations of the compiled
      form is kept, so that eager and compiled results agree). Group $g$
      of chunks works at the scale $R_g$ = the largest key log-scale before it (the first key's
      or the initial state's for the first group): every query of the group has seen it, and
      its own running maximum is $\ge R_g$. Keys are weighted $e^{s_j - R_g}$, which applies
      when no key of the group exceeds $R_g$ by more than 30 nats (checked on the host; no
      overflow, and nothing a query depends on can underflow). The chunk states are then one
      GEMM and one in-place scan over chunks, the intra-chunk block one batched masked GEMM, and
      training uses a custom backward (`kernelapprox.attention._chunked_fn`) that saves only
      its inputs ($\varphi(Q)$, $\varphi(K)$, the weighted $[V, 1]$) and recomputes the
      states, forward for $\partial\varphi(Q)$ and by reverse accumulation for
      $\partial\varphi(K)$, $\partial V$: no per-chunk state or score is kept for the
      backward [Kat20]_.
    - *Running maximum* (everywhere else: ``torch.compile``, other devices, signed maps; and,
      in each sequence, the rows from its first non-finite value or key scale, or key scale
      more than 30 nats above its group's reference, on): query $i$ works at
      $M_i = \max_{j \le i} s_j$ (with the initial state's), and the carried state is rescaled
      to the running maximum as in `RecurrentLinearAttention`. In training (eager) each run of
      at most 8 chunks runs under non-reentrant `torch.utils.checkpoint.checkpoint`: autograd
      keeps the run's arguments (features, $[V, 1]$, per-token and intra-chunk weights) and
      the $F \times (d_v + 1)$ state entering it, and the backward reruns one run at a time
      for its chunk states and scores (module flag ``_RECOMPUTE_GROUPS``; False: autograd
      through every chunk, as under ``torch.compile``).

    Output $i$ depends on positions $\le i$ only, also for non-finite inputs: a NaN or
    Inf at position $j$ reaches rows $\ge j$ (as in the recurrent form), never rows
    before it, whatever the chunk size, bitwise (the rows before a token the shared-scale path
    cannot take are computed as if it were absent); padding after the sequence has no effect.

    Chunk states are formed for groups of chunks sized so that they never outweigh the features
    (of the sequence on the running-maximum path, of 16 384 tokens on the shared-scale path):
    peak memory $O(n(F + d_v) + F d_v)$ per head for any ``chunk_size``, and no
    $(n, F, d_v)$ tensor. Cost $O(nFd_v + nC(F + d_v))$ for chunk size $C$. The backward
    keeps the inputs of the chunked product and, on the running-maximum path, the state entering
    each recomputed run of at most 8 chunks (``_RECOMPUTE_CHUNKS``):
    $O(n(F + d_v + C) + \lceil n_c/8\rceil F d_v)$, no chunk state or score; its transient is one
    run's chunk states, $8 F (d_v + 1)$ per head. Measured (CPU, float32, one sequence, 8 heads,
    $d$ = 64, $r$ = 256, ``chunk_size`` 64), recomputation against plain autograd: peak of a
    training step at $n$ = 16 384 2217 against 2506 MiB (`TrigRF`) and 1107 against 1363 MiB
    (`PositiveRF` on this path); memory held from forward to backward 1328 against 1770 and 630
    against 911 MiB; forward + backward at $n$ = 4096 1.30 against 2.23 s and 0.70 against
    1.15 s (the small runs stay in cache).

    Under ``torch.compile`` the scan over chunks is one scan operator and all chunks form one
    group (their states, $\lceil n/C\rceil \times F \times (d_v + 1)$, are held at once), so
    that one graph serves every sequence length with ``dynamic=True``; the values are those of
    the eager running-maximum loop (equal to the shared-scale path's to rounding).

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
    chunk_size : int, default 64
        Tokens per chunk (any positive size; it need not divide ``n``).
    initial_state : LinearAttentionState, optional
    return_state : bool, default False
    eps : float, default 1e-6
        Denominator guard for signed maps, see `kernelapprox.linear_attention`.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : LinearAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 1, 40, 8).unbind(0)
    >>> k[0, 30, 0] = float("nan")
    >>> out = chunk_linear_attention(q / 2, k / 2, v, ka.PositiveRF(8, 16, seed=0), chunk_size=16)
    >>> bool(out[0, :30].isfinite().all()), bool(out[0, 30:].isnan().all())
    (True, True)
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (a number of tokens), got {chunk_size!r}")
    q, k, v, out_dtype, cdt = prepare(q, k, v, feature_map, True, initial_state)
    with inputs_validated():
        fq = feature_map.query_features(q)  # the per-query scale cancels
        fk, s = feature_map.key_log_features(k)  # per-key log scales s: (..., n), float64 for random maps
    s = s.double()  # keeps the gradient of the per-key scale; the stabilisers below are detached
    # [v, 1] with zero columns up to a multiple of 8: GEMMs of width 72 are faster than of 65
    # on CPU; the padding is stripped from the outputs and the states returned.
    dv = v.shape[-1]
    v1 = with_ones(v, _GEMM_COLUMNS)
    if initial_state is not None and v1.shape[-1] != dv + 1:
        initial_state = LinearAttentionState(
            F.pad(initial_state.kv, (0, v1.shape[-1] - dv - 1)), initial_state.log_scale)
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v1.shape[:-2], s.shape[:-1])
    n, Fd, dv1 = fq.shape[-2], fq.shape[-1], v1.shape[-1]
    C = chunk_size
    compiling = torch.compiler.is_compiling()
    mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()
    # The shared-scale path takes every token (the usual case) or, per sequence, the tokens
    # before the first one it cannot take (`_clean_mask`), so that rows before a bad token are
    # computed the same whatever follows them; the running-maximum path then does the rest.
    head = None
    if not compiling and _SHARED_SCALE and feature_map.positive and fq.device.type == "cpu":
        keep = _clean_mask(fq, v1, s, initial_state, C, lead)
        if keep is None:
            head, st = _shared_scale_path(fq, fk, v1, s, mask, initial_state, cdt, lead)
            out = normalise(head[..., :dv], head[..., dv:dv + 1], feature_map.positive, eps).to(out_dtype)
            if return_state:
                return out, LinearAttentionState(st.kv[..., :dv + 1].contiguous(), st.log_scale)
            return out
        if bool(keep.any()):
            # Rows before each sequence's first bad token: the whole sequence with the keys and
            # values from that token on given weight 0 (same shapes, hence the same GEMMs and
            # bitwise the same rows as without the bad token); the running-maximum path below
            # gives every other row and the final state.
            keep = keep.reshape(*lead, n)
            head = _shared_scale_path(
                fq, fk, v1.expand(*lead, n, dv1).masked_fill(~keep.unsqueeze(-1), 0.0),
                s.expand(*lead, n).masked_fill(~keep, float("-inf")), mask, initial_state, cdt, lead,
            )[0]
    # Under torch.compile the sequence length may be symbolic (dynamic=True): integer arithmetic
    # only, padding applied unconditionally (a zero pad is a no-op), and the scan over chunks is a
    # scan operator instead of a Python loop, so one graph serves every length.
    nc = (n + C - 1) // C  # ceil(n / C)
    pad = nc * C - n
    s_in = s  # (..., n): its shape carries the (possibly symbolic) length, see _scan_states
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
    # sum only takes the exact path). On other devices it always runs, so there is no host sync.
    v_finite = v.device.type == "cpu" and not compiling and bool(torch.isfinite(v.sum()))
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

    parts = (fq, fk, v1, v1_finite, v_poison, w_state, E, w_inter, decay, mask, s_in)
    if compiling:
        # all chunks in one group: a number of groups would depend on the (symbolic) length
        out, state = _running_max_chunks(0, nc, state, *parts, grad=grad, compiling=True)
    else:
        group = max(1, (nc * C * (Fd + dv1)) // (Fd * dv1))
        if grad and _RECOMPUTE_GROUPS:
            # recomputed runs of at most _RECOMPUTE_CHUNKS chunks: the backward's transient is
            # one run's chunk states, not one group's
            group = min(group, _RECOMPUTE_CHUNKS)
        outs = []
        for a in range(0, nc, group):
            if grad and _RECOMPUTE_GROUPS:
                # the graph keeps the arguments only (the tensors above and the state entering the
                # group); the backward reruns the group for what it saves, one group at a time
                o, state = checkpoint(
                    _running_max_chunks, a, min(nc, a + group), state, *parts, grad=True, compiling=False,
                    use_reentrant=False, preserve_rng_state=False,  # no randomness inside
                )
            else:
                o, state = _running_max_chunks(a, min(nc, a + group), state, *parts, grad=grad, compiling=False)
            outs.append(o)
        out = torch.cat(outs, dim=-3)
    out = out.reshape(*lead, nc * C, dv1)[..., :n, :]
    if head is not None and keep is not None:
        out = torch.where(keep.unsqueeze(-1), head, out)
    out = normalise(out[..., :dv], out[..., dv:dv + 1], feature_map.positive, eps).to(out_dtype)
    if return_state:
        g_last = G_incl[..., -1:]
        g_last = torch.where(torch.isfinite(g_last), g_last, torch.zeros_like(g_last))
        return out, LinearAttentionState(state[..., :dv + 1].contiguous(), g_last.unsqueeze(-1))
    return out
