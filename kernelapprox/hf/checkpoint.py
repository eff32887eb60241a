"""Save and load a linearised (and recovered) model: a directory that rebuilds it, outputs identical.

`save_linearized` writes the model's config (transformers' ``save_pretrained`` of the config),
the swap's settings (``kernelapprox.json``) and the model's state dict with its feature maps
(``kernelapprox.pt``, readable with ``weights_only=True``); a model recovered by
`kernelapprox.recover` is saved once its adapters are merged (``recover.merged(lin)``). `load_linearized` builds the model from
its config, linearises it with the same settings and loads every tensor back (strictly).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .linearize import Linearized, MapSpec, attention_modules, build_map, linearize, module_shape
from .switch import transformers_module

__all__ = ["load_linearized", "save_linearized"]

FORMAT = "kernelapprox.hf.linearized/1"
SETTINGS_FILE = "kernelapprox.json"
STATE_FILE = "kernelapprox.pt"


def save_linearized(lin: Linearized, directory: str | Path) -> Path:
    r"""Write a linearised model to ``directory`` so that `load_linearized` rebuilds it exactly.

    Three files: ``config.json`` (the model's config, transformers' ``save_pretrained``),
    ``kernelapprox.json`` (the architecture, the original attention implementation and
    ``lin.settings``: estimator name, ``num_features``, ``layers``, ``window``, ``sinks``, the
    resolved ``exact_heads``, ...), and ``kernelapprox.pt`` (the model's state dict with every
    layer's feature map; LoRA adapters of `kernelapprox.recover.finetune` must be merged first,
    ``recover.merged(lin)``, or the model saved with `kernelapprox.recover.save`). The equivalent
    of ``save_pretrained`` for a linearised model, whose attention implementation is registered
    at run time.

    Parameters
    ----------
    lin : Linearized
        An active handle (`kernelapprox.hf.linearize`, possibly after `kernelapprox.recover`).
    directory : str or Path
        Created if missing; the three files are overwritten.

    Returns
    -------
    Path
        ``directory``.

    Examples
    --------
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, intermediate_size=37, vocab_size=99)
    >>> lin = hf.linearize(LlamaForCausalLM(cfg).eval(), "positive", num_features=16, window=4)
    >>> ids = torch.randint(1, 99, (1, 12))
    >>> with tempfile.TemporaryDirectory() as d, torch.no_grad():
    ...     _ = hf.save_linearized(lin, d)
    ...     lin2 = hf.load_linearized(d)
    ...     same = torch.equal(lin.model(input_ids=ids).logits, lin2.model(input_ids=ids).logits)
    >>> same, lin2.window
    (True, 4)
    """
    if not isinstance(lin, Linearized):
        raise TypeError(f"lin must be the Linearized handle returned by hf.linearize, got {type(lin).__name__}")
    if not lin.active:
        raise ValueError("lin is restored: save the model while it is linearised")
    if not isinstance(directory, str | Path):
        raise TypeError(f"directory must be a str or Path, got {type(directory).__name__}")
    try:
        settings = json.loads(json.dumps(lin.settings))
    except TypeError as exc:
        raise TypeError(f"the settings of the swap are not JSON values ({exc}): pass options of plain types") from exc
    model = lin.model
    if any("lora_" in name for name, _ in model.named_modules()):
        raise ValueError(
            "lin.model has unmerged LoRA adapters: merge them into the weights first "
            "(kernelapprox.recover.merged(lin)), or save with kernelapprox.recover.save"
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    meta = {
        "format": FORMAT,
        "architecture": type(model).__name__,
        "attn_implementation": lin._switch.original,
        "feature_maps": sorted(int(i) for i in lin.feature_maps),
        "settings": settings,
    }
    (directory / SETTINGS_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    torch.save({"format": FORMAT, "model": model.state_dict()}, directory / STATE_FILE)
    return directory


def load_linearized(directory: str | Path, *, feature_map: MapSpec | None = None,
                    device: torch.device | str | None = None) -> Linearized:
    r"""Rebuild a model written by `save_linearized`: same weights, maps, outputs.

    The model is built from ``config.json`` (its transformers class named in ``kernelapprox.json``,
    no download), switched to the saved attention implementation, linearised with the saved
    settings (each layer's map rebuilt from the estimator name, then its tensors loaded, so learned
    maps need no calibration text), then the state dict is loaded (all or nothing: a missing or
    unexpected key raises before any tensor is copied). The model is in eval mode.

    Parameters
    ----------
    directory : str or Path
    feature_map : str, FeatureMap, callable or mapping, optional
        Needed where the model was linearised with maps not built from an estimator name (the same
        specification as then; their tensors come from the file).
    device : device, optional
        Where to put the model (default: CPU).

    Returns
    -------
    Linearized
        The active handle; ``.model`` is the model.

    Raises
    ------
    ValueError
        ``directory`` was not written by `save_linearized`, or its maps need ``feature_map``.

    Examples
    --------
    >>> lin2 = hf.load_linearized("linearised-model")                       # doctest: +SKIP
    >>> lin2.model.generate(input_ids=ids, max_new_tokens=20)              # doctest: +SKIP
    """
    from .._validation import check_device

    if not isinstance(directory, str | Path):
        raise TypeError(f"directory must be a str or Path, got {type(directory).__name__}")
    device = check_device("device", device)
    directory = Path(directory)
    try:
        meta = json.loads((directory / SETTINGS_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"directory must be written by kernelapprox.hf.save_linearized, got {str(directory)!r}: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"directory must be written by kernelapprox.hf.save_linearized, got {str(directory)!r}")
    tf = transformers_module()
    cls = getattr(tf, meta["architecture"], None)
    if cls is None:
        raise ValueError(f"transformers has no model class {meta['architecture']!r} (another version?)")
    config = tf.AutoConfig.from_pretrained(directory)
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or state.get("format") != FORMAT or not isinstance(state.get("model"), dict):
        raise ValueError(f"directory must be written by kernelapprox.hf.save_linearized, got {str(directory)!r}")
    dtype = next((t.dtype for t in state["model"].values() if t.is_floating_point()), None)
    model = cls(config)
    if dtype is not None:
        model = model.to(dtype)
    if device is not None:
        model = model.to(device)
    model.eval()
    model.set_attn_implementation(meta["attn_implementation"])
    st: dict[str, Any] = dict(meta["settings"])
    name = st.pop("feature_map")
    spec: Any = feature_map
    if spec is None:
        if name is None:
            raise ValueError(
                "the model was linearised with maps not built from an estimator name: pass feature_map= the same "
                "specification (its tensors are loaded from the file)"
            )
        modules = attention_modules(model)
        spec = {}
        for layer in meta["feature_maps"]:
            shape = module_shape(modules[layer], model.config) if layer in modules else None
            if shape is None:
                raise ValueError(f"layer {layer}'s attention module has no readable (heads, d_head)")
            spec[layer] = build_map(name, layer, shape[0], shape[1], st["num_features"], st["sampler"],
                                     st["seed"], st["options"])
            if device is not None:
                spec[layer] = spec[layer].to(device)
    exact = {int(k): v for k, v in st["exact_heads"].items()}
    sinks = tuple(st["sinks"]) if isinstance(st["sinks"], list) else st["sinks"]
    kw: dict[str, Any] = {} if isinstance(spec, Mapping) or name is None else dict(st["options"])
    lin = linearize(model, spec, layers=st["layers"], window=st["window"], sinks=sinks, exact_heads=exact,
                    chunk_size=st["chunk_size"], check=st["check"], seed=st["seed"], **kw)
    lin.settings = dict(meta["settings"])
    have = set(model.state_dict())
    if have != set(state["model"]):
        lin.restore()
        raise ValueError(
            f"the saved state dict does not match the rebuilt model: missing {sorted(have - set(state['model']))[:5]}, "
            f"unexpected {sorted(set(state['model']) - have)[:5]}"
        )
    model.load_state_dict(state["model"])
    return lin

