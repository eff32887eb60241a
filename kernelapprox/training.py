r"""Training of learned feature maps: distillation from softmax attention [Zha24]_.

`fit_feature_map` fits a learned map (`kernelapprox.maps.hedgehog.HedgehogFeatures`) so that
linear attention with it reproduces the *attention weights* of softmax attention on calibration
queries and keys (`distillation_loss`, Hedgehog's eq. 5; with a window, on the remainder outside
the exact set of hybrid attention); `fit_gain` fits the map's gain against the exact share of a
hybrid layer. The student's weights are those of `kernelapprox.attention.padded` (one definition
for the layers, the model conversion and this training), so this module sits above ``attention/``
and the maps import nothing of it.

References
----------
.. [Zha24] M. Zhang, K. Bhatia, H. Kumbong, C. Ré. "The Hedgehog & the Porcupine: Expressive
   Linear Attentions with Softmax Mimicry", ICLR 2024, arXiv:2402.04347.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import nn

from ._validation import (
    broadcast_shapes,
    check_floating,
    check_last_dim,
    check_positive_int,
    inputs_validated,
    no_autocast,
)
from .attention.hybrid import check_window, exact_set_mask
from .attention.padded import attention_log_weights, check_window_sinks
from .maps.base import FeatureMap
from .maps.hedgehog import OPTIMIZERS, HedgehogFeatures
from .samplers import make_generator

__all__ = ["fit_feature_map", "fit_gain", "distillation_loss"]


def _check_real(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(cast(Any, value))  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})") from None
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite number, got {value!r}")
    return v


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _validate(fm: object, q: object, k: object, causal: object, scale: object) -> tuple[FeatureMap, float]:
    """Shared checks of `distillation_loss` and `fit_feature_map`."""
    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")
    if not fm.positive:
        raise TypeError(
            f"fm must have positive features (the distillation loss takes log phi(q).phi(k)); "
            f"{type(fm).__name__} is signed"
        )
    q, k = check_floating("q", q), check_floating("k", k)
    check_last_dim("q", q, fm.dim)
    check_last_dim("k", k, fm.dim)
    causal = _check_bool("causal", causal)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal distillation needs as many queries as keys, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2], fm.batch_shape)
    except RuntimeError:
        raise ValueError(
            f"leading dimensions of q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])} and the feature "
            f"map's batch_shape {fm.batch_shape} do not broadcast"
        ) from None
    return fm, _check_real("scale", scale, positive=False)


def _exact_set(
    window: object, sinks: object, q: torch.Tensor, k: torch.Tensor, causal: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The exact sets ``S_i`` (n, n) bool and the rows whose remainder is not empty (1-d index).

    ``(None, None)`` without a window or when every ``S_i`` is empty (the whole-row loss).
    """
    if window is None:
        check_window_sinks(sinks, None)
        return None, None

    w = check_window(window)
    n, m = q.shape[-2], k.shape[-2]
    if n != m:
        raise ValueError(
            f"a window needs as many queries as keys (it is a set of positions), got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}"
        )
    S = exact_set_mask(n, window=w, sinks=sinks, causal=causal, device=q.device)
    if not bool(S.any()):
        return None, None
    attended = torch.ones(n, n, dtype=torch.bool, device=q.device)
    if causal:
        attended = attended.tril()
    valid = (attended & ~S).any(-1).nonzero().squeeze(-1)
    if valid.numel() == 0:
        raise ValueError(
            f"the exact set (window={w}, sinks={sinks!r}) covers every key of every query (n = {n}): "
            "no remainder to fit"
        )
    return S, valid


def _row_losses(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor | None, causal: bool, scale: float,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Cross-entropy $-\sum_j A_{ij}\log\hat A_{ij}$ of the query rows ``rows`` (all if None).

    With ``exact`` (the (n, n) exact sets $S_i$), both rows are restricted to the remainder
    $R_i$ and renormalised there (every row in ``rows`` must have a non-empty remainder).
    ``q``, ``k`` validated and in the compute dtype. Shape (*broadcast(lead, batch_shape), n_rows).
    """
    log_hat, A = attention_log_weights(q, k, fm, causal=causal, exact="exclude", rows=rows, scale=scale,
                                       exact_set=exact)
    return -(A.to(log_hat.dtype) * log_hat).sum(-1)


@no_autocast
def distillation_loss(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float = 1.0,
    window: int | None = None, sinks: int | Sequence[int] = 0,
) -> torch.Tensor:
    r"""Hedgehog's distillation loss [Zha24]_ eq. 5: cross-entropy of linear-attention weights
    against softmax-attention weights, averaged over query rows (and all leading dimensions).

    $$
    A_{ij} = \operatorname{softmax}_j\big(\text{scale}\cdot q_i^\top k_j\big),\qquad
    \hat A_{ij} = \frac{\varphi(q_i)^\top\varphi(k_j)}{\sum_l \varphi(q_i)^\top\varphi(k_l)},\qquad
    \mathcal L = -\frac1n\sum_i\sum_j A_{ij}\log\hat A_{ij}
    $$

    ($j, l \le i$ when causal). Its minimum over $\hat A$ is the entropy of
    $A$, reached at $\hat A = A$. Computed in the log domain ($\log\hat A$ by a
    log-softmax over $\log\varphi(q_i)^\top\varphi(k_j)$), in the library's compute dtype;
    differentiable with respect to the map's parameters.

    With a ``window``, the *remainder* loss of hybrid attention
    (`kernelapprox.hybrid_attention`): with $S_i$ the exact set (window $\cup$ sinks) and
    $R_i$ the other keys query $i$ attends to, both rows are restricted to $R_i$ and
    renormalised there,

    $$
    A^R_{ij} = \frac{e^{\text{scale}\cdot q_i^\top k_j}}{\sum_{l\in R_i} e^{\text{scale}\cdot q_i^\top k_l}},\qquad
    \hat A^R_{ij} = \frac{\varphi(q_i)^\top\varphi(k_j)}{\sum_{l\in R_i}\varphi(q_i)^\top\varphi(k_l)},\qquad
    \mathcal L_R = -\frac1{|I|}\sum_{i\in I}\sum_{j\in R_i} A^R_{ij}\log\hat A^R_{ij},
    $$

    averaged over the rows $I$ with a non-empty remainder. The exact part is taken as given: it
    is the one the hybrid computes exactly, and the map is only asked for the remainder's shape.

    Parameters
    ----------
    fm : FeatureMap
        A map with positive features (any: learned, random or deterministic).
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        Leading dimensions broadcast with each other and with ``fm.batch_shape``. The map sees
        ``q`` and ``k`` as given.
    causal : bool, default False
        Mask keys ``j > i`` in both attentions (``n == m``).
    scale : float, default 1.0
        Multiplies the logits of the *target* only: ``scale=1`` is
        `kernelapprox.softmax_attention` on the same ``q, k`` (the library's convention:
        inputs already carry $d^{-1/4}$ each); raw projections with ``scale=d**-0.5`` give
        the usual transformer attention.
    window : int, optional
        The hybrid's window, in `kernelapprox.hybrid_attention`'s convention (non-causal
        $|i - j| < w$, causal $0 \le i - j < w$; ``n == m``). ``None``: whole rows.
        ``window=0`` with ``sinks=0`` is the whole-row loss.
    sinks : int or sequence of int, default 0
        Sink positions of the exact set (`kernelapprox.attention.hybrid.resolve_sinks`); only with
        a ``window``.

    Returns
    -------
    Tensor, 0-d, dtype the compute dtype (at least float32).

    Examples
    --------
    >>> q = k = torch.eye(4, dtype=torch.float64)
    >>> fm = HedgehogFeatures(4, dtype=torch.float64)
    >>> loss = distillation_loss(fm, q, k)
    >>> loss.shape, bool(loss > 0)
    (torch.Size([]), True)
    """
    fm, scale = _validate(fm, q, k, causal, scale)
    exact, valid = _exact_set(window, sinks, q, k, causal)
    cdt = fm.compute_dtype(q.dtype, k.dtype)
    return _row_losses(fm, q.to(cdt), k.to(cdt), valid, causal, scale, exact).mean()


@no_autocast
def fit_feature_map(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 1e-2,
    batch_size: int | None = None,
    causal: bool = False,
    scale: float = 1.0,
    seed: int | None = None,
    progress: bool = True,
    optimizer: str = "adam",
    window: int | None = None,
    sinks: int | Sequence[int] = 0,
) -> list[float]:
    r"""Fit a learned feature map by distilling softmax attention into linear attention [Zha24]_.

    Minimises `distillation_loss` (the cross-entropy between the exact attention rows
    $A_{i\cdot}$ and the linearised rows $\hat A_{i\cdot}$, [Zha24]_ eq. 5) over the
    map's trainable parameters, in place, with ``steps`` steps of Adam (or SGD).

    With a ``window`` (and ``sinks``), the map is fitted for hybrid attention
    (`kernelapprox.hybrid_attention`): the loss is the remainder loss of `distillation_loss`,
    the cross-entropy of the rows restricted and renormalised to the remainder $R_i$ (the keys
    outside the exact set $S_i$), the exact part taken as given; only rows with a non-empty
    remainder are drawn. ``window=0, sinks=0`` is the whole-row fit, bit for bit.

    With a window, a map with a trainable gain (`HedgehogFeatures` with ``gain=True``) has its
    log-gain set after the steps by `fit_gain` (the cross-entropies do not depend on it; the
    optimiser leaves it alone): the weight of the linear term against the exact window, so that
    the remainder's share of the mass is right on average (LoLCATs' window factor [Zha25]_,
    fitted rather than trained; the kernel's scale is then fitted to data, not an
    approximation of $e^{q^\top k}$).

    Heads: with ``fm.batch_shape = (H,)`` each head has its own parameters; the objective is the
    *sum over the map's batch entries* of their mean row losses, so each head receives exactly the
    gradient it would get if fitted alone (the heads are fitted independently, in one batched
    computation).

    Parameters
    ----------
    fm : FeatureMap
        A learned map (``fm.learned`` true, e.g. `HedgehogFeatures`) with positive features.
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        Calibration queries and keys, as passed to attention (see ``scale``); not modified.
    steps : int, default 200
        Optimiser steps.
    lr : float, default 1e-2
        Learning rate.
    batch_size : int, optional
        Query rows per step, drawn without replacement (the same rows in every leading
        dimension); every key is used. ``None`` (or ``>= n``): all rows, full-batch.
    causal : bool, default False
        Distil causal attention (keys ``j <= i``; ``n == m``).
    scale : float, default 1.0
        Multiplies the logits of the target attention only (the map always sees ``q`` and ``k``
        as given): ``1.0`` matches `kernelapprox.softmax_attention` on the same inputs.
    seed : int, optional
        Seed of the row subsampling (a fresh CPU generator). With a seed the fit is deterministic:
        bit-identical parameters and history on the same machine. ``None``: torch's default
        generator. Unused without ``batch_size``.
    progress : bool, default True
        Show a tqdm progress bar (if tqdm is installed) with the current loss.
    optimizer : {"adam", "sgd"}, default "adam"
    window : int, optional
        Fit the remainder of hybrid attention with this window (`kernelapprox.hybrid_attention`'s
        convention: non-causal $|i - j| < w$, causal $0 \le i - j < w$; ``n == m``). ``None``:
        whole rows.
    sinks : int or sequence of int, default 0
        Sinks of the exact set (`kernelapprox.attention.hybrid.resolve_sinks`), with a ``window``.

    Returns
    -------
    list of float
        The loss history: entry ``t`` is the mean row cross-entropy (over the step's rows and all
        leading dimensions, heads included) at the parameters *before* step ``t``'s update.

    Raises
    ------
    TypeError
        ``fm`` is not a learned map (``fm.learned`` false: nothing to train) or has signed
        features; bad argument types.
    ValueError
        Bad ``steps``, ``lr``, ``batch_size``, ``scale``, ``optimizer``, ``window`` or ``sinks``;
        non-finite ``q`` or ``k``; shapes that do not match; a map whose parameters are all frozen;
        an exact set that leaves no remainder.
    FloatingPointError
        The loss became non-finite (lower ``lr``); the parameters are left as they were before
        that step.

    Notes
    -----
    The map's train/eval mode, the ``requires_grad`` flags and any ``.grad`` of its parameters
    are restored on return; only the parameter values change. Runs under ``torch.enable_grad``
    (callable from inside ``torch.no_grad``).

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> k = torch.randn(32, 4, generator=g, dtype=torch.float64)
    >>> q = k + 0.1 * torch.randn(32, 4, generator=g, dtype=torch.float64)
    >>> fm = HedgehogFeatures(4, dtype=torch.float64)
    >>> hist = fit_feature_map(fm, q, k, steps=30, lr=0.05, seed=0, progress=False)
    >>> len(hist), hist[-1] < hist[0]
    (30, True)

    For hybrid attention, fit the remainder (and the gain):

    >>> fm = HedgehogFeatures(4, gain=True, dtype=torch.float64)
    >>> hist = fit_feature_map(fm, q, k, steps=30, lr=0.05, window=3, sinks=1, progress=False)
    >>> hist[-1] < hist[0], bool(fm.log_gain != 0)
    (True, True)
    """
    if isinstance(fm, FeatureMap) and not fm.learned:
        raise TypeError(
            f"fm must be a learned feature map (fm.learned true, e.g. HedgehogFeatures); "
            f"{type(fm).__name__} has no trainable parameters"
        )
    fm, scale = _validate(fm, q, k, causal, scale)
    exact, valid = _exact_set(window, sinks, q, k, causal)
    steps = check_positive_int("steps", steps)
    lr = _check_real("lr", lr, positive=True)
    n = q.shape[-2] if valid is None else int(valid.numel())  # rows that can be drawn
    if batch_size is not None:
        batch_size = check_positive_int("batch_size", batch_size)
    rows_per_step = n if batch_size is None else min(batch_size, n)
    progress = _check_bool("progress", progress)
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    g = make_generator(seed, None)
    for name, t in (("q", q), ("k", k)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains non-finite values (NaN or Inf): cannot fit on them")
    gain = getattr(fm, "log_gain", None)  # set by fit_gain below, not by the optimiser
    params = [p for p in fm.parameters() if p.requires_grad and p is not gain]
    if not params:
        raise ValueError(f"fm ({type(fm).__name__}) has no parameter with requires_grad=True: nothing to fit")

    cdt = fm.compute_dtype(q.dtype, k.dtype)
    qc, kc = q.detach().to(cdt), k.detach().to(cdt)
    copies = math.prod(fm.batch_shape)  # the objective sums the map copies' mean losses
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    )
    was_training = fm.training
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    history: list[float] = []
    bar = _progress(range(steps), progress)
    try:
        fm.train()
        with torch.enable_grad():
            for t in bar:
                rows = valid
                if rows_per_step < n:
                    rows = torch.randperm(n, generator=g)[:rows_per_step].to(qc.device)
                    if valid is not None:
                        rows = valid[rows]
                per_row = _row_losses(fm, qc, kc, rows, causal, scale, exact)
                mean = per_row.mean()
                value = float(mean.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"the distillation loss became non-finite at step {t} (lr={lr}); the "
                        "parameters are those before this step"
                    )
                history.append(value)
                opt.zero_grad(set_to_none=True)
                (mean * copies).backward()
                opt.step()
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{value:.4g}", refresh=False)
        if isinstance(fm, HedgehogFeatures) and isinstance(gain, nn.Parameter) and gain.requires_grad \
                and exact is not None:
            fit_gain(fm, qc, kc, window=cast(int, window), sinks=sinks, causal=causal, scale=scale)
    finally:
        if hasattr(bar, "close"):
            bar.close()
        fm.train(was_training)
        for p, gr in zip(params, saved_grads, strict=True):
            p.grad = gr
    return history


@no_autocast
def fit_gain(
    fm: HedgehogFeatures,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    r"""Set a map's log-gain for hybrid attention: the remainder's share of the mass right on average.

    In `kernelapprox.hybrid_attention` the exact set $S_i$ contributes
    $D_{S,i} = \sum_{j\in S_i} e^{\text{scale}\cdot q_i^\top k_j}$ and the map
    $\hat D_{R,i} = e^{2g}\sum_{j\in R_i}\varphi(q_i)^\top\varphi(k_j)$, so the hybrid gives the
    exact set the share $\hat p_i(g) = D_{S,i}/(D_{S,i} + \hat D_{R,i})$ where softmax gives
    $p_i$ (`kernelapprox.theory.hybrid_attention.exact_mass`). The log-gain $g$ of each map entry
    (head) is set, in place, to the root of

    $$
    \frac1{|I|}\sum_{i\in I}\hat p_i(g) = \frac1{|I|}\sum_{i\in I} p_i,
    $$

    ($I$ the rows with a non-empty remainder, and every leading dimension the gain does not
    have), the minimiser of the binary cross-entropy $-\sum_i p_i\log\hat p_i + (1-p_i)\log(1-\hat p_i)$
    between the two splits ($\hat p$ is decreasing in $g$: found by bisection, in float64). The
    shapes inside $R_i$ do not depend on $g$ (`distillation_loss` with a window); this is the
    remaining degree of freedom, the weight of the linear term against the window (LoLCATs' window
    factor [Zha25]_, here fitted rather than trained). Caveat: the kernel's scale is then a fitted
    quantity, not an approximation of $e^{q^\top k}$.

    Parameters
    ----------
    fm : HedgehogFeatures
        A map built with ``gain=True``.
    q, k : Tensor, shape (..., n, d)
        Calibration queries and keys, as passed to attention (see `distillation_loss`'s ``scale``).
    window : int
    sinks : int or sequence of int, default 0
        The hybrid's exact set (`kernelapprox.hybrid_attention`'s convention); it must leave some
        row a remainder, and some row an exact key.
    causal : bool, default False
    scale : float, default 1.0
        Multiplies the logits of the softmax side only.

    Returns
    -------
    Tensor, shape ``fm.batch_shape``: the new ``fm.log_gain`` (detached).

    Examples
    --------
    >>> from kernelapprox.attention.hybrid import exact_set_mask
    >>> from kernelapprox.theory.hybrid_attention import exact_mass
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = torch.randn(2, 32, 4, generator=g, dtype=torch.float64).unbind(0)
    >>> fm = HedgehogFeatures(4, gain=True, dtype=torch.float64)
    >>> gain = fit_gain(fm, q, k, window=3, sinks=1)
    >>> S = exact_set_mask(32, window=3, sinks=1)
    >>> D_S, D_R = (torch.exp(q @ k.T) * S).sum(-1), (fm.kernel(q, k) * ~S).sum(-1)
    >>> p = exact_mass(q, k, window=3, sinks=1)
    >>> bool(torch.isclose((D_S / (D_S + D_R)).mean(), p.mean()))
    True
    """
    if not isinstance(fm, HedgehogFeatures) or fm.log_gain is None:
        raise TypeError(f"fm must be a HedgehogFeatures built with gain=True, got {fm!r}")
    _, scale = _validate(fm, q, k, causal, scale)
    if window is None:
        raise TypeError("window must be a non-negative int (the hybrid's window), got None")
    exact, valid = _exact_set(window, sinks, q, k, causal)
    if exact is None or valid is None:
        raise ValueError(f"the exact set (window={window!r}, sinks={sinks!r}) is empty: no split to fit the gain to")
    gain = fm.log_gain
    cdt = fm.compute_dtype(q.dtype, k.dtype)
    q, k = q.detach().to(cdt), k.detach().to(cdt)
    n = q.shape[-2]
    with torch.no_grad(), inputs_validated():
        rem = ~exact
        if causal:
            rem = rem & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        qs, rem, ex = q.index_select(-2, valid), rem.index_select(0, valid), exact.index_select(0, valid)
        logits = (scale * torch.matmul(qs, k.mT)).double()
        log_ds = torch.logsumexp(logits.masked_fill(~ex, -math.inf), -1)
        log_dr = torch.logsumexp(logits.masked_fill(~rem, -math.inf), -1)
        fq, sq = fm.log_features(qs)
        fk, sk = fm.key_log_features(k)
        G = torch.matmul(fq, fk.mT).double()
        log_hat = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sk.double().unsqueeze(-2)
        log_hat = torch.logsumexp(log_hat.masked_fill(~rem, -math.inf), -1) + sq.double()
        log_hat = log_hat - 2 * gain.detach().double().unsqueeze(-1)  # the gain-free kernel mass
        p = torch.sigmoid(log_ds - log_dr)
        a = log_ds - log_hat  # p_hat(g) = sigmoid(a - 2g); a = -inf where S_i is empty
        lead = broadcast_shapes(a.shape, p.shape)
        a, p = a.expand(lead), p.expand(lead)
        bs = tuple(gain.shape)

        def reduce(x: torch.Tensor) -> torch.Tensor:
            """Mean over the rows and every leading dimension that the gain does not have."""
            x = x.mean(-1)
            extra = x.dim() - len(bs)
            if extra > 0:
                x = x.mean(tuple(range(extra)))
            for dim, size in enumerate(bs):
                if size == 1 and x.shape[dim] != 1:
                    x = x.mean(dim, keepdim=True)
            return x.expand(bs)

        target = reduce(p)
        finite = a[torch.isfinite(a)]
        lo = torch.full(bs, float(finite.min()) / 2 - 40.0, dtype=torch.float64, device=q.device)
        hi = torch.full(bs, float(finite.max()) / 2 + 40.0, dtype=torch.float64, device=q.device)
        shape = (*([1] * (a.dim() - 1 - len(bs))), *bs, 1)  # the gain against (*lead, rows)
        for _ in range(100):  # bisection: p_hat decreases in g; 100 halvings of an 80+ wide bracket
            mid = (lo + hi) / 2
            above = reduce(torch.sigmoid(a - 2 * mid.reshape(shape))) > target  # g too small
            lo = torch.where(above, mid, lo)
            hi = torch.where(above, hi, mid)
        gain.copy_(((lo + hi) / 2).to(gain.dtype))
    return gain.detach().clone()


def _progress(it: Iterable[int], enabled: bool) -> Any:
    """A tqdm bar over ``it`` (disabled unless ``enabled``); the bare iterable without tqdm."""
    try:
        tqdm = importlib.import_module("tqdm.auto").tqdm  # optional dependency, untyped
    except ImportError:  # pragma: no cover - tqdm is optional
        return it
    return tqdm(it, desc="fit_feature_map", unit="step", disable=not enabled, leave=False, dynamic_ncols=True)
