"""The whole model: causality, KV-cache decoding, chunked loss, generation, capture_qk, RoPE scalings."""

import math

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_module
from model import GPT, KVCache, ModelConfig, RopeScaling
from model.designs import DESIGNS, Rope, design_of

# Every design of the registry, as (attention, form); its label names the case.
VARIANTS = [(d.attention, d.form or "slack") for d in DESIGNS.values()]
IDS = [d.label for d in DESIGNS.values()]
# The softmax designs: capture_qk's inputs are theirs (stick-breaking's: tests/test_stick_breaking.py)
SOFTMAX = [(d.attention, d.form or "slack") for d in DESIGNS.values() if d.softmax]
# Parameters that make a design's feature visible in `small`'s 2 layers and 20 tokens: the hybrid's
# layer 0 in a window of 3, its layer 1 global NoPE; p-RoPE rotating half its pairs.
PARAMS = {"hybrid": {"hybrid": {"window": 3, "nope_every": 2}}, "prope": {"prope": {"p": 0.5}}}
ROPE_SCALED = [(a, f, s) for a, f in VARIANTS for s in ("none", "dynamic")
               if design_of(a, {a: {"form": f}}).rope or s == "none"]
# arch=llama as `small` builds it: 2 query heads sharing 1 kv head (MQA, a group of 2).
ARCHS = {"neox": {}, "llama": dict(arch="llama", n_kv_head=1, parallel_residual=False)}


pytestmark = pytest.mark.usefixtures("single_thread")


def small(attention="origin", coca_form="slack", arch="neox", **overrides) -> GPT:
    cfg = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=16, ffn_hidden=32, max_seq_len=8, **ARCHS[arch])
    torch.manual_seed(0)
    form = {"coca": {"form": coca_form}} if attention == "coca" else {}
    cfg["design_params"] = {**PARAMS.get(attention, {}), **form}
    model = GPT(ModelConfig(**{**cfg, **overrides}, attention=attention)).double()
    for p in model.parameters():  # larger weights than init_std so that attention is far from uniform
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def tokens(b: int, t: int, seed: int = 0, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention, form", VARIANTS, ids=IDS)
def test_causality(attention, form, arch):
    model = small(attention, form, arch)
    idx = tokens(2, 20)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 64
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=0, atol=1e-12)
    assert (a[:, 12:] - b[:, 12:]).abs().amax(dim=-1).min() > 1e-6  # every later position sees it


@pytest.mark.parametrize("attention, form, scaling", ROPE_SCALED)
@pytest.mark.parametrize("arch", ARCHS)
def test_kv_cache_matches_full_forward(attention, form, scaling, arch):
    """Prompt of 3, a chunk of 4 (queries offset into the cache), then single tokens past 3x L0."""
    model = small(attention, form, arch, rope_scaling=RopeScaling(scaling, 4.0))
    idx = tokens(2, 26, seed=1)
    cache = KVCache(model.cfg.n_layer)
    steps = [(0, 3), (3, 7)] + [(t, t + 1) for t in range(7, 26)]
    with torch.no_grad():
        for start, end in steps:
            got = model(idx[:, start:end], cache=cache)
            want = model(idx[:, :end])[:, start:end]
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert cache.length == 26
    assert cache.layers[0].keys.shape[1] == model.cfg.kv_heads  # the cache holds the kv heads only


def test_dynamic_ntk_changes_only_beyond_training_length():
    plain, dynamic = small(), small(rope_scaling=RopeScaling("dynamic", 4.0))
    idx = tokens(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(plain(idx[:, :8]), dynamic(idx[:, :8]), rtol=0, atol=0)
        assert (plain(idx) - dynamic(idx)).abs().max() > 1e-3
        # a later call at 8 tokens uses the plain base again: nothing leaks from the longer call
        torch.testing.assert_close(dynamic(idx[:, :8]), plain(idx[:, :8]), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention, form", VARIANTS, ids=IDS)
def test_loss_and_token_losses_match_full_logits(attention, form, arch, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 64 * 7)  # 7 tokens per chunk: 3 chunks
    model = small(attention, form, arch).train()
    idx, targets = tokens(2, 10, seed=2), tokens(2, 10, seed=3)
    targets[0, 3] = targets[1, 0] = -100
    loss = model(idx, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(idx)
    want = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), ignore_index=-100)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        per_token = model.token_losses(idx, targets)
    assert per_token.dtype == torch.float32 and per_token.shape == (2, 10)
    assert per_token[0, 3] == 0 and per_token[1, 0] == 0
    want_tokens = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1), ignore_index=-100, reduction="none")
    torch.testing.assert_close(per_token, want_tokens.view(2, 10).float())


@pytest.mark.parametrize("arch, parallel", [("neox", True), ("neox", False), ("llama", False)])
@pytest.mark.parametrize("attention, form, scaling", ROPE_SCALED)
def test_logits_to_keep_is_the_tail_of_the_full_logits(attention, form, scaling, arch, parallel):
    """The tail of the full forward, past the training length too (dynamic NTK), while the last
    block's MLP sees only the kept positions (its attention queries the same ones)."""
    model = small(attention, form, arch, rope_scaling=RopeScaling(scaling, 4.0), parallel_residual=parallel)
    idx = tokens(2, 20, seed=6)
    rows = []
    model.h[-1].mlp.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[1]))
    with torch.no_grad():
        full = model(idx)
        for keep in (1, 5, 20, 30):
            got = model(idx, logits_to_keep=keep)
            torch.testing.assert_close(got, full[:, -keep:], rtol=1e-12, atol=1e-12)
    assert rows == [20, 1, 5, 20, 20]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention", [a for a, f in VARIANTS if f == "slack"])
def test_activation_checkpointing_gives_the_same_gradients(attention, arch):
    idx, targets = tokens(2, 9, seed=4), tokens(2, 9, seed=5)
    grads = []
    for remat in (False, True):
        model = small(attention, arch=arch, activation_checkpointing=remat).train()
        grads.append(torch.autograd.grad(model(idx, targets), list(model.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention, form", SOFTMAX, ids=[d.label for d in DESIGNS.values() if d.softmax])
def test_capture_qk_gives_the_layer_scores(attention, form, arch, layer):
    """Scores from capture_qk by the documented formula, q_eff . k_eff / sqrt(q_eff's width),
    reproduce the layer's attention output (under GQA k_eff has a head per query head: each its kv
    head's; a window masks far keys; PoPE's q_eff and k_eff are twice the head dimension)."""
    model = small(attention, form, arch)
    seen = {}
    model.h[layer].attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0], out=out))
    idx = tokens(1, 12, seed=6)
    captured = model.capture_qk(idx)
    assert len(captured) == model.cfg.n_layer
    q_eff, k_eff, bias, window, sinks, weights = captured[layer]
    assert sinks is None and weights is None  # no model.sinks; softmax
    width = 16 if attention == "pope" else 8
    assert (bias is None) == (design_of(attention, form).bias is None) and q_eff.shape == (1, 2, 12, width)
    assert window == (3 if (attention, layer) == ("hybrid", 0) else 0)
    m = torch.arange(12)
    scores = q_eff @ k_eff.transpose(-1, -2) / math.sqrt(width)
    if attention == "alibi":  # the captured bias is ALiBi's, slopes 2^-4, 2^-8 for 2 heads
        slopes = torch.tensor([2.0**-4, 2.0**-8], dtype=torch.float64)
        causal = m[:, None] >= m[None, :]
        torch.testing.assert_close(bias.scores(0, 12, q_eff.device)[..., causal],
                                   -(slopes[:, None, None] * (m[:, None] - m[None, :]))[..., causal],
                                   rtol=0, atol=1e-12)
    if bias is not None:
        scores = scores + bias.scores(0, 12, q_eff.device)[None]
    scores = scores.masked_fill(m[:, None] < m[None, :], float("-inf"))
    if window:
        scores = scores.masked_fill(m[:, None] - m[None, :] >= window, float("-inf"))
    attn = model.h[layer].attn
    if arch == "neox":
        v = attn.qkv(seen["x"]).view(1, 12, 2, 3, 8)[:, :, :, 2].transpose(1, 2)
    else:  # one kv head serves both query heads
        v = attn.v(seen["x"]).view(1, 12, 1, 8).transpose(1, 2).expand(1, 2, 12, 8)
    y = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(1, 12, 16)
    torch.testing.assert_close(attn.proj(y), seen["out"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attention, form", VARIANTS, ids=IDS)
def test_greedy_generate_follows_full_forward_argmax(attention, form, arch):
    scaling = "dynamic" if design_of(attention, form).rope else "none"
    model = small(attention, form, arch, rope_scaling=RopeScaling(scaling, 2.0))
    idx = tokens(2, 5, seed=7)
    out = model.generate(idx, max_new_tokens=10, greedy=True)
    want = idx
    with torch.no_grad():
        for _ in range(10):
            want = torch.cat((want, model(want)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(out, want)
    torch.manual_seed(0)
    assert torch.equal(model.generate(idx, max_new_tokens=10, top_k=1, temperature=0.7), want)


def test_sampling_respects_top_k_and_checks_arguments():
    model = small()
    idx = tokens(1, 4)
    with torch.no_grad():
        allowed = set(model(idx)[0, -1].topk(3).indices.tolist())
    torch.manual_seed(1)
    drawn = {model.generate(idx, 1, temperature=5.0, top_k=3)[0, -1].item() for _ in range(40)}
    assert drawn <= allowed and len(drawn) > 1
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 2, temperature=0.0)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(idx, 2, top_k=0)


def test_stream_stops_once_every_row_has_produced_a_stop_id():
    """Rows of a batch decode together: one that has stopped goes on until the last one stops."""
    model = small("coca", "slack")
    idx = tokens(2, 5, seed=3)
    free = model.generate(idx, 12, greedy=True)[:, 5:].tolist()
    stop = {free[0][2], free[1][6]}
    ends = [next(s for s, token in enumerate(row) if token in stop) for row in free]
    steps = max(ends) + 1
    assert steps <= 7
    streamed = [token.tolist() for token in model.stream(idx, 12, greedy=True, stop=stop)]
    assert streamed == [[free[0][s], free[1][s]] for s in range(steps)]
    assert model.generate(idx, 12, greedy=True, stop=stop).tolist() == [
        row + out[:steps] for row, out in zip(idx.tolist(), free)]


def test_seed_fixes_the_sample_and_a_tiny_nucleus_is_greedy():
    model = small("alibi")
    idx = tokens(2, 4, seed=5)
    first = model.generate(idx, 8, temperature=1.5, seed=5)
    assert torch.equal(first, model.generate(idx, 8, temperature=1.5, seed=5))
    assert not torch.equal(first, model.generate(idx, 8, temperature=1.5, seed=6))
    assert torch.equal(model.generate(idx, 8, top_p=1e-9, seed=0), model.generate(idx, 8, greedy=True))
    with pytest.raises(ValueError, match="top_p"):
        model.generate(idx, 2, top_p=0.0)


# ---- RoPE scalings -------------------------------------------------------------------------------


def hf_inv_freq(kind: str, r_pct: float, factor: float, seq_len: int | None = None):
    from transformers import GPTNeoXConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(rope_type=kind, factor=factor, rope_theta=10000.0, partial_rotary_factor=r_pct)
    if kind == "yarn":
        params["original_max_position_embeddings"] = 128
    cfg = GPTNeoXConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=128, rope_parameters=params)
    kwargs = {"seq_len": seq_len} if seq_len is not None else {}
    return ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", **kwargs)


@pytest.mark.parametrize("kind, seq_len", [("linear", None), ("dynamic", 100), ("dynamic", 1000), ("yarn", None)])
@pytest.mark.parametrize("r_pct", [1.0, 0.5])
def test_rope_scalings_match_hugging_face(kind, seq_len, r_pct):
    rope = Rope(int(64 * r_pct), 10000.0, 128, RopeScaling(kind, 4.0))
    inv, scale = rope.inv_freq(seq_len or 128)
    hf_inv, hf_scale = hf_inv_freq(kind, r_pct, 4.0, seq_len)
    torch.testing.assert_close(inv.float(), hf_inv, rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale)


def test_static_ntk_and_linear_positions():
    r = 32
    ntk = Rope(r, 10000.0, 128, RopeScaling("ntk", 4.0)).inv_freq(10)[0]
    base = 10000.0 * 4.0 ** (r / (r - 2))
    torch.testing.assert_close(ntk, base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r))
    # linear (PI): position p under factor s is position p / s unscaled
    lin = Rope(r, 10000.0, 128, RopeScaling("linear", 4.0)).tables(torch.tensor([40, 400]), 500, torch.float64)
    plain = Rope(r, 10000.0, 128, RopeScaling()).tables(torch.tensor([10.0, 100.0]), 500, torch.float64)
    torch.testing.assert_close(lin, plain)


@pytest.mark.parametrize("arch", ARCHS)
def test_set_rope_scaling_changes_long_logits_only(arch):
    model = small(arch=arch)
    idx = tokens(1, 24)
    with torch.no_grad():
        before = model(idx)
        model.set_rope_scaling("dynamic", 4.0)
        after = model(idx)
        model.set_rope_scaling("none", 1.0)
        torch.testing.assert_close(model(idx), before, rtol=0, atol=0)
    torch.testing.assert_close(after[:, :1], before[:, :1])  # position 0 is never rotated
    assert (after - before).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_a_scaling_stretches_from_its_original_length(kind):
    """A model continued at 1024 tokens from a 256-token one: YaRN's ramp and dynamic NTK's base
    are those of the pretraining length (`original_max_seq_len`), not of the new one."""
    scaling = RopeScaling(kind, 4.0, original_max_seq_len=256)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=1024, rope_scaling=scaling))
    r = model.cfg.rotary_dims
    for length in (512, 2048):
        got = model.rope.inv_freq(length)
        torch.testing.assert_close(got[0], Rope(r, 10000.0, 256, scaling).inv_freq(length)[0], rtol=0, atol=0)
        assert got[1] == Rope(r, 10000.0, 256, scaling).inv_freq(length)[1]
    assert not torch.equal(model.rope.inv_freq(2048)[0], Rope(r, 10000.0, 1024, scaling).inv_freq(2048)[0])
    model.set_rope_scaling("linear", 2.0)
    assert model.cfg.rope_scaling.original_max_seq_len == 256  # switching the type keeps it
