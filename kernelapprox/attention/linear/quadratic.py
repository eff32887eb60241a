r"""Causal linear attention of positive maps for short calls on accelerators: the quadratic form,
one masked score GEMM and one value GEMM, with every feature at a causal scale.

A short call is launch-bound: its time is the number of kernels, not their work. The scan of
`kernelapprox.attention.linear.chunk_logscan` has a fixed number of operations, most of them for
the state carried across chunks (the chunk sums, their ``logcumsumexp``, the state's read). Here
the whole sequence is one chunk and that machinery is gone: with tiles of $c$ tokens,

$$
[\text{num}, \text{den}]_i = \sum_{t' < t(i)}\sum_{j \in t'}
    \Big(\sum_f e^{\ell^q_{if} + M_{t'f} - \sigma_i}\, e^{\ell^k_{jf} - M_{t'f}}\Big)[v_j, 1]
  + \sum_{j \in t(i),\, j \le i}\Big(\sum_f e^{\ell^q_{if} + \ell^k_{jf} - \sigma_i}\Big)[v_j, 1]
$$

(``2**`` for log2 features): the earlier tiles through one GEMM of the queries against the keys,
each key tile at its own per-feature maximum $M_{t'f}$ (causal: its keys are all before the
query), the query's own tile by exact scores, and an initial state through one more GEMM at its
per-feature log-mass $X_f$. The shift $\sigma_i = \max_f(\ell^q_{if} + T_{if})$, with $T_{if}$ the
feature's causal maximum (and $X_f$), keeps every factor in $[0, 1]$ and gives
$1 \le \text{den}_i \le F(n + 1)$ for a row that sees a key or a state, at any norm (the argument
of `kernelapprox.attention.linear.chunk_logscan`). A single GEMM pair at one per-feature
reference for all keys (`kernelapprox.attention._common.doubly_shifted`) would be cheaper still,
but a later key that sets a feature's reference can underflow an earlier row (its denominator
below `kernelapprox.attention._common.den_floor`); the causal tile references leave no such row,
so no fallback has to be evaluated beside it (without a host read, a fallback is always computed).

Cost per sequence: time $O(n F (n + c) + n^2 d_v)$; memory under autograd $n F (n/c + c + 3) + n^2$
elements (the between-tile query factors, the exact tile scores, the key and state factors, the
score matrix): for short calls.

The maps with one log-scale per key row (signed maps, and positive maps without log2 features)
have their short form too, `quadratic_row_attention`: the whole call one chunk of
`kernelapprox.attention.linear.chunk_rowscan` (one score GEMM with the gates
$e^{s_j - M_i}$, one value GEMM, the initial state through one more), without the scan across
chunks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..state import LinearAttentionState
from .chunk_logscan import ScanResult, padded_keys, sizes, tile_scores
from .chunk_rowscan import row_scores, row_setup

__all__ = ["QUADRATIC_TILE", "quadratic_log_attention", "quadratic_row_attention"]

#: Tokens per tile of exact scores of the quadratic form.
QUADRATIC_TILE = 8

_LN2 = math.log(2.0)


def quadratic_log_attention(
    lq: torch.Tensor,
    lk: torch.Tensor,
    v: torch.Tensor,
    *,
    log2: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    tile: int = QUADRATIC_TILE,
) -> ScanResult:
    r"""Causal linear attention of a positive map as one masked score GEMM pair (module docstring).

    Parameters
    ----------
    lq : Tensor, shape (..., n, F)
        $\log\varphi(q_i)$ up to a constant per row (base 2 with ``log2``, else natural).
    lk : Tensor, shape (..., n, F)
        $\log\psi(k_j)$, every term included; $-\infty$ for a key that takes no part.
    v : Tensor, shape (..., n, dv)
    log2 : bool, default True
        The base of ``lq`` and ``lk``.
    key_padding_mask : Tensor, shape broadcasting with (..., n), bool, optional
        ``True`` = padded key.
    initial_state : LinearAttentionState, optional
        ``kv`` (..., F, dv + 1) at a shared or per-feature natural ``log_scale``.
    return_state : bool, default False
        Return the state after the last token (per feature).
    tile : int, default `QUADRATIC_TILE`
        Tokens per tile of exact scores.

    Returns
    -------
    ScanResult
        As `kernelapprox.attention.linear.chunk_logscan.causal_log_scan`: ``num`` (*lead, n, dv),
        ``den`` (*lead, n) ($\ge 1$ for a row that sees a key or a state, else 0), ``shift``
        (*lead, n), ``state`` (*lead, F, dv + 1) or ``None``.

    Examples
    --------
    >>> lq = torch.tensor([[200.0, -200.0], [0.0, -400.0]])
    >>> lk = torch.tensor([[-400.0, 0.0], [-400.0, 0.0]])
    >>> r = quadratic_log_attention(lq, lk, torch.tensor([[1.0], [3.0]]))
    >>> r.den >= 1, r.num[:, 0] / r.den
    (tensor([True, True]), tensor([1., 2.]))
    """
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    n, Fd, dv = lq.shape[-2], lq.shape[-1], v.shape[-1]
    exp = torch.exp2 if log2 else torch.exp
    to_nat = _LN2 if log2 else 1.0
    ninf = float("-inf")
    lk, v, lead, L = padded_keys(lq, lk, v, key_padding_mask, initial_state)
    c, _ = sizes(n, tile, tile)
    C = -(-n // c) * c
    tail = C - n
    lq = F.pad(lq.expand(*lead, n, Fd).reshape(L, n, Fd), (0, 0, 0, tail))
    lk = F.pad(lk.expand(*lead, n, Fd).reshape(L, n, Fd), (0, 0, 0, tail), value=ninf)
    v = F.pad(v.expand(*lead, n, dv).reshape(L, n, dv), (0, 0, 0, tail))
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (L, C, dv+1)
    kv0 = X = None
    if initial_state is not None:
        # the state at its per-feature log-mass X (inputs' base): each reached feature's mass 1
        skv = initial_state.kv.expand(*lead, Fd, dv + 1).reshape(L, Fd, dv + 1).to(lq.dtype)
        with torch.no_grad():
            z0 = skv[..., dv].double()
            ls = initial_state.log_scale.detach().double().expand(*lead, Fd, 1).reshape(L, Fd)
            X = torch.where(z0 > 0, (torch.log(z0.clamp(min=1e-300)) + ls) / to_nat, torch.full_like(z0, ninf))
            X = X.to(lq.dtype)
            inv = torch.where(z0 > 0, 1.0 / z0, torch.zeros_like(z0)).to(lq.dtype)
        kv0 = skv * inv.unsqueeze(-1)
    with torch.no_grad():
        T = torch.cummax(lk, dim=1).values  # (L, C, F): each feature's causal maximum
        if X is not None:
            T = torch.maximum(T, X.unsqueeze(1))
        sig = (lq + T).amax(dim=-1, keepdim=True)  # (L, C, 1); -inf for a row that sees nothing
        sig0 = torch.where(sig == ninf, torch.zeros_like(sig), sig)
    out = tile_scores(lq.unsqueeze(1), lk.unsqueeze(1), v1.unsqueeze(1), sig0.unsqueeze(1), c, exp).squeeze(1)
    if kv0 is not None and X is not None:
        out = out + torch.matmul(exp(lq + X.unsqueeze(1) - sig0), kv0)
    num = out[:, :n, :dv].reshape(*lead, n, dv)
    den = out[:, :n, dv].reshape(*lead, n)
    shift = sig[:, :n, 0].reshape(*lead, n)
    state = None
    if return_state:
        with torch.no_grad():
            t = lk.amax(dim=1)  # (L, F)
            if X is not None:
                t = torch.maximum(t, X)
            t0 = torch.where(t == ninf, torch.zeros_like(t), t)
        kv = torch.matmul(exp(lk - t0.unsqueeze(1)).mT, v1)  # (L, F, dv+1)
        if kv0 is not None and X is not None:
            kv = kv + exp(X - t0).unsqueeze(-1) * kv0
        state = LinearAttentionState(kv.reshape(*lead, Fd, dv + 1), (t0.double() * to_nat).reshape(*lead, Fd, 1))
    return ScanResult(num, den, shift, state)


def quadratic_row_attention(
    fq: torch.Tensor,
    fk: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> ScanResult:
    r"""Causal linear attention of a map with one log-scale per key row for short calls: one
    score GEMM, one value GEMM (module docstring).

    $$
    [\text{num}, \text{den}]_i = \sum_{j \le i} \varphi(q_i)^\top f_j\, e^{s_j - M_i} [v_j, 1]
        + e^{G_0 - M_i}\,\varphi(q_i)^\top S_0, \qquad M_i = \max(G_0, \max_{j \le i} s_j),
    $$

    as `kernelapprox.attention.linear.chunk_rowscan.causal_row_scan` with one chunk.

    Parameters
    ----------
    fq : Tensor, shape (..., n, F)
        $\varphi(q_i)$ up to a positive factor per row.
    fk : Tensor, shape (..., n, F)
        Bounded key features.
    s : Tensor, shape (..., n)
        Natural key log-scales.
    v : Tensor, shape (..., n, dv)
    key_padding_mask : Tensor, shape broadcasting with (..., n), bool, optional
        ``True`` = padded key.
    initial_state : LinearAttentionState, optional
        ``kv`` (..., F, dv + 1) at one natural ``log_scale`` (..., 1, 1) per sequence.
    return_state : bool, default False

    Returns
    -------
    ScanResult
        As `kernelapprox.attention.linear.chunk_rowscan.causal_row_scan`.

    Examples
    --------
    >>> fq = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    >>> fk = torch.tensor([[1.0, -2.0], [1.0, 0.5]])
    >>> r = quadratic_row_attention(fq, fk, torch.tensor([400.0, 400.0]), torch.tensor([[1.0], [3.0]]))
    >>> r.num[:, 0] / r.den
    tensor([1., 7.])
    """
    n, Fd, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    lead, fq, fk, s, v1, kv0, G0 = row_setup(fq, fk, s, v, key_padding_mask, initial_state)
    cdt = fq.dtype
    ninf = float("-inf")
    with torch.no_grad():
        M = torch.maximum(torch.cummax(s.detach(), dim=-1).values, G0)  # (L, n)
        M0 = torch.where(M == ninf, torch.zeros_like(M), M)
    out = row_scores(fq, fk, v1, s, M0, cdt)  # (L, n, dv + 1)
    if kv0 is not None:
        gate = torch.where(G0 == ninf, torch.zeros_like(M0), torch.exp(G0 - M0)).to(cdt)
        out = out + torch.matmul(fq, kv0) * gate.unsqueeze(-1)
    num = out[..., :dv].reshape(*lead, n, dv)
    den = out[..., dv].reshape(*lead, n)
    shift = M.reshape(*lead, n)
    state = None
    if return_state:
        with torch.no_grad():
            g = torch.maximum(s.detach().amax(dim=-1, keepdim=True), G0)  # (L, 1)
            g = torch.where(torch.isfinite(g), g, torch.zeros_like(g))
        w = torch.where(s == ninf, torch.zeros_like(s), torch.exp(s - g)).to(cdt)
        kv = torch.matmul(fk.mT, v1 * w.unsqueeze(-1))
        if kv0 is not None:
            kv = kv + kv0 * torch.where(G0 == ninf, torch.zeros_like(G0), torch.exp(G0 - g)).to(cdt).unsqueeze(-1)
        state = LinearAttentionState(kv.reshape(*lead, Fd, dv + 1), g.reshape(*lead, 1, 1))
    return ScanResult(num, den, shift, state)
