"""kernelapprox.hf.linearize: KV-cache decoding on the recurrent state (O(1) per generated token).

What is pinned here, on tiny random GPT-2 and LLaMA (grouped-query: 4 query heads, 2 key/value
heads) language models built from configs:

* ``model.generate()`` (greedy) equals a full forward of the generated sequence under the same
  linearised model: the generated tokens are the full forward's argmax, the logits agree to
  1e-5; unpadded and left-padded prompts, the feature map alone, a hybrid window with a sink,
  and exact heads;
* a decoding step continues the stored state: past the first layer it reads none of the cached
  keys but the first and the last (corrupting the others changes nothing); the first layer
  compares its whole cached prefix (its keys carry no context), so reordered beams that share
  their first and last tokens are seen; a call that does not continue the stored state (another
  prompt in between, another batch size, reordered beams) rebuilds it from the cache and still
  equals the full forward;
* no state is kept with autograd; data-dependent maps keep the fit of the prefill while decoding.

Tolerances. Float32 models; logits O(0.1-1); the recurrent and the parallel forms sum the same
terms in another order (measured differences <= 3e-7); checks at 1e-5. Each check is paired with
one it must fail (softmax vs linearised, a corrupted cache rebuilt).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kernelapprox import hf  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning"),
]

VOCAB, B, P, NEW, PAD = 99, 2, 9, 6, 3  # vocabulary, batch, prompt, generated tokens, left padding of row 1


def build(arch: str):
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg).eval()
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=37, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def prompt(pad: bool, batch: int = B, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, P), generator=g)
    mask = torch.ones_like(ids)
    if pad:
        mask[1, :PAD] = 0
    return ids, mask


def full_logits(model, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One forward of the whole sequence, with the positions generation gives left-padded rows."""
    with torch.no_grad():
        return model(input_ids=seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits


def generate(model, ids, mask):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


SETTINGS = {
    "phi": dict(),
    "window": dict(window=3, sinks=1),
    "exact-head": dict(window=2, exact_heads={1: [3]}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generate_equals_the_full_forward(arch, pad, setting):
    model = build(arch)
    ids, mask = prompt(pad)
    full_mask = torch.cat([mask, torch.ones(B, NEW, dtype=mask.dtype)], 1)
    with hf.linearize(model, "positive", num_features=16, **SETTINGS[setting]):
        seq, logits = generate(model, ids, mask)
        ref = full_logits(model, seq, full_mask)[:, P - 1:-1]
    assert seq.shape == (B, P + NEW) and logits.shape == (B, NEW, VOCAB)
    assert torch.equal(ref.argmax(-1), seq[:, P:])  # greedy tokens of the full forward
    assert (logits - ref).abs().max() <= 1e-5
    # the check can fail: the softmax model's logits on the same sequence
    soft = full_logits(model, seq, full_mask)[:, P - 1:-1]
    assert (soft - ref).abs().max() > 1e-3


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


def prefill(model, ids, mask):
    """The cache of all but the last token."""
    return model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions(mask)[:, :-1],
                 use_cache=True).past_key_values


def last_step(model, ids, mask, cache):
    return model(input_ids=ids[:, -1:], attention_mask=mask, past_key_values=cache, use_cache=True,
                 position_ids=positions(mask)[:, -1:]).logits[:, -1]


def steps(model, ids, mask, corrupt=()):
    """Prefill all but the last token, then one decoding step; first corrupt the cached keys and
    values between the first and the last one in the layers ``corrupt``."""
    with torch.no_grad():
        cache = prefill(model, ids, mask)
        for i in corrupt:
            cache.layers[i].keys[:, :, 1:-1] += 1.0
            cache.layers[i].values[:, :, 1:-1] += 1.0
        return last_step(model, ids, mask, cache), cache


@pytest.mark.parametrize("kw", [dict(), dict(window=3, sinks=1)], ids=["phi", "window"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_decoding_step_continues_the_state_and_reads_no_cached_key(arch, kw):
    model = build(arch)
    ids, mask = prompt(pad=True)
    with hf.linearize(model, "positive", num_features=16, **kw) as lin:
        ref = full_logits(model, ids, mask)[:, -1]
        clean, _ = steps(model, ids, mask)
        # layer 1's cached keys 1 .. p-2 are never read: the state already holds them (the
        # window's keys are in its ring buffer)
        corrupted, cache = steps(model, ids, mask, corrupt=[1])
        assert (clean - ref).abs().max() <= 1e-5
        assert (corrupted - ref).abs().max() <= 1e-5
        # layer 0 compares its whole cached prefix with the keys it consumed: a change is seen
        # and the state is rebuilt from the (corrupted) cache
        seen, _ = steps(model, ids, mask, corrupt=[0])
        assert (seen - ref).abs().max() > 1e-3
        # the check can fail: with the state forgotten, the step rebuilds it from the corrupted cache
        lin._streams.clear()
        with torch.no_grad():
            cache.crop(-1)  # back to the prefix of P - 1 tokens
            rebuilt = last_step(model, ids, mask, cache)
        assert (rebuilt - ref).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_step_that_does_not_continue_the_state_rebuilds_it(arch):
    model = build(arch)
    ids, mask = prompt(pad=True)
    other, _ = prompt(pad=True, seed=11)
    with hf.linearize(model, "positive", num_features=16, window=3, sinks=1):
        ref = full_logits(model, ids, mask)[:, -1]
        with torch.no_grad():
            cache = prefill(model, ids, mask)
            prefill(model, other, mask)  # same length, other tokens
            step = last_step(model, ids, mask, cache)
        assert (step - ref).abs().max() <= 1e-5
        # another batch size: row 0 alone, continuing a cache of the batch of 2 is refused, rebuilt
        ref0 = full_logits(model, ids[:1], mask[:1])[:, -1]
        with torch.no_grad():
            cache = prefill(model, ids[:1], mask[:1])
            prefill(model, ids, mask)
            step0 = last_step(model, ids[:1], mask[:1], cache)
        assert (step0 - ref0).abs().max() <= 1e-5


def test_no_state_is_kept_with_autograd():
    model = build("gpt2")
    ids, mask = prompt(pad=False)
    with hf.linearize(model, "positive", num_features=16) as lin:
        model(input_ids=ids, attention_mask=mask).logits.sum().backward()
        assert lin._streams == {}
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        assert set(lin._streams) == {0, 1}
    assert lin._streams == {}  # restore forgets the states


def test_data_dependent_maps_keep_the_fit_of_the_prefill():
    model = build("llama")
    ids, mask = prompt(pad=False)
    with hf.linearize(model, "oprf", num_features=16) as lin:
        with torch.no_grad():
            pre = model(input_ids=ids[:, :-1], use_cache=True)
            fitted = {i: fm.A_.clone() for i, fm in lin.feature_maps.items()}
            step = model(input_ids=ids[:, -1:], past_key_values=pre.past_key_values, use_cache=True).logits
        assert all(torch.equal(lin.feature_maps[i].A_, a) for i, a in fitted.items())  # not refitted
        assert torch.isfinite(step).all()
        seq, logits = generate(model, ids, mask)
        assert seq.shape == (B, P + NEW) and torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_reordered_beams_sharing_their_last_token_are_recognised(arch):
    """Beam search reorders the cache between steps. Two rows that differ early but end with the
    same token have the same first and last layer-0 keys (a layer-0 key depends on its token and
    position only), so the first layer compares its whole cached prefix: swapped rows rebuild."""
    model = build(arch)
    ids, mask = prompt(pad=False)
    ids[:, 0] = ids[0, 0]
    ids[:, -2] = ids[0, -2]  # the same first and last cached tokens, different ones between
    swap = torch.tensor([1, 0])
    with hf.linearize(model, "positive", num_features=16):
        ref = full_logits(model, ids[swap], mask)[:, -1]
        with torch.no_grad():
            cache = prefill(model, ids, mask)
            cache.reorder_cache(swap)
            step = last_step(model, ids[swap], mask, cache)
    assert (step - ref).abs().max() <= 1e-5
