r"""Hybrid attention: exact softmax on a window and sinks, the feature map on the remainder, one
normaliser (after flash-linear-attention's ``ops/<op>/`` layout).

``core`` (the parallel, chunked and block forms and their state), ``recurrent`` (one token per
step), ``naive`` (the quadratic reference).
"""

from .core import (
    HybridAttentionState,
    check_window,
    check_window_mode,
    chunk_hybrid_attention,
    exact_set_mask,
    hybrid_attention,
    parallel_hybrid_attention,
    resolve_sinks,
)
from .naive import naive_hybrid_attention
from .recurrent import RecurrentHybridAttention

__all__ = [
    "HybridAttentionState",
    "RecurrentHybridAttention",
    "check_window",
    "check_window_mode",
    "chunk_hybrid_attention",
    "exact_set_mask",
    "hybrid_attention",
    "naive_hybrid_attention",
    "parallel_hybrid_attention",
    "resolve_sinks",
]
