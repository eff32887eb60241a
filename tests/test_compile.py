"""``torch.compile`` of every registered map and of linear attention, in inference and training.

Every map's ``forward`` and ``log_features``, and linear attention (non-causal and causal) with
every map, trace into one graph (no graph break, also checked with ``fullgraph=True``); the causal
form (a Python loop over chunks) compiled with ``dynamic=True`` compiles once per number of chunks,
for sequence lengths that are multiples of the chunk size and lengths that are not; compiled
results match eager ones. A whole two-layer causal transformer built on ``nn.LinearAttention``
compiles with no graph break and takes a training step with the loss and gradients of eager mode.

Compilation is slow, so the shapes are tiny and most cases use a backend without code
generation: ``eager`` (Dynamo's graph run as is) or, for the maps that write into slices of a
preallocated buffer in eager mode, ``aot_eager`` (adds AOTAutograd's functionalisation, where
in-place and ``out=`` writes are rewritten). A few cases use Inductor, the default backend.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import kernelapprox as ka

D, R, CHUNK = 8, 16, 16
NAMES = [e.name for e in ka.estimators()]
# eager mode writes into slices of one buffer (sin/cos, [u, -u], Taylor blocks, Hedgehog halves)
SLICE_WRITERS = {"trig-sincos", "hyperbolic", "taylor", "hedgehog", "hedgehog-lolcats"}
# lengths of the causal form: multiples of the chunk size and not (2, 3, 3 and 5 chunks)
LENGTHS = (32, 48, 40, 77)
CHUNK_COUNTS = len({-(-n // CHUNK) for n in LENGTHS})


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _data(n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, D, generator=g) / 2 for _ in range(3))
    return q, k, v


def _build(name: str) -> ka.FeatureMap:
    fm = ka.get_estimator(name).build(D, R, seed=0)
    if fm.data_dependent:
        q, k, _ = _data(32, seed=1)
        fm.fit(q, k)
    return fm.eval()


def _cases(fm: ka.FeatureMap) -> dict:
    return {
        "forward": lambda x, k, v: fm(x),
        "log_features": lambda x, k, v: fm.log_features(x),
        "attention": lambda q, k, v: ka.linear_attention(q, k, v, fm),
        "causal": lambda q, k, v: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=CHUNK),
    }


def _close(a, b, tol=1e-5):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _close(x, y, tol)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", NAMES)
def test_no_graph_breaks(name):
    """Zero graph breaks (``torch._dynamo.explain``) for the map and both attention forms."""
    fm = _build(name)
    args = _data()
    counts = {}
    with torch.no_grad():
        for case, fn in _cases(fm).items():
            dynamo.reset()
            e = dynamo.explain(fn)(*args)
            counts[case] = (e.graph_break_count, [str(b.reason).split("\n")[0] for b in e.break_reasons])
    assert all(c == 0 for c, _ in counts.values()), counts


@pytest.mark.parametrize("name", NAMES)
def test_fullgraph_matches_eager(name):
    """``torch.compile(fullgraph=True)`` runs (raises on any graph break) and matches eager."""
    fm = _build(name)
    args = _data()
    backend = "aot_eager" if name in SLICE_WRITERS else "eager"
    cfm = torch.compile(fm, fullgraph=True, backend=backend)
    with torch.no_grad():
        _close(cfm(args[0]), fm(args[0]))
        for case, fn in _cases(fm).items():
            if case == "forward":
                continue
            _close(torch.compile(fn, fullgraph=True, backend=backend)(*args), fn(*args))


# Two of the maps that write into slices of a buffer in eager mode, compiled with Inductor.
@pytest.mark.parametrize("name", ["trig-sincos", "hyperbolic"])
def test_inductor_matches_eager(name):
    fm = _build(name)
    args = _data()
    with torch.no_grad():
        _close(torch.compile(fm, fullgraph=True)(args[0]), fm(args[0]))


@pytest.mark.parametrize("name", ["positive"])
def test_causal_inductor_dynamic(name):
    """Causal attention under Inductor with a dynamic length (a multiple of the chunk size and
    not, the same number of chunks) and the chunk size from a closure: one compile, matches eager."""
    fm = _build(name)
    cnt = CompileCounter()

    def make(chunk_size: int):
        return lambda q, k, v: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=chunk_size)

    fn = make(CHUNK)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (40, 48):
            args = _data(n)
            _close(compiled(*args), fn(*args))
    dynamo.reset()
    counted = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    with torch.no_grad():
        for n in (40, 48):
            counted(*_data(n))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("name", NAMES)
def test_causal_compiles_once_per_chunk_count(name):
    """``dynamic=True``: one graph per number of chunks, for lengths that are multiples of the chunk
    size and lengths that are not (the padding is unconditional; the loop over chunks unrolls)."""
    fm = _build(name)
    cnt = CompileCounter()
    fn = _cases(fm)["causal"]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    with torch.no_grad():
        for n in LENGTHS:
            args = _data(n)
            _close(compiled(*args), fn(*args))
    assert cnt.frame_count == CHUNK_COUNTS, cnt.frame_count


# --------------------------------------------------------------------------- training, whole model
VOCAB, DIM, HEADS, SEQ = 11, 16, 2, 17  # 17 tokens: chunks of 6, 6 and 5
TRAIN_MAPS = ["positive", "oprf", "hedgehog"]


class TinyCausalLM(torch.nn.Module):
    """Embedding, two pre-norm blocks (``nn.LinearAttention(causal=True)`` + MLP), LM head."""

    def __init__(self, name: str, chunk_size: int) -> None:
        super().__init__()
        from kernelapprox.nn import LinearAttention

        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList()
        for i in range(2):
            attn = LinearAttention(DIM, heads=HEADS, causal=True, feature_map=name, num_features=8,
                                   seed=i, chunk_size=chunk_size, check=False)
            mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM))
            self.blocks.append(torch.nn.ModuleList([torch.nn.LayerNorm(DIM), attn, torch.nn.LayerNorm(DIM), mlp]))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for ln1, attn, ln2, mlp in self.blocks:
            x = x + attn(ln1(x))
            x = x + mlp(ln2(x))
        logits = self.head(x[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _train_step(model: torch.nn.Module, step, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One SGD step: the loss and the gradients it used."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    loss = step(ids)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    opt.step()
    return loss.detach(), grads


# Tolerance of compiled against eager, float32: compilation reorders sums (fused reductions over
# at most max(SEQ, 2 DIM, F) = 32 terms), each off by at most 32 u = 32 * 6e-8 = 2e-6 relative
# (the deterministic bound gamma_m = m u); about ten such stages are chained between the input and
# the loss (two blocks of norm, attention, MLP, then the head and the softmax), so 2e-5 relative.
# A wrong chunk or state is O(1e-2).
TRAIN_TOL = {"rtol": 2e-5, "atol": 2e-6}


@pytest.mark.parametrize("name", TRAIN_MAPS)
def test_compiled_causal_transformer_trains_like_eager(name):
    """``torch.compile(model)`` of a two-layer causal transformer (FAVOR+, OPRF, Hedgehog) in
    training mode: the whole model is one graph (``fullgraph=True`` raises on any graph break, and
    Dynamo's graph-break counter stays empty), and one training step gives the eager loss and gradients (AOTAutograd's
    backward of the loop over chunks). The chunk size is a run-time value held by the layer, not a
    literal; 17 tokens in chunks of 6 (three chunks, the last partial)."""
    chunk = int(torch.tensor(6))  # a run-time value, not a literal in the traced code
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = TinyCausalLM(name, chunk)
    twin = TinyCausalLM(name, chunk)
    twin.load_state_dict(model.state_dict())
    unfitted = name == "oprf"  # the layers' OPRF is not fitted (fit=False): it says so in eager mode
    with pytest.warns(UserWarning, match="used before fit") if unfitted else contextlib.nullcontext():
        loss_e, grads_e = _train_step(model, model, ids)
    counters.clear()
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    loss_c, grads_c = _train_step(twin, compiled, ids)
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(loss_c, loss_e, **TRAIN_TOL)
    assert len(grads_c) == len(grads_e) > 0
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, **TRAIN_TOL)


@pytest.mark.slow
def test_compiled_causal_training_inductor():
    """The same training step with the default backend (Inductor), FAVOR+: it compiles forward and
    backward (the prototype scan operator that was here failed in Inductor's lowering) and matches
    eager."""
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    model = TinyCausalLM("positive", 6)
    twin = TinyCausalLM("positive", 6)
    twin.load_state_dict(model.state_dict())
    loss_e, grads_e = _train_step(model, model, ids)
    loss_c, grads_c = _train_step(twin, torch.compile(twin), ids)
    torch.testing.assert_close(loss_c, loss_e, **TRAIN_TOL)
    for gc, ge in zip(grads_c, grads_e, strict=True):
        torch.testing.assert_close(gc, ge, **TRAIN_TOL)


def test_check_warning_still_fires_in_eager():
    """The opt-in closed-form check (``check=True``) is skipped under ``torch.compile`` (no graph
    break, no warning) and still runs in eager mode."""
    fm = ka.TrigRF(D, 4, seed=0)
    q, k, v = (3 * t for t in _data())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = torch.compile(lambda q, k, v: ka.linear_attention(q, k, v, fm, check=True),
                            fullgraph=True, backend="eager")(q, k, v)
    assert not any(issubclass(x.category, ka.KernelApproxWarning) for x in w)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _close(out, ka.linear_attention(q, k, v, fm, check=True))
    assert any(issubclass(x.category, ka.KernelApproxWarning) for x in w)


def test_compiled_map_still_validates_in_eager():
    """Validation keeps raising the same errors in eager after a map was compiled."""
    fm = _build("positive")
    torch.compile(fm, fullgraph=True, backend="aot_eager")(_data()[0])
    with pytest.raises(ValueError, match="expected dim=8"):
        fm(torch.randn(3, 5))
    with pytest.raises(TypeError, match="real floating dtype"):
        fm(torch.ones(3, 8, dtype=torch.int64))
