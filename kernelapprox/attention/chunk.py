"""Causal linear attention computed chunk-wise: a dispatcher over two algorithms.

`chunk_shared.shared_scale_attention` (one key scale per group of chunks) and
`chunk_runmax.running_max_attention` (each query at its running maximum), one per module.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .._validation import inputs_validated, no_autocast
from ..maps.base import FeatureMap
from . import chunk_runmax, chunk_shared
from ._common import apply_padding, check_options, normalise, padding_mask, prepare, with_ones
from .parallel import _GEMM_COLUMNS
from .state import LinearAttentionState

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

    - `kernelapprox.attention.chunk_shared`: one key scale per group of chunks (the largest
      scale before the group), the chunk states a prefix sum, and a backward that saves only its
      inputs and recomputes the states. Taken in eager mode on CPU for positive maps, for every
      token of a sequence before its first non-finite value or key scale, or key scale more than
      30 nats above its group's reference.
    - `kernelapprox.attention.chunk_runmax`: each query at the running maximum of the key scales,
      the carried state rescaled chunk by chunk, in training under activation checkpointing of
      runs of 8 chunks. Everything else: ``torch.compile``, other devices, signed maps (their
      denominators can nearly cancel, and this path keeps one order of operations in eager and
      compiled code), and the rows a sequence's shared-scale prefix does not cover.

    Output $i$ depends on positions $\le i$ only, also for non-finite inputs: a NaN or
    Inf at position $j$ reaches rows $\ge j$ (as in the recurrent form), never rows
    before it, whatever the chunk size, bitwise (the rows before a token the shared-scale path
    cannot take are computed as if it were absent); padding after the sequence has no effect.

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
        Denominator guard for signed maps, see `kernelapprox.linear_attention`.
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
    lead = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v1.shape[:-2], s.shape[:-1])
    # A sequence shorter than a chunk is one chunk of its own length (no padding to chunk_size);
    # under torch.compile the length may be symbolic, and the chunk size stays as given.
    C = chunk_size if compiling else min(chunk_size, fq.shape[-2])
    mask = torch.ones(C, C, dtype=torch.bool, device=fq.device).tril()
    path = _path
    if path == "auto":
        path = "shared" if not compiling and feature_map.positive and fq.device.type == "cpu" else "runmax"
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
            fq, fk, v1, s, mask, initial_state, cdt, lead, recompute=_recompute)
        if head is not None and keep is not None:
            raw = torch.where(keep.unsqueeze(-1), head, raw)
    out = normalise(raw[..., :dv], raw[..., dv:dv + 1], feature_map.positive, eps).to(out_dtype)
    if return_state:
        return out, LinearAttentionState(state.kv[..., :dv + 1].contiguous(), state.log_scale)
    return out
