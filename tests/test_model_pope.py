"""PoPE (Gopalakrishnan et al. 2025) against a float64 reference written from the paper's definition
(not from `model.designs.pope`): the layer's output and the gradients of its input and weights at
shifted positions, with grouped-query attention, partial rotary, document masking and the softmax
modifiers; then the phase's independence of content, the KV cache, checkpointing, conversion."""

from __future__ import annotations

import math

import pytest
import torch
from float64_checks import ARCHS, F64, assert_same_with_gradients, random_gpt

from model import GPT, ModelConfig
from model.attention import CausalSelfAttention
from model.convert import convert
from model.designs import Rope
from model.documents import Documents, positions
from model.gpt import KVCache

BASE = 10000.0
L0 = 16
MODIFIERS = {"plain": {}, "sinks+ssmax": dict(sinks=True, ssmax=True),
             "phase-bias": dict(design_params={"pope": {"phase_bias": True}})}


def reference_output(layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor, docs: torch.Tensor,
                     r: int) -> torch.Tensor:
    """Per head h and pair (m, n) allowed (n <= m, one document), with theta_c = base^(-c / r):

        a(m, n) = sum_{c < r} softplus(q_mc) softplus(k_nc) cos((pos_m - pos_n) theta_c - delta_hc)
                  + sum_{d >= r} q_md k_nd,                      z = a / sqrt(D),

    delta the layer's phase bias clamped to [-2 pi, 0] where it has one (else 0),

    then SSMax's s_h log N_m (N_m the allowed keys) and the sink's exp(a_h) in the denominator
    where the layer has them; out_m = sum_n p_mn v_n, the layer's projections around."""
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    if layer.fused:
        q, k, v = (layer.qkv(x).view(B, T, H, 3, D)[:, :, :, i].transpose(1, 2) for i in range(3))
    else:
        q, k, v = (p(x).view(B, T, -1, D).transpose(1, 2) for p in (layer.q, layer.k, layer.v))
        group = H // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    sp = torch.nn.functional.softplus
    distance = (pos[:, :, None] - pos[:, None, :]).to(F64)[:, None]  # [B, 1, T, T]
    a = torch.zeros(B, H, T, T, dtype=F64)
    delta = torch.zeros(H, r, dtype=F64)
    if layer.qk_transform is not None:
        delta = layer.qk_transform.delta.clamp(-2 * math.pi, 0.0)
    for c in range(r):
        theta = BASE ** (-c / r)
        phase = distance * theta - delta[:, c, None, None]
        a = a + sp(q[..., c])[..., :, None] * sp(k[..., c])[..., None, :] * torch.cos(phase)
    a = a + q[..., r:] @ k[..., r:].transpose(-1, -2)
    z = a / math.sqrt(D)
    m, n = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (n <= m) & (docs[:, None, :, None] == docs[:, None, None, :])
    if layer.ssmax is not None:
        z = z * layer.ssmax[:, None, None] * torch.log(allowed.sum(-1, keepdim=True).to(F64))
    e = torch.where(allowed, torch.exp(z), torch.zeros((), dtype=F64))
    denominator = e.sum(-1, keepdim=True)
    if layer.sinks is not None:
        denominator = denominator + torch.exp(layer.sinks)[:, None, None]
    y = (e / denominator) @ v
    return layer.proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("modifiers", MODIFIERS)
def test_layer_output_and_gradients_match_the_definition(modifiers, arch, documents):
    """Positions from 1000 (or restarting at each document under doc_positions), 40 tokens."""
    cfg = ModelConfig(n_layer=2, ffn_hidden=64, max_seq_len=L0, attention="pope", doc_mask=documents,
                      doc_positions=documents, **MODIFIERS[modifiers], **ARCHS[arch])
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).double()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.4)
    B, T = 2, 40
    x = torch.randn(B, T, cfg.n_embd, dtype=F64, requires_grad=True)
    docs = (torch.tensor([[0] * 13 + [1] * 20 + [2, 3, 4] + [5] * 4, [0] * 40]) if documents
            else torch.zeros(B, T, dtype=torch.long))
    pos = positions(docs) if documents else (1000 + torch.arange(T)).expand(B, T)
    assert cfg.rope_width() == 2 * cfg.rotary_dims
    cos, sin = Rope(cfg.rope_width(), BASE, L0, cfg.rope_scaling).tables(pos, T, F64)
    out = layer(x, (cos[:, None], sin[:, None]), documents=Documents(docs, documents) if documents else None,
                key_counts=positions(docs) + 1)
    want = reference_output(layer, x, pos, docs, cfg.rotary_dims)
    assert_same_with_gradients(out, want, [x, *layer.parameters()])


def test_phase_is_the_positions_alone():
    """q_eff . k_eff / sqrt(D) of one component pair is softplus(q) softplus(k) cos((m - n) theta) / sqrt(D):
    shifting both positions by the same amount leaves every score as it is, and flipping the sign
    of q's content changes its magnitude only, never the phase (RoPE would turn it by pi)."""
    from model.designs.pope import pope_qk

    D, r = 8, 8
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 5, D, generator=g, dtype=F64), torch.randn(1, 1, 5, D, generator=g, dtype=F64)
    rope = Rope(2 * r, BASE, L0, ModelConfig().rope_scaling)

    def scores(q, shift):
        q_eff, k_eff = pope_qk(q, k, rope.tables(torch.arange(5) + shift, 5, F64))
        return q_eff @ k_eff.mT / math.sqrt(q_eff.shape[-1])

    torch.testing.assert_close(scores(q, 0), scores(q, 777), rtol=1e-9, atol=1e-9)
    assert bool((scores(-q, 0).diagonal(dim1=-2, dim2=-1) > 0).all())  # cos(0) with non-negative magnitudes


def gpt(attention: str = "pope", **overrides) -> GPT:
    return random_gpt(L0, **{"n_head": 4, **overrides}, attention=attention)


IDX = torch.randint(0, 64, (2, 48), generator=torch.Generator().manual_seed(1))
LLAMA = dict(arch="llama", parallel_residual=False, n_kv_head=2)


@pytest.mark.parametrize("modifiers", MODIFIERS)
def test_kv_cache_continues_the_full_forward(modifiers):
    model = gpt(**LLAMA, **MODIFIERS[modifiers])
    cache = KVCache(model.cfg.n_layer)
    with torch.no_grad():
        full = model(IDX)
        steps = [model(IDX[:, :40], cache=cache)[:, -1]]
        steps += [model(IDX[:, t : t + 1], cache=cache)[:, -1] for t in range(40, 47)]
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 39:47], rtol=1e-10, atol=1e-10)


def test_activation_checkpointing_gives_the_same_gradients():
    grads = []
    for remat in (False, True):
        model = gpt(**LLAMA, activation_checkpointing=remat).train()
        model(IDX, targets=IDX).backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_phase_bias_starts_at_zero_and_converts_from_origin_as_zero():
    """The phase bias starts at 0 (plain PoPE's scores); an Origin model converts into PoPE with it,
    every tensor carried and the offsets drawn as a new model's (zeros)."""
    with_bias = gpt(design_params={"pope": {"phase_bias": True}})
    assert [n for n, _ in with_bias.named_parameters() if "qk_transform" in n] == [
        "h.0.attn.qk_transform.delta", "h.1.attn.qk_transform.delta"]
    source = gpt("origin")
    target_cfg = ModelConfig(**{**source.cfg.__dict__, "attention": "pope",
                                "design_params": {"pope": {"phase_bias": True}}})
    state, done = convert(source.state_dict(), source.cfg, target_cfg)
    assert done.fresh == ["h.0.attn.qk_transform.delta", "h.1.attn.qk_transform.delta"]
    assert all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    assert not state["h.0.attn.qk_transform.delta"].any()
    plain = GPT(ModelConfig(**{**source.cfg.__dict__, "attention": "pope"})).double()
    biased = GPT(target_cfg).double()
    plain.load_state_dict(source.state_dict())
    biased.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(biased(IDX), plain(IDX), rtol=1e-12, atol=1e-12)


def test_an_origin_model_converts_keeping_every_tensor():
    source = gpt("origin")
    target_cfg = ModelConfig(**{**source.cfg.__dict__, "attention": "pope"})
    state, done = convert(source.state_dict(), source.cfg, target_cfg)
    assert done.fresh == [] and all(torch.equal(state[k], v) for k, v in source.state_dict().items())
    GPT(target_cfg).double().load_state_dict(state)
