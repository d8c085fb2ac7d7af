"""The dose launcher's settings, every one checked before anything trains (launch/reproduce_dose.sh).

Reads FAMILY, DOSES, FRACTION, DESIGNS, SEEDS and TOP_ONLY from the environment (a
setting given there overrides the family file's, which overrides the default) and prints the plan
as shell assignments for the launcher to `eval`: the doses sorted, where each one's WSD decay
starts (its next dose branches there), the checkpoint interval landing on every such step, how many
checkpoints to keep, each design's seeds, the designs the family file trains at one dose alone
(`one_dose: {design: steps}`, from scratch; `top_only` is the same at the top dose) and the
attention statistics' overrides run after each perplexity evaluation (`attention_eval`, a list;
none: no attention task). A bad setting is one `error:` line naming it (exit 2;
a family file that is missing or not YAML: exit 1, an unusable input), before any run starts.

    eval "$(python launch/dose_plan.py)"
"""

from __future__ import annotations

import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from errors import EXIT_INPUT, EXIT_USAGE  # noqa: E402  (after the path)
from launch import study_design  # noqa: E402  (after the path)
from train.config import OptimConfig, wsd_decay_start  # noqa: E402

DEFAULTS = {"doses": "750 1500 3000", "decay_fraction": "0.2", "seeds": "origin coca", "top_only": ""}
NAME = re.compile(r"^[A-Za-z0-9_]+$")


class PlanError(Exception):
    """A setting that cannot be run, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def family_file(path: str) -> dict[str, Any]:
    """The pre-registration's mapping ({} without one)."""
    if not path:
        return {}
    try:
        found = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise PlanError(f"FAMILY={path}: {error.strerror or error}", EXIT_INPUT) from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise PlanError(f"FAMILY={path} is not YAML{line}: {getattr(error, 'problem', None) or error}",
                        EXIT_INPUT) from None
    if not isinstance(found, dict):
        raise PlanError(f"FAMILY={path} is not a YAML mapping (doses, decay_fraction, seeds, ...)", EXIT_INPUT)
    return found


def setting(env: dict[str, str], family: dict[str, Any], name: str, key: str) -> str:
    """The environment's value, else the family file's (a list or mapping as its items, space
    separated), else the default."""
    if env.get(name):
        return env[name]
    value = family.get(key)
    if value is None:
        return DEFAULTS[key]
    if isinstance(value, dict):
        value = list(value)
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def whole_numbers(name: str, text: str) -> list[int]:
    """Whole numbers >= 1, space separated (one line naming the first that is not)."""
    values = text.split()
    if not values:
        raise PlanError(f"{name} is empty: give whole numbers >= 1, space separated")
    for value in values:
        if not re.fullmatch(r"[0-9]+", value) or int(value) < 1:
            raise PlanError(f"{name}={text!r}: {value!r} is not a whole number >= 1")
    return [int(value) for value in values]


def names(name: str, text: str) -> list[str]:
    found = text.split()
    for value in found:
        if not NAME.match(value):
            raise PlanError(f"{name}={text!r}: {value!r} is not a design name (letters, digits, _)")
    return found


def plan(env: dict[str, str]) -> list[str]:
    """The launcher's assignments, or a `PlanError`."""
    family_path = env.get("FAMILY", "")
    family = family_file(family_path)
    doses = sorted(whole_numbers("DOSES", setting(env, family, "DOSES", "doses")))
    if len(set(doses)) != len(doses):
        raise PlanError(f"DOSES={' '.join(map(str, doses))} names a dose twice")
    fraction_text = setting(env, family, "FRACTION", "decay_fraction")
    try:
        optim = OptimConfig(decay="wsd", decay_fraction=float(fraction_text))
    except ValueError as error:
        reason = str(error) if "decay_fraction" in str(error) else "not a number"
        raise PlanError(f"FRACTION={fraction_text}: {reason}") from None
    starts = [wsd_decay_start(optim, dose) for dose in doses]
    for dose, start in zip(doses, starts, strict=True):
        if start >= dose or start < 1:
            raise PlanError(f"FRACTION={fraction_text} of dose {dose} gives {dose - start} decay steps: each dose "
                            "needs a stable phase and at least one decay step")
    designs = names("DESIGNS", setting(env, family, "DESIGNS", "seeds"))
    if not designs:
        raise PlanError("DESIGNS is empty")
    for design in designs:
        try:
            study_design.resolve(family_path, design)
        except SystemExit as refused:  # its one line, which names the known designs
            raise PlanError(f"DESIGNS: {str(refused.code).removeprefix('error: ')}") from None
    top_only = names("TOP_ONLY", setting(env, family, "TOP_ONLY", "top_only"))
    one_dose = {design: doses[-1] for design in top_only} | one_doses(family, doses, designs)
    every = math.gcd(*starts[:-1], doses[-1])
    lines = [f"DOSES=({' '.join(map(str, doses))})", f"STARTS=({' '.join(map(str, starts))})",
             f"EVERY={every}", f"KEEP={doses[-1] // every + 1}", f"FRACTION={shlex.quote(fraction_text)}",
             f"DESIGNS={shlex.quote(' '.join(designs))}", f"ATTENTION={shlex.quote(attention_eval(family))}",
             "declare -gA SEEDS_OF=() ONE_DOSE_OF=()"]
    for design in designs:
        lines.append(f"SEEDS_OF[{design}]={shlex.quote(' '.join(map(str, seeds_of(env, family, design))))}")
        if design in one_dose:
            lines.append(f"ONE_DOSE_OF[{design}]={doses.index(one_dose[design])}")
    return lines


def one_doses(family: dict[str, Any], doses: list[int], designs: list[str]) -> dict[str, int]:
    """The family file's `one_dose` of `designs`: design -> the one dose (one of `doses`) it trains,
    from scratch."""
    found = family.get("one_dose") or {}
    if not isinstance(found, dict):
        raise PlanError("one_dose is a mapping {design: steps}", EXIT_INPUT)
    found = {design: dose for design, dose in found.items() if design in designs}
    for design, dose in found.items():
        if dose not in doses:
            raise PlanError(f"one_dose: {design}'s {dose} is not one of the doses ({' '.join(map(str, doses))})",
                            EXIT_INPUT)
    return found


def attention_eval(family: dict[str, Any]) -> str:
    """The family file's `attention_eval` overrides, space separated ('' without them)."""
    found = family.get("attention_eval") or []
    if not isinstance(found, list) or not all(isinstance(x, str) and " " not in x for x in found):
        raise PlanError("attention_eval is a list of `python -m eval` overrides without spaces", EXIT_INPUT)
    return " ".join(found)


def seeds_of(env: dict[str, str], family: dict[str, Any], design: str) -> list[int]:
    """SEEDS, else 1 .. the design's number of seeds in the family file."""
    if env.get("SEEDS"):
        return whole_numbers("SEEDS", env["SEEDS"])
    if not family:
        raise PlanError("set SEEDS (or FAMILY, whose seeds give each design's number of seeds)")
    count = (family.get("seeds") or {}).get(design) if isinstance(family.get("seeds"), dict) else None
    if not isinstance(count, int) or count < 1:
        raise PlanError(f"design {design} has no number of seeds in FAMILY={env['FAMILY']} (its seeds: "
                        f"{{{design}: <n>}}); or set SEEDS")
    return list(range(1, count + 1))


def main() -> int:
    try:
        print("\n".join(plan(dict(os.environ))))
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.code
    return 0


if __name__ == "__main__":
    sys.exit(main())
