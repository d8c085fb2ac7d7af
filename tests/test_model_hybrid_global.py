"""The hybrid's global layers as RoPE at a base of their own (`global_layers: origin`,
`global_rope_base`: Gemma 3's 5 local : 1 global layout): the global layer against a float64
reference of RoPE at that base, with GQA, partial rotary, shifted positions and document masking;
the model's per-layer tables, the KV cache, the checks in one line."""

from __future__ import annotations

import math

import pytest
import torch
from float64_checks import ARCHS, F64, assert_same_with_gradients, random_gpt, rotate

from model import GPT, ModelConfig
from model.attention import CausalSelfAttention
from model.designs import Rope
from model.documents import Documents, positions
from model.gpt import KVCache

L0 = 16
GLOBAL_BASE = 50.0  # far from 10000, so that a layer on the wrong tables fails
W = 5


def gemma(nope_every: int = 2, **overrides) -> dict:
    return dict(attention="hybrid", design_params={"hybrid": {
        "nope_every": nope_every, "window": W, "global_layers": "origin", "global_rope_base": GLOBAL_BASE}},
        **overrides)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_global_layer_is_rope_at_its_own_base(arch, documents):
    """Layer 1 of 2 (global): softmax(rot_B(q_m) . rot_B(k_n) / sqrt(D)) over n <= m in the query's
    document, no window, B = global_rope_base; output and gradients at 1e-10."""
    cfg = ModelConfig(n_layer=2, ffn_hidden=64, max_seq_len=L0, doc_mask=documents, doc_positions=documents,
                      **gemma(), **ARCHS[arch])
    assert cfg.layer_design(1).rope_base == GLOBAL_BASE and cfg.layer_design(1).window == 0
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg, 1).double()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.4)
    B, T = 2, 40
    x = torch.randn(B, T, cfg.n_embd, dtype=F64, requires_grad=True)
    docs = torch.tensor([[0] * 13 + [1] * 27, [0] * 40]) if documents else torch.zeros(B, T, dtype=torch.long)
    pos = positions(docs) if documents else (1000 + torch.arange(T)).expand(B, T)
    cos, sin = Rope(cfg.rotary_dims, GLOBAL_BASE, L0, cfg.rope_scaling).tables(pos, T, F64)
    out = layer(x, (cos[:, None], sin[:, None]), documents=Documents(docs, documents) if documents else None)

    H, D = layer.n_head, layer.head_dim
    if layer.fused:
        q, k, v = (layer.qkv(x).view(B, T, H, 3, D)[:, :, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (layer.q, layer.k, layer.v))
        k, v = k.repeat_interleave(H // k.shape[1], dim=1), v.repeat_interleave(H // v.shape[1], dim=1)
    r = cfg.rotary_dims
    scores = rotate(q, pos[:, None], r, GLOBAL_BASE) @ rotate(k, pos[:, None], r, GLOBAL_BASE).mT / math.sqrt(D)
    m, n = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (n <= m) & (docs[:, None, :, None] == docs[:, None, None, :])
    want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    want = layer.proj(want.transpose(1, 2).reshape(B, T, cfg.n_embd))
    assert_same_with_gradients(out, want, [x, *layer.parameters()])


def gpt(**config) -> GPT:
    return random_gpt(L0, **{"n_layer": 3, **config})


IDX = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))


def test_every_layer_global_is_origin_at_that_base():
    """nope_every=1 makes every layer global RoPE at global_rope_base: the model is Origin at
    rope_base = that base (the same weights), and not Origin at the model's base, under each scaling."""
    for scaling in ("none", "dynamic", "yarn"):
        hybrid, at_base, plain = gpt(**gemma(1)), gpt(rope_base=GLOBAL_BASE), gpt()
        for model in (hybrid, at_base, plain):
            if scaling != "none":
                model.set_rope_scaling(scaling, 4.0)
        with torch.no_grad():
            torch.testing.assert_close(hybrid(IDX), at_base(IDX), rtol=1e-12, atol=1e-12)
            assert (hybrid(IDX) - plain(IDX)).abs().max() > 1e-3


def test_kv_cache_continues_the_full_forward():
    model = gpt(**gemma(3))
    cache = KVCache(model.cfg.n_layer)
    with torch.no_grad():
        full = model(IDX)
        steps = [model(IDX[:, :40], cache=cache)[:, -1]]
        steps += [model(IDX[:, t : t + 1], cache=cache)[:, -1] for t in range(40, 47)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 39:47], rtol=1e-10, atol=1e-10)


def test_settings_are_checked_in_one_line():
    with pytest.raises(ValueError, match=r"global_layers='rope' is not one of nope, origin"):
        ModelConfig(attention="hybrid", design_params={"hybrid": {"global_layers": "rope"}})
    with pytest.raises(ValueError, match=r"global_rope_base=1000000.0 needs global_layers=origin"):
        ModelConfig(attention="hybrid", design_params={"hybrid": {"global_rope_base": 1e6}})
    with pytest.raises(ValueError, match=r"global_rope_base=0.5 must be > 1"):
        ModelConfig(attention="hybrid", design_params={"hybrid": {"global_layers": "origin", "global_rope_base": 0.5}})
