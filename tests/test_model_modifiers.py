"""The modifiers any design takes: attention sinks (`model.sinks`), scalable softmax (`model.ssmax`)
and RMSNorm of q and k (`model.qk_norm`), each against a float64 reference written from its definition (not from
`model.designs`): the layer's output and the gradients of its input and every weight, on a RoPE
design, a score-bias design of each kernel (ALiBi, KERPLE, FoX: FoX's gates get a gradient
through each row's sink too) and a windowed one, with grouped-query attention and document
masking; then the sink's probability mass and SSMax's scale against their formulas, the KV
cache, activation checkpointing and conversion from Origin."""

from __future__ import annotations

import math

import pytest
import torch
from float64_checks import ARCHS, F64, assert_same_with_gradients, random_gpt, rotate

import model.sink_attention as sink_module
from model import GPT, ModelConfig
from model.attention import CausalSelfAttention
from model.convert import convert
from model.designs import Rope
from model.designs.ssmax import ssmax_scale
from model.documents import Documents, positions

BASE = 10000.0
L0 = 16
W = 5
DESIGNS = {  # (attention, design_params, layer index): the hybrid's layer 0 of 2 is windowed RoPE
    "origin": ("origin", {}, 0),
    "alibi": ("alibi", {}, 0),
    "kerple": ("kerple", {}, 0),
    "fox": ("fox", {}, 0),
    "hybrid-window": ("hybrid", {"hybrid": {"nope_every": 2, "window": W}}, 0),
}
MODIFIERS = {"sinks": dict(sinks=True), "ssmax": dict(ssmax=True), "both": dict(sinks=True, ssmax=True),
             "qk_norm": dict(qk_norm=True), "all": dict(sinks=True, ssmax=True, qk_norm=True)}
# each modifier's parameters under a layer's attention
PARAMETERS = {"sinks": ["sinks"], "ssmax": ["ssmax"], "qk_norm": ["q_norm.weight", "k_norm.weight"]}


# ---- the definitions, in float64 ------------------------------------------------------------------


def alibi_slopes(h: int) -> torch.Tensor:
    """Press et al.'s slopes for H a power of 2: 2^(-8 (i + 1) / H)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=F64)


def rms_across_heads(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, h, T, D] normalised per token over all h * D channels c: x_c / sqrt(mean_c' x_c'^2 + eps) * g_c,
    channel c = head * D + d."""
    B, h, T, D = x.shape
    flat = x.transpose(1, 2).reshape(B, T, h * D)
    flat = flat / torch.sqrt((flat**2).mean(-1, keepdim=True) + eps) * g
    return flat.reshape(B, T, h, D).transpose(1, 2)


def reference_output(layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor,
                     attention: str) -> torch.Tensor:
    """The layer's projections around (QK-norm: q and k, each over all its heads, normalised before
    RoPE), per head h and query m over its allowed keys n (n <= m, the same document, m - n < W in
    the windowed layer), N_m of them:

        z_mn = c_hm q_m . k_n / sqrt(D) + b_h(m, n),  c_hm = s_h log N_m (SSMax) or 1,
        p_mn = exp(z_mn) / (exp(a_h) + sum_n' exp(z_mn')) (sinks; else without exp(a_h)),
        out_m = sum_n p_mn v_n.
    """
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    if layer.fused:
        q, k, v = (layer.qkv(x).view(B, T, H, 3, D)[:, :, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (layer.q, layer.k, layer.v))
    if layer.q_norm is not None:  # k over its kv heads, before they are shared
        q = rms_across_heads(q, layer.q_norm.weight, layer.q_norm.eps)
        k = rms_across_heads(k, layer.k_norm.weight, layer.k_norm.eps)
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if attention in ("origin", "hybrid"):
        r = int(D * (0.5 if layer.fused else 1.0))
        q, k = rotate(q, pos[:, None], r), rotate(k, pos[:, None], r)
    m, n = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (n <= m) & (docs[:, None, :, None] == docs[:, None, None, :])
    if attention == "hybrid":
        allowed = allowed & (m - n < W)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    if layer.ssmax is not None:
        count = allowed.sum(-1, keepdim=True).to(F64)  # [B, 1, T, 1]
        scores = scores * layer.ssmax[:, None, None] * torch.log(count)
    distance = (m - n).clamp(min=0).to(F64)
    if attention == "alibi":
        scores = scores - alibi_slopes(H)[:, None, None] * distance
    if attention == "kerple":  # -r1_h log(1 + r2_h (m - n))
        r1, r2 = layer.score_bias.r1[:, None, None], layer.score_bias.r2[:, None, None]
        scores = scores - r1 * torch.log1p(r2 * distance)
    if attention == "fox":  # sum_{l = n+1..m} log sigmoid(w_h . x_l + b_h) = F_m - F_n
        gate = layer.score_bias.gate
        f = torch.nn.functional.logsigmoid(x @ gate.weight.T + gate.bias).transpose(1, 2).cumsum(-1)  # [B, H, T]
        scores = scores + f[..., :, None] - f[..., None, :]
    e = torch.where(allowed, torch.exp(scores), torch.zeros((), dtype=F64))
    denominator = e.sum(-1, keepdim=True)
    if layer.sinks is not None:
        denominator = denominator + torch.exp(layer.sinks)[:, None, None]
    y = (e / denominator) @ v
    return layer.proj(y.transpose(1, 2).reshape(B, T, C))


# ---- the layer against the definitions --------------------------------------------------------------


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("modifiers", MODIFIERS)
def test_layer_output_and_gradients_match_the_definition(modifiers, design, arch, documents, monkeypatch):
    """RoPE positions from 1000 (or restarting at each document, doc_positions); 40 tokens in query
    chunks of 7 on the explicit path, so its chunks and window ranges are exercised; under
    documents a run of one-token documents too."""
    monkeypatch.setattr(sink_module, "ROWS", 7)
    attention, params, index = DESIGNS[design]
    cfg = ModelConfig(n_layer=2, ffn_hidden=64, max_seq_len=L0, attention=attention, design_params=params,
                      doc_mask=documents, doc_positions=documents, **MODIFIERS[modifiers], **ARCHS[arch])
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg, index).double()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.4)
    if attention == "kerple":  # in the range where its clamp at 0.01 does not act
        with torch.no_grad():
            layer.score_bias.r1.uniform_(0.2, 2.0)
            layer.score_bias.r2.uniform_(0.2, 1.0)
    B, T = 2, 40
    x = torch.randn(B, T, cfg.n_embd, dtype=F64, requires_grad=True)
    docs = (torch.tensor([[0] * 13 + [1] * 20 + [2, 3, 4] + [5] * 4, [0] * 40]) if documents
            else torch.zeros(B, T, dtype=torch.long))
    pos = positions(docs) if documents else (1000 + torch.arange(T)).expand(B, T)
    cos, sin = Rope(cfg.rotary_dims, BASE, L0, cfg.rope_scaling).tables(pos, T, F64)
    counts = positions(docs) + 1  # the keys each query attends to (within its document), as GPT passes them
    out = layer(x, (cos[:, None], sin[:, None]), documents=Documents(docs, documents) if documents else None,
                key_counts=counts)
    want = reference_output(layer, x, pos, docs, attention)
    assert_same_with_gradients(out, want, [x, *layer.parameters()])


@pytest.mark.parametrize("design", ["origin", "alibi"])
def test_kv_cache_continues_the_full_forward(design):
    """Logits of a 40-token prompt then 8 tokens one at a time over the cache (queries at 40..47,
    SSMax's n = 41..48) equal the full forward's: the explicit path on KV-cache steps, and n counted
    over the cache."""
    model = gpt(design, n_kv_head=2, arch="llama", parallel_residual=False, n_head=4, sinks=True, ssmax=True)
    idx = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(2))
    from model.gpt import KVCache

    cache = KVCache(model.cfg.n_layer)
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :40], cache=cache)[:, -1]]
        steps += [model(idx[:, t : t + 1], cache=cache)[:, -1] for t in range(40, 47)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 39:47], rtol=1e-10, atol=1e-10)


# ---- the sink's mass and SSMax's scale ---------------------------------------------------------------


@pytest.mark.parametrize("rows", [1000, 7])
def test_sink_mass_is_exp_a_over_n_plus_exp_a(rows, monkeypatch):
    """With every score 0 and every value 1, query m's output is its keys' probability mass,
    (m + 1) / (m + 1 + exp(a_h)) (the sink's is the rest), on the fused and the explicit path."""
    monkeypatch.setattr(sink_module, "ROWS", rows)
    T, sinks = 300, torch.tensor([-2.0, 0.0, 3.5], dtype=F64)
    q = torch.zeros(1, 3, T, 8, dtype=F64)
    v = torch.ones(1, 3, T, 8, dtype=F64)
    window = 0 if rows == 1000 else 50  # the explicit path: a window of 50 keys
    out = sink_module.sink_attention(q, q, v, sinks, window=window)
    n = torch.arange(1, T + 1, dtype=F64).clamp(max=window or T)
    want = n / (n + torch.exp(sinks)[:, None])
    torch.testing.assert_close(out[0, :, :, 0], want, rtol=1e-13, atol=0)


def test_ssmax_scales_q_by_s_log_n_within_documents_and_windows():
    """The scale is s_h log(n) with n the keys attended: the query's position within its document
    + 1, capped at the window; q_eff of a model with SSMax over q_eff of the same weights without it
    is that scale (capture_qk, 48 tokens past L0 = 16)."""
    s = torch.tensor([0.3, -1.2], dtype=F64)
    counts = torch.tensor([[1, 2, 3, 1, 2, 9]])
    got = ssmax_scale(s, counts, window=4)
    want = torch.tensor([[[math.log(min(c, 4)) * h for c in counts[0].tolist()] for h in s.tolist()]], dtype=F64)
    torch.testing.assert_close(got[..., 0], want, rtol=1e-15, atol=0)
    hybrid = {"hybrid": {"nope_every": 2, "window": W}}
    for attention, params, cap in (("origin", {}, IDX.shape[1]), ("hybrid", hybrid, W)):
        plain = gpt(attention, design_params=params)
        scaled = gpt(attention, design_params=params, ssmax=True)
        scaled.load_state_dict({**plain.state_dict(), **{k: v for k, v in scaled.state_dict().items() if "ssmax" in k}})
        a, b = plain.capture_qk(IDX)[0], scaled.capture_qk(IDX)[0]  # layer 0: the same input in both
        n = torch.arange(1, IDX.shape[1] + 1, dtype=F64).clamp(max=cap)
        ratio = scaled.h[0].attn.ssmax[:, None] * torch.log(n)
        torch.testing.assert_close(b.q_eff, a.q_eff * ratio[None, :, :, None], rtol=1e-12, atol=1e-12)


def test_ssmax_starts_at_one_over_log_l0_and_sinks_as_gpt_oss():
    """s_h = 1 / log(L0) (scale 1 at n = L0); sinks drawn N(0, init_std) as gpt-oss's."""
    cfg = ModelConfig(n_head=64, n_embd=256, max_seq_len=512, sinks=True, ssmax=True, init_std=0.5)
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg)
    assert torch.equal(layer.ssmax, torch.full((64,), 1 / math.log(512)))
    sinks = layer.sinks.detach()
    assert 0.3 < float(sinks.std()) < 0.7 and abs(float(sinks.mean())) < 0.2


# ---- the model around them ---------------------------------------------------------------------------


def gpt(attention: str = "origin", **overrides) -> GPT:
    return random_gpt(L0, attention=attention, **overrides)


IDX = torch.randint(0, 64, (2, 3 * L0), generator=torch.Generator().manual_seed(1))


def test_document_masking_counts_keys_within_each_document_without_doc_positions():
    """NoPE with both modifiers under doc_mask (positions not restarting): a packed row's logits
    are each document's alone, so SSMax's n restarts at every document whatever the positions."""
    model = gpt("nope", sinks=True, ssmax=True, doc_mask=True)
    row = IDX[:1]
    docs = torch.tensor([[0] * 10 + [1] * 25 + [2] * 13])
    with torch.no_grad():
        packed = model(row, documents=docs)
        alone = torch.cat([model(row[:, a:b]) for a, b in ((0, 10), (10, 35), (35, 48))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)


def test_capture_qk_carries_each_layers_sinks_for_the_attention_statistics():
    model = gpt("origin", sinks=True)
    for layer, captured in zip(model.h, model.capture_qk(IDX)):
        assert torch.equal(captured.sinks, layer.attn.sinks.detach())
    assert all(c.sinks is None for c in gpt("origin").capture_qk(IDX))


@pytest.mark.parametrize("attention, settings", [
    ("origin", dict(qk_norm=True)), ("fox", dict(qk_norm=True)), ("fox", dict(design_params={"fox": {"form": "pro"}}))])
def test_activation_checkpointing_gives_the_same_gradients(attention, settings):
    """With the whole block recomputed, QK-norm and FoX Pro skip their own recomputation: same gradients."""
    grads = []
    for remat in (False, True):
        model = gpt(attention, sinks=True, ssmax=True, activation_checkpointing=remat, **settings).train()
        assert model.h[0].attn.recompute != remat
        model(IDX, targets=IDX).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("modifiers", MODIFIERS)
def test_origin_converts_with_the_modifiers_drawn_afresh(modifiers):
    """Every tensor of an Origin model carries; the modifiers' parameters start as a new model's."""
    source = gpt("origin")
    target_cfg = ModelConfig(**{**source.cfg.__dict__, **MODIFIERS[modifiers]})
    state, done = convert(source.state_dict(), source.cfg, target_cfg, seed=3)
    assert all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    new = {k for k in state if k not in source.state_dict()}
    names = [name for modifier in MODIFIERS[modifiers] for name in PARAMETERS[modifier]]
    assert new == set(done.fresh) and new == {f"h.{i}.attn.{name}" for i in range(2) for name in names}
    if "ssmax" in MODIFIERS[modifiers]:
        assert torch.equal(state["h.0.attn.ssmax"], torch.full((2,), 1 / math.log(L0)))
    if "qk_norm" in MODIFIERS[modifiers]:  # scale 1: q and k only normalised (n_head = n_kv_head = 2, D = 16)
        for name in PARAMETERS["qk_norm"]:
            assert all(torch.equal(state[f"h.{i}.attn.{name}"], torch.ones(32, dtype=F64)) for i in range(2))
    GPT(target_cfg).double().load_state_dict(state)


@pytest.mark.parametrize("modifier", ["sinks", "qk_norm"])
def test_a_model_with_modifiers_does_not_convert_to_one_without(modifier):
    from model.convert import ConversionError

    source = gpt("origin", **{modifier: True})
    with pytest.raises(ConversionError, match=f"model.{modifier}"):
        convert(source.state_dict(), source.cfg, ModelConfig(**{**source.cfg.__dict__, modifier: False}))


def test_origin_converts_to_nope_with_qk_norm_keeping_every_tensor():
    """DroPE's start (`experiment=drope`): Origin -> NoPE + QK-norm keeps every tensor bitwise and
    adds only the norms' scales, at 1; with llama's grouped-query attention k's norm spans its kv heads."""
    source = gpt("origin", arch="llama", parallel_residual=False, n_head=4, n_kv_head=2)
    target = ModelConfig(**{**source.cfg.__dict__, "attention": "nope", "qk_norm": True})
    state, done = convert(source.state_dict(), source.cfg, target, seed=3)
    assert all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    assert set(done.fresh) == {f"h.{i}.attn.{n}" for i in range(2) for n in PARAMETERS["qk_norm"]}
    assert state["h.0.attn.q_norm.weight"].shape == (32,) and state["h.0.attn.k_norm.weight"].shape == (16,)
    GPT(target).double().load_state_dict(state)


@pytest.mark.parametrize("attention", ["coca", "pope", "stick_breaking", "fire"])
def test_qk_norm_runs_under_every_kind_of_design(attention):
    """QK-norm acts on the projections' outputs before any design's q/k transform, so every design
    takes it: CoCA (its T normalised as k), PoPE (before its magnitudes), stick-breaking (no softmax:
    its logits are q . k too) and a score-bias design (FIRE)."""
    model = gpt(attention, qk_norm=True)
    with torch.no_grad():
        logits = model(IDX[:, :20])
    assert torch.isfinite(logits).all() and logits.shape == (2, 20, 64)
