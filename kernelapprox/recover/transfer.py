r"""Stage 1 of `kernelapprox.recover`: attention transfer (`transfer`) [Zha25]_.

Each linearised layer's map is trained so that the student's attention output on the teacher's
queries, keys and values (`kernelapprox.attention.padded.padded_attention`) matches the teacher's
softmax output.

References
----------
.. [Zha25] M. Zhang et al., "LoLCATs: on low-rank linearizing of large language models", ICLR 2025.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import hf
from .._validation import check_finite_float
from ..attention.padded import attention_log_weights, padded_attention
from ..hf.switch import valid_keys
from ..maps.base import FeatureMap
from ._common import (
    History,
    _batches,
    _check_common,
    _check_inputs,
    _check_lin,
    _check_teacher,
    _progress,
    _run_callback,
    _tokens,
)

__all__ = ["transfer", "TRANSFER_LOSSES"]

TRANSFER_LOSSES = ("mse", "mse+ce")


def _hybrid_settings(lin: hf.Linearized) -> tuple[int | None, Any, dict[int, set[int]]]:
    """``(window, sinks, exact_heads)`` of the handle (None, 0, {} where hf has none)."""
    window = getattr(lin, "window", None)
    sinks = getattr(lin, "sinks", 0)
    exact = getattr(lin, "exact_heads", None) or {}
    return window, (0 if sinks is None else sinks), {int(k): set(v) for k, v in dict(exact).items()}


# --------------------------------------------------------------------------------------------
# Stage 1: attention transfer
# --------------------------------------------------------------------------------------------
@dataclass
class _LayerData:
    q: torch.Tensor  # scaled kernel inputs (B, H, n, d)
    k: torch.Tensor
    v: torch.Tensor
    target: torch.Tensor  # teacher's softmax output (B, H, n, dv)
    valid: torch.Tensor | None  # (B, m) valid keys, None without padding
    causal: bool
    heads: torch.Tensor  # (H,) bool: heads whose map output enters the model (not exact heads)



def _teacher_layers(teacher: Any, inputs: Mapping[str, Any], layers: list[int],
                    exact: Mapping[int, set[int]]) -> dict[int, _LayerData]:
    """The teacher's q, k, v and softmax attention output of every trained layer, once."""
    cap = hf.capture(teacher, layers=layers, **inputs)
    out: dict[int, _LayerData] = {}
    for lc in cap.layers:
        qs, ks = lc.kernel_inputs()
        valid = valid_keys(lc.allowed, lc.causal)
        heads = torch.ones(lc.q.shape[1], dtype=torch.bool)
        heads[sorted(h for h in exact.get(lc.layer, ()) if 0 <= h < heads.numel())] = False
        out[lc.layer] = _LayerData(
            q=qs.float(), k=ks.float(), v=lc.v.float(), target=lc.softmax_attention().float(),
            valid=valid, causal=lc.causal, heads=heads,
        )
    return out


def _layer_loss(d: _LayerData, idx: torch.Tensor, fm: FeatureMap, loss: str, window: int | None,
                sinks: Any) -> tuple[torch.Tensor, dict[str, float]]:
    """The layer's loss on the sequences ``idx``: mean over the kept heads of (MSE [+ CE])."""
    q, k, v, target = d.q[idx], d.k[idx], d.v[idx], d.target[idx]
    if d.valid is None:
        pieces = [(q, k, v, target)]
    else:  # padded sequences: each on its valid tokens, as the linearised model computes them
        pieces = []
        for i, row in enumerate(d.valid[idx]):
            keep = row.nonzero().squeeze(-1)
            pieces.append((q[i][:, keep], k[i][:, keep], v[i][:, keep], target[i][:, keep]))
    sq_err = torch.zeros(d.heads.numel())
    ce_sum = torch.zeros(d.heads.numel())
    rows = 0
    for qi, ki, vi, ti in pieces:
        out = padded_attention(qi, ki, vi, fm, window=window, sinks=sinks, causal=d.causal)
        err = (out.float() - ti).square()
        sq_err = sq_err + err.sum(dim=(-1, -2)).reshape(-1, d.heads.numel()).sum(0)
        rows += err.numel() // (err.shape[-1] * d.heads.numel())  # query rows per head
        if loss == "mse+ce":
            log_hat, A = attention_log_weights(qi, ki, fm, window=window, sinks=sinks, causal=d.causal)
            ce = -(A * log_hat).sum(-1)
            ce_sum = ce_sum + ce.sum(-1).reshape(-1, d.heads.numel()).sum(0)
    dv = d.v.shape[-1]
    mse = (sq_err / (rows * dv))[d.heads].mean()
    parts = {"mse": float(mse.detach())}
    total = mse
    if loss == "mse+ce":
        ce_mean = (ce_sum / rows)[d.heads].mean()
        parts["ce"] = float(ce_mean.detach())
        total = mse + ce_mean
    return total, parts


def transfer(
    lin: hf.Linearized,
    teacher: Any,
    inputs: Mapping[str, Any],
    *,
    steps: int,
    lr: float = 1e-2,
    batch_size: int,
    loss: str = "mse",
    seed: int = 0,
    weight_decay: float = 0.0,
    progress: bool = True,
    callback: Callable[[int, History], None] | None = None,
) -> History:
    r"""Attention transfer [Zha25]_: train each linearised layer's map so that its attention
    output on the teacher's q, k, v matches the teacher's softmax output.

    For every linearised layer $l$ (all heads at once, the map's ``batch_shape = (heads,)``),

    $$
    \min_{\theta_l}\ \frac1{|H_l|\,n\,d_v}\sum_{h\in H_l}\sum_i \big\|\hat o_i^{(h)} - o_i^{(h)}\big\|^2
    \ \Big[+\ \frac1{|H_l|\,n}\sum_{h\in H_l}\sum_i -\sum_j A^{(h)}_{ij}\log\hat A^{(h)}_{ij}\Big],
    $$

    where $o = \mathrm{softmax}(s\,q k^\top + M)\,v$ is the teacher's attention output (before
    the output projection) on the teacher's own $q, k, v$ of layer $l$ (captured once with
    `kernelapprox.hf.capture`, with the model's scaling $s$ and mask $M$), $\hat o$ the student's:
    `kernelapprox.linear_attention` with $\varphi_{\theta_l}$ on $\sqrt s\,q, \sqrt s\,k$, or
    `kernelapprox.attention.hybrid.hybrid_attention` (exact on the window and sinks) when the
    handle has a ``window``; $H_l$ the heads not kept exact (``lin.exact_heads``); ``"mse+ce"``
    adds the cross-entropy of the attention weights ([Zha24]_ eq. 5, with the window and sinks
    exact for a hybrid). The layers are independent: each trains on the teacher's inputs of that
    layer. AdamW on every parameter of the maps, ``steps`` steps of ``batch_size`` sequences each
    (seeded permutations of the sequences).

    Parameters
    ----------
    lin : kernelapprox.hf.Linearized
        An active handle whose linearised layers hold learned maps (``fm.learned``, e.g. Hedgehog
        built by ``hf.linearize(model, "hedgehog", ...)``). Its maps are trained in place.
    teacher : transformers.PreTrainedModel
        The original model (``copy.deepcopy(model)`` taken before ``hf.linearize``).
    inputs : dict
        Model inputs, ``input_ids`` of shape (sequences, n) (``attention_mask`` optional): the
        calibration text, never the evaluation text.
    steps : int
        Optimiser steps.
    lr : float, default 1e-2
        AdamW learning rate.
    batch_size : int
        Sequences per step (at most the number of sequences).
    loss : {"mse", "mse+ce"}, default "mse"
    seed : int, default 0
        Seed of the sequence draws: with it the run is deterministic (bit-identical maps and
        history on the same machine).
    weight_decay : float, default 0.0
        AdamW's decoupled weight decay.
    progress : bool, default True
        A tqdm bar with the mean loss over the layers.
    callback : callable, optional
        ``callback(step, history)`` after each step's update (e.g. to evaluate the model every few
        steps; it runs under ``torch.no_grad``).

    Returns
    -------
    History
        ``records``: one per step and layer (``step``, ``layer``, ``loss``, ``mse``, ``ce``).

    Raises
    ------
    TypeError
        ``lin`` is not a handle; ``teacher`` is not a model of the same class; a linearised
        layer's map has no trainable parameter (random, deterministic and data-dependent maps are
        not trained by this stage: there is nothing to train).
    ValueError
        The handle is restored; ``teacher`` shares its weights with the linearised model; bad
        ``inputs``, ``steps``, ``lr``, ``batch_size``, ``loss``, ``seed``; ``loss="mse+ce"`` with
        signed features.

    Notes
    -----
    Only parameters change: buffers (the fitted statistics of a data-dependent map, a random
    map's projection) are frozen, and attention is called without ``fit``. The ``requires_grad``
    flags and the train/eval mode of the maps are restored on return (``hf.linearize`` freezes the
    maps it distils, and `finetune` relies on that). A map shared by several layers receives the
    sum of their losses. The teacher and the model are run under ``torch.no_grad`` once (the
    capture); each step then costs the layers' attention only.

    Examples
    --------
    >>> import copy, torch
    >>> from transformers import BertConfig, BertModel
    >>> from kernelapprox import hf, recover
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                              intermediate_size=37, vocab_size=99)).eval()
    >>> teacher = copy.deepcopy(model)
    >>> ids = {"input_ids": torch.randint(0, 99, (8, 16))}
    >>> lin = hf.linearize(model, "hedgehog", num_features=8, calibration=ids, fit_steps=5)
    >>> h = recover.transfer(lin, teacher, ids, steps=20, batch_size=4, lr=0.05, progress=False)
    >>> h.layers, h.losses(0)[-1] < h.losses(0)[0]
    ([0, 1], True)
    """
    lin = _check_lin(lin)
    teacher = _check_teacher(teacher, lin)
    inputs_, sequences = _check_inputs(inputs)
    steps, lr, batch_size, seed, progress = _check_common(steps, lr, batch_size, seed, progress, sequences, callback)
    if not isinstance(loss, str) or loss not in TRANSFER_LOSSES:
        raise ValueError(f"loss must be one of {TRANSFER_LOSSES}, got {loss!r}")
    weight_decay = check_finite_float("weight_decay", weight_decay, min=0.0)
    window, sinks, exact = _hybrid_settings(lin)

    maps = dict(sorted(lin.feature_maps.items()))
    if lin.layers is not None:
        missing = sorted(set(lin.layers) - set(maps))
        if missing:
            raise ValueError(
                f"lin has no feature map yet for layers {missing} (maps built from a name on first use): run "
                "the model once on any input before transfer"
            )
        maps = {layer: fm for layer, fm in maps.items() if layer in lin.layers}
    if not maps:
        raise ValueError("lin has no feature map: nothing to train (run the model once, or linearize with calibration)")
    untrainable = {layer: type(fm).__name__ for layer, fm in maps.items() if not any(True for _ in fm.parameters())}
    if untrainable:
        raise TypeError(
            f"transfer trains the parameters of learned feature maps; the maps of layers {untrainable} have "
            "none (random, deterministic or data-dependent maps): nothing to train -- linearize with a learned "
            "map, e.g. hf.linearize(model, 'hedgehog', num_features=..., calibration=...)"
        )
    if loss == "mse+ce":
        signed = sorted(layer for layer, fm in maps.items() if not fm.positive)
        if signed:
            raise ValueError(f"loss='mse+ce' needs positive features (it takes log phi(q).phi(k)); layers {signed} are signed")

    start = time.process_time()
    data = _teacher_layers(teacher, inputs_, list(maps), exact)
    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for fm in maps.values():
        for p in fm.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    flags = [p.requires_grad for p in params]
    modes = {id(fm): (fm, fm.training) for fm in maps.values()}
    history = History("transfer", loss)
    bar = _progress(range(steps), progress, "transfer")
    try:
        for p in params:
            p.requires_grad_(True)
        for fm, _ in modes.values():
            fm.train()
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        with torch.enable_grad():
            for t, idx in zip(bar, _batches(sequences, batch_size, steps, seed), strict=False):
                opt.zero_grad(set_to_none=True)
                total = torch.zeros(())
                values = []
                for layer, fm in maps.items():
                    value, parts = _layer_loss(data[layer], idx, fm, loss, window, sinks)
                    v = float(value.detach())
                    if not math.isfinite(v):
                        raise FloatingPointError(
                            f"the transfer loss of layer {layer} became non-finite at step {t} (lr={lr}); "
                            "lower lr"
                        )
                    history.records.append({"step": t, "layer": layer, "loss": v, **parts})
                    values.append(v)
                    total = total + value
                total.backward()
                opt.step()
                history.tokens_seen += _tokens(inputs_, idx)
                start += _run_callback(callback, t, history)  # its time is not the stage's
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{sum(values) / len(values):.4g}", refresh=False)
    finally:
        if hasattr(bar, "close"):
            bar.close()
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
            p.grad = None
        for fm, mode in modes.values():
            fm.train(mode)
    history.cpu_seconds = time.process_time() - start
    return history

