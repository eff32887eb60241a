"""The decoding step as a CUDA graph needs it, checked on the CPU: ``RecurrentLinearAttention``
with ``inplace=True`` keeps its state's tensors from the second step on and gives the same rows
and states; the step reads no device value on the host (torch path and fla path, in place or
not); ``torch.compile(step, fullgraph=True)`` traces it without a graph break or a recompilation
per token; `capture` refuses a CPU token with a clear error; and the decoding of a linearised
model (`kernelapprox.hf`) goes through the same dispatch (fla's fused kernels where
`kernelapprox.backends.decode_plan` chooses them).

fla is replaced by the pure-torch functions of fla's contract of ``tests/test_attention_fla.py``.
Tolerances: float32 steps on the same terms in another order, 1e-5 relative; float64 1e-10.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _sync import host_syncs
from test_attention_fla import fake_fused_recurrent_gla, fake_fused_recurrent_simple_gla

import kernelapprox as ka
from kernelapprox import backends
from kernelapprox.attention.linear import fla as fla_mod

pytestmark = [pytest.mark.usefixtures("one_thread")]

MAPS = ["positive", "oprf", "elu", "taylor", "trig-sincos"]


def _map(name, q=None, k=None):
    fm = {e.name: e for e in ka.estimators()}[name].build(dim=8, num_features=16, seed=0)
    if fm.data_dependent:
        fm.fit(q, k)
    return fm


def _tokens(seed=0, T=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, 4, T, 8, generator=g).unbind(0)


@pytest.fixture(params=["torch", "fla"])
def path(request, monkeypatch):
    """The step's path: the torch step, or fla's (fake) fused recurrent kernels."""
    if request.param == "fla":
        kern = SimpleNamespace(fused_recurrent_gla=fake_fused_recurrent_gla,
                               fused_recurrent_simple_gla=fake_fused_recurrent_simple_gla)
        monkeypatch.setattr(fla_mod, "_recurrent_kernels", lambda: kern)
        monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("fla"))
    return request.param


@pytest.mark.parametrize("name", MAPS)
def test_inplace_keeps_the_state_tensors_and_the_rows(path, name):
    q, k, v = _tokens(1)
    fm = _map(name, q, k)
    if path == "fla" and fla_mod.fla_mode(fm) is None:
        pytest.skip("no fla form")
    _, prompt = ka.linear_attention(q[..., :2, :], k[..., :2, :], v[..., :2, :], fm, causal=True, return_state=True)
    plain = ka.RecurrentLinearAttention(fm, state=prompt)
    kept = ka.RecurrentLinearAttention(fm, state=prompt, inplace=True)
    given = (prompt.kv.clone(), prompt.log_scale.clone())
    ptrs = set()
    for t in range(2, 6):
        want = plain.step(q[..., t, :], k[..., t, :], v[..., t, :])
        got = kept.step(q[..., t, :], k[..., t, :], v[..., t, :])
        assert (got - want).abs().max() <= 1e-5 * float(want.abs().max())
        if t > 2:
            ptrs.add((kept.state.kv.data_ptr(), kept.state.log_scale.data_ptr()))
    assert len(ptrs) == 1  # one storage from the second step on
    assert kept.state.kv.is_contiguous() and kept.state.log_scale.is_contiguous()
    assert (kept.state.z - plain.state.z).abs().max() <= 1e-5 * float(plain.state.z.abs().max())
    # the caller's state is never written
    assert torch.equal(prompt.kv, given[0]) and torch.equal(prompt.log_scale, given[1])
    assert kept.steps == plain.steps == 4


def test_inplace_replaces_a_state_that_records_autograd():
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = (t.requires_grad_() for t in _tokens(2))
    rnn = ka.RecurrentLinearAttention(fm, inplace=True)
    outs = [rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(3)]
    torch.stack(outs).sum().backward()  # earlier states were not overwritten under autograd
    assert q.grad is not None and bool(torch.isfinite(q.grad).all())


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", MAPS)
def test_the_step_reads_no_device_value(path, name, inplace, monkeypatch):
    # the accelerator rule (forced on CPU tensors): a signed map's CPU step reads one value for
    # its lost-row warning, which the accelerator path replaces by NaN rows
    monkeypatch.setenv("KERNELAPPROX_BACKEND", "accelerator")
    q, k, v = _tokens(3)
    fm = _map(name, q, k)
    if path == "fla" and fla_mod.fla_mode(fm) is None:
        pytest.skip("no fla form")
    rnn = ka.RecurrentLinearAttention(fm, inplace=inplace)
    pad = torch.tensor([[False, True, False, False], [False, False, False, True]])
    with torch.no_grad():
        rnn.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
        assert not host_syncs(rnn.step, q[..., 1, :], k[..., 1, :], v[..., 1, :])
        assert not host_syncs(rnn.step, q[..., 2, :], k[..., 2, :], v[..., 2, :], key_padding_mask=pad)


@pytest.mark.parametrize("name", ["positive", "elu"])
def test_the_step_compiles_without_graph_breaks(path, name):
    """``torch.compile(rnn.step, fullgraph=True)``: the same rows as the eager step, in place,
    and no recompilation per token (the step counter turns dynamic after one)."""
    from torch._dynamo.utils import counters

    q, k, v = _tokens(4, T=8)
    fm = _map(name)
    if path == "fla" and fla_mod.fla_mode(fm) is None:
        pytest.skip("no fla form")
    torch._dynamo.reset()
    counters.clear()
    eager = ka.RecurrentLinearAttention(fm)
    rnn = ka.RecurrentLinearAttention(fm, inplace=True)
    for r in (eager, rnn):
        r.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    step = torch.compile(rnn.step, fullgraph=True, backend="eager")
    for t in range(1, 8):
        want = eager.step(q[..., t, :], k[..., t, :], v[..., t, :])
        got = step(q[..., t, :], k[..., t, :], v[..., t, :])
        assert (got - want).abs().max() <= 1e-5 * float(want.abs().max())
    assert rnn.steps == 8
    assert counters["stats"]["unique_graphs"] <= 2
    torch._dynamo.reset()


def test_the_in_place_step_survives_functionalisation():
    """``backend="aot_eager"`` (AOTAutograd's functionalisation, as Inductor sees the step, without
    its code generation): the in-place writes of the state reach the decoder's own tensors."""
    q, k, v = _tokens(7, T=5)
    fm = ka.PositiveRF(8, 16, seed=0)
    torch._dynamo.reset()
    eager = ka.RecurrentLinearAttention(fm)
    rnn = ka.RecurrentLinearAttention(fm, inplace=True)
    for r in (eager, rnn):
        r.step(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    kv = rnn.state.kv
    step = torch.compile(rnn.step, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        for t in range(1, 5):
            want = eager.step(q[..., t, :], k[..., t, :], v[..., t, :])
            got = step(q[..., t, :], k[..., t, :], v[..., t, :])
            assert (got - want).abs().max() <= 1e-5 * float(want.abs().max())
    assert rnn.state.kv is kv
    assert (rnn.state.z - eager.state.z).abs().max() <= 1e-5 * float(eager.state.z.abs().max())
    torch._dynamo.reset()


def test_capture_refuses_what_it_cannot_capture():
    fm = ka.PositiveRF(8, 16, seed=0)
    q, k, v = _tokens(5)
    rnn = ka.RecurrentLinearAttention(fm)
    with pytest.raises(ValueError, match="q_t must be a CUDA tensor to capture a CUDA graph, got cpu"):
        rnn.capture(q[..., 0, :], k[..., 0, :], v[..., 0, :])
    with pytest.raises(ValueError, match="warmup must be"):
        rnn.capture(q[..., 0, :], k[..., 0, :], v[..., 0, :], warmup=0)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        ka.RecurrentLinearAttention(fm, inplace="yes")


# ------------------------------------------------------------------ a linearised model decodes through the dispatch


def test_attention_server_decodes_through_fla_where_planned(monkeypatch):
    """`kernelapprox.hf.serving.AttentionServer` steps token by token with
    `RecurrentLinearAttention.step`, so fla's kernels decode where the plan says so: the rows of the
    torch step (float64, 1e-10) and of the full causal pass."""
    from kernelapprox.hf.serving import AttentionServer

    calls = []

    def kernels():
        def gla(**kw):
            calls.append("fused_recurrent_gla")
            return fake_fused_recurrent_gla(**kw)
        return SimpleNamespace(fused_recurrent_gla=gla, fused_recurrent_simple_gla=fake_fused_recurrent_simple_gla)

    g = torch.Generator().manual_seed(6)
    q = 0.5 * torch.randn(2, 2, 9, 8, generator=g, dtype=torch.float64)
    k = 0.5 * torch.randn(2, 1, 9, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 1, 9, 8, generator=g, dtype=torch.float64)
    fm = ka.PositiveRF(8, 16, seed=0, dtype=torch.float64)
    outs = {}
    for path in ("torch", "fla"):
        if path == "fla":
            monkeypatch.setattr(fla_mod, "_recurrent_kernels", kernels)
            monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("fla"))
        server = AttentionServer()
        parts = [server.causal(0, k[:, :, :5], v[:, :, :5], q[:, :, :5], 1.0, fm)]
        for t in range(5, 9):
            parts.append(server.causal(0, k[:, :, :t + 1], v[:, :, :t + 1], q[:, :, t:t + 1], 1.0, fm))
        outs[path] = torch.cat(parts, dim=2)
    assert calls == ["fused_recurrent_gla"] * 4
    full = ka.linear_attention(q, k.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), fm, causal=True)
    assert (outs["fla"] - outs["torch"]).abs().max() < 1e-10
    assert (outs["fla"] - full).abs().max() < 1e-10
    assert (outs["torch"][:, :, 5:] - outs["torch"][:, :, 5:].flip(0)).abs().max() > 1e-3  # rows differ


def test_linearized_generate_decodes_through_fla_where_planned(monkeypatch):
    """``generate`` of a linearised tiny LLaMA with its `kernelapprox.hf.cache.LinearizedCache`:
    every decoding step of every layer on fla's (fake) fused kernel, the logits of the torch step."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernelapprox import hf

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=99, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    lin = hf.linearize(model, "positive", num_features=16, check=False)
    ids = torch.randint(1, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    calls = []

    def kernels():
        def gla(**kw):
            calls.append("fused_recurrent_gla")
            return fake_fused_recurrent_gla(**kw)
        return SimpleNamespace(fused_recurrent_gla=gla, fused_recurrent_simple_gla=fake_fused_recurrent_simple_gla)

    logits = {}
    try:
        for path in ("torch", "fla"):
            if path == "fla":
                monkeypatch.setattr(fla_mod, "_recurrent_kernels", kernels)
                monkeypatch.setattr(backends, "decode_plan", lambda *a, **kw: backends.AttentionPlan("fla"))
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                     do_sample=False, pad_token_id=0, eos_token_id=None,
                                     return_dict_in_generate=True, output_logits=True)
            logits[path] = torch.stack(out.logits, 1)
    finally:
        lin.restore()
    assert len(calls) == 3 * 2  # 3 decoding steps after the prompt's, 2 layers
    assert (logits["fla"] - logits["torch"]).abs().max() < 1e-5
