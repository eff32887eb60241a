r"""What the recovery stages share: the `History` they return and the checks of their arguments."""

from __future__ import annotations

import importlib
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import hf
from .._validation import check_bool, check_finite_float, check_positive_int, check_seed
from ..hf.switch import transformers_module

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


#: Configuration entries that fix the shapes of a model's tensors: a teacher must agree on each.
_SHAPE_KEYS = ("hidden_size", "n_embd", "num_hidden_layers", "n_layer", "num_attention_heads", "n_head",
               "num_key_value_heads", "head_dim", "intermediate_size", "n_inner", "vocab_size")


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
    t_cfg, s_cfg = teacher.config.to_dict(), student.config.to_dict()
    for key in _SHAPE_KEYS:
        if key in t_cfg and key in s_cfg and t_cfg[key] != s_cfg[key]:
            raise ValueError(
                f"teacher has {key}={t_cfg[key]}, the linearised model {key}={s_cfg[key]}: the teacher must be the "
                "original model (teacher = copy.deepcopy(model) before hf.linearize(model, ...))"
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
    if mask is not None:
        empty = (mask == 0).all(dim=-1).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"inputs['attention_mask'] has rows without any token (rows {empty[:10]}"
                f"{', ...' if len(empty) > 10 else ''}): every sequence needs at least one unpadded token"
            )
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


def _run_callback(callback: Callable[[int, Any], None] | None, step: int, history: Any) -> float:
    """Call ``callback(step, history)`` without autograd; return the CPU seconds it took (0 without one)."""
    if callback is None:
        return 0.0
    tick = time.process_time()
    with torch.no_grad():
        callback(step, history)
    return time.process_time() - tick


