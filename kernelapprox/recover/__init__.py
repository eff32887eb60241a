r"""Recover a linearised model: attention transfer, then LoRA fine-tuning (LoLCATs' two stages).

A model swapped to linear (or hybrid) attention by `kernelapprox.hf.linearize` loses accuracy
that per-head distillation alone does not give back ([Kas21]_, [Zha24]_). LoLCATs [Zha25]_
recovers it in two cheap stages, both against the original model (the *teacher*):

**Stage 1,** `transfer` (attention transfer): each linearised layer's feature-map parameters
$\theta_l$ (one set per head) are trained so that the student's attention output, computed on
the **teacher's** queries, keys and values of that layer, matches the teacher's softmax output:

$$
\mathcal L_l(\theta_l) = \frac{1}{H\,n\,d_v}\sum_{h,i}\big\|\hat o^{(l,h)}_i(\theta_l) - o^{(l,h)}_i\big\|_2^2
\;\big[+\ \tfrac1{Hn}\textstyle\sum_{h,i} \mathrm{CE}\big(A^{(l,h)}_{i\cdot}, \hat A^{(l,h)}_{i\cdot}(\theta_l)\big)\big],
$$

with $o = \mathrm{softmax}(s\,qk^\top + M)v$ the teacher's attention output (before the
output projection) and $\hat o$ linear attention (or hybrid attention, exact on a window and
sinks) with the map $\varphi_{\theta_l}$. The layers are independent: layer $l$ sees the
teacher's inputs, never those produced by the linearised layers below it.

**Stage 2,** `finetune`: low-rank adapters ([Hu22], from ``peft``) on the attention projections of the
linearised model, feature maps frozen, trained on the model's own output against the teacher:
the cosine of the sentence embeddings or the MSE of the last hidden states (encoders), the KL
divergence of the next-token distributions (causal language models).

`save` / `load` write and read the whole linearised, fine-tuned model (the model's weights, the
adapters, and the maps); `unload` removes unmerged adapters and switches the model back, giving
the original model bit for bit.

Both stages return a `History` (per step, per layer for `transfer`: the loss, with the tokens seen
and the CPU seconds), deterministic given ``seed``.

References
----------
- [Zha25] M. Zhang, S. Arora, R. Chalamala, A. Wu, B. Spector, A. Singhal, K. Ramesh, C. Ré.
   "LoLCATs: on low-rank linearizing of large language models", ICLR 2025 (Eq. 7, the sliding
   window + linear attention hybrid).
- [Zha24] M. Zhang, K. Bhatia, H. Kumbong, C. Ré. "The Hedgehog & the Porcupine: Expressive
   Linear Attentions with Softmax Mimicry", ICLR 2024, arXiv:2402.04347 (eq. 5: the distillation
   loss; the map as implemented in flash-linear-attention's ``HedgehogFeatureMap``).
- [Kas21] J. Kasai et al., "Finetuning pretrained transformers into RNNs", EMNLP 2021
   (swapping a pretrained model's softmax attention for linear attention).
- Hu22: E. J. Hu, Y. Shen, P. Wallis, Z. Allen-Zhu, Y. Li, S. Wang, L. Wang, W. Chen, "LoRA:
  low-rank adaptation of large language models", ICLR 2022.
"""


from __future__ import annotations

from ._common import History
from .checkpoint import load, save
from .finetune import TARGETS, finetune, lora_targets, merged, unload
from .transfer import transfer

__all__ = ["History", "transfer", "finetune", "lora_targets", "save", "load", "unload", "merged", "TARGETS"]
