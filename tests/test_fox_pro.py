"""FoX Pro (the Forgetting Transformer paper's "Pro" block, `model.design_params.fox.form=pro`) against
a float64 reference written from the paper's definition, one token at a time (not from
`model.designs.fox`): the layer's output and the gradients of its input and every parameter, with
GQA, under document masking, and over a KV cache (the shift reads the cached token); then the
settings around it: conversion, its refusals, the KV cache of a model."""

from __future__ import annotations

import math

import pytest
import torch
from float64_checks import ARCHS, F64, assert_same_with_gradients, random_gpt

from model import GPT, ModelConfig
from model.attention import CausalSelfAttention, LayerCache
from model.convert import ConversionError, convert
from model.documents import Documents
from model.gpt import KVCache

PRO = {"attention": "fox", "design_params": {"fox": {"form": "pro"}}}

pytestmark = pytest.mark.usefixtures("single_thread")


def pro_layer(arch: str, documents: bool = False) -> CausalSelfAttention:
    """A float64 FoX Pro layer with every parameter drawn from N(0, 0.5^2) (the norms' scales too)."""
    cfg = ModelConfig(n_layer=1, ffn_hidden=64, doc_mask=documents, **ARCHS[arch], **PRO)
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
    return layer


def rms_per_head(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """x [D] of head h normalised by its root mean square, times that head's scales [D]."""
    return x / torch.sqrt((x * x).mean() + eps) * scale


def reference(layer: CausalSelfAttention, x: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """The paper's Pro layer for token t of document docs[t] (a document's first token has no
    predecessor, nor does the row's):

        k'_t = a_t k_{t-1} + (1 - a_t) k_t,  a_t = sigmoid(w^k_g . x_t);  v'_t likewise (w^v_g)
        q''_t, k''_t = RMSNorm_h(q_t), RMSNorm_h(k'_t)            (per head, a scale per channel)
        s_tn = q''_t . k''_n / sqrt(D) + sum_{l=n+1..t} log sigmoid(w^f_h . x_l + b^f_h),  n <= t
        o_t = sum_n softmax_n(s_t) v'_n,  out_t = W_out (RMSNorm_h(o_t) * sigmoid(W_g x_t))
    """
    pro, bias = layer.pro, layer.score_bias
    B, T, C = x.shape
    H, D, G = layer.n_head, layer.head_dim, layer.kv_heads
    eps = pro.q_norm.eps
    if layer.fused:
        w, b = layer.qkv.weight.view(H, 3, D, C), layer.qkv.bias.view(H, 3, D)
        q, k, v = (torch.einsum("btc,hdc->bthd", x, w[:, i]) + b[None, None, :, i] for i in range(3))
    else:
        q, k, v = (torch.einsum("btc,hdc->bthd", x, p.weight.view(-1, D, C)) for p in (layer.q, layer.k, layer.v))
    out = []
    for bi in range(B):
        k2, v2 = [], []
        for t in range(T):
            has_prior = t > 0 and docs[bi, t] == docs[bi, t - 1]
            ks, vs = [], []
            for g in range(G):
                a = torch.sigmoid(pro.k_shift.weight[g] @ x[bi, t])
                c = torch.sigmoid(pro.v_shift.weight[g] @ x[bi, t])
                k_prior = k[bi, t - 1, g] if has_prior else torch.zeros(D, dtype=F64)
                v_prior = v[bi, t - 1, g] if has_prior else torch.zeros(D, dtype=F64)
                shifted = a * k_prior + (1 - a) * k[bi, t, g]
                ks.append(rms_per_head(shifted, pro.k_norm.weight[g * D:(g + 1) * D], eps))
                vs.append(c * v_prior + (1 - c) * v[bi, t, g])
            k2.append(ks)
            v2.append(vs)
        rows = []
        for t in range(T):
            heads = []
            for h in range(H):
                g = h // (H // G)
                qh = rms_per_head(q[bi, t, h], pro.q_norm.weight[h * D:(h + 1) * D], eps)
                keys = [n for n in range(t + 1) if docs[bi, n] == docs[bi, t]]
                scores = []
                for n in keys:
                    gap = sum((torch.nn.functional.logsigmoid(bias.gate.weight[h] @ x[bi, j] + bias.gate.bias[h])
                               for j in range(n + 1, t + 1)), torch.zeros((), dtype=F64))
                    scores.append(qh @ k2[n][g] / math.sqrt(D) + gap)
                p = torch.softmax(torch.stack(scores), dim=0)
                o = sum((p[i] * v2[n][g] for i, n in enumerate(keys)), torch.zeros(D, dtype=F64))
                gate = torch.sigmoid(pro.out_gate.weight[h * D:(h + 1) * D] @ x[bi, t])
                heads.append(rms_per_head(o, pro.out_norm.weight[h * D:(h + 1) * D], eps) * gate)
            rows.append(layer.proj(torch.cat(heads)))
        out.append(torch.stack(rows))
    return torch.stack(out)


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_output_and_gradients_match_the_definition(arch):
    layer = pro_layer(arch)
    x = torch.randn(2, 9, 32, dtype=F64, requires_grad=True)
    want = reference(layer, x, torch.zeros(2, 9, dtype=torch.long))
    assert_same_with_gradients(layer(x, None), want, [x, *layer.parameters()])


@pytest.mark.parametrize("arch", ARCHS)
def test_document_masking_gives_each_document_first_token_no_predecessor(arch):
    layer = pro_layer(arch, documents=True)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 3], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    x = torch.randn(2, 9, 32, dtype=F64, requires_grad=True)
    out = layer(x, None, documents=Documents(docs))
    assert_same_with_gradients(out, reference(layer, x, docs), [x, *layer.parameters()])


def test_kv_cache_continues_with_the_cached_token_as_predecessor():
    """5 tokens, then 3, then 1: each first new token's k and v shift toward the last cached one's."""
    layer = pro_layer("llama")
    x = torch.randn(1, 9, 32, dtype=F64)
    cache = LayerCache()
    with torch.no_grad():
        parts = [layer(x[:, a:b], None, cache) for a, b in ((0, 5), (5, 8), (8, 9))]
        want = reference(layer, x, torch.zeros(1, 9, dtype=torch.long))
    torch.testing.assert_close(torch.cat(parts, dim=1), want, rtol=1e-10, atol=1e-10)


def test_the_parts_start_as_the_paper_code_starts_them():
    """Norm scales 1; the shifts' and the gate's linears drawn as the model's (no biases)."""
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, **PRO))
    pro = model.h[0].attn.pro
    for norm in (pro.q_norm, pro.k_norm, pro.out_norm):
        assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    for linear in (pro.k_shift, pro.v_shift, pro.out_gate):
        spread = float(linear.weight.detach().std())
        assert linear.bias is None and 0.5 * model.cfg.init_std < spread < 2 * model.cfg.init_std


def test_a_model_generates_over_its_cache_as_full_forwards():
    model = random_gpt(16, **PRO)
    idx = torch.randint(0, 64, (2, 11))
    cache = KVCache(model.cfg.n_layer)
    with torch.no_grad():
        steps = [model.hidden_states(idx[:, :6], cache)] + [model.hidden_states(idx[:, t:t + 1], cache)
                                                           for t in range(6, 11)]
        full = model.hidden_states(idx)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_conversion_from_origin_and_from_basic_fox_adds_fresh_parts():
    pro = ModelConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, **PRO)
    origin = ModelConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, attention="origin")
    basic = ModelConfig(n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, attention="fox")
    for source in (origin, basic):
        state = GPT(source).state_dict()
        out, done = convert(state, source, pro)
        assert all(torch.equal(out[name], state[name]) for name in state if "score_bias" not in name)
        assert {f"h.{i}.attn.pro.{part}" for i in range(2) for part in ("k_shift.weight", "out_gate.weight")} <= \
            set(done.fresh)
        model = GPT(pro)
        model.load_state_dict(out)  # strict: every tensor of the Pro model is there
    with pytest.raises(ConversionError, match="does not drop learned parameters"):
        convert(GPT(pro).state_dict(), pro, basic)


def test_qk_norm_beside_the_pro_block_is_refused():
    with pytest.raises(ValueError, match="normalises q and k per head itself"):
        ModelConfig(qk_norm=True, **PRO)
    with pytest.raises(ValueError, match="model.design_params.fox.form='plus' is not one of basic, pro"):
        ModelConfig(attention="fox", design_params={"fox": {"form": "plus"}})
