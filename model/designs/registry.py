"""The registry of attention designs: every design the framework builds, evaluates and exports.

Adding a design is its own module beside this one (its math and its `Design` record), one line in
`DESIGNS` below, and its tests; nothing else names it (config validation, the kernels, evaluation,
plots, the export and the benchmarks read this table).
"""

from __future__ import annotations

from .alibi import ALIBI
from .base import Design
from .coca import COCA_SLACK, COCA_STRICT
from .fire import FIRE
from .fox import FOX
from .hybrid import HYBRID
from .kerple import KERPLE
from .nope import NOPE
from .origin import ORIGIN
from .pope import POPE
from .prope import PROPE

DESIGNS: dict[str, Design] = {d.key: d for d in (ORIGIN, ALIBI, COCA_SLACK, COCA_STRICT, NOPE, PROPE, HYBRID,
                                                  KERPLE, FIRE, FOX, POPE)}
ATTENTIONS: tuple[str, ...] = tuple(dict.fromkeys(d.attention for d in DESIGNS.values()))  # model.attention
COCA_FORMS: tuple[str, ...] = tuple(d.coca_form for d in DESIGNS.values() if d.coca_form)
BY_LABEL: dict[str, Design] = {d.label: d for d in DESIGNS.values()}


def design_of(attention: str, coca_form: str = "slack") -> Design:
    """The design a config selects (`model.attention`, and `model.coca_form` for CoCA)."""
    for design in DESIGNS.values():
        if design.attention == attention and design.coca_form in (None, coca_form):
            return design
    raise ValueError(f"attention={attention!r}, coca_form={coca_form!r} is no design; attention is one of "
                     f"{', '.join(ATTENTIONS)}")
