"""Default calls of hybrid attention (every mode) and of a decoding step read no device value
into Python: no ``.item()``, ``bool(tensor)``, ``nonzero`` or copy to the host (counted by
``tests/_sync.py``'s dispatch mode, plus the data-dependent shapes of ``nonzero``, which stall
an accelerator the same way). The causal forms on the CPU read one: which sequences hold a row
whose normaliser underflowed (`kernelapprox.attention.hybrid.rescue`), where reading a CPU value
costs no stall; on other devices they read none."""

from __future__ import annotations

import pytest
import torch
from _sync import HostSyncCounter

import kernelapprox as ka
from kernelapprox.attention.hybrid import RecurrentHybridAttention, hybrid_attention

DATA_DEPENDENT = frozenset({"aten::nonzero", "aten::masked_select", "aten::unique_dim", "aten::_unique2"})


class _Counter(HostSyncCounter):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func._schema.name in DATA_DEPENDENT:
            self.syncs[func._schema.name] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _syncs(fn, *args, **kw):
    with _Counter() as c:
        fn(*args, **kw)
    return dict(c.syncs)


def _qkv(n=40):
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(2, 2, 2, n, 8, generator=g)).unbind(0)
    return q, k, torch.randn(2, 2, n, 8, generator=g)


@pytest.mark.parametrize("mode", ["token", "block"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sinks", [0, 2, [0, 5]])
@pytest.mark.parametrize("window", [0, 4, 40])
@pytest.mark.parametrize("grad", [False, True])
def test_hybrid_attention_default_calls_do_not_sync(mode, causal, sinks, window, grad):
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = (t.requires_grad_(grad) for t in _qkv())
    rescue_check = causal and window < q.shape[-2]  # window >= n: softmax attention, no remainder
    want = {"aten::nonzero": 1} if rescue_check else {}
    assert _syncs(hybrid_attention, q, k, v, fm, window=window, sinks=sinks, causal=causal, window_mode=mode) == want
    if rescue_check:  # the check is the CPU's only: on the meta device (no values) there is none
        qm, km, vm = (t.detach().to("meta").requires_grad_(grad) for t in (q, k, v))
        assert _syncs(hybrid_attention, qm, km, vm, fm.to("meta"), window=window, sinks=sinks, causal=True,
                      window_mode=mode) == {}


@pytest.mark.parametrize("window", [0, 3])
def test_recurrent_step_does_not_sync(window):
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = _qkv(n=8)
    rnn = RecurrentHybridAttention(fm, window=window, sinks=[0, 4])
    for t in range(8):
        assert _syncs(rnn.step, q[..., t, :], k[..., t, :], v[..., t, :]) == {}


def test_the_counter_sees_syncs():
    x = torch.arange(4.0)
    assert _syncs(lambda: (x > 1).nonzero()) == {"aten::nonzero": 1}
    assert _syncs(lambda: float(x.sum())) == {"aten::_local_scalar_dense": 1}
