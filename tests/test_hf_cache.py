"""Linearised models that behave like transformers models: the state cache, save/load, Trainer.

What is pinned here, on tiny GPT-2 and LLaMA (grouped-query) models built from configs (no download):

* ``generate`` on a linearised model builds a `LinearizedCache`, which keeps per layer the
  recurrent state (and the window's ring buffer, the sinks) only: its tensor bytes after 512 and
  after 8192 tokens are equal, where a ``DynamicCache`` grows with every token; greedy and beam
  search on it give the tokens (and logits to 1e-5) of the same model decoding on a
  ``DynamicCache`` (whose continuation the linearised layers recognise, or rebuild from);
* static caches and ``crop`` (assisted decoding) are refused with clear errors; ``restore``
  gives ``generate`` back its own cache;
* `save_linearized` / `load_linearized` round trip a linearised model (window, sinks, exact
  heads) and a recovered one (learned maps, LoRA adapters of `kernelapprox.recover.finetune`
  merged into the weights; unmerged adapters are refused): outputs identical bit for bit;
* transformers' ``Trainer`` runs a few optimisation steps on a linearised model.

Tolerances. Float32 models; the recurrent and chunked forms sum the same terms in another order
(differences <= 3e-7); checks at 1e-5, each paired with a comparison that must fail.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    StaticCache,
)

from kernelapprox import hf  # noqa: E402
from kernelapprox.hf.cache import LinearizedCache, StateLayer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread")]

VOCAB, B, P, NEW = 99, 2, 9, 5


def build(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0,
                         n_positions=8200)
        return GPT2LMHeadModel(cfg).eval()
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      max_position_embeddings=8200)
    return LlamaForCausalLM(cfg).eval()


def prompt(pad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (B, P), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :3] = 0
    return ids, mask


def generate(model, ids, mask, **kw):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, **kw)


SETTINGS = {"phi": dict(), "window": dict(window=3, sinks=1), "exact-head": dict(window=2, exact_heads={1: [3]})}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generate_decodes_on_the_state_cache(arch, pad, setting):
    model = build(arch)
    ids, mask = prompt(pad)
    with hf.linearize(model, "positive", num_features=16, **SETTINGS[setting]):
        out = generate(model, ids, mask, output_logits=True)
        ref = generate(model, ids, mask, output_logits=True, cache=DynamicCache(config=model.config))
    assert isinstance(out.cache, LinearizedCache) and isinstance(ref.cache, DynamicCache)
    assert torch.equal(out.sequences, ref.sequences)
    assert (torch.stack(out.logits) - torch.stack(ref.logits)).abs().max() <= 1e-5
    layers = out.cache.layers
    assert all(isinstance(layer, StateLayer) for layer in layers) and layers[0].get_seq_length() == P + NEW - 1
    # keys and values are kept only where a head stays exact
    assert [layer.keys is not None for layer in layers] == [False, setting == "exact-head"]
    assert ref.cache.layers[0].keys.shape[2] == P + NEW - 1
    soft = generate(model, ids, mask, output_logits=True)  # the check can fail: the softmax model
    assert (torch.stack(soft.logits) - torch.stack(ref.logits)).abs().max() > 1e-3


@pytest.mark.parametrize("kw", [dict(), dict(window=4, sinks=1)], ids=["phi", "window"])
def test_cache_memory_does_not_grow_with_the_sequence(kw):
    model = build("llama")
    sizes = {}
    with hf.linearize(model, "positive", num_features=16, check=False, chunk_size=256, **kw) as lin, torch.no_grad():
        for t in (512, 8192):
            cache = lin.new_cache()
            model(input_ids=torch.randint(1, VOCAB, (1, t)), cache=cache, use_cache=True, logits_to_keep=1)
            model(input_ids=torch.randint(1, VOCAB, (1, 1)), cache=cache, use_cache=True)
            assert cache.get_seq_length() == t + 1
            sizes[t] = cache.nbytes()
        dyn = {}
        for t in (16, 32):  # the check can fail: a DynamicCache grows with every token
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.randint(1, VOCAB, (1, t)), cache=cache, use_cache=True, logits_to_keep=1)
            dyn[t] = sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))
    assert sizes[512] == sizes[8192] > 0
    assert dyn[32] == 2 * dyn[16]


@pytest.mark.parametrize("kw", [dict(), dict(window=3, sinks=1)], ids=["phi", "window"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_beam_search_reorders_the_states(arch, kw):
    model = build(arch)
    ids, mask = prompt(pad=True)
    with hf.linearize(model, "positive", num_features=16, **kw):
        out = generate(model, ids, mask, num_beams=3, num_return_sequences=2)
        ref = generate(model, ids, mask, num_beams=3, num_return_sequences=2, cache=DynamicCache(config=model.config))
        greedy = generate(model, ids, mask)
    assert isinstance(out.cache, LinearizedCache)
    assert torch.equal(out.sequences, ref.sequences) and out.sequences.shape == (2 * B, P + NEW)
    assert not torch.equal(out.sequences[::2], greedy.sequences)  # beams are not greedy here


def test_static_caches_and_rollbacks_are_refused_and_restore_gives_generate_back():
    model = build("llama")
    ids, mask = prompt(pad=False)
    with hf.linearize(model, "positive", num_features=16) as lin:
        with pytest.raises(ValueError, match="constant-size state"):
            generate(model, ids, mask, cache_implementation="static")
        with pytest.raises(ValueError, match="StaticCache"):
            generate(model, ids, mask, cache=StaticCache(config=model.config, max_cache_len=32))
        cache = generate(model, ids, mask).cache
        with pytest.raises(NotImplementedError, match="cannot drop tokens"):
            cache.crop(-1)
        with pytest.raises(TypeError, match="server"):
            LinearizedCache(3, lambda i: True, lambda i: False)
        with pytest.raises(TypeError, match="exact"):
            StateLayer(exact=1)
    assert "_prepare_cache_for_generation" not in model.__dict__
    assert isinstance(generate(model, ids, mask).cache, DynamicCache)
    with pytest.raises(ValueError, match="restored"):
        lin.new_cache()


def test_save_and_load_round_trip_a_linearised_model(tmp_path):
    model = build("llama")
    ids, mask = prompt(pad=True)
    lin = hf.linearize(model, "positive", num_features=16, window=3, sinks=[0, 2], exact_heads={0: [1]})
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        seq = generate(model, ids, mask).sequences
    assert hf.save_linearized(lin, tmp_path / "m") == tmp_path / "m"
    lin2 = hf.load_linearized(tmp_path / "m")
    assert lin2.model is not model and (lin2.window, lin2.sinks, lin2.exact_heads) == (3, (0, 2), {0: [1]})
    with torch.no_grad():
        assert torch.equal(lin2.model(input_ids=ids, attention_mask=mask).logits, before)
        assert torch.equal(generate(lin2.model, ids, mask).sequences, seq)
        other = build("llama", seed=1)  # the check can fail: another model's logits
        with hf.linearize(other, "positive", num_features=16, window=3, sinks=[0, 2]):
            assert not torch.allclose(other(input_ids=ids, attention_mask=mask).logits, before, atol=1e-3)
    lin.restore()
    lin2.restore()
    with pytest.raises(ValueError, match="restored"):
        hf.save_linearized(lin, tmp_path / "x")
    with pytest.raises(ValueError, match="save_linearized"):
        hf.load_linearized(tmp_path / "empty")


def test_save_and_load_round_trip_a_recovered_model(tmp_path):
    from kernelapprox import recover

    model = build("gpt2")
    teacher = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    cal = dict(input_ids=torch.randint(1, VOCAB, (4, 12), generator=g))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin = hf.linearize(model, "hedgehog", num_features=8, calibration=cal, fit_steps=3)
        recover.finetune(lin, teacher, cal, targets=["query", "output"], steps=2, lr=1e-2, batch_size=2,
                         progress=False)
    assert any("lora" in n for n, _ in model.named_modules())
    with pytest.raises(ValueError, match="unmerged LoRA adapters"):
        hf.save_linearized(lin, tmp_path)
    recover.merged(lin)  # the adapters go into the weights
    ids, mask = prompt(pad=True)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    hf.save_linearized(lin, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin2 = hf.load_linearized(tmp_path)
    with torch.no_grad():
        assert torch.equal(lin2.model(input_ids=ids, attention_mask=mask).logits, before)
        assert not torch.allclose(teacher(input_ids=ids, attention_mask=mask).logits, before, atol=1e-3)


def test_trainer_runs_a_few_steps_on_a_linearised_model(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = build("llama")
    g = torch.Generator().manual_seed(7)
    rows = [dict(input_ids=x, labels=x) for x in torch.randint(1, VOCAB, (8, 16), generator=g)]
    with hf.linearize(model, "positive", num_features=16, window=4, sinks=1) as lin:
        weight = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                                 use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        result = trainer.train()
        assert lin.active and result.global_step == 3
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
        assert not torch.equal(model.model.layers[0].self_attn.q_proj.weight, weight)
