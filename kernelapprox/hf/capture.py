"""Capture: record q, k, v, scaling and mask of every attention call, as the model feeds them.

`capture` runs one forward pass and keeps every record (`Capture`); `stream` yields one
`LayerCapture` at a time while the model runs in a worker thread. Both go through `Switch`,
calling the model's own implementation after recording, so the model's outputs are unchanged.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validation import check_bool, check_device, check_tensor_fields
from .switch import Switch, allowed_mask, check_model, original_attention, repeat_kv

__all__ = ["Capture", "LayerCapture", "capture", "stream"]


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




def _recorder(
    impl: str, sink: Callable[[LayerCapture], None], layers: set[int] | None, record_output: bool,
    to: torch.device | str | None,
) -> Callable[..., Any]:
    calls = itertools.count()

    def record(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out = original_attention(impl, module)(
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
                q=keep(query), k=keep(repeat_kv(key, h)), v=keep(repeat_kv(value, h)),
                scaling=s,
                allowed=keep(allowed_mask(attention_mask, b, n, key.shape[2], causal, query.device)),
                causal=causal,
                kv_groups=h // key.shape[1],
                output=keep(out[0].transpose(1, 2)) if record_output else None,
                module=type(module).__name__,
            ))
        return out

    return record


def layer_set(layers: object) -> set[int] | None:
    if layers is None:
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, Sequence | set | frozenset | range) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers
    ):
        raise TypeError(f"layers must be None, an int or a sequence of non-negative ints, got {layers!r}")
    return set(layers)


def num_attention_calls(model: Any) -> int | None:
    """Attention calls per forward pass: the config's layer count (None where unknown, e.g. encoder-decoders)."""
    cfg = getattr(model, "config", None)
    n = getattr(cfg, "num_hidden_layers", None)
    if getattr(cfg, "is_encoder_decoder", False) or isinstance(n, bool) or not isinstance(n, int):
        return None
    return n


def check_layers(layers: set[int] | None, model: Any) -> None:
    n = num_attention_calls(model)
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
    keep_layers = layer_set(layers)
    check_bool("record_output", record_output)
    to = check_device("to", to)
    impl = check_model(model)
    check_layers(keep_layers, model)
    result = Capture()
    switch = Switch(model, _recorder(impl, result.layers.append, keep_layers, record_output, to), "capture")
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
    keep_layers = layer_set(layers)
    check_bool("record_output", record_output)
    to = check_device("to", to)
    impl = check_model(model)
    check_layers(keep_layers, model)
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

    switch = Switch(model, _recorder(impl, sink, keep_layers, record_output, to), "stream")
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

