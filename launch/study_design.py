"""How the study launchers train and evaluate one of their designs (launch/study_lib.sh calls it).

A study design is a key of the registry (model/designs/registry.py: its overrides on the study's
preset) or a variant its family file defines under `variants:`, e.g.

    variants:
      origin_sinks: {design: origin, overrides: [model.sinks=true]}
      drope: {design: nope, preset: drope_ppl, continues: origin}

`design` is the registry design whose attention it trains (its RoPE decides the scalings it is
evaluated with); `overrides` come after the design's; `preset` replaces the launcher's; `continues`
names the design whose run of the same seed it starts from (the launcher adds `init_from`), so that a
continuation and its source differ in nothing but what the continuation changes.

    python launch/study_design.py args FAMILY PRESET DESIGN              # one override per line
    python launch/study_design.py source FAMILY DESIGN                   # the design it continues
    python launch/study_design.py scalings FAMILY DESIGN SCALINGS        # SCALINGS, or [none]
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from model.designs.registry import DESIGNS  # noqa: E402  (after the path)

VARIANT_KEYS = {"design", "overrides", "preset", "continues"}


def variants(family: str) -> dict[str, dict]:
    """The family file's `variants` (none without a family file or the key)."""
    if not family or not Path(family).is_file():
        return {}
    found = (yaml.safe_load(Path(family).read_text()) or {}).get("variants") or {}
    for name, spec in found.items():
        unknown = set(spec) - VARIANT_KEYS
        if unknown or spec.get("design") not in DESIGNS:
            sys.exit(f"error: {family}: variant {name} needs `design` (one of: {', '.join(DESIGNS)}) "
                     f"and takes only {', '.join(sorted(VARIANT_KEYS))}"
                     + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""))
    return found


def resolve(family: str, name: str) -> tuple[str, dict]:
    """(registry design, variant spec) of a study design name; exits naming the known ones."""
    found = variants(family)
    if name in found:
        return found[name]["design"], found[name]
    if name in DESIGNS:
        return name, {}
    if (ROOT / "conf" / "experiment" / f"study_{name}.yaml").is_file():
        return "origin", {}  # a study preset of its own (study_text: Origin on text alone)
    sys.exit(f"error: unknown design {name} (one of: {', '.join([*DESIGNS, *found])})")


def training_args(family: str, preset: str, name: str) -> list[str]:
    """The experiment and the design's settings. PRESET `study` takes conf/experiment/study_<name>.yaml
    where it exists, else study_origin with the design's settings; any other preset takes them as is."""
    design, spec = resolve(family, name)
    preset = spec.get("preset", preset)
    if preset == "study" and not spec and (ROOT / "conf" / "experiment" / f"study_{name}.yaml").is_file():
        return [f"experiment=study_{name}"]
    args = [f"experiment={'study_origin' if preset == 'study' else preset}", *DESIGNS[design].overrides(),
            *spec.get("overrides", [])]
    return args


def main(argv: list[str]) -> None:
    command, family, *rest = argv
    if command == "args":
        print("\n".join(training_args(family, *rest)))
    elif command == "source":
        print(resolve(family, rest[0])[1].get("continues", ""))
    elif command == "scalings":
        print(rest[1] if DESIGNS[resolve(family, rest[0])[0]].rope else "[none]")
    else:
        sys.exit(f"error: unknown command {command} (args, source, scalings)")


if __name__ == "__main__":
    main(sys.argv[1:])
