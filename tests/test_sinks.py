"""``sinks`` means one thing everywhere (`kernelapprox.attention.hybrid.sinks.check_sinks`): a
Python int or a 0-d integer tensor is a count of leading positions; a sequence or a 1-d tensor or
array, of any length, lists positions. ``torch.tensor([5])`` is position 5, not five sinks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernelapprox as ka
from kernelapprox.attention.hybrid import hybrid_attention
from kernelapprox.attention.hybrid.sinks import check_sinks

N, D = 12, 4


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [0.5 * torch.randn(1, 2, N, D, generator=g, dtype=torch.float64) for _ in range(3)]


@pytest.mark.parametrize("as_positions", [torch.tensor([5]), np.array([5]), [5], (5,)],
                         ids=["tensor", "array", "list", "tuple"])
def test_check_sinks_one_element_is_a_position(as_positions):
    assert check_sinks(as_positions) == (5,)
    assert check_sinks(torch.tensor(5)) == 5 and check_sinks(np.int64(5)) == 5 and check_sinks(5) == 5


def test_check_sinks_negative_position_is_a_position_not_a_bad_count():
    assert check_sinks(torch.tensor([-1])) == (-1,)
    with pytest.raises(ValueError, match="sinks as a count of leading positions must be >= 0, got -1"):
        check_sinks(-1)
    with pytest.raises(TypeError, match=r"0-d \(a count\) or 1-d \(positions\) of integers.*shape \(1, 1\)"):
        check_sinks(torch.tensor([[1]]))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["token", "block"])
def test_hybrid_attention_reads_a_one_element_tensor_as_a_position(causal, mode):
    q, k, v = _qkv()
    fm = ka.PositiveRF(D, 8, seed=0, dtype=torch.float64)
    kw = dict(window=2, causal=causal, window_mode=mode)
    as_tensor = hybrid_attention(q, k, v, fm, sinks=torch.tensor([5]), **kw)
    as_list = hybrid_attention(q, k, v, fm, sinks=[5], **kw)
    as_count = hybrid_attention(q, k, v, fm, sinks=5, **kw)
    torch.testing.assert_close(as_tensor, as_list, rtol=0, atol=0)
    assert not torch.equal(as_tensor, as_count)
    # position 0 is a sink; no sink at all differs
    zero = hybrid_attention(q, k, v, fm, sinks=torch.tensor([0]), **kw)
    torch.testing.assert_close(zero, hybrid_attention(q, k, v, fm, sinks=[0], **kw), rtol=0, atol=0)
    assert not torch.equal(zero, hybrid_attention(q, k, v, fm, sinks=0, **kw))


def test_hybrid_attention_non_causal_negative_position():
    q, k, v = _qkv(1)
    fm = ka.PositiveRF(D, 8, seed=0, dtype=torch.float64)
    a = hybrid_attention(q, k, v, fm, window=2, sinks=torch.tensor([-1]), causal=False)
    b = hybrid_attention(q, k, v, fm, window=2, sinks=[N - 1], causal=False)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_linear_attention_layer_reads_a_one_element_tensor_as_a_position():
    layer = ka.nn.LinearAttention(8, heads=2, window=2, sinks=torch.tensor([5]), seed=0)
    assert layer.sinks == (5,)
    assert ka.nn.LinearAttention(8, heads=2, window=2, sinks=torch.tensor(5), seed=0).sinks == 5
    assert ka.nn.LinearAttention(8, heads=2, window=2, sinks=torch.tensor([-1]), seed=0).sinks == (-1,)
