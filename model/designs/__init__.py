"""Attention designs: each one a module with its math and its `Design` record, listed in `registry`.

The package imports only torch and itself (one-dot imports), because the Hugging Face export ships
its files beside the model's own (`hf.export`): the rest of `model/` imports the package only as
`from .designs import ...` (never a submodule), so that the export can write this file as
`designs.py` and every file sits flat in one folder, as transformers' remote code requires.
"""

from .base import Design, ScoreBias
from .registry import ATTENTIONS, BY_LABEL, DESIGNS, design_of
from .rope import Rope, RopeTables, apply_rope
from .sinks import sink_attention_rows, sink_gradient, sink_mass, sink_row_gradient, with_sinks
from .ssmax import key_counts, ssmax_init, ssmax_scale
from .temperature import length_temperature

__all__ = ["ATTENTIONS", "BY_LABEL", "DESIGNS", "Design", "Rope", "RopeTables", "ScoreBias", "apply_rope",
           "design_of", "key_counts", "length_temperature", "sink_attention_rows", "sink_gradient", "sink_mass",
           "sink_row_gradient", "ssmax_init", "ssmax_scale", "with_sinks"]
