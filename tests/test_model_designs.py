"""NoPE, p-RoPE, the interleaved NoPE/RoPE hybrid and the length temperature, each against a
float64 reference written from its definition (not from `model.designs`): the attention layer's
output and the gradients of its input and weights, at shifted positions, with grouped-query
attention and with document masking; then each design's own properties."""

from __future__ import annotations

import math

import pytest
import torch

import model.window_attention as attention_module
from model import GPT, ModelConfig
from model.attention import CausalSelfAttention
from model.convert import convert
from model.designs import Rope
from model.designs.base import unchanged
from model.documents import Documents, positions

F64 = torch.float64
BASE = 10000.0
L0 = 16
W = 5
ARCHS = {  # neox rotates half of each head (rotary_pct 0.5); llama: 4 query heads over 2 kv heads
    "neox": dict(n_head=2, n_embd=32, rotary_pct=0.5),
    "llama": dict(arch="llama", parallel_residual=False, n_head=4, n_kv_head=2, n_embd=32),
}
# (attention, design_params, layer index): the hybrid's layer 0 of 2 is windowed RoPE, layer 1 NoPE.
CASES = {
    "nope": ("nope", {}, 0),
    "p-rope": ("prope", {"prope": {"p": 0.5}}, 0),
    "hybrid-window": ("hybrid", {"hybrid": {"nope_every": 2, "window": W}}, 0),
    "hybrid-nope": ("hybrid", {"hybrid": {"nope_every": 2, "window": W}}, 1),
}


# ---- the definitions, in float64 ------------------------------------------------------------------


def rotate(x: torch.Tensor, pos: torch.Tensor, thetas: list[float]) -> torch.Tensor:
    """Pair (j, j + r/2) of x [..., T, D] turned by pos * theta_j (r = 2 len(thetas)); the rest kept."""
    out = x.clone()
    half = len(thetas)
    for j, theta in enumerate(thetas):
        c, s = torch.cos(pos.to(F64) * theta), torch.sin(pos.to(F64) * theta)
        out[..., j] = x[..., j] * c - x[..., j + half] * s
        out[..., j + half] = x[..., j] * s + x[..., j + half] * c
    return out


def thetas(attention: str, params: dict, layer: int, r: int) -> list[float]:
    """Each rotary pair's frequency in this layer: RoPE's base^(-2j/r); p-RoPE keeps the round(p r/2)
    highest (j = 0, 1, ...) and zeroes the rest; NoPE and the hybrid's NoPE layers rotate nothing."""
    full = [BASE ** (-2 * j / r) for j in range(r // 2)]
    if attention == "nope" or (attention == "hybrid" and layer == 1):
        return [0.0] * (r // 2)
    if attention == "prope":
        kept = round(params["prope"]["p"] * r / 2)
        return full[:kept] + [0.0] * (r // 2 - kept)
    return full


def reference_output(layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor,
                     attention: str, params: dict, index: int, temperature: bool) -> torch.Tensor:
    """softmax over allowed keys of the scores, the layer's own projections (their weights) around it.

    Allowed: n <= m, the same document, and in the hybrid's RoPE layer m - n < W. Scores:
    rot(q_m) . rot(k_n) / sqrt(D), times max(1, log(m' + 1) / log(L0)) with the temperature, m' the
    query's position (its document's under doc_positions)."""
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    if layer.fused:
        q, k, v = (layer.qkv(x).view(B, T, H, 3, D)[:, :, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (layer.q, layer.k, layer.v))
        group = H // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    r = int(D * (0.5 if layer.fused else 1.0))
    freqs = thetas(attention, params, index, r)
    p = pos[:, None]  # [B, 1, T]: heads broadcast
    scores = rotate(q, p, freqs) @ rotate(k, p, freqs).transpose(-1, -2) / math.sqrt(D)
    if temperature:
        scale = torch.tensor([[max(1.0, math.log(i + 1) / math.log(L0)) for i in row] for row in pos.tolist()],
                             dtype=F64)
        scores = scores * scale[:, None, :, None]
    m, n = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (n <= m) & (docs[:, None, :, None] == docs[:, None, None, :])
    if attention == "hybrid" and index == 0:
        allowed = allowed & (m - n < W)
    y = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    return layer.proj(y.transpose(1, 2).reshape(B, T, C))


# ---- the layer against the definitions --------------------------------------------------------------


@pytest.mark.parametrize("temperature", [False, True])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", CASES)
def test_layer_output_and_gradients_match_the_definition(case, arch, documents, temperature, monkeypatch):
    """Positions start at 1000 (or restart at each document under doc_positions); 40 tokens in
    query chunks of 7, so the windowed kernel's chunks and their key ranges are exercised."""
    monkeypatch.setattr(attention_module, "BIAS_CHUNK", 7)
    attention, params, index = CASES[case]
    cfg = ModelConfig(n_layer=2, ffn_hidden=64, max_seq_len=L0, attention=attention, design_params=params,
                      length_temperature=temperature, doc_mask=documents, doc_positions=documents, **ARCHS[arch])
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg, index).double()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.4)
    B, T = 2, 40
    x = torch.randn(B, T, cfg.n_embd, dtype=F64, requires_grad=True)
    docs = torch.tensor([[0] * 13 + [1] * 20 + [2] * 7, [0] * 40])[:B] if documents else torch.zeros(B, T, dtype=int)
    pos = positions(docs) if documents else (1000 + torch.arange(T)).expand(B, T)
    rope = Rope(cfg.rotary_dims, BASE, L0, cfg.rope_scaling, pairs=cfg.rope_pairs())
    cos, sin = rope.tables(pos, T, F64)
    q_scale = None
    if temperature:
        q_scale = (torch.log1p(pos.to(F64)) / math.log(L0)).clamp(min=1.0)[:, None, :, None]
    out = layer(x, (cos[:, None], sin[:, None]), documents=Documents(docs) if documents else None, q_scale=q_scale)
    want = reference_output(layer, x, pos, docs, attention, params, index, temperature)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(out.shape, dtype=F64)
    inputs = [x, *layer.parameters()]
    for got, expected in zip(torch.autograd.grad((out * weights).sum(), inputs),
                             torch.autograd.grad((want * weights).sum(), inputs)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# ---- p-RoPE ------------------------------------------------------------------------------------------


def gpt(attention: str = "origin", **overrides) -> GPT:
    cfg = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=L0)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**cfg, **overrides}, attention=attention)).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


IDX = torch.randint(0, 64, (2, 3 * L0), generator=torch.Generator().manual_seed(1))


def logits(model: GPT) -> torch.Tensor:
    with torch.no_grad():
        return model(IDX)


def test_p_rope_limits_are_rope_and_nope_and_it_is_not_rotary_pct():
    """p = 1 is RoPE and p = 0 NoPE, bitwise (the weights are the same draws); p = 0.25 rotates the
    highest quarter of the frequencies, rotary_pct = 0.25 re-spaces all of them over a quarter of the
    dimensions: different models."""
    assert torch.equal(logits(gpt("prope", design_params={"prope": {"p": 1.0}})), logits(gpt("origin")))
    assert torch.equal(logits(gpt("prope", design_params={"prope": {"p": 0.0}})), logits(gpt("nope")))
    quarter = logits(gpt("prope", design_params={"prope": {"p": 0.25}}))
    assert (quarter - logits(gpt("origin", rotary_pct=0.25))).abs().max() > 1e-3
    assert (quarter - logits(gpt("origin"))).abs().max() > 1e-3


def test_p_rope_scalings_act_on_the_rotating_pairs_only():
    model = gpt("prope", design_params={"prope": {"p": 0.5}})
    model.set_rope_scaling("linear", 4.0)
    inv, _ = model.rope.inv_freq(3 * L0)
    r = model.cfg.rotary_dims
    want = torch.tensor([BASE ** (-2 * j / r) / 4.0 if j < r // 4 else 0.0 for j in range(r // 2)], dtype=F64)
    torch.testing.assert_close(inv, want, rtol=1e-15, atol=0)


def test_p_rope_parameter_is_checked_in_one_line():
    with pytest.raises(ValueError, match=r"model.design_params.prope.p=1.5 must be a number in \[0, 1\]"):
        ModelConfig(attention="prope", design_params={"prope": {"p": 1.5}})
    with pytest.raises(ValueError, match="model.design_params.nope: no design with parameters has that key"):
        ModelConfig(design_params={"nope": {}})


# ---- the length temperature --------------------------------------------------------------------------


def test_temperature_is_one_up_to_the_training_length_then_log_i_over_log_l0():
    from model.designs.temperature import length_temperature

    i = torch.arange(0, 20 * L0)
    got = length_temperature(i, L0)
    want = torch.tensor([max(1.0, math.log(k + 1) / math.log(L0)) for k in i.tolist()], dtype=F64)
    torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
    assert bool((got[:L0] == 1.0).all()) and bool((got[L0:] > 1.0).all())


@pytest.mark.parametrize("attention", ["origin", "alibi", "nope"])
def test_temperature_leaves_the_training_length_alone_and_sharpens_beyond(attention):
    plain, tempered = gpt(attention), gpt(attention, length_temperature=True)
    a, b = logits(plain), logits(tempered)
    assert torch.equal(a[:, :L0], b[:, :L0])
    assert (a[:, L0 + 1:] - b[:, L0 + 1:]).abs().amax(dim=-1).min() > 1e-6
    plain.set_length_temperature(True)  # switched on a trained model: the same as trained with it
    assert torch.equal(logits(plain), b)


# ---- the hybrid ------------------------------------------------------------------------------------


def test_hybrid_window_sees_w_minus_one_back_not_w_and_nope_layers_see_everything():
    """d out_i / d x_j through one layer: the windowed layer reaches j = i - W + 1 and not i - W; the
    NoPE layer reaches the first token from the last."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=16, ffn_hidden=32, max_seq_len=L0, attention="hybrid",
                      design_params={"hybrid": {"nope_every": 2, "window": W}})
    torch.manual_seed(0)
    T, i = 30, 20
    rope = Rope(cfg.rotary_dims, BASE, L0, cfg.rope_scaling).tables(torch.arange(T), T, F64)
    for index, reach in ((0, range(i - W + 1, i + 1)), (1, range(i + 1))):
        layer = CausalSelfAttention(cfg, index).double()
        x = torch.randn(1, T, 16, dtype=F64, requires_grad=True)
        (grad,) = torch.autograd.grad(layer(x, rope)[0, i].sum(), x)
        seen = [j for j in range(T) if grad[0, j].abs().max() > 0]
        assert seen == list(reach), (index, seen)


def test_hybrid_layers_count_from_the_last():
    cfg = ModelConfig(n_layer=6, attention="hybrid", design_params={"hybrid": {"nope_every": 4, "window": 64}})
    assert [cfg.layer_design(i).window for i in range(6)] == [64, 0, 64, 64, 64, 0]
    assert [cfg.layer_design(i).qk is not unchanged for i in range(6)] == [True, False, True, True, True, False]


@pytest.mark.slow
def test_windowed_flex_kernel_matches_the_cpu_kernel():
    """The GPU path (compiled FlexAttention with a sliding-window block mask; forward runs on CPU,
    ~30 s compile) agrees with the chunked CPU kernel, with and without documents."""
    from model.block_masks import document_block_mask, window_block_mask
    from model.kernel_path import run_flex
    from model.window_attention import _chunked_window

    g = torch.Generator().manual_seed(3)
    T = 300
    q, k, v = (torch.randn(2, 4, T, 16, generator=g) for _ in range(3))
    docs = torch.cat([torch.zeros(2, 130, dtype=torch.long), torch.ones(2, 170, dtype=torch.long)], dim=1)
    with torch.no_grad():
        flex = run_flex(q, k, v, block_mask=window_block_mask(T, 37, "cpu"))
        torch.testing.assert_close(flex, _chunked_window(q, k, v, 37), rtol=1e-4, atol=1e-5)
        flex = run_flex(q, k, v, block_mask=document_block_mask(docs, 37))
        chunked = torch.cat([_chunked_window(q[..., :130, :], k[..., :130, :], v[..., :130, :], 37),
                             _chunked_window(q[..., 130:, :], k[..., 130:, :], v[..., 130:, :], 37)], dim=2)
        torch.testing.assert_close(flex, chunked, rtol=1e-4, atol=1e-5)


# ---- conversion from Origin --------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["nope", "prope", "hybrid"])
def test_an_origin_model_converts_keeping_every_tensor(attention):
    source = gpt("origin")
    target_cfg = ModelConfig(**{**source.cfg.__dict__, "attention": attention})
    state, done = convert(source.state_dict(), source.cfg, target_cfg)
    assert done.fresh == [] and all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    GPT(target_cfg).double().load_state_dict(state)
