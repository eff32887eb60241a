"""`hf.token_chunks` tokenises a long text once and cuts it into chunks of ``length``: no
transformers warning that the text exceeds the model's maximum length (it never reaches the model
whole), the same chunks as tokenising it in one piece."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from kernelapprox import hf  # noqa: E402


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "a": 3, "b": 4}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", model_max_length=8)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_long_text_chunks_without_the_length_warning():
    logger = logging.getLogger("transformers")  # transformers' loggers write through this one
    rec = _Records()
    logger.addHandler(rec)
    try:
        tok = _tokenizer()
        text = "a b " * 20  # 40 tokens > model_max_length = 8
        chunks = hf.token_chunks(tok, text, length=8)
        assert not any("longer than the specified maximum" in m for m in rec.messages), rec.messages
        # the warning is transformers' own for a direct call (so the check above can fail)
        _tokenizer()(text, add_special_tokens=False)
        assert any("longer than the specified maximum" in m for m in rec.messages)
    finally:
        logger.removeHandler(rec)
    ids = chunks["input_ids"]
    assert ids.shape == (6, 8)  # 40 tokens, 6 per chunk body
    assert ids[:, 1:-1].flatten().tolist() == [3, 4] * 18
