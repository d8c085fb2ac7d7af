"""Each attention variant against an independent float64 reference of its definition.

The references build what the papers define, the slow way: explicit rotation matrices, the CoCA key
k = q_m * t_n materialised for every (m, n), the released code's three-way contraction, an explicit
ALiBi bias and a plain softmax. The model's fast forms must agree with them.
"""

import math

import pytest
import torch

import model.bias_attention as attention_module
from model import ModelConfig, RopeScaling
from model.attention import CausalSelfAttention, causal_attention
from model.bias_attention import BIAS_CHUNK, LayerBias
from model.designs import DESIGNS, Rope
from model.designs.alibi import AlibiBias, alibi_slopes

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")


# ---- references ----------------------------------------------------------------------------------


def rotations(positions: torch.Tensor, d: int, r: int, base: float = 10000.0) -> torch.Tensor:
    """[T, d, d] rotation matrices: pair (j, j + r/2) turns by p * base^(-2j/r); dims >= r fixed."""
    mats = torch.eye(d, dtype=F64).repeat(len(positions), 1, 1)
    for i, p in enumerate(positions.tolist()):
        for j in range(r // 2):
            a = p * base ** (-2 * j / r)
            c, s = math.cos(a), math.sin(a)
            mats[i, j, j], mats[i, j, j + r // 2] = c, -s
            mats[i, j + r // 2, j], mats[i, j + r // 2, j + r // 2] = s, c
    return mats


def tie_reference(t: torch.Tensor, r: int) -> torch.Tensor:
    out = t.clone()
    for j in range(r // 2):
        avg = ((t[..., j] + t[..., j + r // 2]) / 2).clamp(min=0)
        out[..., j], out[..., j + r // 2] = avg, avg
    out[..., r:] = t[..., r:].clamp(min=0)
    return out


def reference_scores(kind: str, q, k, positions, r: int) -> torch.Tensor:
    """Unmasked scores [B, H, T, T] of one definition (scaled by 1/sqrt(d); ALiBi bias included)."""
    d = q.shape[-1]
    rot = rotations(positions, d, r)
    rq = torch.einsum("tij,bhtj->bhti", rot, q)  # rope(q_m, m)
    if kind == "origin":
        scores = torch.einsum("bhmi,bhni->bhmn", rq, torch.einsum("tij,bhtj->bhti", rot, k))
    elif kind == "strict":  # k = q_m * t_n for every (m, n), then plain RoPE attention
        t = tie_reference(k, r)
        key = q[:, :, :, None, :] * t[:, :, None, :, :]  # [B, H, m, n, d]
        scores = torch.einsum("bhmi,bhmni->bhmn", rq, torch.einsum("nij,bhmnj->bhmni", rot, key))
    elif kind == "slack":  # the released code: contract('bpnd,bpsd,bpnd->bpns', q, rope(t), rope(q))
        rt = torch.einsum("tij,bhtj->bhti", rot, tie_reference(k, r))
        scores = torch.einsum("bhnd,bhsd,bhnd->bhns", q, rt, rq)
    elif kind == "alibi":
        h = q.shape[1]
        slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], dtype=F64)
        dist = (positions[:, None] - positions[None, :]).to(F64)
        return q @ k.transpose(-1, -2) / math.sqrt(d) - slopes[:, None, None] * dist
    return scores / math.sqrt(d)


def reference_attention(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


# ---- helpers -------------------------------------------------------------------------------------

DESIGN_OF = {"origin": "origin", "slack": "coca", "strict": "coca_strict"}  # reference kind -> registry key


def model_scores(kind: str, q, k, positions, r: int) -> torch.Tensor:
    """The model's q_eff . k_eff / sqrt(d) at arbitrary positions."""
    rope = Rope(r, 10000.0, 64, RopeScaling())
    tables = rope.tables(positions, int(positions.max()) + 1, F64)
    q_eff, k_eff = DESIGNS[DESIGN_OF[kind]].qk(q, k, tables)
    return q_eff @ k_eff.transpose(-1, -2) / math.sqrt(q.shape[-1])


def random_qk(b=2, h=3, t=9, d=8, seed=0):
    """Non-contiguous [B, H, T, D] views, as the model produces them from [B, T, H, D]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, dtype=F64, generator=g).transpose(1, 2)
    k = torch.randn(b, t, h, d, dtype=F64, generator=g).transpose(1, 2)
    assert not q.is_contiguous()
    return q, k


def random_positions(t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(3000, generator=g)[:t].sort().values + 1000  # offset, non-contiguous


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["origin", "slack", "strict"])
@pytest.mark.parametrize("d, r", [(8, 8), (12, 8), (16, 4)])
def test_transform_matches_definition(kind, d, r):
    q, k = random_qk(d=d)
    positions = random_positions(q.shape[2])
    expected = reference_scores(kind, q, k, positions, r)
    torch.testing.assert_close(model_scores(kind, q, k, positions, r), expected, rtol=1e-10, atol=1e-10)


def test_strict_is_relative_and_slack_is_not():
    q, k = random_qk(d=8)
    positions = random_positions(q.shape[2])
    for kind in ("strict", "slack"):
        before = model_scores(kind, q, k, positions, 8)
        after = model_scores(kind, q, k, positions + 777, 8)
        if kind == "strict":
            torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)
        else:
            assert (after - before).abs().max() > 1e-2


@pytest.mark.parametrize("heads, expected", [
    (8, [2.0 ** -i for i in range(1, 9)]),
    (16, [2.0 ** (-i / 2) for i in range(1, 17)]),
    # 12 heads: the 8-head sequence, then every other slope of the 16-head one (paper's rule).
    (12, [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]),
])
def test_alibi_slopes(heads, expected):
    torch.testing.assert_close(alibi_slopes(heads), torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)


def per_query_head(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """kv heads [B, Hkv, T, D] as [B, n_head, T, D] by Llama's rule: query head h reads kv head h // group."""
    group = n_head // x.shape[1]
    return x[:, [h // group for h in range(n_head)]]


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("tq, tk", [(BIAS_CHUNK + 37, BIAS_CHUNK + 37), (5, 40), (1, 33)])
def test_alibi_kernel_matches_explicit_bias(tq, tk, kv_heads, monkeypatch):
    """The chunked additive-bias path (CPU training, short inputs, KV-cache steps), gradients too;
    with fewer kv heads than query heads (GQA, MQA) too; the backward's earlier keys in blocks of 50."""
    monkeypatch.setattr(attention_module, "BACKWARD_KEYS", 50)
    b, h, d = 1, 4, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, heads, t, d, dtype=F64, generator=g, requires_grad=True)
               for heads, t in ((h, tq), (kv_heads, tk), (kv_heads, tk)))
    out = causal_attention(q, k, v, LayerBias(AlibiBias(h)))
    positions = torch.arange(tk)
    full_q = torch.cat((torch.zeros(b, h, tk - tq, d, dtype=F64), q), dim=2)
    scores = reference_scores("alibi", full_q, per_query_head(k, h), positions, 0)
    expected = reference_attention(scores, per_query_head(v, h))[:, :, tk - tq :]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    weights = torch.randn(out.shape, dtype=F64, generator=g)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", ["origin", "slack", "strict", "alibi"])
@pytest.mark.parametrize("rotary_pct", [1.0, 0.5])
def test_attention_layer_matches_reference(kind, rotary_pct):
    """The whole layer (fused qkv layout, transform, SDPA kernel, output projection) in float64."""
    attention = "coca" if kind in ("slack", "strict") else kind
    cfg = ModelConfig(n_head=2, n_embd=16, attention=attention,
                      design_params={"coca": {"form": kind}} if attention == "coca" else {},
                      rotary_pct=rotary_pct)
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    b, t, h, d = 2, 11, cfg.n_head, cfg.head_dim
    x = torch.randn(b, t, cfg.n_embd, dtype=F64)
    positions = torch.arange(t)
    rope = None
    if cfg.design.rope:
        rope = Rope(cfg.rotary_dims, cfg.rope_base, cfg.max_seq_len, cfg.rope_scaling).tables(positions, t, F64)
    out = layer(x, rope)

    w = layer.qkv.weight.view(h, 3, d, cfg.n_embd)
    bias = layer.qkv.bias.view(h, 3, d)
    q, k, v = (torch.einsum("btc,hdc->bhtd", x, w[:, i]) + bias[None, :, i, None, :] for i in range(3))
    scores = reference_scores(kind, q, k, positions, cfg.rotary_dims)
    y = reference_attention(scores, v).transpose(1, 2).reshape(b, t, cfg.n_embd)
    torch.testing.assert_close(out, layer.proj(y), rtol=1e-10, atol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_alibi_matches_chunked_path_and_cpu_evaluation_does_not_use_it(monkeypatch, kv_heads):
    """The GPU kernel (compiled FlexAttention, ~30 s compile; run here on CPU) gives the chunked
    path's result (with GQA too); long no-grad inputs on CPU take the fused kernel, not FlexAttention."""
    import model.bias_attention as attention

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, heads, 1024, 16, generator=g) for heads in (4, kv_heads, kv_heads))
    with torch.no_grad():
        chunked = attention._chunked_bias(q, k, v, LayerBias(AlibiBias(4)))
        flex = attention._flex_bias(q, k, v, LayerBias(AlibiBias(4)))
        monkeypatch.setattr(attention, "_flex_bias", None)  # CPU must not reach it
        monkeypatch.setattr(attention, "_chunked_bias", None)  # nor the exact path, in fp32
        fused = causal_attention(q, k, v, LayerBias(AlibiBias(4)))
    assert torch.isfinite(flex).all()
    torch.testing.assert_close(flex, chunked, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused, chunked, rtol=1e-4, atol=1e-5)
