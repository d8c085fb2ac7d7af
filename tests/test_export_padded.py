"""Exports take padded batches as transformers models do: a left-padded batch through an export,
loaded by `AutoModelForCausalLM` alone, gives each row what the row gives on its own (its logits
at its real positions, without and with a KV cache and continued over that cache, and its greedy
`generate` tokens and step logits), for every design of the registry (Origin's export is
transformers' own GPT-NeoX) and the softmax modifiers; padding inside a row, and padding under
dynamic NTK, are refused in one line. Random-weight models of two layers (`test_export_hf`'s),
exported once per module; rows of 30, 17 and 5 tokens, generation crossing the training length."""

from __future__ import annotations

import pytest
import torch
from test_export_hf import L0, load_hf, random_model

from hf.export import export_hf
from model.designs import BY_LABEL

pytestmark = pytest.mark.usefixtures("single_thread")

# design label, architecture, modifiers: every design (neox), then the modifiers and grouped-query attention
CASES = {label: (label, "neox", {}) for label in BY_LABEL} | {
    "origin+sinks+ssmax/llama": ("origin", "llama", dict(sinks=True, ssmax=True)),
    "nope+qk_norm": ("nope", "neox", dict(qk_norm=True)),
    "coca-slack/llama": ("coca-slack", "llama", {}),
}
LENGTHS = (30, 17, 5)
STEPS = 6  # generated tokens: the longest row then passes L0 = 32


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tok, tmp_path_factory):
    """(the export loaded by transformers alone, the rows, the left-padded batch and its mask)."""
    design, variant, modifiers = CASES[request.param]
    out = export_hf(random_model(tok, design, variant, **modifiers), tok, tmp_path_factory.mktemp("export"))
    hf = load_hf(out)
    assert (out / "modeling_coca_lm.py").exists() == bool(not BY_LABEL[design].native_hf or modifiers)
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(4, tok.vocab_size, (n,), generator=g) for n in LENGTHS]
    T = max(LENGTHS)
    batch = torch.full((len(rows), T), tok.pad_id)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        batch[b, T - len(row) :], mask[b, T - len(row) :] = row, 1
    return hf, rows, batch, mask


def test_a_left_padded_batch_gives_each_row_its_own_logits(exported):
    """Without a cache (the batch as documents) and with one (each row over its part), then three more
    tokens over that cache, with the whole mask as transformers passes it and (the remote code, whose
    cache remembers its padding) without: each row's logits at its real positions are its own; the
    same batch unmasked differs (the padding is really there)."""
    hf, rows, batch, mask = exported
    T = batch.shape[1]
    more = torch.randint(4, hf.config.vocab_size, (len(rows), 3), generator=torch.Generator().manual_seed(8))
    whole = torch.cat((mask, torch.ones_like(more)), dim=1)
    remote = type(hf).__name__ == "CocaLMForCausalLM"
    with torch.no_grad():
        alone = [hf(torch.cat((row, more[b]))[None]).logits[0] for b, row in enumerate(rows)]
        unmasked = hf(batch).logits
        for use_cache in (False, True):
            out = hf(batch, attention_mask=mask, use_cache=use_cache)
            for b, row in enumerate(rows):
                torch.testing.assert_close(out.logits[b, T - len(row) :], alone[b][: len(row)], rtol=0, atol=1e-5)
        continued = [(out, whole)] + ([(hf(batch, attention_mask=mask), None)] if remote else [])
        for prefill, given in continued:
            field = "cache" if "cache" in prefill.keys() else "past_key_values"
            after = hf(more, attention_mask=given, **{field: prefill[field]}).logits
            for b, row in enumerate(rows):
                torch.testing.assert_close(after[b], alone[b][len(row) :], rtol=0, atol=1e-5)
    assert min(logits.std() for logits in alone) > 0.05
    moved = [(unmasked[b, T - len(row) :] - alone[b][: len(row)]).abs().max() for b, row in enumerate(rows)]
    assert max(moved) > 1e-2


def test_a_left_padded_generate_gives_each_row_its_greedy_tokens(exported):
    """Batched greedy `generate` (transformers' own positions from the mask, its KV cache) gives each
    row the tokens and the step logits it gets alone."""
    hf, rows, batch, mask = exported
    kwargs = dict(max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    out = hf.generate(batch, attention_mask=mask, **kwargs)
    for b, row in enumerate(rows):
        alone = hf.generate(row[None], **kwargs)
        assert torch.equal(out.sequences[b, batch.shape[1] :], alone.sequences[0, len(row) :])
        for step, logits in zip(out.logits, alone.logits, strict=True):
            torch.testing.assert_close(step[b], logits[0], rtol=0, atol=1e-5)
    assert len(rows[0]) + STEPS > L0


def test_padding_it_cannot_compute_is_refused_in_one_line(tok, tmp_path):
    """Padding between a row's real tokens (given, or right padding continued over a cache, with the
    mask or without it), a row of padding only, positions counted across the padding, a mask that
    disagrees with the padding in the cache, and padding under dynamic NTK."""
    path = export_hf(random_model(tok, "alibi"), tok, tmp_path / "alibi")
    hf = load_hf(path)
    idx = torch.randint(4, tok.vocab_size, (2, 8), generator=torch.Generator().manual_seed(9))
    left = torch.ones_like(idx)
    left[1, :3] = 0
    inside, empty = left.clone(), left.clone()
    inside[0, 4] = 0
    empty[1] = 0
    refusals = [(dict(attention_mask=inside), "not between them"), (dict(attention_mask=empty), "no row of padding"),
                (dict(attention_mask=left, position_ids=torch.arange(8)[None].expand(2, 8)),
                 "position_ids must count from each row's first real token")]
    with torch.no_grad():
        for kwargs, needle in refusals:
            with pytest.raises(ValueError, match=needle) as error:
                hf(idx, **kwargs)
            assert "\n" not in str(error.value)
        with pytest.raises(ValueError, match="not between them"):
            hf.generate(idx, attention_mask=left.flip(1), max_new_tokens=2, do_sample=False, eos_token_id=None)
        for mask, continued, needle in ((left.flip(1), None, "not between them"),  # the cache remembers
                                        (left, torch.ones(2, 9), "disagrees with the padding the cache was filled")):
            out = hf(idx, attention_mask=mask)
            field = "cache" if "cache" in out.keys() else "past_key_values"
            with pytest.raises(ValueError, match=needle):
                hf(idx[:, :1], attention_mask=continued, **{field: out[field]})
    coca = load_hf(export_hf(random_model(tok, "coca-slack"), tok, tmp_path / "coca"),
                   {"rope_type": "dynamic", "factor": 4.0})
    with torch.no_grad(), pytest.raises(ValueError, match="padded batch under dynamic NTK"):
        coca(idx, attention_mask=left)
