r"""Causal linear attention of positive maps as a per-feature log-domain scan, with a number of
tensor operations that does not depend on the sequence length (the accelerator's torch path).

Every feature keeps its own causal scale, as in the gated recurrence of
`kernelapprox.attention.linear.naive_gated.naive_gated_linear_attention` (the running maximum of
the key log-features as a decay gate, after gated linear attention [Yan24]_), but evaluated
chunk-parallel: chunks of $C$ tokens, each split into tiles of $c$ tokens.

- **Across chunks.** The keys of chunk $c$ enter as chunk sums relative to the chunk's
  per-feature maximum $M_{cf}$, with the values split into positive and negative parts and a
  column of ones for the normaliser, $T_c = \sum_{j \in c} e^{\ell^k_{jf} - M_{cf}}[v_j^+, v_j^-, 1]$;
  the state before chunk $c$ is their sum, kept as a logarithm by one ``torch.logcumsumexp``
  over the chunks, $\log S_{<c} = \operatorname{logcumsumexp}_{c' < c}(\log T_{c'} + M_{c'})$,
  and read at the per-feature reference $R_{cf} = \log z_{<c, f}$ (the state's log-mass of
  feature $f$): $\tilde S_{<c} = e^{\log S_{<c} - R_c} \le \max |v|$ (its ones column is 1).
- **Within a chunk, between tiles.** A key tile $t'$ before the query's tile $t(i)$ enters through
  one GEMM at the tile's per-feature maximum $M_{t'f}$ (its keys are all $\le i$, so the reference
  is causal): $\sum_f e^{\ell^q_{if} + M_{t'f} - \sigma_i}\, e^{\ell^k_{jf} - M_{t'f}}$.
- **Within a tile.** The scores are exact:
  $\sum_f e^{\ell^q_{if} + \ell^k_{jf} - \sigma_i}$, $j \le i$, formed element-wise.

Each query's shift is $\sigma_i = \max_f(\ell^q_{if} + T_{if})$ with
$T_{if} = \max(R_{cf}, \max_{j \le i,\, j \in c}\ell^k_{jf})$ the feature's causal maximum. Every
exponent is then $\le 0$, every factor in $[0, 1]$, and a product of two factors is the exact
weight (if the product is representable, so is each factor), and at the maximiser $f^*$ of
$\sigma_i$ one term is 1 (the key that set $T_{if^*}$, or the state's ones column):

$$
1 \le \text{den}_i \le F (n + 1)
$$

for a row that sees a key or a state, at any norm: no denominator underflows, the forward and the
backward are finite for finite inputs ([Kat20]_ for the causal product; the per-feature scales
are the data-dependent decays of [Yan24]_). The shifts $M$, $R$, $T$, $\sigma$ are constants for
autograd (they cancel in $\text{num}_i / \text{den}_i$). Nothing reads a tensor value on the host,
and no Python loop runs over chunks: a fixed number of operations for any $n$, which is what a
launch-bound accelerator and ``torch.compile(fullgraph=True)`` need.

Cost per sequence, for $F$ features, $d_v$ value columns, chunk $C$ and tile $c$: time
$O(n F (c + C + d_v))$ (the tile scores $n c F$ element-wise, the between-tile GEMM $n C F$,
the chunk sums and state reads $n F d_v$). Memory under autograd (what the backward keeps, in
elements): the exact tile scores $n c F$ (the $(L, n_c, C/c, c, c, F)$ log-domain tensor), the
between-tile query factors $n (C/c) F$, the key and state-read factors $3 n F$, the state
$\approx 5 (n/C) F (2 d_v + 1)$ (the chunk sums, their logarithm, its ``logcumsumexp``, its
exponential) and $n (C + 3 d_v)$ for the between-tile scores and the values. With the defaults
$C = 64$, $c = 8$ and $d_v = 64$, $F = 128$: about $31\,nF$ (measured with
``torch.autograd.graph.saved_tensors_hooks`` at $n = 4096$: $32\,nF$), where exact log-domain
scores over whole chunks of 64 would keep over $64\,nF$.

References
----------
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
   autoregressive transformers with linear attention", ICML 2020.
.. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers
   with hardware-efficient training", ICML 2024.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..._validation import broadcast_shapes
from ..state import LinearAttentionState

__all__ = ["CHUNK", "TILE", "ScanResult", "causal_log_scan", "tile_scores"]

#: Tokens per chunk of the state scan (default).
CHUNK = 64
#: Tokens per tile of exact scores within a chunk (default).
TILE = 8

_LN2 = math.log(2.0)
NEG = -1e30  # a finite "minus infinity" for logarithms of zero: logcumsumexp and its backward stay finite


class ScanResult(NamedTuple):
    """The parts of causal linear attention computed at per-feature scales.

    Attributes
    ----------
    num : Tensor, shape (..., n, dv)
        The numerator times $e^{-\\sigma_i}$ (``2**-sigma`` for log2 features).
    den : Tensor, shape (..., n)
        The denominator times the same factor: $\\ge 1$ for a row that sees a key or a state,
        0 for a row that sees none.
    shift : Tensor, shape (..., n)
        $\\sigma_i$, detached, in the base of the inputs; $-\\infty$ for a row that sees nothing.
    state : LinearAttentionState or None
        The state after the last token, per feature (``log_scale`` (..., F, 1), natural log,
        float64), when asked for.
    """

    num: torch.Tensor
    den: torch.Tensor
    shift: torch.Tensor
    state: LinearAttentionState | None


def _safe_log(x: torch.Tensor) -> torch.Tensor:
    """``log(x)`` for ``x > 0``, `NEG` for ``x <= 0`` (the gradient at those entries is 0, not
    NaN), NaN for NaN (a NaN value reaches the later chunks through the state, not dropped)."""
    pos = x > 0
    low = torch.where(x.isnan(), x, torch.full_like(x, NEG))
    return torch.where(pos, torch.where(pos, x, torch.ones_like(x)).log(), low)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def sizes(n: int, chunk: int, tile: int) -> tuple[int, int]:
    """The tile and chunk sizes ``(c, C)`` of a call of length ``n``: ``c = min(tile, n)``, the
    chunk rounded up to a multiple of ``c``, and a sequence shorter than a chunk one chunk of its
    own length (rounded up to whole tiles). Under ``torch.compile`` (where ``n`` may be symbolic)
    the sizes stay as given, rounded to whole tiles.

    Examples
    --------
    >>> sizes(1000, 64, 8), sizes(20, 64, 8), sizes(5, 64, 8)
    ((8, 64), (8, 24), (5, 5))
    """
    if torch.compiler.is_compiling():
        return tile, -(-chunk // tile) * tile
    c = min(tile, n)
    C = -(-chunk // c) * c
    return c, min(C, -(-n // c) * c)


def _flatten(x: torch.Tensor, lead: torch.Size, L: int) -> torch.Tensor:
    return x.expand(*lead, *x.shape[-2:]).reshape(L, *x.shape[-2:])


def tile_scores(
    lq: torch.Tensor, lk: torch.Tensor, v1: torch.Tensor, sig: torch.Tensor, tile: int,
    exp: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    r"""The keys of each query's own chunk, $\sum_{j \le i,\, j \in c} A_{ij} [v_j, 1]$ with
    $A_{ij} = \sum_f e^{\ell^q_{if} + \ell^k_{jf} - \sigma_i}$ (module docstring): exact scores
    within a tile, one GEMM at each earlier tile's per-feature key maximum between tiles.

    Parameters
    ----------
    lq, lk : Tensor, shape (L, nc, C, F)
        Query and key log-features ($-\infty$ for an absent key), ``C`` a multiple of ``tile``.
    v1 : Tensor, shape (L, nc, C, P)
    sig : Tensor, shape (L, nc, C, 1)
        Finite shifts with $\sigma_i \ge \ell^q_{if} + \ell^k_{jf}$ for every $j \le i$ of the chunk.
    tile : int
    exp : callable
        ``torch.exp2`` for log2 features, ``torch.exp`` for natural ones.

    Returns
    -------
    Tensor, shape (L, nc, C, P)

    Examples
    --------
    >>> lq, lk = torch.zeros(2, 1, 1, 4, 1).unbind(0)
    >>> v1 = torch.tensor([[[[1.0, 1.0], [3.0, 1.0], [5.0, 1.0], [7.0, 1.0]]]])
    >>> tile_scores(lq, lk, v1, torch.zeros(1, 1, 4, 1), 2, torch.exp2)[0, 0]
    tensor([[ 1.,  1.],
            [ 4.,  2.],
            [ 9.,  3.],
            [16.,  4.]])
    """
    L, nc, C, Fd = lq.shape
    P = v1.shape[-1]
    c = tile
    nt = C // c
    ninf = float("-inf")
    ar = torch.arange(c, device=lq.device)
    causal = (ar[:, None] >= ar[None, :]).unsqueeze(-1)  # (c, c, 1)
    a = lq - sig  # (L, nc, C, F): the query side, shifted
    # in place after the first allocation: neither the sum nor the mask needs its input for autograd
    x = a.reshape(L, nc, nt, c, 1, Fd) + lk.reshape(L, nc, nt, 1, c, Fd)  # (L, nc, nt, c, c, F)
    scores = _exp_(x.masked_fill_(~causal, ninf), exp).sum(dim=-1)  # (L, nc, nt, c, c), every term <= 1
    out = torch.matmul(scores, v1.reshape(L, nc, nt, c, P)).reshape(L, nc, C, P)
    if nt == 1:
        return out
    lkt = lk.reshape(L, nc, nt, c, Fd)
    with torch.no_grad():
        Mt = lkt.amax(dim=3)  # (L, nc, nt, F): each tile's per-feature maximum, -inf where no key reaches
        Mt0 = torch.where(Mt == ninf, torch.zeros_like(Mt), Mt)
        ta = torch.arange(nt, device=lq.device)
        earlier = (ta[:, None] < (torch.arange(C, device=lq.device) // c)[None, :]).unsqueeze(-1)  # (nt', C, 1)
    kf = exp(lkt - Mt0.unsqueeze(3))  # (L, nc, nt, c, F), in [0, 1]
    qx = a.unsqueeze(2) + Mt.unsqueeze(3)  # (L, nc, nt', C, F), <= 0 where read
    qf = _exp_(qx.masked_fill_(~earlier, ninf), exp)
    between = torch.matmul(qf, kf.mT)  # (L, nc, nt', C, c)
    between = between.transpose(2, 3).reshape(L, nc, C, C)  # key index t' * c + j
    return out + torch.matmul(between, v1)


def _exp_(x: torch.Tensor, exp: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``exp(x)`` in place (``x`` is a fresh temporary that autograd does not keep)."""
    return x.exp2_() if exp is torch.exp2 else x.exp_()


def _state_logs(state: LinearAttentionState, dv: int, dtype: torch.dtype) -> torch.Tensor:
    r"""A state as natural-log masses $\log[S^+, S^-, z]$ (..., F, 2 dv + 1), `NEG` for zero.

    The scale (``log_scale`` (..., F, 1) or (..., 1, 1)) is a constant for autograd; ``kv``
    keeps its gradient.
    """
    kv = state.kv
    num, z = kv[..., :dv], kv[..., dv:dv + 1]
    parts = torch.cat([num.clamp(min=0), (-num).clamp(min=0), z.clamp(min=0)], dim=-1)
    ls = state.log_scale.detach().double()
    return (_safe_log(parts.double()) + ls).clamp(min=NEG).to(dtype)


def padded_keys(
    lq: torch.Tensor, lk: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Size, int]:
    """The log-domain forms' common start: padded keys at $-\\infty$ (``lk`` (..., n, F)) with zero
    values (``v`` (..., n, dv)), and the broadcast batch shape ``lead`` of ``lq``, ``lk``, ``v`` and
    the state, with its size ``L``."""
    if key_padding_mask is not None:
        lk = lk.masked_fill(key_padding_mask.unsqueeze(-1), float("-inf"))
        v = v.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
    shapes = [lq.shape[:-2], lk.shape[:-2], v.shape[:-2]]
    if initial_state is not None:
        shapes.append(initial_state.kv.shape[:-2])
    lead = broadcast_shapes(*shapes)
    return lk, v, lead, math.prod(lead)


def causal_log_scan(
    lq: torch.Tensor,
    lk: torch.Tensor,
    v: torch.Tensor,
    *,
    log2: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    delay: int = 0,
    block: int = 0,
    chunk: int = CHUNK,
    tile: int = TILE,
) -> ScanResult:
    r"""Causal linear attention of a positive map with every feature at its own causal scale,
    in a fixed number of tensor operations (module docstring).

    $$
    [\text{num}, \text{den}]_i = e^{-\sigma_i}\sum_{j \in J_i}\sum_f e^{\ell^q_{if} + \ell^k_{jf}} [v_j, 1]
    $$

    (``2**`` for log2 features) with $J_i = \{j \le i\}$ (and the initial state's keys), so that
    $o_i = \text{num}_i / \text{den}_i$.

    Parameters
    ----------
    lq : Tensor, shape (..., n, F)
        $\log\varphi(q_i)$ up to a constant per row (base 2 with ``log2``, else natural).
    lk : Tensor, shape (..., n, F)
        $\log\psi(k_j)$, every term included; $-\infty$ for a key that takes no part.
    v : Tensor, shape (..., n, dv)
    log2 : bool, default True
        The base of ``lq`` and ``lk`` (and of the returned ``shift``).
    key_padding_mask : Tensor, shape broadcasting with (..., n), bool, optional
        ``True`` = padded key: no part in any row (a row that sees only padded keys gives 0).
    initial_state : LinearAttentionState, optional
        The keys before the first token: ``kv`` (..., F, dv + 1) at a shared (..., 1, 1) or
        per-feature (..., F, 1) natural ``log_scale``. Not with ``delay`` or ``block``.
    return_state : bool, default False
        Return the state after the last token (per feature). Not with ``delay`` or ``block``.
    delay : int, default 0
        Query $i$ reads the keys $j \le i - \text{delay}$ (the hybrid's remainder).
    block : int, default 0
        ``> 0``: query $i$ reads the keys of the blocks $\le \lfloor i / \text{block}\rfloor - 2$
        (blocks of ``block`` tokens; the chunk is then the block, no scores within it).
    chunk : int, default `CHUNK`
        Tokens per chunk of the state scan (rounded up to whole tiles; see `sizes`).
    tile : int, default `TILE`
        Tokens per tile of exact scores.

    Returns
    -------
    ScanResult
        ``num`` (*lead, n, dv), ``den`` (*lead, n), ``shift`` (*lead, n), and ``state``
        (*lead, F, dv + 1) with ``return_state`` (else ``None``), ``lead`` the broadcast batch shape.

    Examples
    --------
    Features $2^{\pm 200}$ that meet in no per-row shift: the denominators stay $\ge 1$.

    >>> lq = torch.tensor([[200.0, -200.0], [0.0, -400.0]])
    >>> lk = torch.tensor([[-400.0, 0.0], [-400.0, 0.0]])
    >>> r = causal_log_scan(lq, lk, torch.tensor([[1.0], [3.0]]))
    >>> r.den >= 1, r.num[:, 0] / r.den
    (tensor([True, True]), tensor([1., 2.]))
    """
    _check_int("delay", delay, 0)
    _check_int("block", block, 0)
    _check_int("chunk", chunk, 1)
    _check_int("tile", tile, 1)
    if (delay or block) and (initial_state is not None or return_state):
        raise ValueError("causal_log_scan: initial_state and return_state need delay=0 and block=0")
    n, Fd, dv = lq.shape[-2], lq.shape[-1], v.shape[-1]
    exp = torch.exp2 if log2 else torch.exp
    to_nat = _LN2 if log2 else 1.0
    ninf = float("-inf")
    lk, v, lead, L = padded_keys(lq, lk, v, key_padding_mask, initial_state)
    lq, lk, v = _flatten(lq, lead, L), _flatten(lk, lead, L), _flatten(v, lead, L)
    if block:
        C = c = block
        gap = 2  # chunk c reads the chunks <= c - 2
    else:
        if delay:  # shift the keys by the delay: query i then reads the shifted keys j <= i
            lk = F.pad(lk, (0, 0, delay, 0), value=ninf)[:, :n]
            v = F.pad(v, (0, 0, delay, 0))[:, :n]
        c, C = sizes(n, chunk, tile)
        gap = 1
    nc = -(-n // C)
    tail = nc * C - n
    lq = F.pad(lq, (0, 0, 0, tail)).reshape(L, nc, C, Fd)
    lk = F.pad(lk, (0, 0, 0, tail), value=ninf).reshape(L, nc, C, Fd)
    v = F.pad(v, (0, 0, 0, tail)).reshape(L, nc, C, dv)
    dt = lq.dtype

    # across chunks: chunk sums at the chunk's per-feature maximum, one logcumsumexp over chunks
    with torch.no_grad():
        Mc = lk.amax(dim=2)  # (L, nc, F)
        Mc0 = torch.where(Mc == ninf, torch.zeros_like(Mc), Mc)
    ek = exp(lk - Mc0.unsqueeze(2))  # (L, nc, C, F), in [0, 1]
    ones = torch.ones_like(v[..., :1])
    vals = torch.cat([v.clamp(min=0), (-v).clamp(min=0), ones], dim=-1)  # (L, nc, C, 2dv+1)
    logT = _safe_log(torch.matmul(ek.mT, vals)) + (Mc0 * to_nat).unsqueeze(-1)  # natural log
    if initial_state is not None:
        init = _state_logs(initial_state, dv, dt).expand(*lead, Fd, 2 * dv + 1).reshape(L, 1, Fd, 2 * dv + 1)
    else:
        init = logT.new_full((L, 1, Fd, 2 * dv + 1), NEG)
    logS = torch.logcumsumexp(torch.cat([init, logT], dim=1), dim=1)  # (L, nc+1, F, 2dv+1), inclusive
    reads = F.pad(logS, (0, 0, 0, 0, gap - 1, 0), value=NEG)[:, :nc]  # the state before each chunk
    with torch.no_grad():
        Rn = reads[..., -1]  # (L, nc, F): log-mass of each feature in the state
        empty = Rn < NEG / 2
        Rq = torch.where(empty, torch.full_like(Rn, ninf), Rn * (1.0 / to_nat))  # in the inputs' base
    St = torch.exp(reads - torch.where(empty, torch.zeros_like(Rn), Rn).unsqueeze(-1))  # ones column 1 (0 if empty)

    with torch.no_grad():
        if block:
            Tq = Rq.unsqueeze(2)  # (L, nc, 1, F)
        else:
            Tq = torch.maximum(Rq.unsqueeze(2), torch.cummax(lk, dim=2).values)  # (L, nc, C, F)
        sig = (lq + Tq).amax(dim=-1, keepdim=True)  # (L, nc, C, 1); -inf for a row that sees nothing
        sig0 = torch.where(sig == ninf, torch.zeros_like(sig), sig)
    out = torch.matmul(exp(lq + Rq.unsqueeze(2) - sig0), St)  # (L, nc, C, 2dv+1)
    num = out[..., :dv] - out[..., dv:2 * dv]
    den = out[..., 2 * dv]
    if not block:
        intra = tile_scores(lq, lk, torch.cat([v, ones], dim=-1), sig0, c, exp)
        num = num + intra[..., :dv]
        den = den + intra[..., dv]
    num = num.reshape(L, nc * C, dv)[:, :n].reshape(*lead, n, dv)
    den = den.reshape(L, nc * C)[:, :n].reshape(*lead, n)
    shift = sig.reshape(L, nc * C)[:, :n].reshape(*lead, n)
    state = None
    if return_state:
        last = logS[:, -1]  # (L, F, 2dv+1), every key and the initial state
        with torch.no_grad():
            Rf = last[..., -1]
            Rf0 = torch.where(Rf < NEG / 2, torch.zeros_like(Rf), Rf)
        kvp = torch.exp(last - Rf0.unsqueeze(-1))
        kv = torch.cat([kvp[..., :dv] - kvp[..., dv:2 * dv], kvp[..., 2 * dv:]], dim=-1)
        state = LinearAttentionState(kv.reshape(*lead, Fd, dv + 1), Rf0.double().reshape(*lead, Fd, 1))
    return ScanResult(num, den, shift, state)
