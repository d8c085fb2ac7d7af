"""`python -m eval run=<run dir or checkpoint> task=ppl|passkey|attention|all key=value ...`

Loads the model once, runs the tasks under each RoPE scaling, writes `<run>/eval/<task>.json` and
the tables and figures (`eval.report`), and logs them to W&B. Bad input ends with a one-line
`error: ...` and exit status 2.
"""

from __future__ import annotations

import dataclasses
import datetime
import resource
import sys
import time
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.config import DataConfig
from data.documents import long_documents
from eval import report
from eval.config import EvalConfig, Scaling, default_lengths
from eval.passkey import make_cases
from eval.sweep import applicable, default_plot_layers, sweep_attention, sweep_passkey, sweep_ppl
from eval.wandb_log import log_to_wandb

ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


class EvalError(Exception):
    """A problem with the user's input, reported as one line."""


def run_dir_of(path: Path) -> Path:
    """The run directory of a run or of one of its checkpoints (`<run>/checkpoints/step_*`)."""
    return path.parent.parent if path.parent.name == "checkpoints" else path


def evaluate(cfg: EvalConfig) -> dict[str, list[Path]]:
    """Run the configured tasks and write results; returns the files written, by task."""
    from train.export import load_model

    run = Path(cfg.run)
    if not run.exists():
        raise EvalError(f"run or checkpoint not found: {run}")
    model, train_cfg, tokenizer = load_model(str(run), device=cfg.device)
    mcfg = train_cfg.model
    train_len = mcfg.max_seq_len
    trained = Scaling(mcfg.rope_scaling.type, mcfg.rope_scaling.factor)
    requested = [Scaling.parse(s) for s in cfg.scalings]
    if not requested:
        rs = cfg.model.rope_scaling
        requested = [Scaling(rs.type, rs.factor) if rs is not None else trained]
    scalings, notes = applicable(requested, mcfg.attention)
    data_cfg: DataConfig = dataclasses.replace(train_cfg.data, sources=list(cfg.sources) or train_cfg.data.sources)
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir_of(run) / "eval"
    label = mcfg.attention if mcfg.attention != "coca" else f"coca-{mcfg.coca_form}"
    meta = {
        "run": str(run),
        "label": label,
        "attention": mcfg.attention,
        "coca_form": mcfg.coca_form if mcfg.attention == "coca" else None,
        "train_len": train_len,
        "n_layer": mcfg.n_layer,
        "n_embd": mcfg.n_embd,
        "trained_scaling": trained.label,
        "step": _step_of(run),
        "source": ", ".join(s.describe() for s in data_cfg.sources) + f" ({cfg.split})",
        "device": cfg.device,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }

    prefix = [tokenizer.eos_id]  # training streams put EOS before every document

    def documents(n_tokens: int, n_docs: int) -> list[list[int]]:
        """`n_docs` documents of exactly `n_tokens` ids, starting with the EOS prefix."""
        try:
            docs = long_documents(data_cfg, tokenizer, min_tokens=n_tokens - 1, n_docs=n_docs, split=cfg.split, seed=cfg.seed)
        except ValueError as e:
            raise EvalError(str(e)) from None
        return [prefix + d for d in docs]

    for task in cfg.tasks:
        start = time.perf_counter()
        if task == "ppl":
            lengths = cfg.ppl.lengths or default_lengths(train_len)
            docs = documents(max(lengths) + 1, cfg.ppl.n_docs)
            rows = sweep_ppl(model, docs, lengths, cfg.ppl.stride or train_len, scalings, trained, cfg.ppl.batch_tokens, cfg.progress)
            payload = {"meta": meta, "rows": rows, "notes": notes}
        elif task == "passkey":
            lengths = cfg.passkey.lengths or default_lengths(train_len)
            try:
                cases = [c for L in lengths for c in make_cases(tokenizer, L, cfg.passkey.n_cases, cfg.seed, cfg.passkey.depths, prefix)]
            except ValueError as e:
                raise EvalError(str(e)) from None
            records = sweep_passkey(model, cases, cfg.passkey.modes, scalings, trained, cfg.progress)
            payload = {"meta": meta, "cases": records, "modes": list(cfg.passkey.modes), "notes": notes}
        else:
            a = cfg.attention
            length = a.length or 4 * train_len
            plot_layers = a.layers or default_plot_layers(mcfg.n_layer)
            if max(plot_layers) > mcfg.n_layer:
                raise EvalError(f"attention.layers: layer {max(plot_layers)} > model.n_layer={mcfg.n_layer}")
            att_scalings, att_notes = applicable([Scaling.parse(s) for s in a.scalings], mcfg.attention)
            (segment,) = documents(length, 1)
            rows, profiles = sweep_attention(model, segment, att_scalings, trained, plot_layers, a.sigma, a.window, a.chunk)
            out.mkdir(parents=True, exist_ok=True)
            report.save_profiles(out / report.PROFILES_FILE, profiles)
            payload = {"meta": meta, "rows": rows, "length": length, "sigma": a.sigma, "window": a.window,
                       "layers": plot_layers, "notes": att_notes}
        payload["seconds"] = round(time.perf_counter() - start, 2)
        payload["peak_rss_mb"] = round(peak_rss_mb(), 1)
        report.save_json(out / f"{task}.json", payload)
    written = report.render(report.run_results(out), out)
    log_to_wandb(cfg, train_cfg, run_dir_of(run), out, written)
    return written


def _step_of(run: Path) -> int | None:
    """The step in a checkpoint directory's name (`step_00001000`), when `run` is one."""
    name = run.name
    return int(name.split("_", 1)[1]) if name.startswith("step_") and name[5:].isdigit() else None


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@hydra.main(version_base="1.3", config_path="../conf", config_name="eval")
def main(dcfg: DictConfig) -> None:
    try:
        cfg: EvalConfig = OmegaConf.to_object(dcfg)
        torch.manual_seed(cfg.seed)
        written = evaluate(cfg)
    except (EvalError, ValueError, FileNotFoundError, OmegaConfBaseException) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        sys.exit(2)
    for task, paths in written.items():
        print(f"{task}: " + ", ".join(str(p) for p in paths))


def _one_line(e: Exception) -> str:
    """OmegaConf wraps a __post_init__ ValueError with full-key context lines: keep the cause."""
    cause = e.__cause__ if isinstance(e, OmegaConfBaseException) and e.__cause__ else e
    return str(cause).strip().splitlines()[0]


if __name__ == "__main__":
    main()
