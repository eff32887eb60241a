"""Decoding benchmark: per-token time of ``model.generate()`` after a long prompt, linearised or not.

Run: ``python -m benchmarks decode [--lengths 512 8192] [--new 32] [--repeats 3] [--threads 1]``

Model: a tiny LLaMA built from a config (2 layers, hidden 32, 4 query heads and 2 key/value heads
of d_head = 8, vocabulary 99, random weights, float32, eval mode), so that attention and its
bookkeeping are a visible part of a step. Modes:

- ``softmax``: the model's own attention (sdpa) on its KV cache: a step reads the ``t`` cached
  keys, O(t);
- ``linear``: `kernelapprox.hf.linearize` with FAVOR+ (``"positive"``, r = 32): a step advances
  the per-layer linear-attention state by the new token, O(1) in ``t``;
- ``hybrid``: the same map with ``window=64, sinks=1``: a step reads the ring buffer of the last
  64 keys and the state, O(1) in ``t``.

Per-token time: for a prompt of ``t`` random tokens, greedy ``generate`` of ``1 + new`` tokens;
a stopping criterion stamps ``time.perf_counter()`` after every token, and the intervals after
the first token are the decoding steps (the prefill excluded). The median over all steps of
``repeats`` runs is printed (robust to the spikes of a shared machine; the runs alternate
between the lengths, so that a change of load reaches all of them), with ``ratio``, the
per-token time at the longest length over that at the shortest (1 for a cost that does not grow
with the prompt).

The model's own KV cache still grows (transformers' ``DynamicCache`` appends to it each step, and
the attention mask has ``t`` entries), so a linearised step keeps an O(t) memory copy; at these
lengths it is small next to the step's fixed cost. Timings depend on the machine and its load:
quote them with ``uptime``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence

import torch


def build_model(max_positions: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=99, max_position_embeddings=max_positions,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, new: int) -> list[float]:
    """Wall-clock seconds of each decoding step of one greedy ``generate`` of ``1 + new`` tokens
    (the prefill excluded): the intervals between consecutive calls of a stopping criterion, which
    ``generate`` calls once after every token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1 + new,
                       min_new_tokens=1 + new, do_sample=False, pad_token_id=0, eos_token_id=None,
                       stopping_criteria=StoppingCriteriaList([Stamp()]))
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def run(lengths: Sequence[int], new: int, repeats: int) -> list[dict[str, object]]:
    from kernelapprox import hf

    model = build_model(max(lengths) + new + 8)
    g = torch.Generator().manual_seed(1)
    prompts = {t: torch.randint(1, 99, (1, t), generator=g) for t in lengths}
    modes = {"softmax": None, "linear": {}, "hybrid": {"window": 64, "sinks": 1}}
    rows: list[dict[str, object]] = []
    for mode, kw in modes.items():
        lin = None if kw is None else hf.linearize(model, "positive", num_features=32, check=False, **kw)
        try:
            step_seconds(model, prompts[min(lengths)], 2)  # warm-up
            steps: dict[int, list[float]] = {t: [] for t in lengths}
            for _ in range(repeats):  # the lengths alternate, so that a change of load hits both
                for t in lengths:
                    steps[t] += step_seconds(model, prompts[t], new)
            per = {t: statistics.median(v) for t, v in steps.items()}
        finally:
            if lin is not None:
                lin.restore()
        row: dict[str, object] = {"mode": mode}
        row.update({f"ms/token t={t}": 1e3 * s for t, s in per.items()})
        row["ratio"] = per[max(lengths)] / per[min(lengths)]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks decode", description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 8192], help="prompt lengths t")
    parser.add_argument("--new", type=int, default=32, help="decoding steps timed per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per length (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.lengths) or args.new < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("lengths, new, repeats and threads must be positive")
    torch.set_num_threads(args.threads)
    import pandas as pd

    rows = run(sorted(set(args.lengths)), args.new, args.repeats)
    table = pd.DataFrame(rows).set_index("mode")
    print(f"per-token decode time, tiny LLaMA (2 layers, 4 heads / 2 kv heads, d_head 8), "
          f"{args.new} steps, median of {args.repeats}, {args.threads} thread(s)")
    print(table.to_string(float_format=lambda x: f"{x:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
