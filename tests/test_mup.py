"""muP (`model.mup`): the kind of every parameter of every design on both architectures, the base
width equal to the standard model, the output multiplier and 1/d attention against their
definitions, the lr factors (Adam's and Muon's spectral ones), and the coordinate check: activation
and update sizes flat across widths 64..512 under muP, growing under the standard parametrization."""

from __future__ import annotations

import math
import re

import pytest
import torch

from bench.mup_coord_check import coordinates, spread
from model import GPT, ModelConfig
from model.designs import DESIGNS
from model.mup import kinds, lr_multiplier

pytestmark = pytest.mark.usefixtures("single_thread")

HIDDEN = re.compile(r"h\.\d+\.(attn\.(qkv|q|k|v|proj)|mlp\.(fc|proj|gate|up|down))\.weight")
LLAMA = dict(arch="llama", parallel_residual=False, n_kv_head=2)


def _cfg(width: int, **overrides) -> ModelConfig:
    return ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=width, ffn_hidden=2 * width, vocab_size=64,
                                 max_seq_len=16, mup=True, mup_base_width=32), **overrides})


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["neox", "llama"])
@pytest.mark.parametrize("key", list(DESIGNS))
def test_mup_kinds_of_every_design_parameter_and_their_lr_factors(key, arch):
    """From the shapes at two widths: the projections are hidden (Adam lr / m), the LM head the
    readout, a design's matrix from the width to the heads (FoX's forget gate) output-like
    (lr / m), everything else (the design's per-head and fixed-size parameters among them) a
    vector at lr x 1; Muon's factor under `original` is 1 and under `match_rms_adamw` 1/sqrt(m)."""
    design = DESIGNS[key]
    modifiers = dict(sinks=True, ssmax=True) if design.softmax else {}
    model = GPT(_cfg(128, **arch, **design.settings(), **modifiers))  # m = 4
    found = kinds(model)
    params = dict(model.named_parameters())
    for name, kind in found.items():
        p = params[name]
        if HIDDEN.fullmatch(name):
            assert kind == "hidden", name
            assert lr_multiplier(model, "original", p, True) == pytest.approx(1.0)
            assert lr_multiplier(model, "match_rms_adamw", p, True) == pytest.approx(0.5)
        elif name == "lm_head.weight":
            assert kind == "readout"
        elif kind == "output":
            assert p.dim() == 2 and p.shape[1] == 128 and p.shape[0] < 128 and name.endswith(".weight"), name
        else:
            assert kind == "vector" or kind == "hidden" and "pro" in name, (name, kind)
        expected = 0.25 if kind in ("hidden", "output") else 1.0
        assert lr_multiplier(model, "original", p, False) == pytest.approx(expected), name
    if key == "fox":
        assert {n for n, k in found.items() if k == "output"} == {f"h.{i}.attn.score_bias.gate.weight" for i in (0, 1)}


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["neox", "llama"])
def test_mup_at_the_base_width_is_the_standard_model(arch):
    torch.manual_seed(0)
    standard = GPT(_cfg(32, mup=False, **arch))
    torch.manual_seed(0)
    mup = GPT(_cfg(32, **arch))
    assert all(torch.equal(a, b) for a, b in zip(standard.parameters(), mup.parameters(), strict=True))
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(standard(idx), mup(idx))


def test_mup_init_output_multiplier_and_attention_against_their_definitions():
    """At m = 4: hidden weights drawn at init_std / 2, the embedding and head at init_std; the logits
    are W_head h / m (float64 from the final hidden states); each layer's q_eff is q_eff of the same
    weights without muP times sqrt(d_base / d) = 1/2 (scores q.k sqrt(d_base)/d)."""
    torch.manual_seed(0)
    cfg = _cfg(128, n_layer=4)
    model = GPT(cfg)
    assert model.h[0].mlp.fc.weight.std().item() == pytest.approx(0.01, rel=0.05)
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        h = model.hidden_states(idx).double()
        expected = h @ model.lm_head.weight.double().T / 4.0
        torch.testing.assert_close(model(idx).double(), expected, rtol=1e-5, atol=1e-6)
        plain = GPT(_cfg(128, n_layer=4, mup=False))
        plain.load_state_dict(model.state_dict())
        first = model.capture_qk(idx)[0], plain.capture_qk(idx)[0]
        torch.testing.assert_close(first[0].q_eff, first[1].q_eff * math.sqrt(32 / 128), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(first[0].k_eff, first[1].k_eff)


BOUND = 2.0  # max/min of a size over widths 64..512 (8x): Theta(1) passes, Theta(sqrt(width)) (2.8x) fails


def _spreads(data: dict) -> dict[str, tuple[float, float]]:
    return {name: (spread({w: v[0] for w, v in by_width.items()}), spread({w: v[1] for w, v in by_width.items()}))
            for name, by_width in data.items()}


def test_mup_coord_check_adamw_is_flat_across_widths():
    """Three AdamW steps at lr 1e-2 at widths 64, 128, 256, 512: under muP every activation's size
    and its change from init (embedding, each block, logits) stay within BOUND across widths."""
    spreads = _spreads(coordinates(mup=True, optimizer="adamw", seeds=1))
    assert all(a < BOUND and b < BOUND for a, b in spreads.values()), spreads


@pytest.mark.slow
def test_mup_coord_check_muon_is_flat_and_standard_grows():
    """The same under Muon (its spectral lr factors); and the check can fail: under the standard
    parametrization the blocks' sizes grow with the width past BOUND (measured: x32 and x53 under
    AdamW, x4 under Muon, docs/mup_coord_check.png)."""
    spreads = _spreads(coordinates(mup=True, optimizer="muon", seeds=1))
    assert all(a < BOUND and b < BOUND for a, b in spreads.values()), spreads
    for optimizer in ("adamw", "muon"):
        standard = _spreads(coordinates(mup=False, optimizer=optimizer, seeds=1))
        assert standard["block 1"][1] > 1.5 * BOUND, standard


@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["neox", "llama"])
@pytest.mark.parametrize("attention", ["origin", "coca"])
def test_mup_hf_export_computes_our_logits_in_transformers(attention, arch, tmp_path):
    """A muP model (m = 4, weights moved off init so the multipliers matter) exports as the remote-code
    model, whose config carries the base width; transformers' AutoModelForCausalLM runs the shipped
    code and gives our logits (1e-5), which differ from the same weights without muP."""
    import json

    from transformers import AutoModelForCausalLM

    from data.tokenizer import config_from_overrides, get_tokenizer
    from hf.export import export_hf

    tokenizer = get_tokenizer(config_from_overrides([f"cache_dir={tmp_path / 'cache'}", "tokenizer.sample_docs=60"],
                                                    512))
    torch.manual_seed(0)
    model = GPT(_cfg(128, vocab_size=tokenizer.vocab_size, attention=attention, **arch)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = export_hf(model, tokenizer, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["mup_base_width"] == 32
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "CocaLMForCausalLM"
    idx = torch.randint(4, tokenizer.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
        torch.testing.assert_close(hf(idx).logits, ours, rtol=0, atol=1e-5)
        plain = GPT(_cfg(128, vocab_size=tokenizer.vocab_size, attention=attention, mup=False, **arch)).eval()
        plain.load_state_dict(model.state_dict())
        assert (plain(idx) - ours).abs().max() > 1e-2  # without the multipliers the logits differ


def test_mup_size_ladder_matches_tokens_per_parameter():
    """`+size=<rung>`: widths and depths grow up the ladder, each under muP from the first rung's width,
    each trained on 20 tokens per non-embedding parameter (the model's own count, to one step)."""
    from model.config import count_parameters
    from train.config import compose, to_train_config

    rungs = [to_train_config(compose([f"+size={rung}"])) for rung in ("xs", "s", "m", "l", "xl")]
    assert all(a.model.n_embd < b.model.n_embd and a.model.n_layer <= b.model.n_layer
               for a, b in zip(rungs, rungs[1:]))
    for cfg in rungs:
        assert cfg.model.mup and cfg.model.mup_base_width == rungs[0].model.n_embd
        per_step = cfg.batch_size * cfg.model.max_seq_len
        assert (per_step, cfg.model.max_seq_len) == (16 * 128, 128)
        params = count_parameters(cfg.model)["non_embedding"]
        assert 20 * params <= cfg.max_steps * per_step < 20 * params + per_step


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_mup_run_optimizer_groups_carry_the_lr_factors(optimizer):
    """The run's optimizer (`train.engine.build_optimizer`) under muP at m = 4: AdamW's hidden and
    output-like matrices at lr_scale 1/4, everything else at 1; Muon's group at muon_lr / lr (its
    spectral factor under `original` is 1)."""
    from train.config import OptimConfig, TrainConfig
    from train.engine import build_optimizer

    model = GPT(_cfg(128))
    cfg = TrainConfig(model=model.cfg, optim=OptimConfig(name=optimizer, lr=1e-3, muon_lr=0.02))
    names = {id(p): n for n, p in model.named_parameters()}
    found = kinds(model)
    for group in build_optimizer(model, cfg).param_groups:
        for p in group["params"]:
            if group.get("use_muon"):
                assert HIDDEN.fullmatch(names[id(p)]) and group["lr_scale"] == pytest.approx(20.0)
            else:
                hidden = found[names[id(p)]] in ("hidden", "output")
                assert group["lr_scale"] == pytest.approx(0.25 if hidden else 1.0), names[id(p)]
                assert not (optimizer == "muon" and HIDDEN.fullmatch(names[id(p)]))


def test_lr_transfer_sweep_points_compose_and_read_back(tmp_path):
    """bench/lr_transfer.py: each sweep point is a valid training configuration at its width and
    learning rate, under muP from the sweep's base width or not; a finished run's final validation
    loss is read from its metrics, a diverged one is inf, an unfinished one None."""
    from bench.lr_transfer import final_val_loss, overrides
    from train.config import compose, to_train_config

    run = tmp_path / "point"
    for mup in (False, True):
        args = overrides(mup, 128, -7, "muon", 300, run, base_width=32)
        cfg = to_train_config(compose([a for a in args if not a.startswith(("name=", "run_dir="))]))
        assert (cfg.model.n_embd, cfg.model.ffn_hidden, cfg.model.mup, cfg.model.mup_base_width) == (128, 512, mup, 32)
        assert cfg.optim.name == "muon" and cfg.optim.lr == cfg.optim.muon_lr == 2.0 ** -7 and cfg.max_steps == 300
    run.mkdir()
    assert final_val_loss(run, 300) is None
    (run / "metrics.jsonl").write_text('{"step": 300, "loss": 4.0}\n{"step": 300, "val_loss": 3.5}\n')
    assert final_val_loss(run, 300) == 3.5 and final_val_loss(run, 400) is None
    (run / "DIVERGED").write_text("non-finite loss")
    assert final_val_loss(run, 300) == math.inf
