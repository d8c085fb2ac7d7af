"""Attention designs: each one a module with its math and its `Design` record, listed in `registry`.

The package imports only torch and itself (one-dot imports), because the Hugging Face export ships
its files beside the remote-code model (`hf.export`): training and the exported model run the same
math.
"""

from .base import Design
from .registry import ATTENTIONS, BY_LABEL, DESIGNS, design_of
from .rope import Rope, RopeTables, apply_rope

__all__ = ["ATTENTIONS", "BY_LABEL", "DESIGNS", "Design", "Rope", "RopeTables", "apply_rope",
           "design_of"]
