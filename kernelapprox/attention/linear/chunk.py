"""Causal linear attention computed chunk-wise: a dispatcher over two algorithms.

`chunk_shared.shared_scale_attention` (one key scale per group of chunks) and
`chunk_runmax.running_max_attention` (each query at its running maximum), one per module; and
`per_feature_attention`, which recomputes the rows whose denominator underflows with every
feature at its own causal scale. On accelerators, positive maps with log2 features go to
`chunk_logscan` (the log-domain scan) and every other map to `chunk_rowscan` (the row-scale scan),
or, for short calls, to the forms of `quadratic` (`kernelapprox.backends.attention_plan` decides).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from ... import backends
from ..._validation import broadcast_shapes, inputs_validated, no_autocast
from ...maps.base import FeatureMap
from .._common import (
    apply_padding,
    check_options,
    den_floor,
    feature_state,
    has_log2_features,
    host_reads,
    log2_state,
    lost_tolerance,
    normalise,
    padding_mask,
    per_feature_keys,
    prepare,
    row_norms,
    shared_state,
    signed_lost,
    state_abs_mass,
    with_ones,
)
from ..state import LinearAttentionState
from . import chunk_runmax, chunk_shared
from .chunk_logscan import causal_log_scan
from .chunk_rowscan import causal_row_scan
from .parallel import _GEMM_COLUMNS
from .quadratic import quadratic_log_attention, quadratic_row_attention

_PATHS = ("auto", "shared", "runmax")


def _padding_scale(s: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    r"""The log-scale given to padded keys: per sequence, the smallest of its valid keys'
    (0 for a sequence without any), shape (..., 1), detached.

    A padded key contributes through its zero row of $[V, 1]$ only, so its scale need only
    (a) raise no maximum: it is at most every valid key's, so each running maximum and group
    reference is that of the valid keys alone, once one has been seen, and (b) keep every weight
    finite. $-\infty$ would meet (a) but not (b): rows before a sequence's first valid key
    would have the running maximum $-\infty$, the weights of their (masked) future keys
    $e^{s_j + \infty}$, and the backward $0 \cdot \infty$ = NaN. With this choice those rows
    have a finite maximum, every weight a row can see is $\le 1$, and a sequence padded on the
    left keeps the shared-scale path (its keys' spread is unchanged).
    """
    lo = s.masked_fill(pad, float("inf")).amin(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(lo), lo, torch.zeros_like(lo))


#: Tokens per block of `per_feature_attention`: its intra-block scores are formed in the log
#: domain, ``n x B x F`` per sequence, and its block states ``(n / B) x F x P``; 8 balances the
#: two for ``P`` of a few dozen value columns.
_PF_BLOCK = 8


def per_feature_attention(
    lq: torch.Tensor, lk: torch.Tensor, v1: torch.Tensor, pad: torch.Tensor | None,
    initial_state: LinearAttentionState | None, lead: torch.Size, dv: int,
) -> torch.Tensor:
    r"""Causal ``[num | den]`` with every feature at its own causal scale: $\text{den}_i \ge 1$.

    With $\ell^q_{if} = \log_2\varphi_f(q_i) + c_i$ (``lq``, $c_i$ any per-row constant) and
    $\ell^k_{jf} = \log_2\psi_f(k_j)$ (``lk``), the per-feature running maximum of the keys and
    each query's shift against it,

    $$
    T_{if} = \max\big(X^0_f, \max_{j \le i} \ell^k_{jf}\big), \qquad
    s_i = \max_f\,(\ell^q_{if} + T_{if}),
    $$

    ($X^0_f = \log_2 z^0_f$, the initial state's per-feature mass, $-\infty$ without one) give
    $[\text{num}, \text{den}]_i = \sum_{j \le i}\sum_f 2^{\ell^q_{if} + \ell^k_{jf} - s_i}[v_j, 1]$
    (plus the initial state's part): the true row times $2^{-s_i - c_i}$, which cancels in the
    ratio. Blocks $b$ of $B$ (`_PF_BLOCK`) tokens, with $X^b_f$ the running maximum before block
    $b$ ($T$ at its last token before it): the keys of earlier blocks enter through the state
    $\tilde S^b = \sum_{j < b} 2^{\ell^k_{jf} - X^b_f}[v_j, 1]$, carried as
    $\tilde S^{b+1} = 2^{X^b - X^{b+1}} \circ \tilde S^b + \sum_{j \in b} 2^{\ell^k_{jf} - X^{b+1}_f}[v_j, 1]$,
    read by the query factors $2^{\ell^q_{if} + X^b_f - s_i}$, and the keys of the query's own
    block by the scores $\sum_f 2^{\ell^q_{if} + \ell^k_{jf} - s_i}$, $j \le i$, formed in the
    log domain (a factorisation at one reference per block would let a later key of the block
    underflow an earlier row, or overflow its query factors). Every exponent is $\le 0$
    ($\ell^q_{if} + T_{if} \le s_i$, $X^b \le T \le X^{b+1}$), so every factor is in
    $[0, 1]$; and at the maximiser $f^*$ of $s_i$ either the state ($T_{if^*} = X^b_{f^*}$:
    query factor 1, and the key that set $X^b_{f^*}$ puts 1 into $\tilde z^b_{f^*}$) or an
    intra-block score ($T_{if^*} = \ell^k_{jf^*}$: one term 1) holds a term 1:

    $$
    1 \le \text{den}_i \le F\,(n + 1),
    $$

    for a row with a valid key or a non-empty initial state (0 otherwise, see `normalise`).
    The forward and the backward ($1/\text{den}_i$) are then finite for finite inputs, however
    peaked the features -- the causal counterpart of `kernelapprox.attention._common.doubly_shifted`
    ([Kat20]_ for the causal product, the per-feature scales as the data-dependent decays of
    gated linear attention [Yan24]_). Row $i$ depends on positions $\le i$ only. Cost
    $O(n F (B + P))$, memory $O(nF(B + P/B))$ per sequence under autograd (the shifts are
    constants for it): a fallback, not the usual path.

    Parameters
    ----------
    lq : Tensor, shape (..., n, F)
    lk : Tensor, shape (..., n, F)
    v1 : Tensor, shape (..., n, P)
        $[v, 1]$ with zero columns up to ``P``, padded rows zero.
    pad : Tensor, shape broadcasting with (..., n), bool, or None
        Padded keys (``True``): $\ell^k = -\infty$.
    initial_state : LinearAttentionState, optional
        With ``kv`` of shape (..., F, P); its masses $z^0$ are column ``dv``.
    lead : torch.Size
        The broadcast batch shape.
    dv : int
        The value width (the ones column of ``v1``).

    Returns
    -------
    Tensor, shape (*lead, n, P)
        ``[num | den]``, not normalised.

    References
    ----------
    .. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
       autoregressive transformers with linear attention", ICML 2020.
    .. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers
       with hardware-efficient training", ICML 2024.

    Examples
    --------
    Features $2^{\pm 200}$ that meet in no per-row shift: the denominators stay $\ge 1$.

    >>> lq = torch.tensor([[200.0, -200.0], [0.0, -400.0]])
    >>> lk = torch.tensor([[-400.0, 0.0], [-400.0, 0.0]])
    >>> v1 = torch.tensor([[1.0, 1.0], [3.0, 1.0]])
    >>> out = per_feature_attention(lq, lk, v1, None, None, torch.Size([]), 1)
    >>> out[:, 1] >= 1, out[:, 0] / out[:, 1]
    (tensor([True, True]), tensor([1., 2.]))
    """
    n, Fd, P = lq.shape[-2], lq.shape[-1], v1.shape[-1]
    L = math.prod(lead)
    ninf = float("-inf")
    if pad is not None:
        lk = lk.masked_fill(pad.unsqueeze(-1), ninf)
    B = min(_PF_BLOCK, n)
    nb = -(-n // B)
    extra = nb * B - n  # trailing rows: queries sliced off, keys of weight 0
    lq = F.pad(lq, (0, 0, 0, extra)).expand(*lead, nb * B, Fd).reshape(L, nb, B, Fd)
    lk = F.pad(lk, (0, 0, 0, extra), value=ninf).expand(*lead, nb * B, Fd).reshape(L, nb, B, Fd)
    v1 = F.pad(v1, (0, 0, 0, extra)).expand(*lead, nb * B, P).reshape(L, nb, B, P)
    if initial_state is None:
        state = lk.new_zeros(L, Fd, P)
        X0 = lk.new_full((L, 1, Fd), ninf)
    else:
        kv0, X0 = log2_state(initial_state, dv, lk.dtype)  # each reached feature's mass 1
        state = F.pad(kv0, (0, P - kv0.shape[-1])).expand(*lead, Fd, P).reshape(L, Fd, P)
        X0 = X0.expand(*lead, Fd).reshape(L, 1, Fd)
    with torch.no_grad():
        T = torch.maximum(torch.cummax(lk.reshape(L, nb * B, Fd), dim=1).values, X0).view(L, nb, B, Fd)
        X_out = T[:, :, -1]  # (L, nb, F): after each block
        X_in = torch.cat((X0, X_out[:, :-1]), dim=1)  # before each block
        s = (lq + T).amax(dim=-1, keepdim=True)  # (L, nb, B, 1)
        s = torch.where(s == ninf, torch.zeros_like(s), s)  # a row that reaches no key
        X_ref = torch.where(X_out == ninf, torch.zeros_like(X_out), X_out)
        decay = torch.exp2(X_in - X_ref)
        decay = torch.where(X_in == ninf, torch.zeros_like(decay), decay)  # an empty past
    kv = torch.matmul(torch.exp2(lk - X_ref.unsqueeze(-2)).mT, v1)  # (L, nb, F, P), at X_out
    states = []
    for b in range(nb):  # sequential scan over blocks: O(F P) per block
        states.append(state)
        state = state * decay[:, b].unsqueeze(-1) + kv[:, b]
    inter = torch.matmul(torch.exp2(lq + X_in.unsqueeze(-2) - s), torch.stack(states, dim=1))
    causal = torch.ones(B, B, dtype=torch.bool, device=lq.device).tril()
    lam = (lq.unsqueeze(-2) + lk.unsqueeze(-3) - s.unsqueeze(-1)).masked_fill(~causal.unsqueeze(-1), ninf)
    intra = torch.matmul(torch.exp2(lam).sum(dim=-1), v1)  # (L, nb, B, P)
    return (inter + intra).reshape(*lead, nb * B, P)[..., :n, :]


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
    key_padding_mask: torch.Tensor | None = None,
    _path: Literal["auto", "shared", "runmax"] = "auto",
    _recompute: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Causal linear attention, chunked.

    With chunks $c$ of ``chunk_size`` tokens, $A_c = \operatorname{tril}(\varphi(Q_c)\varphi(K_c)^\top)$
    and the state before the chunk $S_{<c} = S_0 + \sum_{c' < c}\varphi(K_{c'})^\top [V_{c'}, 1]$:

    $$
    [\text{num}, \text{den}]_c = \varphi(Q_c)\, S_{<c} + A_c\,[V_c, 1]
    $$

    [Kat20]_. Causal stabilisation: every key keeps its own log scale $s_j$, and no output may
    depend on a later key's scale (a global key maximum would let one large future key underflow
    the past). Two algorithms, equal to rounding, one module each:

    - `kernelapprox.attention.linear.chunk_shared`: one key scale per group of chunks (the largest
      scale before the group), the chunk states a prefix sum, and a backward that saves only its
      inputs and recomputes the states. Taken in eager mode on CPU for positive maps, for every
      token of a sequence before its first non-finite value or key scale, or key scale more than
      30 nats above its group's reference.
    - `kernelapprox.attention.linear.chunk_runmax`: each query at the running maximum of the key scales,
      the carried state rescaled chunk by chunk, in training under activation checkpointing of
      runs of 8 chunks. Everything else on the CPU: ``torch.compile``, signed maps (their
      denominators can nearly cancel, and this path keeps one order of operations in eager and
      compiled code), and the rows a sequence's shared-scale prefix does not cover.

    Both shift each query and each key by its own maximum over the features. For features that
    peak at different random features for queries and keys (a fitted FAVOR++/FAVOR# map at large
    norms) a denominator can then underflow in float32 although the attention weights are
    ordinary numbers: in eager mode, for positive maps with log2 features, the rows below
    `den_floor` are recomputed by `per_feature_attention` (every feature at its own causal
    scale, $\text{den}_i \ge 1$, so also a finite backward); one host read per call.

    On accelerators (`kernelapprox.backends.attention_plan`; on any device with
    ``KERNELAPPROX_BACKEND=accelerator``) positive maps with log2 features take forms with every
    feature at its own causal scale ($\text{den}_i \ge 1$ at any norm), a fixed number of tensor
    operations for any ``n`` and no host read: calls shorter than
    `kernelapprox.backends.SHORT_CALL_N` the quadratic form
    (`kernelapprox.attention.linear.quadratic.quadratic_log_attention`), longer ones the chunked
    log-domain scan (`kernelapprox.attention.linear.chunk_logscan.causal_log_scan`, chunks of
    ``chunk_size`` tokens). Every other map (signed maps, elu+1, ReLU) takes the row-scale forms
    there, each key's log-scale a scalar gate and each query at the running maximum of the key
    scales (the rows of the running-maximum path, to rounding), also a fixed number of
    operations and no host read: `kernelapprox.attention.linear.quadratic.quadratic_row_attention`
    for short calls, `kernelapprox.attention.linear.chunk_rowscan.causal_row_scan` otherwise. There
    a non-finite input reaches every row of its chunk (of the call, in the quadratic forms) and the
    later ones. The returned state has one log scale per feature (log2 maps) or one per sequence
    (the other maps), as on the CPU.

    On the shared-scale and running-maximum paths, output $i$ depends on positions $\le i$ only,
    also for non-finite inputs: a NaN or Inf at position $j$ reaches rows $\ge j$ (as in the
    recurrent form), never rows before it, whatever the chunk size, bitwise (the rows before a
    token the shared-scale path cannot take are computed as if it were absent); padding after the
    sequence has no effect.

    Memory: peak $O(n(F + d_v) + F d_v)$ per head for any ``chunk_size`` (no $(n, F, d_v)$
    tensor); cost $O(nFd_v + nC(F + d_v))$ for chunk size $C$. The backward keeps the inputs of
    the chunked product and, on the running-maximum path, the state entering each recomputed run:
    $O(n(F + d_v + C) + \lceil n_c/8\rceil F d_v)$, no chunk state or score. Measurements:
    ``docs/performance.md``.

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
        Denominator guard for signed maps, see `kernelapprox.linear_attention`. A signed map's
        rows lost to cancellation are reported (`_signed_lost_rows`: a warning on the CPU, NaN
        rows on the accelerator path).
    key_padding_mask : Tensor, optional
        Bool, ``True`` = padded key, shape (batch, n) or broadcasting with (..., n); see
        `kernelapprox.linear_attention`. A padded key enters both algorithms with a zero row
        of $[V, 1]$ (nothing in any numerator or denominator) and the smallest log-scale of its
        sequence's valid keys (`_padding_scale`), so that it raises no running maximum or
        group reference. Padded queries still attend to the valid keys before them; a row with
        none gives 0.
    _path : {"auto", "shared", "runmax"}, default "auto"
        Private (benchmarks and tests): force an algorithm. ``"shared"`` still hands the rows it
        cannot take to the running-maximum path; it cannot run inside ``torch.compile``.
    _recompute : bool, default True
        Private: activation checkpointing of the running-maximum path in training (``False``:
        autograd through every chunk).

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : LinearAttentionState, if ``return_state``

    References
    ----------
    .. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
       autoregressive transformers with linear attention", ICML 2020.

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
    if _path not in _PATHS:
        raise ValueError(f"_path must be one of {_PATHS}, got {_path!r}")
    if not isinstance(_recompute, bool):
        raise TypeError(f"_recompute must be a bool, got {_recompute!r}")
    compiling = torch.compiler.is_compiling()
    if _path == "shared" and compiling:
        raise ValueError("_path='shared' decides on the host and cannot run inside torch.compile; use 'auto'")
    eps = check_options(return_state, eps)
    pad = padding_mask(key_padding_mask, k.shape)
    q, k, v, out_dtype, cdt = prepare(q, k, v, feature_map, True, initial_state)
    given_state = initial_state  # per-feature scales kept for the rescue and the returned state
    initial_state = shared_state(initial_state)
    log2 = feature_map.positive and has_log2_features(feature_map)
    device_path = False
    plan = None
    if _path == "auto":
        grad = torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
            or any(p.requires_grad for p in feature_map.parameters()))
        plan = backends.attention_plan(q.device, q.dtype, n=q.shape[-2], gated=log2, grad=grad)
        device_path = plan.path != "cpu"
    lq = lk = None
    if device_path and log2 and plan is not None:
        # Accelerators (and the forced accelerator path): every feature at its own causal scale, a
        # fixed number of operations for any n, no host read, no rescue needed: the quadratic form
        # for short calls, the chunked log-domain scan otherwise.
        with inputs_validated():
            lq = feature_map.query_log2_features(q)
            lk = feature_map.key_log2_features(k)
        if lq is not None and lk is not None:
            if plan.path == "quadratic":
                res = quadratic_log_attention(lq, lk, v, key_padding_mask=pad, initial_state=given_state,
                                              return_state=return_state)
            else:
                res = causal_log_scan(lq, lk, v, key_padding_mask=pad, initial_state=given_state,
                                      return_state=return_state, chunk=chunk_size)
            out = normalise(res.num, res.den.unsqueeze(-1), True, eps).to(out_dtype)
            if return_state:
                assert res.state is not None
                return out, res.state
            return out
    if device_path and plan is not None and (lq is None or lk is None):
        # Every other map on accelerators: one log-scale per key row, each query at the running
        # maximum of the key scales, a fixed number of operations for any n, no host read.
        kp, vp = apply_padding(pad, k, v)
        with inputs_validated():
            fq = feature_map.query_features(q)
            fk, s = feature_map.key_log_features(kp)
        if plan.path == "quadratic":
            res = quadratic_row_attention(fq, fk, s, vp, key_padding_mask=pad, initial_state=initial_state,
                                          return_state=return_state)
        else:
            res = causal_row_scan(fq, fk, s, vp, key_padding_mask=pad, initial_state=initial_state,
                                  return_state=return_state, chunk=chunk_size)
        lost = None
        if not feature_map.positive:
            lost = _row_scan_lost(res.den.unsqueeze(-1), fq, fk, s, pad, initial_state, plan.path,
                                  chunk_size, v.shape[-1])
        out = normalise(res.num, res.den.unsqueeze(-1), feature_map.positive, eps, lost, host=False).to(out_dtype)
        if return_state:
            assert res.state is not None
            return out, res.state
        return out
    k, v = apply_padding(pad, k, v)
    with inputs_validated():
        fq = feature_map.query_features(q)  # the per-query scale cancels
        fk, s = feature_map.key_log_features(k)  # per-key log scales s: (..., n), float64 for random maps
    s = s.double()  # keeps the gradient of the per-key scale; the stabilisers are detached
    if pad is not None:
        s = s.masked_fill(pad, 0.0)
        s = torch.where(pad, _padding_scale(s.detach(), pad), s)
    # [v, 1] with zero columns up to a multiple of 8: GEMMs of width 72 are faster than of 65
    # on CPU; the padding is stripped from the outputs and the states returned.
    dv = v.shape[-1]
    v1 = with_ones(v, _GEMM_COLUMNS)
    if pad is not None:
        v1 = v1.masked_fill(pad.unsqueeze(-1), 0.0)
    if initial_state is not None and v1.shape[-1] != dv + 1:
        initial_state = LinearAttentionState(
            F.pad(initial_state.kv, (0, v1.shape[-1] - dv - 1)), initial_state.log_scale)
    lead = broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v1.shape[:-2], s.shape[:-1])
    # A sequence shorter than a chunk is one chunk of its own length (no padding to chunk_size);
    # under torch.compile the length may be symbolic, and the chunk size stays as given.
    C = chunk_size if compiling else min(chunk_size, fq.shape[-2])
    mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()
    path = _path
    if path == "auto":
        path = ("shared" if not compiling and not device_path and feature_map.positive and fq.device.type == "cpu"
                else "runmax")
    # The shared-scale path takes every token (the usual case) or, per sequence, the tokens before
    # the first one it cannot take (`clean_mask`): those rows are the whole sequence with the keys
    # and values from that token on given weight 0 (same shapes, hence the same GEMMs and bitwise
    # the same rows as without the bad token); the running-maximum path gives the other rows.
    keep = chunk_shared.clean_mask(fq, v1, s, initial_state, C, lead) if path == "shared" else None
    if path == "shared" and keep is None:
        raw, state = chunk_shared.shared_scale_attention(fq, fk, v1, s, mask, initial_state, cdt, lead)
    else:
        head = None
        if keep is not None and bool(keep.any()):
            keep = keep.reshape(*lead, -1)
            head = chunk_shared.shared_scale_attention(
                fq, fk, v1.expand(*lead, *v1.shape[-2:]).masked_fill(~keep.unsqueeze(-1), 0.0),
                s.expand(*lead, s.shape[-1]).masked_fill(~keep, float("-inf")), mask, initial_state, cdt, lead,
            )[0]
        raw, state = chunk_runmax.running_max_attention(
            fq, fk, v1, s, mask, initial_state, cdt, lead, recompute=_recompute, host_reads=not device_path)
        if head is not None and keep is not None:
            raw = torch.where(keep.unsqueeze(-1), head, raw)
    if log2 and not compiling and not device_path:
        raw = _rescue_underflow(raw, q, k, v, feature_map, pad, given_state, lead)
    lost, host = None, True
    if not feature_map.positive:  # signed maps: the rows lost to cancellation (`signed_lost`)
        host = not device_path and host_reads(raw.device)
        lost = _signed_lost_rows(raw[..., dv:dv + 1], fq, fk, s, pad, initial_state, path, keep, mask,
                                 v1.shape[-1], lead, dv, host)
    out = normalise(raw[..., :dv], raw[..., dv:dv + 1], feature_map.positive, eps, lost, host=host).to(out_dtype)
    if return_state:
        lk = feature_map.key_log2_features(k) if log2 else None
        if lk is not None:
            # the state at per-feature scales (one GEMM): a later segment or a decoder then
            # reads every feature, also those far below the largest key's
            v1s = with_ones(v)
            st = None
            if given_state is not None:
                st = log2_state(given_state, dv, v1s.dtype)
            kv, t = per_feature_keys(lk, v1s, pad, st)
            return out, feature_state(kv, t)
        return out, LinearAttentionState(state.kv[..., :dv + 1].contiguous(), state.log_scale)
    return out


#: Candidate rows whose exact bound `_exact_bound_lost` forms at once ((rows, n) products).
_EXACT_ROWS = 256


def _row_scan_lost(
    den: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, s: torch.Tensor, pad: torch.Tensor | None,
    initial_state: LinearAttentionState | None, path: str, chunk: int, dv: int,
) -> torch.Tensor:
    r"""The lost rows (*lead, n, 1) bool of a signed map on the accelerator's row-scale forms
    (`kernelapprox.attention._common.signed_lost`): the magnitude bound
    $B_i = \sum_{j \le i}|\varphi(q_i)|^\top|f_j|\,e^{s_j - M_i}$ (plus the initial state's
    $|z_0|$) is the same form run on $|\varphi(Q)|$, $|f|$ and a value column of ones, so it is in
    the units of ``den`` (both at the row's shift $M_i$). No host read; constant for autograd.
    """
    with torch.no_grad():
        fq, fk, s = fq.detach().abs(), fk.detach().abs(), s.detach()
        ones = torch.ones_like(s, dtype=fk.dtype).unsqueeze(-1)
        has_key = torch.ones((), dtype=torch.bool, device=den.device)
        if pad is not None:
            ones = ones.masked_fill(pad.unsqueeze(-1), 0.0)
            has_key = (torch.cumsum(~pad, dim=-1) > 0).unsqueeze(-1)
        st = None
        if initial_state is not None:
            z0 = state_abs_mass(initial_state, dv).to(fk.dtype)
            st = LinearAttentionState(torch.cat([z0, z0], dim=-1), initial_state.log_scale.detach())
            has_key = has_key | (z0 > 0).any(dim=-2, keepdim=True)
        if path == "quadratic":
            b = quadratic_row_attention(fq, fk, s, ones, key_padding_mask=pad, initial_state=st)
        else:
            b = causal_row_scan(fq, fk, s, ones, key_padding_mask=pad, initial_state=st, chunk=chunk)
        return signed_lost(den, b.den.unsqueeze(-1), has_key)


def _signed_lost_rows(
    den: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, s: torch.Tensor, pad: torch.Tensor | None,
    initial_state: LinearAttentionState | None, path: str, keep: torch.Tensor | None, mask: torch.Tensor,
    P: int, lead: torch.Size, dv: int, host: bool,
) -> torch.Tensor:
    r"""The lost rows of a signed map's causal call, (*lead, n, 1) bool
    (`kernelapprox.attention._common.signed_lost`): $|\text{den}_i| \le \tau B_i$ with the
    magnitude bound

    $$
    B_i = |\varphi(q_i)|^\top\Big(\sum_{j \le i}|f_j|\,e^{s_j} + |z_0|\,e^{G_0}\Big)\,e^{-\rho_i},
    $$

    in the units of the row as its path computed it ($\rho_i$: `chunk_runmax.row_scales`, or
    `chunk_shared.row_scales` for the rows that the shared-scale path gave; $|z_0|$: the initial
    state's part, `kernelapprox.attention._common.state_abs_mass`). Constant for autograd.

    - ``host`` (CPU): a screen by Cauchy-Schwarz, $B_i \le M_i = \|\varphi(q_i)\|(\sum_{j \le i}
      \|f_j\|e^{s_j} + \|z_0\|e^{G_0})e^{-\rho_i}$, from the rows' norms and a float64
      ``logcumsumexp`` over the keys ($O(nF)$: 2.6 ms of a 60 ms call, ``docs/attention.md``); only the rows with
      $|\text{den}_i| \le \tau M_i$ (rare) get their exact $B_i$, in float64, $O(nF)$ each
      (one host read).
    - otherwise (no host read): $B_i$ for every row by `chunk_runmax.running_max_attention` on
      $|\varphi(Q)|$, $|f|$ and a column of ones (a third of the call's time on the CPU).
    """
    with torch.no_grad():
        n = s.shape[-1]
        s = s.detach()
        fq, fk = fq.detach(), fk.detach()
        rho = chunk_runmax.row_scales(s, initial_state)
        if path == "shared":
            shared = chunk_shared.row_scales(s, fq.shape[-1], P, mask.shape[-1], initial_state, lead)
            rho = shared if keep is None else torch.where(keep.reshape(*lead, -1), shared, rho)
        rho = rho.expand(*lead, n)
        z0 = None if initial_state is None else state_abs_mass(initial_state, dv)  # (..., F, 1)
        has_key = torch.ones((), dtype=torch.bool, device=den.device)
        if pad is not None:
            has_key = (torch.cumsum(~pad, dim=-1) > 0).unsqueeze(-1)
        if z0 is not None:
            has_key = has_key | (z0 > 0).any(dim=-2, keepdim=True)
        if not host:
            # [1, 0]: two columns, so that the rows come back as a slice of the same layout as the
            # call's own (a one-column slice makes torch.compile guard on the length)
            ones = F.pad(torch.ones_like(s, dtype=fk.dtype).unsqueeze(-1), (0, 1))
            if pad is not None:
                ones = ones.masked_fill(pad.unsqueeze(-1), 0.0)
            st = None if initial_state is None or z0 is None else LinearAttentionState(
                F.pad(z0.to(fk.dtype), (0, 1)), initial_state.log_scale)
            babs = chunk_runmax.running_max_attention(
                fq.abs(), fk.abs(), ones, s, mask, st, fk.dtype, lead, recompute=False, host_reads=False)[0]
            babs = babs[..., :1]
            if path == "shared":  # into the units of the shared-scale rows
                run = chunk_runmax.row_scales(s, initial_state).expand(*lead, n)
                babs = babs * torch.exp(run - rho).to(babs.dtype).unsqueeze(-1)
            return signed_lost(den, babs, has_key)
        # the screen: M_i >= B_i from the rows' norms, the keys' summed in the log domain
        ell = s + torch.log(row_norms(fk).double())
        if pad is not None:
            ell = ell.masked_fill(pad, float("-inf"))
        acc = torch.logcumsumexp(ell, dim=-1)
        if z0 is not None:
            G0 = initial_state.log_scale.detach().double().squeeze(-1)  # type: ignore[union-attr]
            acc = torch.logaddexp(acc, torch.log(row_norms(z0.mT).double()) + G0)
        M = (row_norms(fq) * torch.exp(acc - rho).to(fq.dtype)).unsqueeze(-1)
        cand = signed_lost(den, M, has_key)  # a superset of the lost rows
        if not bool(cand.any()):  # the host read
            return cand
        return cand & _exact_bound_lost(den, fq, fk, s, pad, z0, initial_state, rho, cand, lead)


def _exact_bound_lost(
    den: torch.Tensor, fq: torch.Tensor, fk: torch.Tensor, s: torch.Tensor, pad: torch.Tensor | None,
    z0: torch.Tensor | None, initial_state: LinearAttentionState | None, rho: torch.Tensor,
    cand: torch.Tensor, lead: torch.Size,
) -> torch.Tensor:
    r"""`_signed_lost_rows` on the candidate rows ``cand`` (*lead, n, 1): their exact
    $B_i = \sum_{j \le i} |\varphi(q_i)|^\top|f_j|\,e^{s_j - \rho_i}$ (+ the state's part), in
    float64 (no product of two float32 features underflows there), one sequence at a time,
    $O(nF)$ per candidate row. Returns the lost rows (*lead, n, 1); other rows False."""
    n = s.shape[-1]
    L = math.prod(lead)

    def flat(t: torch.Tensor, tail: int) -> torch.Tensor:
        return t.expand(*lead, *t.shape[t.dim() - tail:]).reshape(L, *t.shape[t.dim() - tail:])

    fq2, fk2, s2, rho2 = flat(fq, 2), flat(fk, 2), flat(s, 1), flat(rho, 1)
    den2, cand2 = flat(den, 2)[..., 0], flat(cand, 2)[..., 0]
    pad2 = None if pad is None else flat(pad, 1)
    z02 = None if z0 is None else flat(z0, 2)[..., 0]
    G02 = None if initial_state is None else flat(initial_state.log_scale.detach().double(), 2)[..., 0, 0]
    out = torch.zeros_like(cand2)
    j = torch.arange(n, device=s.device)
    tol = lost_tolerance(den.dtype)
    for b in cand2.any(dim=-1).nonzero().squeeze(-1).tolist():
        fka = fk2[b].double().abs()  # (n, F)
        for rows in cand2[b].nonzero().squeeze(-1).split(_EXACT_ROWS):  # (R, n) products at a time
            a = fq2[b, rows].double().abs()  # (R, F)
            keep = j.unsqueeze(0) <= rows.unsqueeze(-1)
            if pad2 is not None:
                keep = keep & ~pad2[b].unsqueeze(0)
            logw = (s2[b].unsqueeze(0) - rho2[b, rows].unsqueeze(-1)).masked_fill(~keep, float("-inf"))
            bound = ((a @ fka.mT) * torch.exp(logw)).sum(-1)
            if z02 is not None and G02 is not None:
                bound = bound + (a @ z02[b].double()) * torch.exp(G02[b] - rho2[b, rows])
            out[b, rows] = den2[b, rows].double().abs() <= tol * bound
    return out.reshape(*lead, n, 1)


def _rescue_underflow(
    raw: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap,
    pad: torch.Tensor | None, initial_state: LinearAttentionState | None, lead: torch.Size,
) -> torch.Tensor:
    r"""``raw`` (*lead, n, P) with the rows whose denominator is below `den_floor` (and that see
    a valid key or an initial state) recomputed by `per_feature_attention`, in the sequences that
    hold one; the other rows unchanged, bitwise. One host read.

    The shared-scale and running-maximum paths shift each query and each key by its own
    maximum over the features: a query whose features peak where no key's do (fitted
    FAVOR++/FAVOR#, $A^* \ll 0$, at large norms) gets a denominator that underflows in float32 (to 0:
    a silently zero output; or to a tiny number whose $1/\text{den}$ overflows the backward into
    NaN). Those rows are recomputed with $\text{den} \ge 1$; autograd then passes nothing to the
    replaced rows of the fast path.
    """
    n, dv = raw.shape[-2], v.shape[-1]
    if raw.device.type == "meta":  # no values to read: shapes only
        return raw
    with torch.no_grad():
        small = raw[..., dv] < den_floor(raw.dtype)  # (*lead, n); NaN is not small
        if pad is not None and initial_state is None:  # rows before the first valid key: 0 / 0
            small = small & (torch.cumsum(~pad, dim=-1) > 0)
        L = math.prod(lead)
        rows = small.expand(*lead, n).reshape(L, n)
        seqs = rows.any(dim=-1).nonzero().squeeze(-1)  # the host read
    if seqs.numel() == 0:
        return raw
    with inputs_validated():
        lq = feature_map.query_log2_features(q)
        lk = feature_map.key_log2_features(k)
    if lq is None or lk is None:
        return raw
    # [v, 1] afresh: without autograd the fast paths weight theirs in place and write over it
    v1 = with_ones(v, _GEMM_COLUMNS)
    if pad is not None:
        v1 = v1.masked_fill(pad.unsqueeze(-1), 0.0)

    def pick(t: torch.Tensor, tail: int) -> torch.Tensor:
        return t.expand(*lead, *t.shape[t.dim() - tail:]).reshape(L, *t.shape[t.dim() - tail:])[seqs]

    sub_pad = None if pad is None else pick(pad.expand(*lead, n), 1)
    sub_state = None
    if initial_state is not None:
        sub_state = LinearAttentionState(pick(initial_state.kv, 2), pick(initial_state.log_scale, 2))
    fixed = per_feature_attention(pick(lq, 2), pick(lk, 2), pick(v1, 2), sub_pad, sub_state, seqs.shape, dv)
    flat = raw.reshape(L, n, raw.shape[-1])
    sub = torch.where(rows[seqs].unsqueeze(-1), fixed.to(raw.dtype), flat[seqs])
    return flat.index_copy(0, seqs, sub).reshape(raw.shape)
