"""The extension experiment's pilot rule (eval.budget): the budget and t_init from validation curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import budget
from eval.budget import BudgetRule, choose_budget, choose_t_init

RULE = BudgetRule(pilot_steps=300, every=25, window=50, min_gain=0.01)


def _curve(values: list[float]) -> dict[int, float]:
    return {25 * (i + 1): v for i, v in enumerate(values)}


def test_the_budget_is_the_first_step_where_every_curve_gained_under_the_threshold():
    """a flattens from 150 (gain 150 vs 100: 1 - 4.95 / 5.0 = 1.0% is not < 1%; 175 vs 125: 0.8%),
    b already at 100: the first step both qualify is 175."""
    a = _curve([6.0, 5.6, 5.3, 5.1, 5.0, 4.96, 4.95, 4.96, 4.95, 4.95, 4.95, 4.95])
    b = _curve([5.0, 4.99, 4.99, 4.98, 4.98, 4.98, 4.98, 4.97, 4.97, 4.97, 4.97, 4.97])
    assert choose_budget({"a": a}, RULE) == 175
    assert choose_budget({"b": b}, RULE) == 75  # the first step with a step 50 before it
    assert choose_budget({"a": a, "b": b}, RULE) == 175


def test_a_curve_that_keeps_improving_gets_the_pilot_length():
    steady = _curve([6.0 * 0.97 ** i for i in range(12)])  # 3% per 25 steps: never under 1% per 50
    assert choose_budget({"steady": steady}, RULE) == 300


def test_t_init_is_the_option_with_the_lower_loss_at_the_budget_from_k_on_a_tie():
    curves = {"dropin_from_k": {100: 5.0}, "dropin_fresh": {100: 4.9}}
    assert choose_t_init(curves, 100) == "fresh"
    assert choose_t_init({**curves, "dropin_fresh": {100: 5.0}}, 100) == "from_k"
    assert choose_t_init({"extend_pi": {100: 5.0}}, 100) == "from_k"  # no drop-in piloted


def test_the_pilot_folder_gives_pilot_md_and_json_and_a_missing_run_is_one_line(tmp_path: Path, capsys):
    pilot = tmp_path / "pilot"
    shapes = {"extend_pi": [6.0, 5.5, 5.2, 5.19, 5.18, 5.18], "dropin_from_k": [5.0, 4.99, 4.98, 4.98, 4.98, 4.98],
              "dropin_fresh": [5.2, 5.1, 5.05, 5.04, 5.04, 5.04], "continue_origin": [5.0] * 6}
    for name, values in shapes.items():
        (pilot / name).mkdir(parents=True)
        rows = [{"step": s, "loss": 1.0} for s in range(10, 160, 10)]
        rows += [{"step": s, "val_loss": v} for s, v in _curve(values).items()]
        (pilot / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        length = 1024 if name.startswith("extend") else 256
        (pilot / name / "config.yaml").write_text(f"batch_size: {4096 // length}\nmodel:\n  max_seq_len: {length}\n")
    family = tmp_path / "family.yaml"
    family.write_text("budget_rule: {pilot_steps: 150, every: 25, window: 50, min_gain: 0.01}\n")
    out = tmp_path / "out"
    assert budget.main([str(pilot), "--out", str(out), "--family", str(family)]) == 0
    choice = json.loads((out / "pilot.json").read_text())
    # extend_pi gains 5.6% at 100 (5.19 vs 5.5), 0.4% at 125 (5.18 vs 5.2); the others under 1% by then
    assert (choice["budget"], choice["t_init"]) == (125, "from_k")  # from_k 4.98 < fresh 5.04 at 125
    assert "**Budget: 125 steps** (512,000 tokens per run)" in (out / "pilot.md").read_text()
    assert capsys.readouterr().out == "budget 125 t_init from_k\n"
    (pilot / "dropin_fresh" / "metrics.jsonl").unlink()
    assert budget.main([str(pilot), "--out", str(out), "--family", str(family)]) == 1
    assert capsys.readouterr().err.strip().endswith("missing: dropin_fresh)")


def _pilot(root: Path) -> tuple[Path, Path]:
    """A complete pilot of three runs (150 steps) and the family file of its rule."""
    pilot = root / "pilot"
    for name in ("extend_pi", "dropin_from_k", "dropin_fresh"):
        (pilot / name).mkdir(parents=True)
        rows = [{"step": s, "val_loss": 5.0 - s / 1000} for s in range(25, 175, 25)]
        (pilot / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        (pilot / name / "config.yaml").write_text("batch_size: 4\nmodel:\n  max_seq_len: 256\n")
    family = root / "family.yaml"
    family.write_text("budget_rule: {pilot_steps: 150, every: 25, window: 50, min_gain: 0.01}\n")
    return pilot, family


BROKEN_PILOTS = {  # what is done to dropin_fresh -> what the one line says
    "stopped early": ("metrics.jsonl", '{"step": 25, "val_loss": 5.0}\n{"step": 50, "val_loss": 4.9}\n',
                      "has validation losses up to step 50, short of the pilot's 150 steps"),
    "config not yaml": ("config.yaml", "batch_size: [4\nmodel: {\n", "config.yaml is not a run's config"),
    "config without batch_size": ("config.yaml", "model:\n  max_seq_len: 256\n", "config.yaml is not a run's config"),
    "torn metrics": ("metrics.jsonl", '{"step": 25, "val_loss": 5.0}\n{"step": 50, "val_lo\n',
                     "metrics.jsonl: line 2 is not a metrics record"),
    "binary metrics": ("metrics.jsonl", b"\x80\xff\x00binary", "metrics.jsonl is not a text file"),
}


@pytest.mark.parametrize("case", list(BROKEN_PILOTS))
def test_a_broken_pilot_run_is_one_line_naming_its_file_exit_1(case, tmp_path, capsys):
    pilot, family = _pilot(tmp_path)
    name, content, needle = BROKEN_PILOTS[case]
    path = pilot / "dropin_fresh" / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert budget.main([str(pilot), "--out", str(tmp_path / "out"), "--family", str(family)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert str(pilot / "dropin_fresh") in err[0]


def test_the_committed_rule_reads():
    assert budget.load_rule(budget.FAMILY_FILE) == RULE
    with pytest.raises(ValueError, match="needs budget_rule"):
        budget.load_rule(Path(__file__))
