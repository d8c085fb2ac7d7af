"""bench/gpu_check.sh, the check prepared for a lent GPU, kept from rotting between GPUs.

The slow test runs its CPU dry run (every stage: the real trainer on the 350M presets shrunk to the
tiny model in fp32 under ZeRO 2, save and resume, generation, the benchmarks, and the GPU path forced
on the CPU: the fake-CUDA op sweep and compiled FlexAttention against the CPU kernels) and checks the
files it leaves under $OUT, its stages in the order of value (bench/gpu_check.py stage_plan). The fast
tests check that its judge (bench/gpu_check.py) does fail bad runs and names what to rerun, its
wheel-install decisions, its disk plan (and that the script skips what the disk budget cannot hold
before anything trains), that its default variants cover the registry with the right overrides, and
that its time estimate puts the paper's designs, resume and MFU inside the first call's budget with
room for a rerun in the same 15-minute lease.
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
# Three of the GPU run's fourteen variants: Origin, resumed, on its paper preset; ALiBi, the paper's wave
# (before resume and MFU); and the modifier row (paper_350m_origin with its modifiers), after them.
VARIANTS = ("origin", "alibi", "origin+sinks+ssmax+qk_norm")
# The dry run's order: gpu_check.py's plan (two GPUs: the dry run runs sequence parallelism on the CPU),
# with the CPU-only gpu_path before the last stage.
PLAN = [stage for group in gpu_check.stage_plan(list(VARIANTS), 1, gpus=2) for stage in group]
STAGES = [*PLAN[:-1], "gpu_path", PLAN[-1]]
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
    # Limits for a CPU shared with other work (a busy 2-core machine took 25 minutes): only a hang fails.
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK": str(work), "WHEELS": str(wheels),
           "OMP_NUM_THREADS": "1", "VARIANTS": " ".join(VARIANTS), "BUDGET_S": "3000",
           "CAPS": "env=300 train=600 bench=900"}
    result = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=3300)
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
    assert STAGES[:6] == ["env", "z2_origin", "z2_alibi", "resume", "bench_train", "z2_origin+sinks+ssmax+qk_norm"]
    for name in (f"z2_{v}" for v in VARIANTS):
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
    assert "Time estimate for a Hopper GPU" in estimate and "| z2_origin |" in estimate and "\ndisk: " in estimate
    log = (out / "log.txt").read_text()
    assert all(f"== {name} (estimate ~" in log for name in PLAN[:-1] if name != "bench_sequence_parallel")
    assert "== bench_sequence_parallel (no GPU estimate," in log  # planned for one GPU: the estimate has no row
    summary = (out / "summary.md").read_text()
    assert f"RESULT: {len(STAGES) - 1} stages ok; skipped: bench_train_compiled" in summary
    assert "rerun:" not in summary  # a dry-run skip is not a failure


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


def test_estimate_puts_the_valuable_stages_first_with_room_for_a_rerun(capsys, tmp_path: Path) -> None:
    """The GPU run's defaults (fourteen variants, 15 steps of 32 x 512 tokens) on an H100 (7 trainer runs
    at once) and an H200 (13): the paper's three designs, resume and MFU come first and are estimated
    inside the first call's 330 s; 330 s, the rerun's budget and ~2 minutes of start-up and transfers
    fit in the lease's 15 minutes; each stage gets its estimate for gpu_check.sh (--tsv)."""
    designs = " ".join(DEFAULT_VARIANTS)
    plan = [s for group in gpu_check.stage_plan(DEFAULT_VARIANTS, 7, gpus=1) for s in group]
    assert plan[:6] == ["env", "z2_origin", "z2_alibi", "z2_coca", "resume", "bench_train"]
    assert plan[6 + len(DEFAULT_VARIANTS) - 3:] == ["generation", "bench_attention", "bench_doc_mask",
                                                     "bench_train_compiled"]
    assert 330 + gpu_check.RERUN_BUDGET_S + 120 <= 15 * 60
    for parallel in (7, 13):
        tsv = tmp_path / f"{parallel}.tsv"
        assert gpu_check.main(["estimate", "--designs", designs, "--steps", "15", "--resume-at", "10", "--batch",
                               "32", "--parallel", str(parallel), "--tsv", str(tsv)]) == 0
        printed = capsys.readouterr().out
        rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in printed.splitlines()
                if line.startswith("| ") and not line.startswith("| stages")}
        assert float(rows["bench_train"][3]) <= 330 - 60  # by then: a minute to spare
        assert "past the" not in rows["bench_train"][-1]
        seconds = dict(line.split("\t") for line in tsv.read_text().splitlines())
        assert list(seconds) == [s for group in gpu_check.stage_plan(DEFAULT_VARIANTS, parallel, 1) for s in group]
        assert all(int(v) > 0 for v in seconds.values())
        assert seconds["z2_alibi"] == seconds["z2_coca"]  # one wave, one time
    gpu_check.main(["estimate", "--designs", designs, "--steps", "15", "--resume-at", "10", "--batch", "32",
                    "--parallel", "1"])  # one at a time: the rows past the budget say so
    assert "past the 330 s budget: skipped, for the rerun" in capsys.readouterr().out


def test_disk_plan() -> None:
    """Each trainer run holds one checkpoint at a time, the first with resume two: the budget (DISK_GB,
    never above the free space; by default the free space less 5 GB) caps the runs at once and resume."""
    assert gpu_check.checkpoint_gb() == pytest.approx(gpu_check.params_350m() * 14 / 1e9)
    assert 4.0 < gpu_check.checkpoint_gb() < 4.5  # 306M parameters x (2 + 4 + 8) bytes
    assert gpu_check.disk_plan(60.0, 4.3, 7, None)[:2] == (7, True)  # 55 GB: room for 12
    assert gpu_check.disk_plan(60.0, 4.3, 7, 13.0)[:2] == (3, True)
    assert gpu_check.disk_plan(10.0, 4.3, 7, 100.0)[:2] == (2, True)  # DISK_GB above the free space: the free space
    runs, resume, why = gpu_check.disk_plan(10.0, 4.3, 7, None)  # 5 GB: one checkpoint
    assert (runs, resume) == (1, False) and "resume skipped" in why
    runs, resume, why = gpu_check.disk_plan(8.0, 4.3, 7, None)
    assert (runs, resume) == (0, False) and "every trainer stage skipped" in why


@pytest.mark.slow
def test_script_skips_what_the_disk_budget_cannot_hold(tmp_path: Path) -> None:
    """DISK_GB=0: the check reads it before anything trains, and skips the trainer and resume saying
    why (the rest of the dry run is left out with STAGES)."""
    out = tmp_path / "out"
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(out), "WORK": str(tmp_path / "work"), "OMP_NUM_THREADS": "1",
           "WHEELS": str(tmp_path / "none"), "DISK_GB": "0", "STAGES": "z2_origin z2_alibi resume",
           "VARIANTS": "origin alibi"}
    result = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    stages = results(out)
    assert list(stages) == ["env", "z2_origin", "z2_alibi", "resume"]
    for name in ("z2_origin", "z2_alibi", "resume"):
        assert stages[name]["status"] == "skipped" and "every trainer stage skipped" in stages[name]["note"]
    assert "budget 0.0 GB" in (out / "estimate.md").read_text()
    assert not (tmp_path / "work" / "runs" / "z2_origin").exists()


def test_summary_names_the_rerun(tmp_path: Path) -> None:
    """Failed, timed-out and out-of-time stages go to the rerun line, with env and, for resume, the first
    trainer run whose checkpoint it needs; a stage skipped for another reason does not."""
    out = tmp_path / "out"
    for stage, extra in [("env", []), ("z2_origin", []), ("z2_alibi", ["--rc", "1"]), ("resume", ["--rc", "124"]),
                         ("z2_fire", ["--skipped", "out of time (needs ~84 s, 20 s of the 330 s budget left)"]),
                         ("bench_sequence_parallel", ["--skipped", "sequence parallelism (P=2) needs 2 GPUs"])]:
        gpu_check.main(["record", str(out), "--stage", stage, *extra])
    summary = (out / "summary.md").read_text()
    assert summary.splitlines()[-1] == (f'rerun: STAGES="env z2_origin z2_alibi resume z2_fire" '
                                        f"BUDGET_S={gpu_check.RERUN_BUDGET_S} bash bench/gpu_check.sh")


def test_script_parses() -> None:
    for script in ("bench/gpu_check.sh", "bench/make_wheels.sh"):
        assert subprocess.run(["bash", "-n", script], cwd=ROOT).returncode == 0, script
    helped = subprocess.run([sys.executable, "bench/gpu_check.py", "--help"], cwd=ROOT, capture_output=True)
    assert helped.returncode == 0
