r"""Causal linear attention of the maps with one log-scale per key row -- the signed maps
(trigonometric, Taylor, Nyström, hybrid) and the positive maps without log2 features (elu+1,
ReLU) -- in a number of tensor operations that does not depend on the sequence length (the
accelerator's torch path for them).

Keys enter as $\psi(k_j) = f_j\,e^{s_j}$: bounded features $f_j$ of either sign and one
natural log-scale $s_j$ per key (`FeatureMap.key_log_features`; $e^{\|k\|^2/2}$ and its
relatives for the trigonometric and hybrid maps, $\log\|\varphi(k)\|$ for Taylor, the largest
landmark exponent for Nyström, 0 for elu+1 and ReLU). Queries enter as $\varphi(q_i)$ up to a
positive factor per row (`FeatureMap.query_features`), which cancels. Each query works at the
running maximum of the key scales,

$$
M_i = \max\big(G_0, \max_{j \le i} s_j\big),
$$

($G_0$ the initial state's scale), the scale of the running-maximum path
`kernelapprox.attention.linear.chunk_runmax`, so that the stabilised numerators and denominators
are those of that path, which the signed maps' normaliser (`kernelapprox.attention._common.normalise`)
judges; the scalar $e^{s_j - M_i} \le 1$ is a decay gate shared by every feature (gated linear
attention with a data-dependent scalar gate [Yan24]_; the causal product [Kat20]_). With chunks
$c$ of $C$ tokens:

- **Within a chunk** the scores are exact: $A_{ij} = \varphi(q_i)^\top f_j\,e^{s_j - M_i}$,
  $j \le i$, one GEMM and one shift per row (`row_scores`), signed.
- **Across chunks** the keys of chunk $c$ enter as the chunk sum at the chunk's maximum
  $m_c = \max_{j \in c} s_j$, $T_c = \sum_{j \in c} f_j^\top [v_j, 1]\,e^{s_j - m_c}$, and the
  state before chunk $c$ is kept at $G_{c-1} = \max(G_0, \max_{c' < c} m_{c'})$:

  $$
  \tilde S_{<c} = \sum_{c' < c} e^{m_{c'} - G_{c-1}}\, T_{c'} \;+\; e^{G_0 - G_{c-1}} S_0,
  $$

  read as $e^{G_{c-1} - M_i}\,\varphi(q_i)^\top\tilde S_{<c}$. The weights factor as
  $e^{m_{c'}}e^{-G_{c-1}}$, but a cumulative sum of $e^{m_{c'}} T_{c'}$ would overflow (key
  scales $\|k\|^2/2$ in the thousands), and a ``logcumsumexp`` of the logarithms of the positive
  and negative parts of the signed $T$ rounds each logarithm to the size of the scales
  ($s \approx 8192$ at $\|k\| = 128$: a relative $5 \cdot 10^{-4}$ in float32), loses the gradient
  at entries that are 0, and is slow (measured on CPU: 3 times this call's other work). The sum
  is therefore two levels of exact weight matrices, every entry an exponential of a difference
  $\le 0$ formed in the scales' own dtype (`weighted_prefix`): one batched GEMM within groups of
  16 chunks, one across the groups' totals.

Every weight is $\le 1$, so nothing overflows for finite inputs:
$|\tilde S_{<c}| \le n \max|f| \max|[v, 1]|$. The denominators are those of the
running-maximum path: a signed map's can cancel (its estimate of the row sum is near 0), a
positive map's can underflow where the products $\varphi_f(q)\varphi_f(k)$ do; both go to
`normalise`, as on the CPU. The shifts $m$, $G$, $M$ are constants for autograd; $s$ keeps its
gradient through the gates.

Positive maps without log2 features (elu+1, ReLU) take this path too, rather than their log
features $\log\varphi$ through the per-feature scan of
`kernelapprox.attention.linear.chunk_logscan`. It is safe without per-feature scales: their
features carry no exponential scale ($s_j = 0$, $0 \le \varphi(x) \le 1 + \max(x, 0)$), so the
products $\varphi(q)^\top\varphi(k)$ and their sums over all keys are representable wherever
the features are (float32: $n F (1 + \|x\|_\infty)^2 \max|v| < 3 \cdot 10^{38}$); every term of
a denominator is $\ge 0$, so its rounding is relative (no cancellation); and per-feature
scales built from the map's own float32 features would recover nothing that their underflow
(elu's $e^x$ below $x \approx -87$) has already lost. A denominator is then 0 only where every
product is 0 (ReLU's all-negative query: 0/0, as on the CPU path). The gates are all 1 and this
is the plain chunked form. Measured on CPU (one thread, $B = 1$, $H = 4$, $d = F = 64$,
$d_v = 64$, forward and backward): 122 ms (elu+1) and 71 ms (ReLU) at $n = 4096$, against 765 and
819 ms through the per-feature log scan. Their returned state has one scale, as on the CPU path.

A non-finite input reaches every row of its chunk and every later row, never an earlier chunk;
a row that sees no key (padding) has $\text{num} = \text{den} = 0$, as on the CPU path. Cost per sequence: time $O(nC(F + d_v) + nFd_v)$;
memory under autograd (measured with ``torch.autograd.graph.saved_tensors_hooks`` at
$n = 4096$, $F = 128$, $d_v = 64$, $C = 64$, the map excluded): $9.1\,nF$ elements of float32
(the features, the scores, their float64 gates and the masked scores $\approx 5nC$, the chunk
states $(n/C)F(d_v + 1)$ and their prefix sums), where the per-feature scan keeps $32\,nF$.

References
----------
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
   autoregressive transformers with linear attention", ICML 2020.
.. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers
   with hardware-efficient training", ICML 2024.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._validation import broadcast_shapes
from ..state import LinearAttentionState
from .chunk_logscan import ScanResult

__all__ = ["CHUNK", "GROUP", "causal_row_scan", "row_scores", "row_setup", "weighted_prefix"]

#: Tokens per chunk (default).
CHUNK = 64
#: Chunk states per group of `weighted_prefix` (the exact weight matrix within a group).
GROUP = 16


def _gates(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """``exp(a - b)`` (broadcast) with ``a = -inf`` read as 0 and, where ``keep`` is false, 0
    (masked before the exponential: a dropped entry may be ``exp(+inf)``)."""
    d = a - b
    drop = a == float("-inf")
    if keep is not None:
        drop = drop | ~keep
    return torch.exp(d.masked_fill(drop, float("-inf")))


def weighted_prefix(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    r"""The prefix sums $y_c = \sum_{c' \le c} e^{a_{c'} - b_c}\, x_{c'}$ of signed ``x``, with
    every weight formed as an exponential of a difference $\le 0$.

    The weights factor as $e^{a_{c'}}e^{-b_c}$, but a cumulative sum of $e^{a_{c'}} x_{c'}$ would
    overflow (key scales $\|k\|^2/2$ in the thousands). With $b$ non-decreasing and
    $a_c \le b_c$, two levels of exact weight matrices: within groups of $g$ entries
    (``group``), $y^{\text{loc}}_c = \sum_{c' \le c,\ c' \in \gamma(c)} e^{a_{c'} - b_c}x_{c'}$ (one
    batched GEMM with a $(g \times g)$ weight matrix per group), and across groups, the totals
    $X_\gamma = y^{\text{loc}}_{e(\gamma)}$ at each group's last entry $e(\gamma)$ summed by one
    more GEMM, $Y_\gamma = \sum_{\gamma' < \gamma} e^{b_{e(\gamma')} - b_{e(\gamma - 1)}} X_{\gamma'}$, read as
    $y_c = y^{\text{loc}}_c + e^{b_{e(\gamma(c) - 1)} - b_c}\,Y_{\gamma(c)}$. Every exponent is a
    difference $\le 0$ formed in the dtype of ``a`` and ``b`` (float64 for the maps' log-scales),
    so the weights carry no rounding of the scales' size; signed sums stay GEMM sums (no split
    into parts, no logarithm); linear in ``x``, the backward is autograd's. Cost per sequence
    $O(N g M + (N/g)^2 M)$ for $N$ entries of $M$ elements: a fixed number of operations for any
    $N$. ``a`` and ``b`` are constants for autograd. A NaN or $+\infty$ in ``a`` or ``b`` and a
    non-finite entry of ``x`` make the same and every later entry NaN, no earlier one (they enter
    the GEMMs as 0: a weight 0 times NaN would reach the earlier entries).

    Parameters
    ----------
    x : Tensor, shape (L, N, ...)
    a, b : Tensor, shape (L, N)
        $a_c \le b_c$, $b$ non-decreasing; $a = -\infty$ for an entry of weight 0.
    group : int, default `GROUP`

    Returns
    -------
    Tensor, shape (L, N, ...), ``x``'s dtype.

    Examples
    --------
    >>> x = torch.tensor([[3.0, -1.0, 2.0]])
    >>> a, b = torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.0, 1.0, 1.0]])
    >>> weighted_prefix(x, a, b, group=2)  # [3, 3/e - 1, 3/e - 1 + 2/e]
    tensor([[3.0000, 0.1036, 0.8394]])
    """
    L, N = a.shape
    tail = x.shape[2:]
    Mx = math.prod(tail)
    a, b = a.detach(), b.detach()
    ng = -(-N // group)
    pad = ng * group - N
    with torch.no_grad():
        ap = F.pad(a, (0, pad), value=float("-inf")).reshape(L, ng, group)
        bp = torch.cat([b, b[:, -1:].expand(L, pad)], dim=1).reshape(L, ng, group)
        ar = torch.arange(group, device=a.device)
        W = _gates(ap.unsqueeze(-2), bp.unsqueeze(-1), ar[:, None] >= ar[None, :]).to(x.dtype)  # (L, ng, g, g)
        e = bp[..., -1]  # (L, ng): each group's last reference
        e_in = F.pad(e[:, :-1], (1, 0), value=float("-inf"))  # before each group
        ga = torch.arange(ng, device=a.device)
        Wg = _gates(e.unsqueeze(-2), e_in.unsqueeze(-1), ga[None, :] < ga[:, None]).to(x.dtype)  # (L, ng, ng)
        read = _gates(e_in.unsqueeze(-1), bp).to(x.dtype)  # (L, ng, g): e^{b_{e(gamma-1)} - b_c}
    # a non-finite entry enters the GEMMs as 0 (its weight 0 for the earlier entries would make it
    # NaN there) and marks its own and every later entry
    x = x.reshape(L, N, Mx)
    bad = ~torch.isfinite(x)
    with torch.no_grad():
        bad_ab = (a.isnan() | (a == math.inf) | b.isnan() | (b == math.inf)).unsqueeze(-1)  # (L, N, 1)
        poison = torch.cumsum(bad | bad_ab, dim=1, dtype=torch.int32) > 0
        W, Wg, read = (w.masked_fill(w.isnan(), 0.0) for w in (W, Wg, read))
    xp = F.pad(x.masked_fill(bad, 0.0), (0, 0, 0, pad)).reshape(L, ng, group, Mx)
    local = torch.matmul(W, xp)  # (L, ng, g, M)
    Y = torch.matmul(Wg, local[:, :, -1])  # (L, ng, M): the earlier groups, at e_in
    y = (local + read.unsqueeze(-1) * Y.unsqueeze(2)).reshape(L, ng * group, Mx)[:, :N]
    return y.masked_fill(poison, math.nan).reshape(L, N, *tail)


def row_scores(
    fq: torch.Tensor, fk: torch.Tensor, v1: torch.Tensor, s: torch.Tensor, M0: torch.Tensor, cdt: torch.dtype,
) -> torch.Tensor:
    r"""The keys of each query's own chunk: $\sum_{j \le i} \varphi(q_i)^\top f_j\,e^{s_j - M_i}\,[v_j, 1]$.

    The gates $e^{s_j - M_i}$ are formed in the dtype of ``s`` (float64 for the random maps) and
    rounded once to ``cdt``, as on the running-maximum path (whose rows these then match to the
    rounding of the sums), and masked before the exponential (a later key's gate may be
    $e^{+\infty}$);
    the scores are masked after the product too, so that a non-finite later key stays out of the
    row's scores.

    Parameters
    ----------
    fq, fk : Tensor, shape (..., C, F)
    v1 : Tensor, shape (..., C, P)
    s : Tensor, shape (..., C)
        Key log-scales ($-\infty$ for a padded key).
    M0 : Tensor, shape (..., C)
        Finite row scales with $M_i \ge s_j$ for $j \le i$.
    cdt : torch.dtype
        The compute dtype of the scores.

    Returns
    -------
    Tensor, shape (..., C, P)

    Examples
    --------
    >>> fq = torch.ones(3, 1); fk = torch.ones(3, 1); v1 = torch.tensor([[1.0, 1.0], [3.0, 1.0], [5.0, 1.0]])
    >>> s = torch.tensor([0.0, 0.0, 0.0])
    >>> row_scores(fq, fk, v1, s, s, torch.float32)
    tensor([[1., 1.],
            [4., 2.],
            [9., 3.]])
    """
    C = fq.shape[-2]
    ar = torch.arange(C, device=fq.device)
    causal = ar[:, None] >= ar[None, :]
    D = (s.unsqueeze(-2) - M0.unsqueeze(-1)).masked_fill(~causal, float("-inf"))  # (..., C_i, C_j)
    E = torch.exp(D).to(cdt)
    A = (torch.matmul(fq, fk.mT) * E).masked_fill(~causal, 0.0)
    return torch.matmul(A, v1)


def _exp_gate(a: torch.Tensor, b: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """``exp(a - b)`` with ``a = -inf`` read as 0 (an empty past), in ``cdt``."""
    return torch.where(a == float("-inf"), torch.zeros_like(a), torch.exp(a - b)).to(cdt)


def _finite0(x: torch.Tensor) -> torch.Tensor:
    """``x`` with ``-inf`` replaced by 0 (a finite reference where nothing is seen)."""
    return torch.where(x == float("-inf"), torch.zeros_like(x), x)


def row_setup(
    fq: torch.Tensor, fk: torch.Tensor, s: torch.Tensor, v: torch.Tensor,
    key_padding_mask: torch.Tensor | None, initial_state: LinearAttentionState | None,
) -> tuple[torch.Size, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The common inputs of the row-scale forms, flattened to ``L`` sequences: ``lead``, ``fq``,
    ``fk`` (L, n, F), ``s`` (L, n) with padded keys at $-\\infty$, ``v1`` (L, n, dv + 1) with
    padded rows 0, the initial state's ``kv`` (L, F, dv + 1) or ``None``, and its scale ``G0``
    (L, 1) ($-\\infty$ without a state). ``initial_state`` has one scale per sequence."""
    n, Fd, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    cdt = torch.promote_types(torch.promote_types(fq.dtype, fk.dtype), v.dtype)
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask, float("-inf"))
        v = v.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
    shapes = [fq.shape[:-2], fk.shape[:-2], s.shape[:-1], v.shape[:-2]]
    if initial_state is not None:
        shapes.append(initial_state.kv.shape[:-2])
    lead = broadcast_shapes(*shapes)
    L = math.prod(lead)
    fq = fq.to(cdt).expand(*lead, n, Fd).reshape(L, n, Fd)
    fk = fk.to(cdt).expand(*lead, n, Fd).reshape(L, n, Fd)
    s = s.expand(*lead, n).reshape(L, n)
    v = v.to(cdt).expand(*lead, n, dv).reshape(L, n, dv)
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # a padded key's ones are gated to 0 by s
    kv0 = None
    G0 = s.new_full((L, 1), float("-inf"))
    if initial_state is not None:
        if initial_state.log_scale.shape[-2] != 1:
            raise ValueError("the row-scale forms take a state with one log_scale per sequence (..., 1, 1); "
                             f"got log_scale of shape {tuple(initial_state.log_scale.shape)}")
        kv0 = initial_state.kv.to(cdt).expand(*lead, Fd, dv + 1).reshape(L, Fd, dv + 1)
        G0 = initial_state.log_scale.detach().to(s.dtype).expand(*lead, 1, 1).reshape(L, 1)
    return lead, fq, fk, s, v1, kv0, G0


def causal_row_scan(
    fq: torch.Tensor,
    fk: torch.Tensor,
    s: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    chunk: int = CHUNK,
) -> ScanResult:
    r"""Causal linear attention of a map with one log-scale per key row, in a fixed number of
    tensor operations (module docstring).

    $$
    [\text{num}, \text{den}]_i = \sum_{j \le i} \varphi(q_i)^\top f_j\, e^{s_j - M_i}\, [v_j, 1]
        \;+\; e^{G_0 - M_i}\,\varphi(q_i)^\top S_0,
    $$

    the true row times $e^{-M_i}$ and the query's own factor, which cancel in
    $o_i = \text{num}_i / \text{den}_i$.

    Parameters
    ----------
    fq : Tensor, shape (..., n, F)
        $\varphi(q_i)$ up to a positive factor per row (`FeatureMap.query_features`).
    fk : Tensor, shape (..., n, F)
        Bounded key features $f_j$ (`FeatureMap.key_log_features`).
    s : Tensor, shape (..., n)
        Natural key log-scales $s_j$ (float64 for the random maps; the gates are formed from
        differences in this dtype).
    v : Tensor, shape (..., n, dv)
    key_padding_mask : Tensor, shape broadcasting with (..., n), bool, optional
        ``True`` = padded key: no part in any row (a row that sees only padded keys gives 0).
    initial_state : LinearAttentionState, optional
        ``kv`` (..., F, dv + 1) at one natural ``log_scale`` (..., 1, 1) per sequence.
    return_state : bool, default False
        Return the state after the last token, at the scale $G$ of every key seen.
    chunk : int, default `CHUNK`
        Tokens per chunk (a call shorter than a chunk is one chunk of its own length).

    Returns
    -------
    ScanResult
        ``num`` (*lead, n, dv), ``den`` (*lead, n), ``shift`` $M_i$ (*lead, n) (natural log,
        $-\infty$ for a row that sees nothing), ``state`` (``kv`` (*lead, F, dv + 1),
        ``log_scale`` (*lead, 1, 1)) with ``return_state``, else ``None``.

    Examples
    --------
    Signed features at the key scale $e^{400}$ (beyond float32), the second row
    $(-1 \cdot 1 + 1.5 \cdot 3) / (-1 + 1.5) = 7$:

    >>> fq = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    >>> fk = torch.tensor([[1.0, -2.0], [1.0, 0.5]])
    >>> r = causal_row_scan(fq, fk, torch.tensor([400.0, 400.0]), torch.tensor([[1.0], [3.0]]))
    >>> r.num[:, 0] / r.den, r.shift
    (tensor([1., 7.]), tensor([400., 400.]))
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
    n, Fd, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    lead, fq, fk, s, v1, kv0, G0 = row_setup(fq, fk, s, v, key_padding_mask, initial_state)
    L, P, cdt = fq.shape[0], dv + 1, fq.dtype
    ninf = float("-inf")
    C = chunk if torch.compiler.is_compiling() else min(chunk, n)
    nc = -(-n // C)
    tail = nc * C - n
    if tail or torch.compiler.is_compiling():  # (a zero pad copies; under compile n may be symbolic)
        fq, fk, v1 = (F.pad(x, (0, 0, 0, tail)) for x in (fq, fk, v1))
        s = F.pad(s, (0, tail), value=ninf)
    fq, fk = fq.reshape(L, nc, C, Fd), fk.reshape(L, nc, C, Fd)
    v1, s = v1.reshape(L, nc, C, P), s.reshape(L, nc, C)
    with torch.no_grad():
        sd = s.detach()
        m_in = torch.cummax(sd, dim=-1).values  # (L, nc, C): within the chunk, up to each row
        mc = m_in[..., -1]  # (L, nc): each chunk's maximum
        m_all = torch.cat([G0, mc], dim=-1)  # (L, nc + 1): the initial state, then the chunks
        G = torch.cummax(m_all, dim=-1).values  # the scale through each entry
        G_excl = G[:, :nc]  # before each chunk
        M = torch.maximum(m_in, G_excl.unsqueeze(-1))  # (L, nc, C): each row's scale
        M0 = _finite0(M)
    intra = row_scores(fq, fk, v1, s, M0, cdt)  # (L, nc, C, P)
    w = _exp_gate(s, _finite0(mc).unsqueeze(-1), cdt).unsqueeze(-1)  # e^{s_j - m_c} <= 1
    T = torch.matmul(fk.mT, v1 * w)  # (L, nc, F, P)
    init = kv0.unsqueeze(1) if kv0 is not None else T.new_zeros(L, 1, Fd, P)
    states = weighted_prefix(torch.cat([init, T], dim=1), m_all, G)  # (L, nc + 1, F, P), at G
    gate = _exp_gate(G_excl.unsqueeze(-1), M0, cdt).unsqueeze(-1)  # e^{G_{c-1} - M_i}
    out = torch.matmul(fq, states[:, :nc]) * gate + intra
    out = out.reshape(L, nc * C, P)[:, :n]
    num = out[..., :dv].reshape(*lead, n, dv)
    den = out[..., dv].reshape(*lead, n)
    shift = M.reshape(L, nc * C)[:, :n].reshape(*lead, n)
    state = None
    if return_state:
        g_last = G[:, -1:]  # 0 where no key was seen (or a non-finite one)
        g_last = torch.where(torch.isfinite(g_last), g_last, torch.zeros_like(g_last))
        state = LinearAttentionState(states[:, -1].reshape(*lead, Fd, P), g_last.reshape(*lead, 1, 1))
    return ScanResult(num, den, shift, state)
