r"""The cache of a linearised model: per layer its recurrent state, not every key and value.

A transformers ``Cache`` keeps, for each attention layer, what the next decoding step needs. For a
layer running softmax attention that is every key and value seen (``DynamicCache``: memory
$O(t)$); for a layer linearised by `kernelapprox.hf.linearize` it is the state of
`kernelapprox.hf.serving.AttentionServer`: the linear-attention state
$[S \mid z] \in \mathbb R^{F \times (d_v + 1)}$ per head and, with a window, the ring buffer of
the last $w$ keys and values and the sink tokens (`kernelapprox.LinearAttentionState`,
`kernelapprox.attention.hybrid.HybridAttentionState`), whose size does not depend on $t$.
`LinearizedCache` holds exactly that, as the linear-attention models of flash-linear-attention
(``fla``) do; layers left with softmax attention, and the heads kept exact, keep their keys and
values.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .serving import AttentionServer, Group, Stream

__all__ = ["LinearizedCache", "StateLayer"]


def _state_tensors(state: Any) -> Iterator[torch.Tensor]:
    if state is None:
        return
    for f in dataclasses.fields(state):
        val = getattr(state, f.name)
        if isinstance(val, torch.Tensor):
            yield val


def _map_rows(state: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The state with ``fn`` applied to each tensor field (all of which lead with the batch)."""
    if state is None:
        return None
    return dataclasses.replace(state, **{
        f.name: fn(getattr(state, f.name)) for f in dataclasses.fields(state)
        if isinstance(getattr(state, f.name), torch.Tensor)
    })


class StateLayer(CacheLayerMixin):
    """The cache of one linearised layer in a `LinearizedCache`.

    Holds ``stream`` (the layer's `kernelapprox.hf.serving.Stream`: one state per group of
    sequences), ``seen`` (tokens consumed) and, with exact heads, ``keys``/``values`` (every key and
    value, for the softmax heads). ``update`` hands back the new keys and values only.

    Parameters
    ----------
    exact : bool, default False
        Keep the keys and values (the layer has exact heads).

    Examples
    --------
    >>> from kernelapprox.hf.cache import StateLayer
    >>> StateLayer().get_seq_length(), StateLayer().nbytes()
    (0, 0)
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, exact: bool = False) -> None:
        if not isinstance(exact, bool):
            raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
        super().__init__()
        self.stream: Stream | None = None
        self.seen = 0
        self.new = 0  # tokens of the call in progress
        self.exact = exact

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.new = key_states.shape[-2]
        self.seen += self.new
        if self.exact:  # the softmax heads read every key
            self.keys = key_states if self.keys is None else torch.cat([self.keys, key_states], dim=-2)
            self.values = value_states if self.values is None else torch.cat([self.values, value_states], dim=-2)
        return key_states, value_states  # the new ones only: the state holds the rest

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:  # the state is small: it stays where it is
        pass

    def prefetch(self) -> None:
        pass

    def reset(self) -> None:
        self.stream, self.seen, self.new = None, 0, 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError(
                "a linearised layer's state cannot drop tokens (it is a sum over them): crop is not supported, "
                "so assisted decoding and other rollbacks are refused"
            )

    def _rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (a permutation, a selection or a repetition)."""
        if self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))
        st = self.stream
        if st is None:
            return
        if st.per_sequence:  # one group per sequence: the groups are reordered (a host read of index)
            groups = [copy.copy(st.groups[i]) for i in index.tolist()]
        else:
            groups = [Group(g.fm, _map_rows(g.state, lambda t: t.index_select(0, index.to(t.device))), g.count)
                      for g in st.groups]
        self.stream = Stream(int(index.numel()), st.consumed, st.per_sequence, groups)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rows(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        b = self.stream.batch if self.stream is not None else (0 if self.keys is None else self.keys.shape[0])
        self._rows(torch.arange(b).repeat_interleave(repeats))

    def nbytes(self) -> int:
        """Bytes of the tensors held (states, ring buffers, sinks, exact heads' keys and values)."""
        total = 0
        if self.stream is not None:
            total += sum(t.numel() * t.element_size() for g in self.stream.groups for t in _state_tensors(g.state))
        for t in (self.keys, self.values):
            if t is not None:
                total += t.numel() * t.element_size()
        return total


class LinearizedCache(Cache):
    r"""A transformers ``Cache`` for a linearised model: each linearised layer keeps its state only.

    Built by ``Linearized.new_cache()`` (and by ``model.generate`` on its own while the model is
    linearised). Per linearised layer it holds the decoding state of
    `kernelapprox.hf.serving.AttentionServer` (a `StateLayer`): $F \times (d_v + 1)$ numbers per
    head and sequence for linear attention, plus the ring buffer of the last ``window`` keys and
    values and the sink tokens for hybrid attention, whatever the number of tokens $t$; layers
    left with softmax attention keep every key and value (``DynamicLayer``), and so do the layers
    with exact heads (their softmax reads them). ``nbytes()`` is the memory held.

    Beam search reorders the states (``reorder_cache``), contrastive search selects rows
    (``batch_select_indices``); a state is a sum over its tokens and cannot forget them, so
    ``crop`` (assisted decoding) raises ``NotImplementedError``. Static caches
    (``cache_implementation="static"``) are refused by ``generate`` with a clear error: this cache
    is already of constant size. Outside ``torch.no_grad()`` the states are kept detached
    (gradients do not flow into earlier calls).

    Parameters
    ----------
    server : AttentionServer
        The linearised model's server (``Linearized``'s).
    linear : callable int -> bool
        Whether a layer index is linearised.
    exact : callable int -> bool
        Whether a layer keeps exact heads.

    Examples
    --------
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, intermediate_size=37, vocab_size=99)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> lin = hf.linearize(model, "positive", num_features=16, window=4, sinks=1)
    >>> sizes = []
    >>> for n in (64, 256):
    ...     cache = lin.new_cache()
    ...     with torch.no_grad():
    ...         _ = model(input_ids=torch.randint(1, 99, (1, n)), cache=cache, use_cache=True)
    ...     sizes.append(cache.nbytes())
    >>> sizes[0] == sizes[1], cache.get_seq_length()
    (True, 256)
    >>> lin.restore()
    """

    def __init__(self, server: AttentionServer, linear: Callable[[int], bool],
                 exact: Callable[[int], bool]) -> None:
        if not isinstance(server, AttentionServer):
            raise TypeError(f"server must be an AttentionServer, got {type(server).__name__}")
        for name, fn in (("linear", linear), ("exact", exact)):
            if not callable(fn):
                raise TypeError(f"{name} must be a callable layer index -> bool, got {type(fn).__name__}")
        super().__init__(layers=[])
        self.server = server
        self._linear = linear
        self._exact = exact

    def _layer(self, idx: int) -> Any:
        while len(self.layers) <= idx:
            i = len(self.layers)
            self.layers.append(StateLayer(self._exact(i)) if self._linear(i) else DynamicLayer())
        return self.layers[idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self._layer(layer_idx)
        out = layer.update(key_states, value_states, *args, **kwargs)
        if isinstance(layer, StateLayer):  # the layer's attention call, next, continues this state
            self.server.pending[layer_idx] = layer
        return out

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (all layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, StateLayer):
                total += layer.nbytes()
            else:
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if isinstance(t, torch.Tensor):
                        total += t.numel() * t.element_size()
        return total

    def __repr__(self) -> str:
        return f"LinearizedCache(layers={len(self.layers)}, tokens={self.get_seq_length()}, bytes={self.nbytes()})"

