r"""Recover a linearised model: attention transfer, then LoRA fine-tuning (LoLCATs' two stages).

A model swapped to linear (or hybrid) attention by `kernelapprox.hf.linearize` loses accuracy
that per-head distillation alone does not give back ([Kas21]_, [Zha24]_). LoLCATs [Zha25]_
recovers it in two cheap stages, both against the original model (the *teacher*):

1. `transfer` (attention transfer): each linearised layer's feature-map parameters
   $\theta_l$ (one set per head) are trained so that the student's attention output, computed on
   the **teacher's** queries, keys and values of that layer, matches the teacher's softmax output:

   $$
   \mathcal L_l(\theta_l) = \frac{1}{H\,n\,d_v}\sum_{h,i}\big\|\hat o^{(l,h)}_i(\theta_l) - o^{(l,h)}_i\big\|_2^2
   \;\big[+\ \tfrac1{Hn}\textstyle\sum_{h,i} \mathrm{CE}\big(A^{(l,h)}_{i\cdot}, \hat A^{(l,h)}_{i\cdot}(\theta_l)\big)\big],
   $$

   with $o = \mathrm{softmax}(s\,qk^\top + M)v$ the teacher's attention output (before the
   output projection) and $\hat o$ linear attention (or hybrid attention, exact on a window and
   sinks) with the map $\varphi_{\theta_l}$. The layers are independent: layer $l$ sees the
   teacher's inputs, never those produced by the linearised layers below it.
2. `finetune`: low-rank adapters ([Hu22], from ``peft``) on the attention projections of the
   linearised model, feature maps frozen, trained on the model's own output against the teacher:
   the cosine of the sentence embeddings or the MSE of the last hidden states (encoders), the KL
   divergence of the next-token distributions (causal language models).

`save` / `load` write and read the whole linearised, fine-tuned model (the model's weights, the
adapters, and the maps); `unload` removes unmerged adapters and switches the model back, giving
the original model bit for bit.

Both stages return a `History` (per step, per layer for `transfer`: the loss, with the tokens seen
and the CPU seconds), deterministic given ``seed``.

References
----------
- [Zha25] M. Zhang, S. Arora, R. Chalamala, A. Wu, B. Spector, A. Singhal, K. Ramesh, C. Ré.
   "LoLCATs: on low-rank linearizing of large language models", ICLR 2025 (Eq. 7, the sliding
   window + linear attention hybrid).
- [Zha24] M. Zhang, K. Bhatia, H. Kumbong, C. Ré. "The Hedgehog & the Porcupine: Expressive
   Linear Attentions with Softmax Mimicry", ICLR 2024, arXiv:2402.04347 (eq. 5: the distillation
   loss; the map as implemented in flash-linear-attention's ``HedgehogFeatureMap``).
- [Kas21] J. Kasai et al., "Finetuning pretrained transformers into RNNs", EMNLP 2021
   (swapping a pretrained model's softmax attention for linear attention).
- Hu22: E. J. Hu, Y. Shen, P. Wallis, Z. Allen-Zhu, Y. Li, S. Wang, L. Wang, W. Chen, "LoRA:
  low-rank adaptation of large language models", ICLR 2022.
"""

from __future__ import annotations

import importlib
import math
import re
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from . import hf
from ._validation import check_bool, check_finite_float, check_positive_int, check_seed, inputs_validated
from .hf.switch import transformers_module, valid_keys
from .maps.base import FeatureMap

__all__ = ["History", "transfer", "finetune", "lora_targets", "save", "load", "unload", "TARGETS"]

TRANSFER_LOSSES = ("mse", "mse+ce")
FINETUNE_LOSSES = ("cosine", "hidden-mse", "kl")

#: Friendly projection names -> module-name suffixes, per ``config.model_type``.
TARGETS: dict[str, dict[str, str]] = {
    "bert": {"query": "attention.self.query", "key": "attention.self.key",
             "value": "attention.self.value", "output": "attention.output.dense"},
    "gpt2": {"query": "attn.c_attn", "key": "attn.c_attn", "value": "attn.c_attn", "output": "attn.c_proj"},
    "llama": {"query": "self_attn.q_proj", "key": "self_attn.k_proj",
              "value": "self_attn.v_proj", "output": "self_attn.o_proj"},
}
for _alias in ("roberta", "distilbert", "electra", "xlm-roberta"):
    TARGETS.setdefault(_alias, TARGETS["bert"])
for _alias in ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"):
    TARGETS.setdefault(_alias, TARGETS["llama"])

# adapters injected by `finetune`: model -> (peft model, the LoRA settings saved by `save`)
# (and the model's requires_grad flags before the injection, given back by `merged` / `unload`)
_ADAPTERS: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, Any], dict[str, bool]]] = weakref.WeakKeyDictionary()


@dataclass
class History:
    """What one recovery stage did, step by step.

    Attributes
    ----------
    stage : {"transfer", "finetune"}
    loss : str
        The loss that was minimised.
    records : list of dict
        One per step and layer (`transfer`: keys ``step``, ``layer``, ``loss``, and ``mse`` /
        ``ce`` for ``loss="mse+ce"``) or one per step (`finetune`: ``step``, ``loss``); the loss
        at the parameters *before* that step's update. ``pandas.DataFrame(h.records)`` tabulates it.
    tokens_seen : int
        Non-padded tokens of the sequences drawn, summed over the steps.
    cpu_seconds : float
        Process CPU time of the stage (``time.process_time``), callbacks excluded.

    Examples
    --------
    >>> h = History("transfer", "mse", [{"step": 0, "layer": 1, "loss": 0.5},
    ...                                 {"step": 1, "layer": 1, "loss": 0.25}], 18, 0.1)
    >>> h.losses(1), h.layers
    ([0.5, 0.25], [1])
    """

    stage: str
    loss: str
    records: list[dict[str, Any]] = field(default_factory=list)
    tokens_seen: int = 0
    cpu_seconds: float = 0.0

    @property
    def layers(self) -> list[int]:
        """The layers that were trained (`transfer`), sorted; empty for `finetune`."""
        return sorted({r["layer"] for r in self.records if r.get("layer") is not None})

    def losses(self, layer: int | None = None) -> list[float]:
        """The loss per step: of ``layer`` (`transfer`), or of the model (`finetune`, ``layer=None``).

        For `transfer` with ``layer=None``: the mean over the layers at each step.
        """
        if layer is not None:
            out = [r["loss"] for r in self.records if r.get("layer") == layer]
            if not out:
                raise ValueError(f"layer must be one of the trained layers {self.layers}, got {layer!r}")
            return out
        steps: dict[int, list[float]] = {}
        for r in self.records:
            steps.setdefault(r["step"], []).append(r["loss"])
        return [sum(v) / len(v) for _, v in sorted(steps.items())]


# --------------------------------------------------------------------------------------------
# Checks shared by the stages
# --------------------------------------------------------------------------------------------
def _check_lin(lin: object) -> hf.Linearized:
    if not isinstance(lin, hf.Linearized):
        raise TypeError(f"lin must be the Linearized handle returned by hf.linearize, got {type(lin).__name__}")
    if not lin.active:
        raise ValueError("lin must be active (lin.restore() was called: the model runs softmax attention again)")
    return lin


def _check_teacher(teacher: object, lin: hf.Linearized) -> Any:
    tf = transformers_module()
    if not isinstance(teacher, tf.PreTrainedModel):
        raise TypeError(f"teacher must be a transformers PreTrainedModel, got {type(teacher).__name__}")
    student = lin.model
    if teacher is student or any(
        p.data_ptr() == q.data_ptr() for p, q in zip(teacher.parameters(), student.parameters(), strict=False)
    ):
        raise ValueError(
            "teacher must be the original model, not the linearised one nor a view of its weights: take "
            "teacher = copy.deepcopy(model) before hf.linearize(model, ...)"
        )
    if type(teacher) is not type(student):
        raise TypeError(
            f"teacher must be the same architecture as the linearised model ({type(student).__name__}), "
            f"got {type(teacher).__name__}"
        )
    return teacher


def _check_inputs(inputs: object) -> tuple[dict[str, Any], int]:
    """The model inputs as a dict, and the number of sequences (dimension 0 of ``input_ids``)."""
    if not isinstance(inputs, Mapping):
        raise TypeError(f"inputs must be a dict of model inputs (input_ids, attention_mask, ...), got {type(inputs).__name__}")
    ids = inputs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        got = f"shape {tuple(ids.shape)}, {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"inputs['input_ids'] must be an integer tensor of shape (sequences, n), got {got}")
    mask = inputs.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        got_mask = str(tuple(mask.shape)) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"inputs['attention_mask'] must have the shape of input_ids {tuple(ids.shape)}, got {got_mask}")
    return dict(inputs), ids.shape[0]


def _check_common(steps: object, lr: object, batch_size: object, seed: object, progress: object,
                  sequences: int, callback: object = None) -> tuple[int, float, int, int, bool]:
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable (step, history) or None, got {type(callback).__name__}")
    steps_ = check_positive_int("steps", steps)
    lr_ = check_finite_float("lr", lr, min=0.0, min_open=True)
    bs = check_positive_int("batch_size", batch_size)
    if bs > sequences:
        raise ValueError(f"batch_size must be at most the number of input sequences ({sequences}), got {bs}")
    seed_ = check_seed("seed", seed, allow_none=False)
    assert seed_ is not None  # allow_none=False
    return steps_, lr_, bs, seed_, check_bool("progress", progress)


def _batches(sequences: int, batch_size: int, steps: int, seed: int) -> list[torch.Tensor]:
    """Sequence indices of every step: consecutive slices of seeded permutations (epochs)."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    perm = torch.randperm(sequences, generator=g)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > sequences:
            perm, pos = torch.randperm(sequences, generator=g), 0
        out.append(perm[pos:pos + batch_size])
        pos += batch_size
    return out


def _select(inputs: Mapping[str, Any], idx: torch.Tensor, sequences: int) -> dict[str, Any]:
    return {k: v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == sequences else v
            for k, v in inputs.items()}


def _tokens(inputs: Mapping[str, Any], idx: torch.Tensor) -> int:
    mask = inputs.get("attention_mask")
    if mask is None:
        return int(idx.numel() * inputs["input_ids"].shape[1])
    return int(mask[idx].sum())


def _progress(it: Iterable[int], enabled: bool, desc: str) -> Any:
    try:
        tqdm = importlib.import_module("tqdm.auto").tqdm  # optional dependency, untyped
    except ImportError:  # pragma: no cover - tqdm is optional
        return it
    return tqdm(it, desc=desc, unit="step", disable=not enabled, leave=False, dynamic_ncols=True)


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


def _run_callback(callback: Callable[[int, Any], None] | None, step: int, history: Any) -> float:
    """Call ``callback(step, history)`` without autograd; return the CPU seconds it took (0 without one)."""
    if callback is None:
        return 0.0
    tick = time.process_time()
    with torch.no_grad():
        callback(step, history)
    return time.process_time() - tick


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


def _student_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, causal: bool,
                 window: int | None, sinks: Any) -> torch.Tensor:
    from .attention import linear_attention
    from .attention.hybrid import hybrid_attention

    if window is None:
        return linear_attention(q, k, v, fm, causal=causal)  # type: ignore[return-value]
    return hybrid_attention(q, k, v, fm, window=window, sinks=sinks, causal=causal)  # type: ignore[return-value]


def _student_log_weights(q: torch.Tensor, k: torch.Tensor, fm: FeatureMap, causal: bool,
                         window: int | None, sinks: Any) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(log Â, A)`` of one unpadded batch (…, n, m): the student's attention weights (linear, or
    exact on the window and sinks and $\varphi$ elsewhere, one normaliser) and the teacher's."""
    from .attention.hybrid import exact_set_mask

    n, m = q.shape[-2], k.shape[-2]
    logits = q @ k.mT
    with inputs_validated():
        fq, sq = fm.log_features(q)
        fk, sk = fm.key_log_features(k)
    G = fq @ fk.mT
    lin_logits = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sq.unsqueeze(-1) + sk.unsqueeze(-2)
    if window is not None:
        exact = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=q.device)
        lin_logits = torch.where(exact, logits, lin_logits)
    if causal:
        future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        logits = logits.masked_fill(future, float("-inf"))
        lin_logits = lin_logits.masked_fill(future, float("-inf"))
    log_hat = torch.log_softmax(lin_logits, dim=-1)
    if causal:
        log_hat = log_hat.masked_fill(future, 0.0)  # A = 0 there: no 0 * (-inf)
    return log_hat, torch.softmax(logits.detach(), dim=-1)


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
        out = _student_out(qi, ki, vi, fm, d.causal, window, sinks)
        err = (out.float() - ti).square()
        sq_err = sq_err + err.sum(dim=(-1, -2)).reshape(-1, d.heads.numel()).sum(0)
        rows += err.numel() // (err.shape[-1] * d.heads.numel())  # query rows per head
        if loss == "mse+ce":
            log_hat, A = _student_log_weights(qi, ki, fm, d.causal, window, sinks)
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


# --------------------------------------------------------------------------------------------
# Stage 2: LoRA fine-tuning
# --------------------------------------------------------------------------------------------
def _layer_of(name: str) -> int | None:
    m = re.search(r"\.(\d+)\.", f".{name}.")
    return int(m.group(1)) if m else None


def lora_targets(model: Any, targets: str | Sequence[str], layers: Iterable[int] | None = None) -> list[str]:
    """The full module names that ``targets`` designate in ``model``.

    Parameters
    ----------
    model : transformers.PreTrainedModel
    targets : str or sequence of str
        Friendly names ``"query"``, ``"key"``, ``"value"``, ``"output"`` (mapped per architecture by
        `TARGETS`: BERT ``attention.self.query`` ... ``attention.output.dense``; GPT-2 ``attn.c_attn``
        for query, key and value, which it projects together, and ``attn.c_proj``; LLaMA
        ``self_attn.q_proj`` ... ``o_proj``), or module names, matched as the whole name or its
        trailing dotted part (``"value"`` is friendly; ``"self.value"`` matches BERT's modules).
    layers : iterable of int, optional
        Keep the modules of these layers only (the layer index is the first integer component of
        the module name).

    Returns
    -------
    list of str
        Sorted module names (each a ``torch.nn.Linear`` or transformers ``Conv1D``).

    Raises
    ------
    ValueError
        A name that matches no module (the message names it), or matches a module that is not a
        linear projection.

    Examples
    --------
    >>> from transformers import GPT2Config, GPT2Model
    >>> from kernelapprox.recover import lora_targets
    >>> model = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99))
    >>> lora_targets(model, ["output"], layers=[1])
    ['h.1.attn.c_proj']
    """
    from transformers.pytorch_utils import Conv1D

    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, Sequence) or not targets or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"targets must be a non-empty sequence of module names, got {targets!r}")
    table = TARGETS.get(getattr(model.config, "model_type", ""), {})
    keep = None if layers is None else set(layers)
    modules = dict(model.named_modules())
    out: set[str] = set()
    for t in targets:
        suffix = table.get(t, t)
        found = [name for name in modules if name == suffix or name.endswith("." + suffix)]
        if keep is not None:
            found = [name for name in found if _layer_of(name) in keep]
        if not found:
            friendly = f" (friendly names for model_type {model.config.model_type!r}: {sorted(table)})" if table else ""
            raise ValueError(f"targets: {t!r} matches no module of {type(model).__name__}{friendly}")
        bad = [name for name in found if not isinstance(modules[name], torch.nn.Linear | Conv1D)]
        if bad:
            raise ValueError(f"targets: {t!r} matches modules that are not linear projections: {bad[:3]}")
        out.update(found)
    return sorted(out)


def _hidden(out: Any) -> torch.Tensor:
    h = getattr(out, "last_hidden_state", None)
    if h is None:
        hs = getattr(out, "hidden_states", None)
        if hs is None:
            raise ValueError("the model's output has neither last_hidden_state nor hidden_states")
        h = hs[-1]
    return h


def _embed(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`kernelapprox.hf.sentence_embeddings`'s pooling, differentiable."""
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
    w = mask.to(hidden.dtype).unsqueeze(-1)
    return F.normalize((hidden * w).sum(1) / w.sum(1).clamp_min(1e-9), dim=-1)


def _finetune_loss(kind: str, student: Any, teacher: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    mask = batch.get("attention_mask")
    if kind == "kl":
        with torch.no_grad():
            p_log = torch.log_softmax(teacher(**batch).logits.float(), dim=-1)
        s_log = torch.log_softmax(student(**batch).logits.float(), dim=-1)
        kl = (p_log.exp() * (p_log - s_log)).sum(-1)  # (b, n)
        w = torch.ones_like(kl) if mask is None else mask.to(kl.dtype)
        return (kl * w).sum() / w.sum().clamp_min(1.0)
    with torch.no_grad():
        h_t = _hidden(teacher(**batch, output_hidden_states=True)).float()
    h_s = _hidden(student(**batch, output_hidden_states=True)).float()
    if kind == "hidden-mse":
        w = torch.ones(h_s.shape[:2]) if mask is None else mask.to(h_s.dtype)
        return ((h_s - h_t).square().mean(-1) * w).sum() / w.sum().clamp_min(1.0)
    cos = (_embed(h_s, mask) * _embed(h_t, mask)).sum(-1)
    return (1.0 - cos).mean()


def finetune(
    lin: hf.Linearized,
    teacher: Any,
    inputs: Mapping[str, Any],
    *,
    lora_rank: int = 8,
    lora_alpha: float = 16,
    targets: str | Sequence[str] = ("query", "key", "value", "output"),
    loss: str | None = None,
    steps: int,
    lr: float = 1e-3,
    batch_size: int,
    seed: int = 0,
    merge: bool = False,
    progress: bool = True,
    callback: Callable[[int, History], None] | None = None,
) -> tuple[Any, History]:
    r"""LoRA fine-tuning of the linearised model against the teacher, feature maps frozen [Zha25]_.

    Low-rank adapters $W \mapsto W + \tfrac{\alpha}{r} BA$ ($A \in \mathbb R^{r\times d_{in}}$,
    $B \in \mathbb R^{d_{out}\times r}$, $B = 0$ at the start: the model is unchanged before the
    first step) are injected with ``peft`` (``LoraConfig``, ``get_peft_model``) on the attention
    projections ``targets`` of the linearised layers; every other weight, and every feature map,
    is frozen. The adapters minimise, on the model's own output against the teacher's:

    - ``"cosine"`` (encoders, default without a language-model head):
      $\frac1B\sum_b 1 - \cos(e_b, e^{\mathrm T}_b)$, the sentence embeddings of
      `kernelapprox.hf.sentence_embeddings` (mean pooling over the non-padded tokens, normalised);
    - ``"hidden-mse"``: the mean over the non-padded tokens of
      $\frac1{d}\|h_t - h^{\mathrm T}_t\|^2$, last hidden states;
    - ``"kl"`` (causal language models, the default with a head):
      the mean over the non-padded positions of $\mathrm{KL}(p^{\mathrm T}_t \,\|\, p_t)$, the
      next-token distributions.

    AdamW, ``steps`` steps of ``batch_size`` sequences (seeded permutations); the model runs in
    eval mode (no dropout), gradients enabled.

    Parameters
    ----------
    lin : kernelapprox.hf.Linearized
        An active handle (after `transfer`, or straight from ``hf.linearize``).
    teacher : transformers.PreTrainedModel
        The original model (a deepcopy taken before ``hf.linearize``).
    inputs : dict
        Model inputs, ``input_ids`` (sequences, n): calibration text.
    lora_rank, lora_alpha : int, float, default 8, 16
        $r$ and $\alpha$.
    targets : str or sequence of str, default all four projections
        Friendly names or module names (`lora_targets`); restricted to the linearised layers.
    loss : {"cosine", "hidden-mse", "kl"}, optional
        Default: ``"kl"`` for a model with an output head (``get_output_embeddings()``), else
        ``"cosine"``.
    steps : int
    lr : float, default 1e-3
    batch_size : int
    seed : int, default 0
        Seed of the adapters' initialisation and of the sequence draws (deterministic run).
    merge : bool, default False
        Merge the adapters into the weights at the end (``peft``'s ``merge_and_unload``): the model
        is then the original architecture with new weights (`save` / ``load_state_dict`` on a
        freshly linearised model restore it). Otherwise the adapters stay separate (`unload`
        removes them).
    progress : bool, default True
    callback : callable, optional
        ``callback(step, history)`` after each step's update, under ``torch.no_grad``.

    Returns
    -------
    model : transformers.PreTrainedModel
        ``lin.model`` itself, adapted in place and still linearised.
    history : History
        One record per step: ``step``, ``loss``.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (named in the message); a target that matches no module; adapters already
        injected (call `unload` first, or pass ``merge=True`` the first time).

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
    >>> model, h = recover.finetune(lin, teacher, ids, targets=["value"], steps=3, batch_size=4,
    ...                             progress=False)
    >>> h.loss, len(h.losses()), h.tokens_seen
    ('cosine', 3, 192)
    >>> sorted(n for n, p in model.named_parameters() if p.requires_grad)[:1]
    ['encoder.layer.0.attention.self.value.lora_A.default.weight']
    """
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    lin = _check_lin(lin)
    teacher = _check_teacher(teacher, lin)
    inputs_, sequences = _check_inputs(inputs)
    steps, lr, batch_size, seed, progress = _check_common(steps, lr, batch_size, seed, progress, sequences, callback)
    rank = check_positive_int("lora_rank", lora_rank)
    alpha = check_finite_float("lora_alpha", lora_alpha, min=0.0, min_open=True)
    merge = check_bool("merge", merge)
    model = lin.model
    has_head = callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None
    if loss is None:
        loss = "kl" if has_head else "cosine"
    if not isinstance(loss, str) or loss not in FINETUNE_LOSSES:
        raise ValueError(f"loss must be one of {FINETUNE_LOSSES} or None, got {loss!r}")
    if loss == "kl" and not has_head:
        raise ValueError(f"loss='kl' needs a model with a language-model head, got {type(model).__name__}")
    if model in _ADAPTERS:
        raise ValueError("lin.model already has adapters from finetune: call recover.unload(lin) first, or merge=True")
    names = lora_targets(model, targets, lin.layers)
    modules = dict(model.named_modules())
    fan_in_fan_out = isinstance(modules[names[0]], Conv1D)
    if any(isinstance(modules[n], Conv1D) != fan_in_fan_out for n in names):
        raise ValueError(f"targets mix Conv1D and Linear projections: {names}")

    start = time.process_time()
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for fm in lin.feature_maps.values():
        fm.requires_grad_(False)
    settings = {"r": rank, "lora_alpha": alpha, "target_modules": names, "fan_in_fan_out": fan_in_fan_out}
    config = LoraConfig(lora_dropout=0.0, bias="none", **settings)  # type: ignore[arg-type]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(seed)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    _ADAPTERS[model] = (peft_model, settings, flags)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    was_training = model.training
    model.eval()
    history = History("finetune", loss)
    bar = _progress(range(steps), progress, "finetune")
    try:
        with torch.enable_grad():
            for t, idx in zip(bar, _batches(sequences, batch_size, steps, seed), strict=False):
                batch = _select(inputs_, idx, sequences)
                value = _finetune_loss(loss, model, teacher, batch)
                v = float(value.detach())
                if not math.isfinite(v):
                    raise FloatingPointError(f"the fine-tuning loss became non-finite at step {t} (lr={lr}); lower lr")
                history.records.append({"step": t, "loss": v})
                opt.zero_grad(set_to_none=True)
                value.backward()
                opt.step()
                history.tokens_seen += _tokens(inputs_, idx)
                start += _run_callback(callback, t, history)  # its time is not the stage's
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{v:.4g}", refresh=False)
    finally:
        if hasattr(bar, "close"):
            bar.close()
        for p in params:
            p.grad = None
        model.train(was_training)
    if merge:
        merged(lin)
    history.cpu_seconds = time.process_time() - start
    return model, history


def merged(lin: hf.Linearized) -> Any:
    """Merge `finetune`'s adapters into the weights (``peft``'s ``merge_and_unload``), in place.

    Returns ``lin.model`` (still linearised), now without adapter modules. No-op without adapters.
    """
    model = _check_lin(lin).model
    entry = _ADAPTERS.pop(model, None)
    if entry is not None:
        entry[0].merge_and_unload()
        _give_back_flags(model, entry[2])
    return model


def _give_back_flags(model: Any, flags: Mapping[str, bool]) -> None:
    for name, p in model.named_parameters():
        if name in flags:
            p.requires_grad_(flags[name])


def unload(lin: hf.Linearized) -> Any:
    """Remove `finetune`'s unmerged adapters (``peft``'s ``unload``) and restore the model.

    The model is then the original one bit for bit (the adapters never touch the base weights, and
    `transfer` trains only the maps), its ``requires_grad`` flags as they were before `finetune`. Merged adapters cannot be removed: their change is in the
    weights. Returns ``lin.model``.

    Examples
    --------
    >>> recover.unload(lin)                                   # doctest: +SKIP
    """
    if not isinstance(lin, hf.Linearized):
        raise TypeError(f"lin must be the Linearized handle returned by hf.linearize, got {type(lin).__name__}")
    entry = _ADAPTERS.pop(lin.model, None)
    if entry is not None:
        entry[0].unload()
        _give_back_flags(lin.model, entry[2])
    lin.restore()
    return lin.model


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------
_FORMAT = "kernelapprox.recover/1"


def save(lin: hf.Linearized, path: str | Path) -> None:
    """Write the linearised (fine-tuned) model: its state dict, the adapters' settings, the maps.

    ``torch.save`` of a dict of tensors and plain values (readable with ``weights_only=True``).

    Parameters
    ----------
    lin : kernelapprox.hf.Linearized
    path : str or Path

    Examples
    --------
    >>> recover.save(lin, "linearised.pt")                       # doctest: +SKIP
    >>> lin2 = hf.linearize(fresh_model, "hedgehog", num_features=64, calibration=ids, fit_steps=1)  # doctest: +SKIP
    >>> recover.load(lin2, "linearised.pt")                     # doctest: +SKIP
    """
    if not isinstance(lin, hf.Linearized):
        raise TypeError(f"lin must be the Linearized handle returned by hf.linearize, got {type(lin).__name__}")
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    entry = _ADAPTERS.get(lin.model)
    torch.save({
        "format": _FORMAT,
        "model": lin.model.state_dict(),
        "feature_maps": {int(layer): fm.state_dict() for layer, fm in lin.feature_maps.items()},
        "lora": None if entry is None else dict(entry[1]),
    }, path)


def load(lin: hf.Linearized, path: str | Path) -> Any:
    """Load what `save` wrote into a freshly linearised model of the same architecture and maps.

    Injects the same adapters first (if the saved model had unmerged ones), then loads the model's
    state dict and every layer's map (strictly: a missing or unexpected key raises).

    Parameters
    ----------
    lin : kernelapprox.hf.Linearized
        ``hf.linearize`` of a fresh model with the same ``feature_map`` specification (learned maps
        may be calibrated for one step: their parameters are overwritten).
    path : str or Path

    Returns
    -------
    transformers.PreTrainedModel
        ``lin.model``, with the saved weights, adapters and maps.

    Raises
    ------
    ValueError
        Not a file written by `save`; the handle lacks a map the file has.
    """
    from peft import LoraConfig, get_peft_model

    lin = _check_lin(lin)
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != _FORMAT:
        raise ValueError(f"path must be a file written by kernelapprox.recover.save, got {str(path)!r}")
    model = lin.model
    missing = sorted(set(ckpt["feature_maps"]) - set(lin.feature_maps))
    if missing:
        raise ValueError(
            f"lin has no feature map for layers {missing} of the file: linearize the same layers with the same "
            "feature_map (run the model once if its maps are built on first use)"
        )
    if ckpt["lora"] is not None:
        if model in _ADAPTERS:
            raise ValueError("lin.model already has adapters: load into a freshly linearised model")
        settings = dict(ckpt["lora"])
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        for p in model.parameters():
            p.requires_grad_(False)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            peft_model = get_peft_model(model, LoraConfig(lora_dropout=0.0, bias="none", **settings))
        _ADAPTERS[model] = (peft_model, settings, flags)
    model.load_state_dict(ckpt["model"])
    for layer, state in ckpt["feature_maps"].items():
        lin.feature_maps[layer].load_state_dict(state)
    return model
