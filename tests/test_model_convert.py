"""model.convert: an Origin model's weights carried into CoCA (slack, strict) or ALiBi."""

import re

import pytest
import torch

from model import GPT, ModelConfig
from model.convert import ConversionError, convert

pytestmark = pytest.mark.usefixtures("single_thread")

ARCHS = {
    "neox": dict(arch="neox"),
    "llama": dict(arch="llama", n_kv_head=2, parallel_residual=False, tie_embeddings=True),
}


def config(arch: str, attention: str = "origin", coca_form: str = "slack", t_init: str = "from_k",
           **extra) -> ModelConfig:
    shape = dict(vocab_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, max_seq_len=32)
    return ModelConfig(**{**shape, **ARCHS[arch], **extra}, attention=attention,
                       design_params={"coca": {"form": coca_form, "t_init": t_init}})


def trained_origin(arch: str) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = config(arch)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # away from the initialisation, biases included
    return cfg, model.state_dict()


def k_rows(state: dict, cfg: ModelConfig, layer: int) -> torch.Tensor:
    if cfg.arch == "neox":
        return state[f"h.{layer}.attn.qkv.weight"].view(cfg.n_head, 3, cfg.head_dim, -1)[:, 1]
    return state[f"h.{layer}.attn.k.weight"]


def steps_lower_the_loss(cfg: ModelConfig, state: dict) -> bool:
    model = GPT(cfg)
    model.load_state_dict(state)  # strict: every name and shape of the target
    idx = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(idx[:, :-1], idx[:, 1:])
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("target", [("coca", "slack"), ("coca", "strict"), ("alibi", "slack")])
def test_from_k_and_alibi_carry_every_tensor_bitwise_and_train(arch, target):
    source, state = trained_origin(arch)
    cfg = config(arch, *target, t_init="from_k")
    out, done = convert(state, source, cfg)
    assert sorted(out) == sorted(state) and done.fresh == [] and done.carried == sorted(state)
    assert all(torch.equal(out[name], state[name]) for name in state)
    assert steps_lower_the_loss(cfg, out)


@pytest.mark.parametrize("arch", ARCHS)
def test_fresh_t_redraws_only_k_and_keeps_the_rest_bitwise(arch):
    source, state = trained_origin(arch)
    cfg = config(arch, "coca", t_init="fresh")
    out, done = convert(state, source, cfg, seed=3)
    assert len(done.fresh) == cfg.n_layer
    for layer in range(cfg.n_layer):
        new, old = k_rows(out, cfg, layer), k_rows(state, cfg, layer)
        assert not torch.equal(new, old)
        assert abs(float(new.std()) - cfg.init_std) < 0.3 * cfg.init_std  # drawn as the model draws K
        if cfg.arch == "neox":  # Q and V rows of the fused projection, and the non-K biases, are kept
            w_new = out[f"h.{layer}.attn.qkv.weight"].view(cfg.n_head, 3, cfg.head_dim, -1)
            w_old = state[f"h.{layer}.attn.qkv.weight"].view(cfg.n_head, 3, cfg.head_dim, -1)
            assert torch.equal(w_new[:, 0], w_old[:, 0]) and torch.equal(w_new[:, 2], w_old[:, 2])
            b_new = out[f"h.{layer}.attn.qkv.bias"].view(cfg.n_head, 3, cfg.head_dim)
            b_old = state[f"h.{layer}.attn.qkv.bias"].view(cfg.n_head, 3, cfg.head_dim)
            assert torch.equal(b_new[:, 0], b_old[:, 0]) and torch.equal(b_new[:, 2], b_old[:, 2])
            assert not b_new[:, 1].any()
    untouched = [n for n in state if ".attn.qkv." not in n and ".attn.k." not in n]
    assert untouched and all(torch.equal(out[n], state[n]) for n in untouched)
    assert set(done.carried) == set(untouched) | {n for n in state if ".attn.q." in n or ".attn.v." in n}
    again, _ = convert(state, source, cfg, seed=3)
    assert all(torch.equal(again[n], out[n]) for n in out)  # seeded
    assert steps_lower_the_loss(cfg, out)


@pytest.mark.parametrize("source, target, message", [
    (config("neox", "alibi"), config("neox", "coca"), "only Origin (RoPE) models convert"),
    (config("neox", "coca"), config("neox", "origin"), "only Origin (RoPE) models convert"),
    (config("neox"), config("neox", "coca", n_layer=3), "keeps the shape: the source has model.n_layer=2"),
    (config("llama"), config("neox", "coca"), "keeps the shape: the source has model.arch=llama"),
])
def test_conversions_that_cannot_make_sense_are_one_line(source, target, message):
    with pytest.raises(ConversionError, match=re.escape(message)) as error:
        convert(GPT(source).state_dict(), source, target)
    assert "\n" not in str(error.value)


def test_unknown_t_init_is_refused():
    src = config("neox")
    with pytest.raises(ValueError, match="t_init='zeros' is not one of from_k, fresh"):  # the config refuses it
        convert(GPT(src).state_dict(), src, config("neox", "coca", t_init="zeros"))
