"""Config validation, flavors and parameter counts."""

import pytest

from model import GPT, ModelConfig, RopeScaling, count_parameters, flavor


def test_350m_is_the_papers_shape():
    cfg = flavor("350m")
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.ffn_hidden) == (24, 1024, 16, 4096)
    assert (cfg.layernorm_eps, cfg.rotary_pct, cfg.rope_base, cfg.init_std) == (1e-5, 1.0, 10000.0, 0.02)
    assert cfg.parallel_residual and not cfg.tie_embeddings and cfg.max_seq_len == 512
    assert abs(count_parameters(cfg)["non_embedding"] - 302e6) < 1e6


@pytest.mark.parametrize("name, overrides", [
    ("tiny", {}), ("tiny", {"tie_embeddings": True}), ("tiny", {"parallel_residual": False}),
    ("llama_tiny", {}), ("llama_tiny", {"tie_embeddings": True}), ("llama_tiny", {"n_kv_head": 1}),
    ("llama_tiny", {"n_kv_head": 4}),
])
def test_count_parameters_matches_the_module(name, overrides):
    cfg = flavor(name, n_layer=2, **overrides)
    counts = count_parameters(cfg)
    model = GPT(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["embedding"] == model.wte.weight.numel() * (1 if cfg.tie_embeddings else 2)
    assert 1e6 < count_parameters(flavor(name))["total"] < 10e6


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(attention="foo"), ["model.attention='foo'", "origin, alibi, coca"]),
        (dict(design_params={"coca": {"form": "loose"}}), ["model.design_params.coca.form", "slack, strict"]),
        (dict(n_embd=60, n_head=4), ["head dimension", "even"]),
        (dict(n_embd=250, n_head=4), ["model.n_embd", "divisible"]),
        (dict(rotary_pct=0.3), ["model.rotary_pct", "19 rotary dims", "even"]),  # int(64 * 0.3) = 19
        (dict(rotary_pct=1.5), ["model.rotary_pct", "(0, 1]"]),
        (dict(rope_scaling=RopeScaling("ntk", 2.0), attention="alibi"), ["model.rope_scaling.type", "none"]),
        (dict(n_layer=0), ["model.n_layer", "positive"]),
        (dict(arch="gpt2"), ["model.arch='gpt2'", "neox, llama"]),
        (dict(n_kv_head=2), ["model.n_kv_head=2", "model.arch=llama"]),
        (dict(arch="llama", parallel_residual=False, n_kv_head=3), ["model.n_kv_head=3", "divide", "model.n_head=4"]),
        (dict(arch="llama", parallel_residual=False, n_kv_head=0), ["model.n_kv_head", "positive"]),
        (dict(arch="llama"), ["model.arch='llama'", "model.parallel_residual=false"]),
        (dict(arch="llama", parallel_residual=False, rotary_pct=0.5), ["model.arch='llama'", "model.rotary_pct=1.0"]),
    ],
)
def test_bad_config_names_the_field(overrides, words):
    with pytest.raises(ValueError) as err:
        flavor("tiny", **overrides)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "kwargs, words",
    [(dict(type="ntk2"), ["model.rope_scaling.type", "none, linear, ntk, dynamic, yarn, llama3"]),
     (dict(type="ntk", factor=0.5), ["model.rope_scaling.factor", ">= 1"]),
     (dict(type="llama3", low_freq_factor=4.0, high_freq_factor=1.0), ["high_freq_factor > low_freq_factor > 0"])],
)
def test_bad_rope_scaling(kwargs, words):
    with pytest.raises(ValueError) as err:
        RopeScaling(**kwargs)
    for word in words:
        assert word in str(err.value)


def test_unknown_flavor_and_dict_scaling():
    with pytest.raises(ValueError, match="tiny, 125m, 350m, 1.3b"):
        flavor("7b")
    assert ModelConfig(rope_scaling={"type": "dynamic", "factor": 4.0}).rope_scaling == RopeScaling("dynamic", 4.0)


def test_set_rope_scaling_validates():
    model = GPT(flavor("tiny", n_layer=1, attention="alibi"))
    with pytest.raises(ValueError, match="model.rope_scaling.type"):
        model.set_rope_scaling("dynamic", 4.0)
    model = GPT(flavor("tiny", n_layer=1))
    model.set_rope_scaling("dynamic", 4.0)
    assert model.cfg.rope_scaling.type == "dynamic" and model.rope.scaling.factor == 4.0
