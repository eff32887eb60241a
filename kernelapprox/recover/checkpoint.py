r"""Checkpoints of `kernelapprox.recover`: `save` and `load` of a linearised (fine-tuned) model."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .. import hf
from ._common import _ADAPTERS, _check_lin

__all__ = ["save", "load"]

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

