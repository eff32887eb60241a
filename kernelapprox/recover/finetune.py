r"""Stage 2 of `kernelapprox.recover`: LoRA fine-tuning (`finetune`) [Hu22]_ and its adapters
(`lora_targets`, `merged`, `unload`).

References
----------
.. [Hu22] E. J. Hu et al., "LoRA: low-rank adaptation of large language models", ICLR 2022.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .. import hf
from .._validation import check_bool, check_finite_float, check_positive_int
from ._common import (
    _ADAPTERS,
    History,
    _batches,
    _check_common,
    _check_inputs,
    _check_lin,
    _check_teacher,
    _progress,
    _run_callback,
    _select,
    _tokens,
)

__all__ = ["finetune", "lora_targets", "merged", "unload", "TARGETS", "FINETUNE_LOSSES"]

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


