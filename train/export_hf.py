"""`python -m train.export_hf run=<run or checkpoint> out=<dir> [rope_scaling=dynamic:4] [overwrite=true]`

Loads a run's newest complete checkpoint, or the checkpoint given, of any kind (ZeRO 0-3, bf16 or
fp32; weights gathered to fp32 by `train.load.load_model`) and writes it with `hf.export.export_hf`
as a self-contained Hugging Face model directory (what it holds: `hf/export.py`), of either
architecture: Origin as a plain `GPTNeoXForCausalLM` or `LlamaForCausalLM`, the others as remote code.

`out` is checked before anything loads: never a run or checkpoint directory, inside one or holding
one (what a run looks like is train's knowledge, checked here), then `hf.export.check_out`'s rules:
a non-empty `out` must be a previous export, recognised by the marker `coca_lm_export.json` that
lists its files, and is replaced only with `overwrite=true`. The export is written beside `out` and
renamed in: a failure leaves the previous export or nothing.

Errors are one `error: ...` line with errors.py's exit status: 2 for a wrong command line (an
unknown argument or bad value, an `out` refused: hf's `ExportError`), 1 for an unusable input (a
missing run, a bad checkpoint, a tokenizer the export cannot express).
"""

from __future__ import annotations

import sys
from pathlib import Path

from data.cli import exit_code
from data.tokenizer import Tokenizer
from errors import EXIT_USAGE, UsageError, UserError, report_error
from hf.export import ExportError, check_out, export_hf, native, tokenizer_refusal
from model.config import parse_scaling
from train.checkpoint import MARKER, find_checkpoint

RUN_FILES = ("checkpoints", "metrics.jsonl", "deepspeed.json")  # beside config.yaml: a run directory
USAGE = ("usage: python -m train.export_hf run=<run dir or checkpoint> out=<dir> "
         "[rope_scaling=none|linear:F|ntk:F|dynamic:F|yarn:F|llama3:F] [overwrite=true]")


def training_files(path: Path) -> str | None:
    """'run' or 'checkpoint' when `path` holds a training run's or a checkpoint's files, else None."""
    if not path.is_dir():
        return None
    if (path / "config.yaml").is_file() and any((path / name).exists() for name in RUN_FILES):
        return "run"
    if (path / MARKER).is_file() or any(path.glob("*model_states.pt")) or any(path.glob("client_rank*.pt")):
        return "checkpoint"
    return None


def check_outside_runs(out: Path, run: Path) -> None:
    """Refuse an `out` that is, lies inside or contains a run or checkpoint directory (or `run`).
    A symbolic link is left to `check_out`, which refuses it."""
    target = out.expanduser().absolute()
    if target.is_symlink():
        return
    real = target.resolve()
    for place in (real, *real.parents):
        kind = training_files(place)
        if kind:
            where = "is" if place == real else f"lies inside {place}, which is"
            raise ExportError(f"out={out} {where} a {kind} directory: give out= a directory outside runs")
    source = run.expanduser().resolve()
    if source == real or real in source.parents:
        raise ExportError(f"out={out} contains run={run}: give out= a directory outside the run")
    inner = next((p for p in sorted(real.iterdir()) if training_files(p)), None) if real.is_dir() else None
    if inner is not None:
        raise ExportError(f"out={out} contains the {training_files(inner)} directory {inner}: "
                          "give out= a new or empty directory")


def _parse_args(argv: list[str]) -> dict[str, str]:
    args = {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq or key not in ("run", "out", "rope_scaling", "overwrite"):
            raise UsageError(f"unknown argument {arg!r}; {USAGE}")
        args[key] = value
    for key in ("run", "out"):
        if not args.get(key):
            raise UsageError(f"{key}= is required; {USAGE}")
    if args.get("overwrite", "false") not in ("true", "false"):
        raise UsageError(f"overwrite={args['overwrite']!r} must be true or false")
    return args


def main(argv: list[str] | None = None) -> int:
    """Exit 0 with the directory written, else 1 or 2 (the module's docstring) with one `error:` line."""
    from train.load import checkpoint_tokenizer, load_model

    try:
        args = _parse_args(sys.argv[1:] if argv is None else argv)
        out, run, overwrite = Path(args["out"]), Path(args["run"]), args.get("overwrite") == "true"
        scaling = parse_scaling(args["rope_scaling"]) if "rope_scaling" in args else None
        if not run.exists():
            raise FileNotFoundError(f"run or checkpoint not found: {run}")
        check_outside_runs(out, run)
        check_out(out, overwrite)
        ckpt = find_checkpoint(run)
        stored = checkpoint_tokenizer(ckpt)
        refusal = tokenizer_refusal(stored) if isinstance(stored, Tokenizer) else None
        if refusal:
            raise UserError(refusal)
        model, _, tokenizer = load_model(str(ckpt))  # DeepSpeed's merge is quiet (train.load)
        if scaling is not None:
            model.set_rope_scaling(scaling.type, scaling.factor)
        export_hf(model, tokenizer, out, overwrite=overwrite, checkpoint=ckpt)
    except (ExportError, UserError, ValueError, OSError) as error:
        return report_error(error, EXIT_USAGE if isinstance(error, ExportError) else exit_code(error))
    m = model.cfg
    kind = f"llama {m.design.label}" if m.arch == "llama" else m.design.label
    code = "" if native(m) else " (trust_remote_code=True)"
    s = m.rope_scaling
    rope = "" if not m.design.rope else (" (no RoPE scaling)" if s.type == "none"
                                         else f" (RoPE scaling {s.type}:{s.factor:g})")
    print(f"exported {kind}{rope} to {out}: AutoModelForCausalLM{code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
