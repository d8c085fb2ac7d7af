"""bench/gpu_check.sh, the check prepared for a lent GPU, kept from rotting between GPUs.

The slow test runs its CPU dry run (every stage: the real trainer on the 350M presets shrunk to the
tiny model in fp32 under ZeRO 2, save and resume, generation, the benchmarks, and the GPU path forced
on the CPU: the fake-CUDA op sweep and compiled FlexAttention against the CPU kernels) and checks the
files it leaves under $OUT. The fast tests check that its judge (bench/gpu_check.py) does fail bad
runs, its wheel-install decisions, that its default variants cover the registry with the right
overrides, and that its time estimate for an H200 fits the 8-minute budget.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bench import gpu_check
from model.convert import MODIFIERS
from model.designs import DESIGNS, design_of
from train.config import compose, to_train_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = (ROOT / "bench" / "gpu_check.sh").read_text()
DEFAULT_VARIANTS = re.search(r'variants=\$\{VARIANTS:-"([^"]+)"\}', SCRIPT).group(1).split()
# Three of the GPU run's fourteen variants: Origin, resumed, on its paper preset; FoX Pro, without a preset
# of its own (paper_350m_origin with its attention and form); and the modifier row.
VARIANTS = ("origin", "fox_pro", "origin+sinks+ssmax+qk_norm")
STAGES = ["env", *(f"z2_{v}" for v in VARIANTS), "resume", "generation", "bench_train", "bench_attention",
          "bench_doc_mask", "bench_sequence_parallel", "gpu_path", "bench_train_compiled"]
OUT_FILES = {"estimate.md", "summary.md", "results.jsonl", "metrics.jsonl", "bench.md", "env.txt", "log.txt"}


def selects(model, variant: str) -> bool:
    """Whether a model config (a `ModelConfig`, or a run's saved config.yaml) selects the variant
    `<design>+<modifier>...`: its design, and exactly its modifiers."""
    design, *modifiers = variant.split("+")
    return (design_of(model.attention, model.design_params).key == design
            and {m for m in MODIFIERS if getattr(model, m)} == set(modifiers))


def results(out: Path) -> dict[str, dict]:
    lines = (out / "results.jsonl").read_text().splitlines()
    return {e["stage"]: e for e in map(json.loads, lines) if e["stage"] != "_meta"}


@pytest.mark.slow
def test_dry_run_runs_every_stage(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"  # names only: the dry run plans the install, it installs nothing
    wheels.mkdir()
    for name in ("deepspeed-0.19.8-py3-none-any.whl", "pyarrow-24.0.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "typing_extensions-0.0.1-py3-none-any.whl"):
        (wheels / name).touch()
    (wheels / "CONDITIONS").write_text("# name|range\npyarrow|>=0.1\ntyping-extensions|<0.1\n")
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK": str(work), "WHEELS": str(wheels),
           "OMP_NUM_THREADS": "1", "VARIANTS": " ".join(VARIANTS)}
    result = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    check_dry_run(out, work)


def check_dry_run(out: Path, work: Path) -> None:
    """What a dry run leaves under $OUT and its work folder."""
    # What comes back from a device call: 7 small files, no folders.
    assert {p.name for p in out.iterdir()} == OUT_FILES
    assert all(p.is_file() and p.stat().st_size < 2**20 for p in out.iterdir())

    stages = results(out)
    assert list(stages) == STAGES
    assert all(stages[s]["status"] == "ok" for s in STAGES[:-1]), (out / "summary.md").read_text()
    assert stages["bench_train_compiled"]["status"] == "skipped"
    for name in STAGES[1:len(VARIANTS) + 1]:
        run = stages[name]
        assert run["steps"] == 8 and run["loss_last"] < run["loss_first"] and run["tokens_per_s"] > 0
        assert run["peak_mem_gb"] > 0
    resume = stages["resume"]
    assert resume["resumed_first_step"] == 6 and resume["rel_diff"] <= 1e-5

    # Each run trained its own design on its 350M preset, under ZeRO 2.
    for v in VARIANTS:
        config = (work / "runs" / f"z2_{v}" / "config.yaml").read_text()
        assert f"name: paper_350m_{v.replace('+', '_')}" in config
        assert selects(OmegaConf.create(config).model, v)
        assert json.loads((work / "runs" / f"z2_{v}" / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2
        assert not (work / "runs" / f"z2_{v}" / "checkpoints").exists()  # removed: GBs each on a GPU

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["run"] for r in records} == {*(f"z2_{v}" for v in VARIANTS), "resume"}
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)

    env_txt = (out / "env.txt").read_text()
    assert "skip    pyarrow 24.0.0" in env_txt and "install typing-extensions 0.0.1" in env_txt
    assert "install deepspeed 0.19.8: missing on the image" in env_txt and "deepspeed 0.19" in env_txt
    bench = (out / "bench.md").read_text()
    assert "| model | batch x tokens |" in bench and "## bench_attention" in bench
    assert "| N | B | documents / row | attention |" in bench and "## bench_doc_mask" in bench
    assert "| tokens | P=1 peak MiB |" in bench and "## bench_sequence_parallel" in bench
    assert "## generation" in bench and all(f"| {v} | bf16 |" in bench for v in VARIANTS)
    assert "## gpu_path" in bench and "cases, 0 with an op that has no CUDA kernel" in bench
    assert "compiled Flex vs CPU kernels" in bench  # and the forced path equals the CPU kernels (exit 0)
    estimate = (out / "estimate.md").read_text()
    assert "Time estimate for an H200" in estimate and f"| z2 x {len(VARIANTS)} |" in estimate
    summary = (out / "summary.md").read_text()
    assert f"RESULT: {len(STAGES) - 1} stages ok; skipped: bench_train_compiled" in summary


def _metrics(run_dir: Path, losses: list[float], start: int = 1) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step, loss in enumerate(losses, start):
            f.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": 1000.0, "grad_norm": 1.0, "mem_gb": 1.0,
                                "mfu": 0.4}) + "\n")
    return run_dir


def test_judge_fails_bad_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    good = _metrics(tmp_path / "good", [8.0 - 0.1 * i for i in range(10)])
    flat = _metrics(tmp_path / "flat", [8.0] * 10)
    nan = _metrics(tmp_path / "nan", [8.0, 7.0, float("nan"), 6.0, 5.0, 5.0])
    resumed = _metrics(tmp_path / "resumed", [7.3 + 0.01, 7.2, 7.1], start=8)
    late = _metrics(tmp_path / "late", [7.2, 7.1], start=9)
    for stage, extra in [("good", ["--run", str(good)]), ("flat", ["--run", str(flat)]), ("nan", ["--run", str(nan)]),
                         ("crashed", ["--rc", "1"]), ("hung", ["--rc", "124", "--seconds", "90"]),
                         ("resumed", ["--run", str(resumed), "--reference", str(good), "--resume-step", "7"]),
                         ("late", ["--run", str(late), "--reference", str(good), "--resume-step", "7"])]:
        assert gpu_check.main(["record", str(out), "--stage", stage, *extra]) == 0
    stages = results(out)
    assert stages["good"]["status"] == "ok" and stages["good"]["mfu"] == 0.4
    assert stages["flat"]["status"] == "FAIL" and "did not fall" in stages["flat"]["note"]
    assert stages["nan"]["status"] == "FAIL" and "non-finite" in stages["nan"]["note"]
    assert stages["crashed"]["status"] == "FAIL" and stages["hung"]["status"] == "timeout"
    assert stages["resumed"]["status"] == "FAIL" and "relative difference" in stages["resumed"]["note"]
    assert stages["late"]["status"] == "FAIL" and "started at step 9, not 8" in stages["late"]["note"]
    assert "RESULT: FAIL (flat, nan, crashed, hung, resumed, late)" in (out / "summary.md").read_text()


def test_install_plan(tmp_path: Path, capsys) -> None:
    for name in ("hydra_core-1.3.8-py3-none-any.whl", "numpy-1.0.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "packaging-0.1-py3-none-any.whl"):
        (tmp_path / name).touch()
    (tmp_path / "CONDITIONS").write_text("numpy|>=1.0\npackaging|<0.2\n")  # this machine's numpy is >= 1
    assert gpu_check.main(["install", str(tmp_path), str(tmp_path / "site"), "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("install hydra-core 1.3.8: missing on the image")
    assert lines[1].startswith("skip    numpy 1.0.0: image has ") and lines[2].startswith("install packaging 0.1")
    assert lines[3] == f"plan only: 2 of 3 wheels would be installed into {tmp_path / 'site'}"
    assert not (tmp_path / "site").exists()


def test_default_variants_cover_the_registry_with_their_presets() -> None:
    """The GPU run trains every design of the registry and a modifier row, each with the overrides
    (gpu_check.sh's `preset`) that select it, and nothing else, on the 350M preset."""
    assert {v.split("+")[0] for v in DEFAULT_VARIANTS} == set(DESIGNS)
    assert any("+" in v for v in DEFAULT_VARIANTS)
    preset = re.search(r"^preset\(\) \{.*?^\}", SCRIPT, re.M | re.S).group(0)
    printed = subprocess.run(["bash", "-c", f'{preset}\nfor v; do preset "$v"; done', "-", *DEFAULT_VARIANTS],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(printed) == len(DEFAULT_VARIANTS)
    for variant, words in zip(DEFAULT_VARIANTS, printed, strict=True):
        cfg = to_train_config(compose([*words.split(), f"run_dir=/tmp/runs/z2_{variant}"]))
        assert selects(cfg.model, variant), (variant, words)
        assert cfg.model.n_layer == 24 and cfg.model.max_seq_len == 512 and cfg.model.activation_checkpointing
        assert cfg.name == f"paper_350m_{variant.replace('+', '_')}" and cfg.run_dir.endswith(f"z2_{variant}")


def test_estimate_fits_the_budget(capsys) -> None:
    """The GPU run's defaults (gpu_check.sh: fourteen variants, 15 steps of 32 x 512 tokens, thirteen
    at a time: what an H200's memory holds) are estimated within the 480 s budget, every stage with its row."""
    designs = " ".join(DEFAULT_VARIANTS)
    assert gpu_check.main(["estimate", "--designs", designs, "--steps", "15", "--resume-at", "10", "--batch", "32",
                           "--parallel", "13"]) == 0
    printed = capsys.readouterr().out
    total = float(printed.split("total ")[1].split()[0])
    assert total <= 480 and "past the" not in printed
    for stage in ("env", "z2 x 14", "resume", "generation", "bench_train", "bench_attention", "bench_doc_mask"):
        assert f"| {stage} |" in printed
    gpu_check.main(["estimate", "--designs", designs, "--steps", "15", "--resume-at", "10", "--batch", "32",
                    "--parallel", "1"])  # one at a time it would not fit: the rows past the budget say so
    assert "past the 480 s budget" in capsys.readouterr().out


def test_script_parses() -> None:
    for script in ("bench/gpu_check.sh", "bench/make_wheels.sh"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    helped = subprocess.run([sys.executable, "bench/gpu_check.py", "--help"], cwd=ROOT, capture_output=True)
    assert helped.returncode == 0
