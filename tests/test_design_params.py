"""Design parameters: CoCA's in `model.design_params.coca` like every other design's; the keys they
had before are refused on the command line and read where they went in saved configs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from model import ModelConfig
from model.designs import DESIGNS, registry

REPO = Path(__file__).resolve().parents[1]
PUBLISHED = sorted(REPO.glob("docs/results/*/*/config.yaml"))


@pytest.mark.parametrize("override, new", [("model.coca_form=strict", "model.design_params.coca.form"),
                                           ("t_init=fresh", "model.design_params.coca.t_init")])
def test_a_moved_key_is_refused_in_one_line_naming_its_new_one(override, new, capsys):
    from train.__main__ import main as train_main

    code = train_main(["model.attention=coca", override])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert override.partition("=")[0] in lines[0] and new in lines[0]


def test_coca_form_and_t_init_are_parameters_of_coca():
    from train.config import compose, to_train_config

    cfg = to_train_config(compose(["model.attention=coca", "model.design_params.coca.form=strict",
                                   "model.design_params.coca.t_init=fresh"]))
    assert cfg.model.design is DESIGNS["coca_strict"]
    assert (cfg.model.params.form, cfg.model.params.t_init) == ("strict", "fresh")
    assert ModelConfig(attention="coca").design is DESIGNS["coca"]  # slack by default
    assert "coca_form" not in OmegaConf.to_yaml(OmegaConf.structured(cfg)) and "\nt_init" not in \
        OmegaConf.to_yaml(OmegaConf.structured(cfg))


def test_published_run_configs_load_with_their_design_and_t_init():
    """Every published config.yaml was written before the move (`coca_form`, top-level `t_init`):
    each loads, selects the design its folder names, and a drop-in run keeps the pilot's t_init."""
    from train.config import to_train_config

    assert PUBLISHED and any("coca_form: strict" in p.read_text() for p in PUBLISHED)
    pilot = json.loads((REPO / "docs/results/extension/pilot.json").read_text())["t_init"]
    checked = 0
    for path in PUBLISHED:
        cfg = to_train_config(OmegaConf.load(path))
        design = re.sub(r"_s\d+$", "", path.parent.name)
        if design in DESIGNS and path.parent.parent.name in ("study", "designs", "perplexity"):
            assert cfg.model.design is DESIGNS[design], path
            checked += 1
        if design == "dropin_coca":
            assert cfg.model.design is DESIGNS["coca"] and cfg.model.params.t_init == pilot, path
    assert checked > 10


def test_a_checkpoint_and_an_export_written_before_the_move_read_their_form(tmp_path):
    from hf.imports import model_config
    from train.checkpoint import saved_model

    strict = next(p for p in PUBLISHED if "coca_form: strict" in p.read_text())
    (tmp_path / "config.yaml").write_text(strict.read_text())  # a checkpoint's config.yaml
    assert saved_model(tmp_path).design is DESIGNS["coca_strict"]
    export = {"model_type": "coca_lm", "arch": "neox", "attention": "coca", "coca_form": "strict",
              "design_params": {}, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 32}
    assert model_config(export).design is DESIGNS["coca_strict"]


def test_the_registry_refuses_a_key_listed_twice():
    origin = DESIGNS["origin"]
    with pytest.raises(ValueError, match="the registry lists key origin twice"):
        registry._check((origin, DESIGNS["alibi"], origin))
    registry._check(tuple(DESIGNS.values()))  # the registry as it is passes
