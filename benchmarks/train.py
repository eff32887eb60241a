"""Training benchmark: a small causal transformer with linear attention, eager, compiled and bf16.

Run: ``python -m benchmarks train [--steps N] [--threads T] [--maps M ...] [--quick]``
``[--backend B] [--no-progress]``

Model: a byte-level causal language model (vocabulary 256) with an embedding, learned absolute
positions, two pre-norm blocks (attention + a 4x GELU MLP), a final norm and a linear head;
$d_\\text{model} = 64$, 4 heads ($d_h = 16$). The attention of every block is
``kernelapprox.nn.LinearAttention(causal=True, feature_map=...)`` with

- ``positive``: FAVOR+ (orthogonal rows, the default $r = \\lfloor d_h \\ln d_h \\rfloor = 44$);
- ``oprf``: OPRF / FAVOR++ with ``fit=True``: the layer calls ``feature_map.fit(q, k)`` on every
  call, choosing $A^*(\\bar t)$ per sequence and head from that batch's scaled queries and keys
  (the fit checks its inputs for finite values on the host: under ``torch.compile`` each
  attention call is split at that check, so this model compiles into several graphs);
- ``hedgehog``: Hedgehog's learned map (trained with the model);
- ``softmax``: the baseline, exact causal softmax attention
  (``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``) with the same
  projections.

Data: the bytes of ``kernelapprox.hf.pydoc_text("all")`` (the interactive help shipped with
CPython, so nothing is downloaded); every step draws ``batch`` windows of ``seq + 1`` bytes at
positions from one fixed generator, the same windows in every mode. AdamW (lr 3e-3, weight decay
0.01), batch 32, sequence 128, the same initial weights (one seed) in every mode of a map.

Modes: ``eager`` (float32), ``compiled`` (``torch.compile(model)``, float32, the backend of
``--backend``, default Inductor) and ``bf16`` (eager under
``torch.autocast("cpu", dtype=torch.bfloat16)``; weights and optimiser stay float32).

Columns of the table:

- ``loss``: final training loss, the mean of the last 10 steps' losses (nats per byte;
  $\\ln 256 = 5.55$ is a uniform guess);
- ``s/step``: mean wall-clock seconds of a training step (forward, backward, AdamW) after the
  first ``warmup`` steps (2; 1 when fewer than 4 steps are run);
- ``compile s``: for ``compiled``, the first step's time minus ``s/step``, i.e. the time
  Dynamo, AOTAutograd and the backend took to build the graphs;
- ``max |Δ| vs eager``: the largest absolute difference between this mode's loss and the
  eager loss over the first 20 steps (``min(20, steps)``). Compilation reorders float32 sums, so
  the compiled curve agrees with eager to float32 rounding, which grows along training (AdamW's
  normalised steps amplify differences in small gradients): the first steps differ by a few
  float32 ulps of the loss ($\\approx 5\\cdot 10^{-7}$ at a loss of 4), later steps by more; a
  wrong chunk, state or gradient is $O(10^{-2})$ or more from the first step. bf16 is a
  different arithmetic (8 bits of mantissa in the matrix products), so its difference measures
  the effect of autocast on training, not a fault, and is expected to exceed the compiled one.

The timings depend on the CPU, the thread count (``--threads``) and on other processes: quote
them with the machine's load (``uptime``). ``--quick`` is a smoke run: 4 steps of ``softmax``
and ``positive`` in all three modes, compiled with ``aot_eager`` unless ``--backend`` is given
(Dynamo and AOTAutograd without code generation; Inductor's compilation alone takes about a
minute per model on 2 busy cores); its timings are not the benchmark's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from kernelapprox.nn import LinearAttention

VOCAB = 256
DIM, HEADS, LAYERS = 64, 4, 2
BATCH, SEQ = 32, 128
LR, WEIGHT_DECAY = 3e-3, 0.01
MAPS = ("softmax", "positive", "oprf", "hedgehog")
MODES = ("eager", "compiled", "bf16")
QUICK_MAPS = ("softmax", "positive")
QUICK_STEPS = 4
COMPARE_STEPS = 20
LAST_STEPS = 10


class SoftmaxAttention(nn.Module):
    """Multi-head causal softmax attention with the projections of `LinearAttention` (SDPA)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            split(self.to_q(x)), split(self.to_k(x)), split(self.to_v(x)), is_causal=True
        )
        return self.to_out(o.transpose(1, 2).reshape(b, n, d))


def make_attention(name: str, seed: int) -> nn.Module:
    """The attention of one block: ``"softmax"`` or a `LinearAttention` with map ``name``."""
    if name == "softmax":
        return SoftmaxAttention(DIM, HEADS)
    return LinearAttention(
        DIM, heads=HEADS, causal=True, feature_map=name, seed=seed, fit=name == "oprf", check=False
    )


class CausalLM(nn.Module):
    """Byte-level causal LM: embedding + positions, pre-norm blocks, final norm, head; returns the loss."""

    def __init__(self, attention: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
        self.blocks = nn.ModuleList()
        for i in range(LAYERS):
            mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
            self.blocks.append(
                nn.ModuleList([nn.LayerNorm(DIM), make_attention(attention, seed=i), nn.LayerNorm(DIM), mlp])
            )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x, y = ids[:, :-1], ids[:, 1:]
        h = self.emb(x) + self.pos[: x.shape[1]]
        for ln1, attn, ln2, mlp in self.blocks:
            h = h + attn(ln1(h))
            h = h + mlp(ln2(h))
        logits = self.head(self.norm(h)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def load_tokens() -> torch.Tensor:
    """The byte stream of the training text (int64, values in [0, 256))."""
    from kernelapprox.hf import pydoc_text

    data = pydoc_text("all").encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, steps: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """``steps`` batches of shape (BATCH, SEQ + 1), windows at positions from one fixed generator."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ + 1)
    for _ in range(steps):
        start = torch.randint(0, tokens.numel() - SEQ - 1, (BATCH, 1), generator=g)
        yield tokens[start + offsets]


@dataclass
class Run:
    """One (map, mode) training run: per-step losses and wall-clock times."""

    attention: str
    mode: str
    losses: list[float]
    times: list[float]

    @property
    def warmup(self) -> int:
        return 2 if len(self.times) >= 4 else 1

    @property
    def final_loss(self) -> float:
        last = self.losses[-LAST_STEPS:]
        return sum(last) / len(last)

    @property
    def step_s(self) -> float:
        t = self.times[self.warmup :] or self.times[-1:]
        return sum(t) / len(t)

    @property
    def compile_s(self) -> float:
        return max(self.times[0] - self.step_s, 0.0)


def train(
    attention: str,
    mode: str,
    tokens: torch.Tensor,
    steps: int,
    *,
    backend: str = "inductor",
    seed: int = 0,
    progress: bool = True,
) -> Run:
    """Train a fresh `CausalLM` (initial weights from ``seed``) for ``steps`` AdamW steps in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.manual_seed(seed)
    model = CausalLM(attention)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    step: Callable[[torch.Tensor], torch.Tensor] = model
    if mode == "compiled":
        torch._dynamo.reset()
        step = torch.compile(model, backend=backend)
    ctx: Callable[[], AbstractContextManager[object]] = (
        (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if mode == "bf16" else nullcontext
    )
    losses: list[float] = []
    times: list[float] = []
    bar = tqdm(
        batches(tokens, steps),
        total=steps,
        desc=f"{attention:>8} {mode:<8}",
        disable=not progress,
        leave=False,
        file=sys.stderr,
    )
    for ids in bar:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ctx():
            loss = step(ids)
        loss.backward()
        opt.step()
        value = loss.item()
        times.append(time.perf_counter() - t0)
        losses.append(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"{attention}/{mode}: loss {value} at step {len(losses)}")
        bar.set_postfix(loss=f"{value:.3f}")
    return Run(attention, mode, losses, times)


def max_diff(run: Run, ref: Run, steps: int = COMPARE_STEPS) -> float:
    """Largest absolute difference of the two loss curves over their first ``steps`` steps."""
    return max(abs(a - b) for a, b in zip(run.losses[:steps], ref.losses[:steps], strict=False))


def table(runs: Sequence[Run]) -> str:
    """The markdown table of the runs (one row per (map, mode))."""
    eager = {r.attention: r for r in runs if r.mode == "eager"}
    lines = [
        "| attention | mode | loss | s/step | compile s | max \\|Δ\\| vs eager |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        ref = eager.get(r.attention)
        diff = "—" if ref is None or r is ref else f"{max_diff(r, ref):.1e}"
        comp = f"{r.compile_s:.1f}" if r.mode == "compiled" else "—"
        lines.append(f"| {r.attention} | {r.mode} | {r.final_loss:.4f} | {r.step_s:.3f} | {comp} | {diff} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks train", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200, help="training steps per run (default 200)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument(
        "--maps", nargs="+", choices=MAPS, default=None, help=f"attentions (default {' '.join(MAPS)})"
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; aot_eager with --quick)"
    )
    p.add_argument("--quick", action="store_true", help=f"{QUICK_STEPS} steps of {' and '.join(QUICK_MAPS)}")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    steps = QUICK_STEPS if args.quick else args.steps
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    maps = args.maps or (QUICK_MAPS if args.quick else MAPS)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokens = load_tokens()
    runs = []
    modes = ["eager", *[m for m in args.modes if m != "eager"]]  # eager first: the reference
    for name in maps:
        for mode in modes:
            runs.append(train(name, mode, tokens, steps, backend=backend, progress=not args.no_progress))
    print(
        f"{steps} steps, batch {BATCH}, seq {SEQ}, d_model {DIM}, {HEADS} heads, {LAYERS} layers, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, backend {backend}"
    )
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
