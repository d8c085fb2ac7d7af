"""The design registry (`model.designs`): every design is one complete record that the rest of the
framework reads, and the package stays shippable as the exported model's remote code."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from eval.plots import DESIGN_COLORS, design_of
from model import GPT, ModelConfig
from model.designs import ATTENTIONS, BY_LABEL, DESIGNS
from model.designs import design_of as registry_design_of

PACKAGE = Path(__file__).resolve().parents[1] / "model" / "designs"


def test_keys_labels_and_colours_are_unique():
    assert len({d.key for d in DESIGNS.values()}) == len({d.label for d in DESIGNS.values()}) == len(DESIGNS)
    colours = [d.colour for d in DESIGNS.values()]
    assert len(set(colours)) == len(colours) and all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colours)
    assert set(ATTENTIONS) == {d.attention for d in DESIGNS.values()}


@pytest.mark.parametrize("key", list(DESIGNS))
def test_a_config_selects_its_design_and_every_reader_finds_it(key):
    design = DESIGNS[key]
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=16, ffn_hidden=32, **design.settings())
    assert cfg.design is design is registry_design_of(**design.settings())
    assert (GPT(cfg).rope is not None) == design.rope
    assert design_of(design.label) == design_of(f"{key}_s3 (x) + dynamic:8") == key  # report labels and run names
    assert DESIGN_COLORS[key] == design.colour


def test_an_unknown_attention_is_refused_naming_the_designs():
    with pytest.raises(ValueError, match="model.attention='nope_typo' is not one of origin, alibi, coca"):
        ModelConfig(attention="nope_typo")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(level, module) of each import in a file: level 1 is `from .x import`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


def test_the_package_imports_only_torch_the_standard_library_and_itself():
    """The export ships these files flat beside its modeling file, and transformers resolves only
    one-dot imports of sibling files there: nothing else of this project may be imported."""
    siblings = {p.stem for p in PACKAGE.glob("*.py")}
    for path in PACKAGE.glob("*.py"):
        for level, module in _imports(path):
            if level:
                assert level == 1 and module in siblings, f"{path.name}: from {'.' * level}{module}"
            else:
                top = module.split(".")[0]
                assert top == "torch" or top in sys.stdlib_module_names, f"{path.name}: import {module}"


def test_the_registry_is_what_the_export_and_benchmarks_list():
    from bench.attention import VARIANTS
    from hf.export import REMOTE_CODE

    designs = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert designs | {"modeling_coca_lm.py", "gpt.py", "hf_layout.py", "designs.py"} <= set(REMOTE_CODE)
    assert set(BY_LABEL) <= set(VARIANTS)
