"""The registry of attention designs: every design the framework builds, evaluates and exports.

Adding a design is its own module beside this one (its math and its `Design` record), one line in
`DESIGNS` below, and its tests; nothing else names it (config validation, the kernels, evaluation,
plots, the export and the benchmarks read this table).
"""

from __future__ import annotations

from typing import Any

from .alibi import ALIBI
from .base import Design
from .coca import COCA_SLACK, COCA_STRICT
from .fire import FIRE
from .fox import FOX, FOX_PRO
from .hybrid import HYBRID
from .kerple import KERPLE
from .nope import NOPE
from .origin import ORIGIN
from .pope import POPE
from .prope import PROPE
from .stick_breaking import STICK_BREAKING

_LISTED: tuple[Design, ...] = (ORIGIN, ALIBI, COCA_SLACK, COCA_STRICT, NOPE, PROPE, HYBRID, KERPLE, FIRE, FOX,
                               POPE, STICK_BREAKING, FOX_PRO)
DESIGNS: dict[str, Design] = {d.key: d for d in _LISTED}
ATTENTIONS: tuple[str, ...] = tuple(dict.fromkeys(d.attention for d in DESIGNS.values()))  # model.attention
BY_LABEL: dict[str, Design] = {d.label: d for d in DESIGNS.values()}


def _check(designs: tuple[Design, ...]) -> None:
    """Refuse a registry where a key, a label or a selection (attention and form) is taken twice, or
    where the forms of one attention disagree on their parameters (they share one section)."""
    for what, value in (("key", lambda d: d.key), ("label", lambda d: d.label),
                        ("attention and form", lambda d: (d.attention, d.form))):
        seen = [value(d) for d in designs]
        twice = sorted({str(v) for v in seen if seen.count(v) > 1})
        if twice:
            raise ValueError(f"the registry lists {what} {twice[0]} twice")
    for attention in ATTENTIONS:
        params = {d.params for d in designs if d.attention == attention}
        if len(params) > 1:
            raise ValueError(f"the forms of attention={attention} have different params dataclasses")


_check(_LISTED)


def design_of(attention: str, design_params: Any = None) -> Design:
    """The design a config selects: `model.attention` and, for a design of several forms (CoCA's),
    the `form` of its section of `design_params` (a `DesignParams` or a dict; its first form by
    default)."""
    section = (design_params.get(attention) if isinstance(design_params, dict)
               else getattr(design_params, attention, None))
    form = section.get("form") if isinstance(section, dict) else getattr(section, "form", None)
    for design in DESIGNS.values():
        if design.attention == attention and (design.form is None or form is None or design.form == form):
            return design
    raise ValueError(f"attention={attention!r} with form={form!r} is no design; attention is one of "
                     f"{', '.join(ATTENTIONS)}")
