"""Helper of bench/gpu_check.sh: install the carried wheels, judge each stage, write the summary.

Standard library only (plus `packaging`, for version ranges), so it runs on the GPU image before
anything is installed. Each `record` appends one JSON line to <out>/results.jsonl and rewrites
<out>/summary.md from all lines so far: a call cut short still leaves every finished stage behind.

    python3 bench/gpu_check.py env .whl /tmp/site [--plan]      # nvidia-smi, install, versions
    python3 bench/gpu_check.py install .whl /tmp/site [--plan]
    python3 bench/gpu_check.py record OUT --stage z2_origin --rc 0 --seconds 41.2 --run RUN_DIR
    python3 bench/gpu_check.py record OUT --stage resume --rc 0 --seconds 30 --run RESUMED \\
        --reference REFERENCE_RUN --resume-step 20 --tol 5e-3
    python3 bench/gpu_check.py estimate --designs "origin alibi" --steps 12 --batch 32 --parallel 5 \
        --tsv stage_seconds.tsv
    python3 bench/gpu_check.py disk --free-gb 40 --ckpt-gb 4.3 --parallel 7 [--budget-gb 20]
    python3 bench/gpu_check.py checkpoint-gb        # a 350M ZeRO 2 checkpoint's size, for the disk plan
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

WARMUP_STEPS = 5  # records up to this step are left out of tokens/s and MFU (allocator, autotuning, compile)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) of a wheel file name."""
    name, version = path.name.split("-")[:2]
    return _norm(name), version


def installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install(wheels: Path, target: Path, plan: bool) -> int:
    """Install every wheel, except one listed in CONDITIONS whose range the image's own version meets."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    conditions = {}
    conditions_file = wheels / "CONDITIONS"
    if conditions_file.is_file():
        for line in conditions_file.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                name, spec = line.split("|", 1)
                conditions[_norm(name)] = SpecifierSet(spec.strip())
    chosen = []
    found = sorted(wheels.glob("*.whl"))
    if not found:
        print(f"error: no wheels in {wheels} (make them with bench/make_wheels.sh)", file=sys.stderr)
        return 1
    for path in found:
        name, version = wheel_name(path)
        have = installed_version(name)
        if name in conditions:
            try:
                keep = have is not None and conditions[name].contains(have, prereleases=True)
            except InvalidVersion:
                keep = False
            reason = f"image has {have or 'none'}, needs {conditions[name]}"
            if keep:
                print(f"skip    {name} {version}: {reason}")
                continue
            print(f"install {name} {version}: {reason}")
        else:
            print(f"install {name} {version}: missing on the image" + (f" (image has {have})" if have else ""))
        chosen.append(str(path))
    if plan:
        print(f"plan only: {len(chosen)} of {len(found)} wheels would be installed into {target}")
        return 0
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(target), *chosen]
    print("$ " + " ".join(command[:12]) + f" ... ({len(chosen)} wheels)", flush=True)
    return subprocess.run(command).returncode


VERSIONS = """
import importlib, sys, traceback
import torch
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    print(f"cuda {torch.version.cuda} {torch.cuda.get_device_name()} {props.total_memory / 2**30:.0f} GiB "
          f"bf16 {torch.cuda.is_bf16_supported()}")
else:
    print("cuda: none")
missing = []
for name in ("torch", "deepspeed", "hydra", "omegaconf", "datasets", "torchdata", "pyarrow", "fsspec", "pydantic",
             "sentencepiece", "transformers", "numpy", "triton"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')} {module.__file__}")
    except Exception as error:  # an import can fail with more than ImportError (a version check, a bad binary)
        print(f"{name} FAILED: {type(error).__name__}: {error}")
        traceback.print_exc(limit=-3)
        if name not in ("transformers", "triton"):  # the training stack needs the rest
            missing.append(name)
sys.exit(f"the training stack cannot import: {', '.join(missing)}" if missing else 0)
"""


def environment(wheels: Path, site: Path, plan: bool) -> int:
    """The machine, the wheels installed (or, with --plan, the decisions), and the versions imported."""
    import os
    import platform
    import shutil

    print(f"host: {platform.platform()}; cpus: {os.cpu_count()}; python {platform.python_version()} ({sys.executable})",
          flush=True)
    if shutil.which("nvidia-smi"):
        subprocess.run(["nvidia-smi"])
    installed = 0
    if wheels.is_dir():
        installed = install(wheels, site, plan)
    elif not plan:
        print(f"error: no wheel folder {wheels} (make it with bench/make_wheels.sh)", file=sys.stderr)
        installed = 1
    else:
        print(f"no wheel folder {wheels}: nothing to plan (bench/make_wheels.sh makes it)")
    env = dict(os.environ)
    if not plan:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    sys.stdout.flush()
    imported = subprocess.run([sys.executable, "-c", VERSIONS], env=env).returncode
    return installed or imported


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def judge_run(run_dir: Path, min_drop: float) -> tuple[dict, list[str]]:
    """Numbers of one training run from its metrics.jsonl, and what is wrong with it."""
    records = read_records(run_dir)
    train = [r for r in records if "loss" in r]
    problems: list[str] = []
    result: dict = {"steps": max((r["step"] for r in train), default=0)}
    if not train:
        return result, ["no training record in metrics.jsonl"]
    losses = [r["loss"] for r in train]
    if not all(_finite(x) for x in losses):
        problems.append("a non-finite loss")
    last = train[-min(5, len(train)):]
    result["loss_first"] = losses[0]
    result["loss_last"] = statistics.fmean(r["loss"] for r in last)
    if all(_finite(x) for x in losses):
        drop = 1 - result["loss_last"] / losses[0]
        result["loss_drop"] = drop
        if not drop >= min_drop:
            problems.append(f"loss did not fall by {min_drop:.0%} (first {losses[0]:.4f}, mean of last "
                            f"{len(last)} {result['loss_last']:.4f})")
    steady = [r for r in train if r["step"] > WARMUP_STEPS] or train
    result["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steady)
    if any("mfu" in r for r in steady):
        result["mfu"] = statistics.median(r["mfu"] for r in steady if "mfu" in r)
    result["peak_mem_gb"] = max((r.get("mem_gb", 0.0) for r in train), default=0.0)
    if any(not _finite(r.get("grad_norm", 0.0)) for r in train):
        problems.append("a non-finite gradient norm")
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if vals:
        result["val_loss"] = vals[-1]
        if not _finite(vals[-1]):
            problems.append("a non-finite validation loss")
    return result, problems


def judge_resume(run_dir: Path, reference: Path, resume_step: int, tol: float) -> tuple[dict, list[str]]:
    """The resumed run's first step must be resume_step + 1 and match the uninterrupted run's loss."""
    resumed = {r["step"]: r["loss"] for r in read_records(run_dir) if "loss" in r}
    ref = {r["step"]: r["loss"] for r in read_records(reference) if "loss" in r}
    if not resumed:
        return {}, ["the resumed run wrote no training record"]
    first = min(resumed)
    result = {"resumed_first_step": first, "loss_resumed": resumed[first], "loss_reference": ref.get(first)}
    problems = []
    if first != resume_step + 1:
        problems.append(f"the resumed run started at step {first}, not {resume_step + 1}")
    if first not in ref:
        problems.append(f"the reference run has no loss at step {first}")
    else:
        diff = abs(resumed[first] - ref[first]) / max(1.0, abs(ref[first]))
        result["rel_diff"] = diff
        if not diff <= tol:
            problems.append(f"step {first} loss {resumed[first]:.6f} after resume vs {ref[first]:.6f} "
                            f"uninterrupted (relative difference {diff:.2e} > {tol:.0e})")
        common = sorted(set(resumed) & set(ref))
        result["max_rel_diff_all_steps"] = max(abs(resumed[s] - ref[s]) / max(1.0, abs(ref[s])) for s in common)
    return result, problems


def record(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entry: dict = {"stage": args.stage, "rc": args.rc, "seconds": round(args.seconds, 1)}
    for item in args.meta or []:
        key, _, value = item.partition("=")
        entry[key] = value
    problems: list[str] = []
    if args.rc == 124 or args.rc == 137:
        problems.append(f"timed out after {args.seconds:.0f} s")
    elif args.rc != 0:
        problems.append(f"exit code {args.rc}")
    if args.run:
        run_dir = Path(args.run)
        numbers, found = judge_run(run_dir, args.min_drop) if not args.reference else ({}, [])
        if args.reference:
            numbers, found = judge_resume(run_dir, Path(args.reference), args.resume_step, args.tol)
            more, _ = judge_run(run_dir, 0.0)
            numbers.update({k: more[k] for k in ("tokens_per_s", "mfu", "peak_mem_gb") if k in more})
        entry.update(numbers)
        if args.rc == 0:
            problems += found
        with open(out / "metrics.jsonl", "a") as f:
            for r in read_records(run_dir):
                f.write(json.dumps({"run": args.stage, **r}) + "\n")
    if args.skipped:
        entry["status"] = "skipped"
        problems = [args.skipped]
    else:
        entry["status"] = "ok" if not problems else ("timeout" if args.rc in (124, 137) else "FAIL")
    note = "; ".join(problems + ([args.note] if args.note else []))
    if note:
        entry["note"] = note
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    write_summary(out)
    print(f"== {args.stage}: {entry['status']} ({entry['seconds']} s){': ' + note if note else ''}", flush=True)
    return 0


def _fmt(value, spec: str, empty: str = "") -> str:
    return format(value, spec) if isinstance(value, (int, float)) and math.isfinite(value) else empty


def write_summary(out: Path) -> None:
    entries = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    meta = next((e for e in entries if e["stage"] == "_meta"), {})
    stages = [e for e in entries if e["stage"] != "_meta"]
    lines = ["# GPU check", ""]
    for key in ("date", "mode", "device", "torch", "budget_s", "command"):
        if key in meta:
            lines.append(f"- {key}: {meta[key]}")
    lines += ["", "| stage | status | s | steps | loss first -> last 5 | tokens/s | MFU | peak GB | note |",
              "|---|---|---|---|---|---|---|---|---|"]
    for e in stages:
        loss = ""
        if "loss_first" in e:
            loss = f"{_fmt(e['loss_first'], '.3f', 'nan')} -> {_fmt(e['loss_last'], '.3f', 'nan')}"
        elif "loss_resumed" in e:
            loss = (f"step {e.get('resumed_first_step')}: {_fmt(e['loss_resumed'], '.5f', 'nan')} "
                    f"(uninterrupted {_fmt(e.get('loss_reference'), '.5f', '-')})")
        lines.append(
            f"| {e['stage']} | {e['status']} | {e['seconds']:.0f} | {e.get('steps', '')} | {loss} | "
            f"{_fmt(e.get('tokens_per_s'), ',.0f')} | {_fmt(e.get('mfu'), '.1%')} | "
            f"{_fmt(e.get('peak_mem_gb'), '.1f')} | {e.get('note', '').replace('|', '/')} |"
        )
    failed = [e["stage"] for e in stages if e["status"] not in ("ok", "skipped")]
    skipped = [e["stage"] for e in stages if e["status"] == "skipped"]
    lines += [""]
    if failed:
        lines.append(f"RESULT: FAIL ({', '.join(failed)})" + (f"; skipped: {', '.join(skipped)}" if skipped else ""))
    else:
        skipped_note = f"; skipped: {', '.join(skipped)}" if skipped else ""
        lines.append(f"RESULT: {len(stages) - len(skipped)} stages ok{skipped_note}")
    again = rerun_stages(stages)
    if again:
        lines.append(f'rerun: STAGES="{" ".join(again)}" BUDGET_S={RERUN_BUDGET_S} bash bench/gpu_check.sh')
    (out / "summary.md").write_text("\n".join(lines) + "\n")


RERUN_BUDGET_S = 300  # the same lease's second call: 15 min less start-up, transfers and the first call's 330 s


def rerun_stages(stages: list[dict]) -> list[str]:
    """What a second call should run: every stage that failed, timed out or did not fit in the budget,
    with what it needs (env; resume needs the first trainer run's checkpoint), in the check's order."""
    names = [e["stage"] for e in stages]
    again = {e["stage"] for e in stages if e["status"] in ("FAIL", "timeout")
             or e.get("note", "").startswith("out of time")}
    first_run = next((name for name in names if name.startswith("z2_")), None)
    if "resume" in again and first_run:
        again.add(first_run)
    if not again:
        return []
    return ["env", *(name for name in names if name in again and name != "env")]


def meta(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    entry = {"stage": "_meta"}
    for item in args.items:
        key, _, value = item.partition("=")
        entry[key] = value
    with open(out / "results.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")
    write_summary(out)
    return 0


# ---- the time estimate, printed before the check starts ----------------------------------------------------
# What the estimate assumes of a Hopper GPU (H100 or H200: the same dense bf16 peak; none of it measured
# yet: docs/GPU.md). The model work comes from FLOPs; the rest is fixed costs per process, which dominate
# at 350M.
HOPPER_BF16 = 989e12  # dense bf16 FLOP/s (train/flops.py's table)
TRAIN_MFU = 0.30  # eager PyTorch, activation checkpointing, 350M: the low end of the usual 30-45%
COSTS = {  # seconds
    "env": 25.0,  # install the wheels, import everything, nvidia-smi
    "start": 15.0,  # python, torch, deepspeed, datasets imports; the 350M model built on the CPU, moved
    "tokenizer": 5.0,  # the first run trains the stdlib tokenizer (4096 pieces) for the rest
    "engine": 8.0,  # DeepSpeed's engine, the optimizer, the loader's first batch
    "flex_train": 40.0,  # FlexAttention's forward and backward compiled to Triton, per design that uses it
    "flex_forward": 10.0,  # its forward alone (generation), per design and precision
    "checkpoint": 6.0,  # a 4.3 GB ZeRO 2 checkpoint written or read
    "bench_train": 45.0, "bench_attention": 45.0, "bench_doc_mask": 40.0, "bench_sequence_parallel": 60.0,
    "bench_train_compiled": 90.0,  # bench_train with our blocks compiled by inductor
}
# FlexAttention on a GPU: the score biases (FoX Pro's forget gate too) and the hybrid's window. PoPE runs
# SDPA, stick-breaking its own kernel, and a model with attention sinks their explicit chunks (`flex`).
FLEX_DESIGNS = {"alibi", "kerple", "fire", "fox", "fox_pro", "hybrid"}
PAPER = ("alibi", "coca")  # trained right after the first variant (Origin), before resume and MFU
DECODE_STEP_S = 0.005  # a 350M decoding step at batch 1: kernel launches, not FLOPs (24 layers x ~15 kernels)
# Seconds a training step beside the FLOPs: stick-breaking's kernel runs eagerly, 64 query rows at a time,
# ~27k small kernels a step (8 chunks x 24 layers x 2 micro-batches x ~70: a chunk's forward twice under
# activation checkpointing, its backward) at ~10 us each.
EAGER_STEP_S = {"stick_breaking": 0.3}
BYTES_PER_PARAM = 2 + 4 + 8  # a ZeRO 2 bf16 checkpoint: bf16 weights, fp32 master weights, Adam's two moments
DISK_RESERVE_GB = 5.0  # left free beside the checkpoints: logs, the tokenizer, compile caches


def flex(variant: str) -> bool:
    """Whether a variant (`<design>+<modifier>...`) runs FlexAttention on a GPU: its design does, and no
    attention sinks take it to their explicit chunks instead (model/sink_attention.py)."""
    design, *modifiers = variant.split("+")
    return design in FLEX_DESIGNS and "sinks" not in modifiers


def params_350m(n_layer=24, n_embd=1024, ffn=4096, vocab=4096) -> int:
    """A 350M GPT-NeoX's parameters (the paper preset's, tokenizer of 4096 pieces), norms left out."""
    return n_layer * (4 * n_embd * n_embd + 2 * n_embd * ffn) + vocab * n_embd


def flops_per_token(n_layer=24, n_embd=1024, seq=512) -> float:
    """A 350M GPT-NeoX's model FLOPs per trained token: 6 N + 12 L d T (train/flops.py's formula)."""
    return 6 * params_350m() + 12 * n_layer * n_embd * seq


def checkpoint_gb() -> float:
    """One 350M ZeRO 2 checkpoint, in GB: what each trainer run writes at its last step."""
    return params_350m() * BYTES_PER_PARAM / 1e9


def disk_plan(free_gb: float, ckpt_gb: float, parallel: int, budget_gb: float | None) -> tuple[int, bool, str]:
    """(trainer runs at once, whether resume fits, a line saying why) for a disk budget: DISK_GB if
    given (never more than the free space), else the free space less DISK_RESERVE_GB. Each run holds
    one checkpoint at a time (train_finish removes it); the first run with resume two (its
    step-RESUME_AT one, then the resumed run's last)."""
    budget = min(free_gb, budget_gb) if budget_gb is not None else free_gb - DISK_RESERVE_GB
    fits = max(0, math.floor(budget / ckpt_gb))
    runs, resume = min(parallel, fits), fits >= 2
    why = (f"{free_gb:.1f} GB free, budget {budget:.1f} GB, {ckpt_gb:.2f} GB a checkpoint: "
           f"{runs} trainer run(s) at once (memory allows {parallel})")
    if not resume:
        why += "; resume skipped (it needs two checkpoints at once)"
    if runs == 0:
        why += "; every trainer stage skipped (not one checkpoint fits)"
    return runs, resume, why


def stage_plan(designs: list[str], parallel: int, gpus: int) -> list[list[str]]:
    """The check's stages in gpu_check.sh's order, grouped as they run (a trainer wave at once)."""
    first, rest = designs[0], designs[1:]
    paper = [d for d in rest if d in PAPER]
    others = [d for d in rest if d not in PAPER]

    def waves(variants: list[str]) -> list[list[str]]:
        return [[f"z2_{d}" for d in variants[i : i + parallel]] for i in range(0, len(variants), max(parallel, 1))]

    plan = [["env"], [f"z2_{first}"], *waves(paper), ["resume"], ["bench_train"], *waves(others), ["generation"],
            ["bench_attention"], ["bench_doc_mask"]]
    if gpus >= 2:
        plan.append(["bench_sequence_parallel"])
    return plan + [["bench_train_compiled"]]


def estimate(args) -> int:
    """Per stage: its model FLOPs, the seconds they take at TRAIN_MFU of a Hopper GPU, the fixed costs,
    and the running total against the budget; trainer runs started at once share the GPU (their work
    adds up) and overlap their fixed costs on the CPUs. With --tsv, `stage<TAB>seconds` for each stage
    (a wave's members each get the wave's seconds), which gpu_check.sh prints as each stage starts and
    uses to skip one that no longer fits."""
    designs = args.designs.split()
    step_flops = args.batch * 512 * flops_per_token() * 4 / 3  # activation checkpointing: one more forward
    step_s = step_flops / (HOPPER_BF16 * TRAIN_MFU)

    def trainer(variant: str, checkpoints: int = 1) -> float:
        return (COSTS["start"] + COSTS["engine"] + COSTS["flex_train"] * flex(variant)
                + checkpoints * COSTS["checkpoint"])

    def work(variant: str, steps: int) -> float:
        return steps * (step_s + EAGER_STEP_S.get(variant.split("+")[0], 0.0))

    def variant_of(stage: str) -> str:
        return stage.removeprefix("z2_")

    rows = []  # (stages, model FLOPs, seconds, what)
    for group in stage_plan(designs, args.parallel, args.gpus):
        name = group[0]
        if name.startswith("z2_"):
            variants = [variant_of(g) for g in group]
            if variants[0] == designs[0]:
                seconds = COSTS["tokenizer"] + trainer(designs[0], 2) + work(designs[0], args.steps)
                what = f"alone: the tokenizer, checkpoints at {args.resume_at} and {args.steps}"
            else:
                seconds = max(trainer(v) for v in variants) + sum(work(v, args.steps) for v in variants)
                what = f"{len(variants)} at once"
            rows.append((group, len(variants) * args.steps * step_flops, seconds, what))
        elif name == "env":
            rows.append((group, 0.0, COSTS["env"], "install, import"))
        elif name == "resume":
            after = args.steps - args.resume_at
            rows.append((group, after * step_flops, trainer(designs[0], 2) + work(designs[0], after),
                         f"from step {args.resume_at}"))
        elif name == "generation":
            gen_flops = 2 * len(designs) * (args.prompt + args.new) * flops_per_token() / 3  # forward: 2N per token
            seconds = COSTS["start"] + len(designs) * 2 * (args.new * DECODE_STEP_S + 0.5)
            seconds += sum(2 * COSTS["flex_forward"] for d in designs if flex(d))
            rows.append((group, gen_flops, seconds, "every variant, fp32 and bf16, greedy over the KV cache"))
        else:
            rows.append((group, 0.0, COSTS[name], "fixed costs and compiles dominate"))
    print(f"Time estimate for a Hopper GPU (H100 or H200: dense bf16 {HOPPER_BF16 / 1e12:.0f} TFLOP/s at "
          f"{TRAIN_MFU:.0%} MFU for the model work, fixed costs assumed per process: bench/gpu_check.py COSTS), "
          f"{args.parallel} trainer run(s) at once\n")
    print("| stages | model TFLOP | estimated s | by then | what |\n|---|---|---|---|---|")
    elapsed, lines = 0.0, []
    for group, flops, seconds, what in rows:
        elapsed += seconds
        late = "" if elapsed <= args.budget else f" (past the {args.budget:.0f} s budget: skipped, for the rerun)"
        print(f"| {' '.join(group)} | {flops / 1e12:,.0f} | {seconds:.0f} | {elapsed:.0f} | {what}{late} |")
        lines += [f"{stage}\t{math.ceil(seconds)}" for stage in group]
    print(f"\ntotal {elapsed:.0f} s; the budget {args.budget:.0f} s")
    if args.tsv:
        Path(args.tsv).write_text("\n".join(lines) + "\n")
    return 0


def disk(args) -> int:
    """Print `<runs at once> <1 if resume fits, else 0>`, then the line that says why (for estimate.md)."""
    runs, resume, why = disk_plan(args.free_gb, args.ckpt_gb, args.parallel, args.budget_gb)
    print(f"{runs} {int(resume)}\n{why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("install", help="install the carried wheels the image needs")
    p.add_argument("wheels", type=Path)
    p.add_argument("target", type=Path)
    p.add_argument("--plan", action="store_true", help="print the decisions, install nothing")
    p = sub.add_parser("env", help="machine facts, the wheels installed (or planned), the versions imported")
    p.add_argument("wheels", type=Path)
    p.add_argument("site", type=Path)
    p.add_argument("--plan", action="store_true", help="install nothing (the CPU dry run)")
    p = sub.add_parser("meta", help="the run's facts (key=value) at the top of the summary")
    p.add_argument("out")
    p.add_argument("items", nargs="*")
    p = sub.add_parser("record", help="judge one stage, append it to results.jsonl, rewrite summary.md")
    p.add_argument("out")
    p.add_argument("--stage", required=True)
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--run", help="a training run directory (its metrics.jsonl)")
    p.add_argument("--min-drop", type=float, default=0.05, help="the loss must fall by this fraction")
    p.add_argument("--reference", help="with --run: the uninterrupted run a resumed run must match")
    p.add_argument("--resume-step", type=int, default=0)
    p.add_argument("--tol", type=float, default=1e-5, help="relative loss difference allowed after resume")
    p.add_argument("--skipped", help="the stage did not run: why")
    p.add_argument("--note")
    p.add_argument("--meta", action="append", help="key=value stored with the stage")
    p = sub.add_parser("checkpoint-gb", help="the size of one 350M ZeRO 2 checkpoint, in GB")
    p = sub.add_parser("disk", help="trainer runs at once and whether resume fits, for the disk budget")
    p.add_argument("--free-gb", type=float, required=True, help="df's free space where the runs write")
    p.add_argument("--ckpt-gb", type=float, required=True, help="one checkpoint's size")
    p.add_argument("--parallel", type=int, required=True, help="the runs at once the GPU's memory allows")
    p.add_argument("--budget-gb", type=float, help="DISK_GB: at most this much (default: free less 5 GB)")
    p = sub.add_parser("estimate", help="the check's time on a Hopper GPU, per stage, from FLOPs and fixed costs")
    p.add_argument("--designs", required=True, help="the trainer's variants, <design>[+<modifier>...], space-separated")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume-at", type=int, required=True)
    p.add_argument("--batch", type=int, required=True, help="sequences of 512 tokens per optimizer step")
    p.add_argument("--parallel", type=int, default=1, help="trainer processes at a time")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--budget", type=float, default=330.0)
    p.add_argument("--tsv", help="write stage<TAB>estimated seconds here")
    args = parser.parse_args(argv)
    if args.command == "estimate":
        return estimate(args)
    if args.command == "disk":
        return disk(args)
    if args.command == "checkpoint-gb":
        print(f"{checkpoint_gb():.2f}")
        return 0
    if args.command == "install":
        return install(args.wheels, args.target, args.plan)
    if args.command == "env":
        return environment(args.wheels, args.site, args.plan)
    if args.command == "meta":
        return meta(args)
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
