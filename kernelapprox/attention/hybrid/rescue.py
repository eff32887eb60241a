r"""The causal hybrid rows whose normaliser underflows, recomputed with every feature at its own scale.

The causal CPU forms (`kernelapprox.attention.hybrid.chunk_hybrid_attention`, the causal block
window) shift each query by one bound of its remainder, $m_i \ge s(q_i) + G_i$ ($s(q_i)$ the
query's largest log-feature, $G_i$ the largest key log-scale it has seen), and compute every
weight as a number in $[0, 1]$ under it. For a map whose query and key features peak at
different features (a fitted FAVOR++/FAVOR#/SDERF map at large norms) the bound is far above the
true remainder $\log\varphi(q_i)^\top\sum_j\psi(k_j)$; when it is also above every exact logit,
the whole row -- the window's terms and the remainder's -- underflows, and $\hat o_i$ is a ratio
of rounding errors (or $0/0$). With every weight $\le 1$, a row whose denominator under $m_i$ is
at least `kernelapprox.attention._common.den_floor` ($2.3\cdot10^{-13}$ in float32) has lost only
terms below the smallest normal number (relative error $\le nF t^{2/3}$), so that floor tells the
rows to redo; one host read per call (CPU only). Where no host read is allowed (an accelerator),
the causal calls take the flex path instead (`kernelapprox.attention.hybrid.flex`), per feature
throughout, with or without a state, so they have no row to redo.

Those rows are recomputed here, for the sequences that hold one, in the log domain with no shared
scale (`kernelapprox.attention.hybrid.flex.per_feature_causal`): the window and sinks with their
log-sum-exp in plain torch, the remainder by the per-feature delayed scan of the flex form, a
carried state at per-feature scales, merged under one shift per row. Every part holds a term 1
at its own shift, so the merged denominator is $\ge 1$, whatever the norms. The usual call
pays one comparison per row and the host read; the recomputation, 3 to 7 times the chunked
form's cost, only for the sequences that need it. (The decoding step,
`kernelapprox.attention.hybrid.recurrent.RecurrentHybridAttention`, keeps its state per feature
instead and needs no rescue.)

Signed maps (trigonometric, hybrid, Nystrom) have no log domain: their denominator is a sum of
terms of both signs, guarded by ``eps`` (`kernelapprox.attention._common.normalise`: where the
stabilised $|\hat D_i| \le \varepsilon$, $\hat D_i + 2\varepsilon$). A row the guard changes is
not the estimator's (its features nearly cancel, or the scale bound $s(q_i) + G_i$ overshoots
its mass by more than $\log(1/\varepsilon)$, down to an underflow to 0); nor is a non-causal row
whose remainder, the global feature sum minus the window's feature terms, cancels beyond the
compute dtype. `warn_signed_rows` says so with a `kernelapprox.KernelApproxWarning` (one host
read, CPU in eager mode) rather than returning such rows silently.

Where a call may not read the host (accelerators, ``torch.compile``) and still runs a torch form
(signed maps; positive maps only under ``KERNELAPPROX_BACKEND=torch``), `lost_rows_to_nan`
returns the rows that would have been recomputed or warned about as NaN: the same rows, found by
the same comparisons (`underflowed_rows`, `signed_lost_rows`), with no host read.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

from ..._validation import KernelApproxWarning, inputs_validated
from ...maps.base import FeatureMap
from .._common import den_floor
from .logfeatures import log_features_pair

__all__ = ["lost_rows_to_nan", "rescue_rows", "signed_lost_rows", "underflowed_rows", "warn_signed_rows"]

def underflowed_rows(den: torch.Tensor, reached: torch.Tensor | None) -> torch.Tensor:
    """Rows whose denominator (under the fast forms' shift, every weight ``<= 1``) is below
    `kernelapprox.attention._common.den_floor` and that reach a key (``reached``, broadcasting
    with ``den``; ``None``: every row does). NaN is not small (a non-finite input's rows stay)."""
    small = den < den_floor(den.dtype)
    return small if reached is None else small & reached


def rescue_rows(
    res: torch.Tensor, rows: torch.Tensor, lead: torch.Size, fm: FeatureMap, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, *, window: int, block: bool, sinks: tuple[int, ...], pad: torch.Tensor | None,
    old_sinks: tuple[torch.Tensor, torch.Tensor] | None = None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    r"""``res`` (*lead, n, dv), normalised, with ``rows`` (*lead, n) replaced by
    `kernelapprox.attention.hybrid.flex.per_feature_causal` in the sequences that hold one; the
    other rows unchanged, bitwise. One host read.

    Arguments as `kernelapprox.attention.hybrid.flex.per_feature_causal`, with the batch dimensions ``lead`` (broadcast): ``q``
    (..., n, d), ``k`` (..., ne, d), ``v`` (..., ne, dv) finite, ``pad`` (..., ne), ``old_sinks``
    and ``state`` with leading dimensions broadcasting with ``lead``.
    """
    n, dv = res.shape[-2], res.shape[-1]
    Lb = math.prod(lead)
    flat_rows = rows.expand(*lead, n).reshape(Lb, n)
    with torch.no_grad():
        seqs = flat_rows.any(dim=-1).nonzero().squeeze(-1)  # the host read
    if seqs.numel() == 0:
        return res
    with inputs_validated():
        lq, lk = log_features_pair(fm, q, k)

    def pick(t: torch.Tensor, tail: int) -> torch.Tensor:
        shape = t.shape[t.dim() - tail:]
        return t.expand(*lead, *shape).reshape(Lb, *shape)[seqs]

    cdt = res.dtype
    sub_old = None if old_sinks is None else (pick(old_sinks[0].to(cdt), 2), pick(old_sinks[1].to(cdt), 2))
    sub_state = None if state is None else (pick(state[0], 2), pick(state[1], 1))
    from .flex import per_feature_causal

    fixed = per_feature_causal(
        pick(q, 2), pick(k, 2), pick(v, 2), pick(lq.to(cdt), 2), pick(lk.to(cdt), 2), window=window, block=block,
        sinks=sinks, pad=None if pad is None else pick(pad, 1), old_sinks=sub_old, state=sub_state,
    )
    flat = res.reshape(Lb, n, dv)
    sub = torch.where(flat_rows[seqs].unsqueeze(-1), fixed.to(res.dtype), flat[seqs])
    return flat.index_copy(0, seqs, sub).reshape(res.shape)


def _user_stacklevel() -> int:
    """``stacklevel`` of the first frame outside kernelapprox and torch (the user's call), counted
    from the caller of this function's caller."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep
    skip = (root, os.path.dirname(torch.__file__) + os.sep)
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


#: A non-causal row of a signed map is flagged when the rounding of its global-minus-window
#: remainder, at most $u B_i$ ($u$ the unit roundoff, $B_i$ the sum of the magnitudes that cancel),
#: exceeds this fraction of its denominator: the output may then move by about that fraction of
#: the values' scale.
CANCELLATION_TOL = 1e-2


def signed_lost_rows(den: torch.Tensor, eps: float, reached: torch.Tensor | None = None,
                     bound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The rows of a signed map that are not the estimator's, as two bool tensors shaped as ``den``
    (..., n): ``guarded`` ($|\hat D_i| \le \varepsilon$, the ``eps`` guard changes the row) and
    ``cancelled`` (with ``bound``: $u B_i >$ `CANCELLATION_TOL` $\cdot|\hat D_i|$), both only in
    rows that reach a key (``reached``). No host read. See `warn_signed_rows`.

    Examples
    --------
    >>> g, c = signed_lost_rows(torch.tensor([1.0, 1e-9, 1.0]), 1e-6, bound=torch.tensor([1.0, 1.0, 1e8]))
    >>> g.tolist(), c.tolist()
    ([False, True, False], [False, False, True])
    """
    guarded = den.abs() <= eps
    cancelled = torch.zeros_like(guarded)
    if bound is not None:
        u = torch.finfo(den.dtype).eps / 2
        cancelled = (u * bound.to(den.dtype) > CANCELLATION_TOL * den.abs()) & ~guarded
    if reached is not None:
        guarded, cancelled = guarded & reached, cancelled & reached
    return guarded, cancelled


def lost_rows_to_nan(res: torch.Tensor, den: torch.Tensor, feature_map: FeatureMap, eps: float, *,
                     causal: bool, reached: torch.Tensor | None = None,
                     bound: torch.Tensor | None = None) -> torch.Tensor:
    r"""``res`` (..., n, dv) with NaN in the rows that a host read would rescue or warn about, for
    the calls that make none (accelerators under ``KERNELAPPROX_BACKEND=torch``, signed maps on
    accelerators, ``torch.compile``): never a silently wrong row.

    Positive maps, causal forms: the rows whose denominator under the shared scale underflows
    (`underflowed_rows`; on the CPU they are recomputed by `rescue_rows`). Signed maps: the rows of
    `signed_lost_rows` (on the CPU, `warn_signed_rows` warns). ``den`` (..., n) is the stabilised
    denominator, ``reached`` and ``bound`` as in `signed_lost_rows`. No host read.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> res = torch.ones(3, 2)
    >>> lost_rows_to_nan(res, torch.tensor([1.0, 1e-9, 2.0]), ka.TrigRF(4, 8, seed=0), 1e-6, causal=True)
    tensor([[1., 1.],
            [nan, nan],
            [1., 1.]])
    """
    with torch.no_grad():
        if feature_map.positive:
            if not causal:  # the non-causal forms shift per feature: their normaliser is >= 1
                return res
            lost = underflowed_rows(den, reached)
        else:
            guarded, cancelled = signed_lost_rows(den, eps, reached, bound)
            lost = guarded | cancelled
    return res.masked_fill(lost.unsqueeze(-1), float("nan"))


def warn_signed_rows(den: torch.Tensor, eps: float, feature_map: FeatureMap, form: str,
                     reached: torch.Tensor | None = None, bound: torch.Tensor | None = None) -> None:
    r"""A `kernelapprox.KernelApproxWarning` for the rows of a signed map that are not the estimator's.

    - the ``eps`` guard changes the row: $|\hat D_i| \le \varepsilon$ for the stabilised
      denominator ``den`` (..., n) of a row that reaches a key (``reached``, broadcasting with
      ``den``; ``None``: every row; a row without any key is 0 by
      `kernelapprox.attention._common.normalise`, not an error);
    - (non-causal forms, ``bound`` (..., n) given) the remainder, the global feature sum minus the
      window's feature terms, cancels beyond the compute dtype: $u B_i > $ `CANCELLATION_TOL`
      $\cdot|\hat D_i|$, with $B_i = |\tilde\varphi(q_i)|^\top\sum_j|\tilde\psi(k_j)|$ (the
      magnitudes of the terms that cancel, under the row's shift) and $u$ the unit roundoff.

    Positive maps, devices other than the CPU and ``torch.compile``: nothing (no host read; the
    callers mark the rows NaN there, `lost_rows_to_nan`). One
    host read otherwise.

    Examples
    --------
    >>> import warnings, kernelapprox as ka
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn_signed_rows(torch.tensor([1.0, 1e-9]), 1e-6, ka.TrigRF(4, 8, seed=0), "causal")
    >>> [x.category.__name__ for x in w]
    ['KernelApproxWarning']
    """
    if feature_map.positive or den.device.type != "cpu" or torch.compiler.is_compiling():
        return
    with torch.no_grad():
        guarded, cancelled = signed_lost_rows(den, eps, reached, bound)
        n_guard, n_cancel = torch.stack([guarded.sum(), cancelled.sum()]).tolist()  # the host read
    reasons = []
    if n_guard:
        reasons.append(
            f"{n_guard} have a stabilised denominator within eps = {eps:g} of 0 (the feature estimate nearly "
            "cancels, or the scale bound of the shift overshoots the row's mass so far that it underflows), "
            "and the eps guard changed them")
    if n_cancel:
        reasons.append(
            f"{n_cancel} have a remainder (the global feature sum minus the window's feature terms) that cancels "
            f"beyond {den.dtype}'s precision: rounding may move them by more than {CANCELLATION_TOL:g} of the "
            "values' scale")
    if reasons:
        warnings.warn(
            KernelApproxWarning(
                f"hybrid attention ({form}) with the signed map {type(feature_map).__name__}: of {den.numel()} "
                f"rows, {'; '.join(reasons)}. Their outputs are not the estimator's; float64 inputs, smaller norms "
                "or a positive map avoid it."
            ),
            stacklevel=_user_stacklevel(),
        )
