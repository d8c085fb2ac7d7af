"""The extension experiment's fine-tuning budget and CoCA t_init, chosen from a pilot's validation losses.

`conf/study/extension.yaml` fixes the rule before the pilot runs (`budget_rule`): the budget is
the first validated step s at which every pilot run's validation loss improved by less than
`min_gain` (relative) over the preceding `window` steps, else `pilot_steps`; t_init is the
drop-in option (`dropin_from_k`, `dropin_fresh`) with the lower validation loss at that step
(from_k on a tie). Only validation losses are read, never an evaluation.

    python -m eval.budget runs/extension/pilot --out docs/results/extension

reads `<pilot>/<recipe>/metrics.jsonl` and writes `pilot.md` (the curves and the choice) and
`pilot.json` (`budget`, `t_init`), which launch/reproduce_extension.sh trains with.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.cli import OneLineParser, exit_code
from data.config import DataError, check_dir
from errors import report_error
from eval.results import save_json
from eval.tables import markdown

FAMILY_FILE = Path(__file__).resolve().parents[1] / "conf" / "study" / "extension.yaml"
T_INIT_RUNS = {"from_k": "dropin_from_k", "fresh": "dropin_fresh"}


@dataclass(frozen=True)
class BudgetRule:
    pilot_steps: int
    every: int
    window: int
    min_gain: float


def load_rule(path: Path) -> BudgetRule:
    try:
        return BudgetRule(**OmegaConf.to_container(OmegaConf.load(path))["budget_rule"])
    except (OSError, KeyError, TypeError, yaml.YAMLError) as e:
        raise DataError(f"--family {path} needs budget_rule (pilot_steps, every, window, min_gain): {e}") from None


def _text(path: Path) -> str:
    """A file's text; one `DataError` naming it where it is not UTF-8 text."""
    try:
        return path.read_text()
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not a text file ({error.reason} at byte {error.start})") from None


def val_curve(run: Path) -> dict[int, float]:
    """Validation loss by step from a run's metrics.jsonl; a line that is not a JSON record (a torn
    or binary file) is one `DataError` naming the file and the line."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{path}: no such file (train the pilot first: launch/reproduce_extension.sh)")
    curve = {}
    for number, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if "val_loss" in record:
                curve[int(record["step"])] = float(record["val_loss"])
        except (ValueError, TypeError, KeyError) as error:
            raise DataError(f"{path}: line {number} is not a metrics record ({type(error).__name__}: {error}); "
                            "a run cut short mid-write leaves such a line: resume it, or remove the line") from None
    return curve


def tokens_per_step(run: Path) -> int | None:
    """batch_size x model.max_seq_len from a run's config.yaml (None without one); a config.yaml
    that is not YAML or lacks either key is one `DataError` naming it."""
    path = run / "config.yaml"
    if not path.is_file():
        return None
    try:
        cfg = OmegaConf.create(yaml.safe_load(_text(path)))
        return int(cfg.batch_size) * int(cfg.model.max_seq_len)
    except (yaml.YAMLError, ValueError, TypeError, AttributeError, OmegaConfBaseException) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise DataError(f"{path} is not a run's config (batch_size and model.max_seq_len): "
                        f"{type(error).__name__}: {first}") from None


def choose_budget(curves: dict[str, dict[int, float]], rule: BudgetRule) -> int:
    """The first step s where every curve has s and s - window and gained less than min_gain
    (relative) from s - window to s; `rule.pilot_steps` where no step qualifies."""
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    for s in steps:
        if s > rule.pilot_steps or s - rule.window not in steps:
            continue
        if all((c[s - rule.window] - c[s]) / c[s - rule.window] < rule.min_gain for c in curves.values()):
            return s
    return rule.pilot_steps


def choose_t_init(curves: dict[str, dict[int, float]], budget: int) -> str:
    """The drop-in option with the lower validation loss at the budget (from_k on a tie, and
    where the pilot has no drop-in)."""
    if not any(run in curves for run in T_INIT_RUNS.values()):
        return "from_k"
    loss = {t: curves[run][budget] for t, run in T_INIT_RUNS.items()}
    return "fresh" if loss["fresh"] < loss["from_k"] else "from_k"


def write_pilot(pilot: Path, out: Path, family: Path = FAMILY_FILE) -> dict:
    rule = load_rule(family)
    runs = sorted(p for p in pilot.iterdir() if (p / "metrics.jsonl").is_file()) if pilot.is_dir() else []
    curves = {run.name: val_curve(run) for run in runs}
    missing = [name for name in T_INIT_RUNS.values() if name not in curves]
    if not curves or len(missing) == 1:
        raise DataError(f"{pilot}: the pilot needs a run per recipe and one per t_init "
                        f"(missing: {', '.join(missing) or 'every run'})")
    short = next(((name, max(c, default=0)) for name, c in curves.items() if max(c, default=0) < rule.pilot_steps),
                 None)
    if short:
        raise DataError(f"{pilot / short[0]} has validation losses up to step {short[1]}, short of the pilot's "
                        f"{rule.pilot_steps} steps (budget_rule.pilot_steps): finish it (resume=auto) first")
    budget = choose_budget(curves, rule)
    t_init = choose_t_init(curves, budget)
    sizes = {tokens_per_step(run) for run in runs}
    tokens = f"{budget * sizes.pop():,} tokens per run" if len(sizes) == 1 else "tokens per step differ between runs"
    steps = sorted(set().union(*curves.values()))
    md = ["# Pilot: the fine-tuning budget and t_init (conf/study/extension.yaml's budget_rule)", "",
          f"Validation loss at each run's training length, every {rule.every} steps, {rule.pilot_steps} steps. "
          f"Rule: the first step where every run gained less than {rule.min_gain:.0%} over the preceding "
          f"{rule.window} steps; t_init: the drop-in option with the lower loss there.", "",
          markdown(["run"] + [str(s) for s in steps], [[name] + [c.get(s, "") for s in steps]
                                                       for name, c in curves.items()]), "",
          "Relative gain over the preceding window:", "",
          markdown(["run"] + [str(s) for s in steps if s - rule.window in steps],
                   [[name] + [f"{(c[s - rule.window] - c[s]) / c[s - rule.window]:+.2%}"
                              for s in steps if s - rule.window in steps] for name, c in curves.items()]), "",
          f"**Budget: {budget} steps** ({tokens}). "
          f"**t_init: {t_init}** ("
          + (", ".join(f"{t} {curves[r][budget]:.4f}" for t, r in T_INIT_RUNS.items()) + f" at {budget}"
             if not missing else "no drop-in piloted") + ").", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "pilot.md").write_text("\n".join(md))
    choice = {"budget": budget, "t_init": t_init, "curves": curves}
    save_json(out / "pilot.json", choice)
    return choice


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m eval.budget", description=__doc__.splitlines()[0])
    parser.add_argument("pilot", type=Path, help="the pilot's folder of runs (one per recipe)")
    parser.add_argument("--out", type=Path, required=True, help="where pilot.md and pilot.json go")
    parser.add_argument("--family", type=Path, default=FAMILY_FILE, help="the file with budget_rule")
    args = parser.parse_args(argv)
    try:
        check_dir(args.out, "--out")
        choice = write_pilot(args.pilot, args.out, args.family)
    except (FileNotFoundError, ValueError) as e:
        return report_error(e, exit_code(e))
    print(f"budget {choice['budget']} t_init {choice['t_init']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
