r"""Checkpoints of `kernelapprox.recover`: `save` and `load` of a linearised (fine-tuned) model."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import hf
from .._io import atomic_write
from ..maps.base import FeatureMap
from ._common import _ADAPTERS, _check_lin

__all__ = ["save", "load"]

_FORMAT = "kernelapprox.recover/1"


def save(lin: hf.Linearized, path: str | Path) -> None:
    """Write the linearised (fine-tuned) model: its state dict, the adapters' settings, the maps.

    ``torch.save`` of a dict of tensors and plain values (readable with ``weights_only=True``),
    written all or nothing (a temporary file in the same folder, then ``os.replace``): an
    interrupted save leaves the previous file whole. A restored handle (``lin.restore()``) is
    refused.

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
    lin = _check_lin(lin)
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    entry = _ADAPTERS.get(lin.model)
    ckpt = {
        "format": _FORMAT,
        "model": lin.model.state_dict(),
        "feature_maps": {int(layer): fm.state_dict() for layer, fm in lin.feature_maps.items()},
        "feature_map_config": {int(layer): _map_config(fm) for layer, fm in lin.feature_maps.items()},
        "lora": None if entry is None else dict(entry[1]),
    }
    atomic_write(path, lambda f: torch.save(ckpt, f))


def _map_config(fm: FeatureMap) -> dict[str, Any]:
    """What a map's state dict does not say: its class and the settings that give its parameters meaning."""
    out: dict[str, Any] = {"class": type(fm).__name__}
    for key in ("dim", "num_features", "feature_dim", "variant"):
        value = getattr(fm, key, None)
        if isinstance(value, bool | int | float | str):
            out[key] = value
    return out


def _shape_errors(what: str, want: Mapping[str, Any], got: Mapping[str, Any]) -> list[str]:
    """Keys missing or unexpected in ``got`` against ``want``, and shapes that differ."""
    errors = []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing:
        errors.append(f"{what}: missing keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if extra:
        errors.append(f"{what}: unexpected keys {extra[:5]}{' ...' if len(extra) > 5 else ''}")
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if isinstance(a, torch.Tensor) and (not isinstance(b, torch.Tensor) or a.shape != b.shape):
            shape = tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__
            errors.append(f"{what}: {key} has shape {shape} in the file, {tuple(a.shape)} here")
    return errors


def _read(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path``, its structure checked; any failure names the file."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # truncated, corrupt, or not a torch file at all
        raise ValueError(
            f"path {str(path)!r} is not a readable kernelapprox.recover checkpoint (truncated or corrupt?): "
            f"{type(e).__name__}: {e}"
        ) from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != _FORMAT:
        raise ValueError(f"path must be a file written by kernelapprox.recover.save, got {str(path)!r}")
    maps = ckpt.get("feature_maps")
    if not isinstance(ckpt.get("model"), Mapping) or not isinstance(maps, Mapping) or not all(
        isinstance(s, Mapping) for s in maps.values()
    ):
        raise ValueError(f"path {str(path)!r} is a kernelapprox.recover checkpoint without its model or maps")
    return ckpt


def _dry_model(model: Any) -> Any:
    """A copy of ``model`` on the meta device (no tensor data is copied): loading into it checks keys
    and shapes without touching ``model``."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(
            t, torch.nn.Parameter) else meta
    return copy.deepcopy(model, memo)


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
        Not a file written by `save` (or a truncated one: the message names the file); a file that
        does not fit the handle (other layers, another map or width, other tensor shapes). Every
        check runs before the model changes: after a refusal, the model is as it was and a load
        of the right file works.
    """
    from peft import LoraConfig, get_peft_model

    lin = _check_lin(lin)
    if not isinstance(path, str | Path):
        raise TypeError(f"path must be a str or Path, got {type(path).__name__}")
    ckpt = _read(path)
    model = lin.model
    where = f"the file {str(path)!r}"
    missing = sorted(set(ckpt["feature_maps"]) - set(lin.feature_maps))
    if missing:
        raise ValueError(
            f"lin has no feature map for layers {missing} of {where}: linearize the same layers with the same "
            "feature_map (run the model once if its maps are built on first use)"
        )
    extra = sorted(set(lin.feature_maps) - set(ckpt["feature_maps"]))
    if extra:
        raise ValueError(f"lin linearises layers {extra} that {where} has no feature map for: linearize the same "
                         "layers as the saved model")
    errors = []
    for layer, config in (ckpt.get("feature_map_config") or {}).items():
        here = _map_config(lin.feature_maps[layer])
        diff = {k: (v, here.get(k)) for k, v in dict(config).items() if here.get(k) != v}
        if diff:
            errors.append(f"feature map of layer {layer}: " + ", ".join(
                f"{k}={a!r} in the file, {b!r} here" for k, (a, b) in diff.items()))
    for layer, state in ckpt["feature_maps"].items():
        errors += _shape_errors(f"feature map of layer {layer}", lin.feature_maps[layer].state_dict(), state)
    if ckpt["lora"] is not None and model in _ADAPTERS:
        raise ValueError("lin.model already has adapters: load into a freshly linearised model")
    if not errors:  # the model's keys and shapes, on a data-free copy with the same adapters
        dry = _dry_model(model)
        if ckpt["lora"] is not None:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
                get_peft_model(dry, LoraConfig(lora_dropout=0.0, bias="none", **dict(ckpt["lora"])))
        errors += _shape_errors("model", dry.state_dict(), ckpt["model"])
    if errors:
        raise ValueError(
            f"{where} does not fit this linearised model (nothing was changed): " + "; ".join(errors[:6])
            + ("; ..." if len(errors) > 6 else "")
        )
    if ckpt["lora"] is not None:
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

