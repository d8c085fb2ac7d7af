"""`python -m eval run=<run, checkpoint or HF directory> task=ppl|passkey|recall|attention|position_loss|ruler|all ...`

Loads the model once, runs the tasks under each RoPE scaling, writes `<run>/eval/<task>.json` and
the tables and figures (`eval.report`), and logs them to W&B. Bad input ends with a one-line
`error: ...`, checked before the model loads where it can be, with errors.py's exit status: 2 for
a wrong command line (key, value, device, a file where a folder is expected), 1 for an unusable
input it names (a missing run or file, a bad checkpoint, an unusable corpus: `data.cli`).

The evaluation corpus: the run's training sources (their `split`, test by default), or the
`sources=` given here. Files given here are read whole when they are split by document (a path
without `{split}`): `sources=[{kind:files,path:"books/test.jsonl"}]` evaluates every document of
that file, whatever its name; a `{split}` path, stdlib or hub sources still read `split`.
"""

from __future__ import annotations

import dataclasses
import datetime
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.cli import booleans_only, compose_tree, exit_code, validated
from data.config import DataConfig, DataError, check_dir
from data.documents import long_documents
from data.ruler.haystack import read_essay
from data.ruler.tasks import TASKS as RULER_TASKS
from data.ruler.tasks import Encoder, TooShort
from data.ruler.tasks import make_cases as make_ruler_cases
from data.sources import by_document, source_files
from data.tasks import make_cases, make_recall_cases, recall_vocab
from data.tokenizer import Tokenizer
from errors import UsageError, UserError, report_error
from eval import long_context_report, report, results
from eval.attention_stats import distance_bins
from eval.config import EvalConfig, Scaling, default_lengths
from eval.sweep import (
    applicable,
    default_plot_layers,
    rope_request_refusal,
    sweep_attention,
    sweep_heads,
    sweep_passkey,
    sweep_position_loss,
    sweep_ppl,
    sweep_recall,
    sweep_ruler,
)
from eval.wandb_log import log_to_wandb
from model import GPT
from model.denormals import flush_denormals
from train.config import TrainConfig, setup_id
from train.load import check_device, load_model, model_config_of, model_path


class EvalError(UsageError):
    """A request this run cannot serve (a length, layer or source it lacks), reported as one line."""


@dataclass
class Session:
    """One loaded run and what every task needs from it."""

    cfg: EvalConfig
    model: GPT
    train_cfg: TrainConfig
    tokenizer: Tokenizer
    data: DataConfig
    trained: Scaling
    out: Path
    meta: dict

    @property
    def whole(self) -> bool:
        """Explicit `sources=` are the evaluation corpus: by-document files are read whole."""
        return bool(self.cfg.sources)

    @property
    def train_len(self) -> int:
        return self.train_cfg.model.max_seq_len

    @property
    def prefix(self) -> list[int]:
        """Training streams put EOS before every document: evaluation inputs start the same way."""
        return [self.tokenizer.eos_id]

    def documents(self, n_tokens: int, n_docs: int) -> list[list[int]]:
        """`n_docs` evaluation documents of exactly `n_tokens` ids, the EOS prefix first."""
        try:
            docs = long_documents(self.data, self.tokenizer, min_tokens=n_tokens - 1, n_docs=n_docs,
                                  split=self.cfg.split, seed=self.cfg.seed, whole=self.whole)
        except DataError:
            raise
        except ValueError as e:
            raise EvalError(str(e)) from None
        return [self.prefix + d for d in docs]

    def scalings(self) -> tuple[list[Scaling], list[str]]:
        """The sweep for ppl and passkey: `scalings`, else `model.rope_scaling`, else as trained."""
        requested = [Scaling.parse(s) for s in self.cfg.scalings]
        if not requested:
            rs = self.cfg.model.rope_scaling
            requested = [Scaling.parse(f"{rs.type}:{rs.factor}") if rs.type is not None else self.trained]
        return applicable(requested, self.train_cfg.model.design)


def check_sources_listed(cfg: EvalConfig) -> None:
    """Explicit local sources exist and hold text files (documents are read after the model loads)."""
    for src in cfg.sources:
        if src.kind == "files":
            source_files(src, cfg.split, DataConfig(sources=[src]))
        elif not src.is_text:
            raise EvalError(f"sources: {src.describe()} is not a text corpus; evaluate on stdlib, files or hub sources")


def open_session(cfg: EvalConfig) -> Session:
    run = Path(cfg.run)
    if not run.exists():
        raise FileNotFoundError(f"run or checkpoint not found: {run}")
    check_device(cfg.device)
    out = Path(cfg.out_dir) if cfg.out_dir else run_dir_of(run) / "eval"
    check_dir(out, "out_dir")
    check_sources_listed(cfg)
    ckpt = model_path(run)  # a Hugging Face directory: imported
    refusal = rope_request_refusal(cfg.model.rope_scaling.type, cfg.model.rope_scaling.factor, model_config_of(ckpt))
    if refusal:
        raise EvalError(refusal)
    model, train_cfg, tokenizer = load_model(str(ckpt), device=cfg.device)
    m = train_cfg.model
    data = dataclasses.replace(train_cfg.data, sources=list(cfg.sources) or train_cfg.data.sources)
    whole = bool(cfg.sources) and any(by_document(s) for s in data.sources)
    trained = Scaling(m.rope_scaling.type, m.rope_scaling.factor, m.length_temperature)
    stream, prompt_seed = cfg.prompt_stream(train_cfg.seed)
    meta = {
        "run": str(run),
        "label": m.design.label,
        "attention": m.attention,
        "coca_form": m.design.form,  # the results' name for it (model.design_params.coca.form)
        "train_len": m.max_seq_len,
        "n_layer": m.n_layer,
        "n_embd": m.n_embd,
        "trained_scaling": trained.label,
        "seed": train_cfg.seed,
        "prompt_stream": stream,
        "prompt_seed": prompt_seed,
        "config_id": setup_id(train_cfg),
        "checkpoint": str(ckpt),
        "step": _step_of(ckpt),
        "source": ", ".join(s.describe() for s in data.sources if s.is_text)
                  + (" (whole files)" if whole else f" ({cfg.split})"),
        "device": cfg.device,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    return Session(cfg, model, train_cfg, tokenizer, data, trained, out, meta)


def run_ppl(s: Session) -> dict:
    c = s.cfg.ppl
    lengths = c.lengths or default_lengths(s.train_len)
    scalings, notes = s.scalings()
    docs = s.documents(max(lengths) + 1, c.n_docs)
    rows = sweep_ppl(s.model, docs, lengths, c.stride or s.train_len, scalings, s.trained, c.batch_tokens,
                     s.cfg.progress)
    return {"rows": rows, "notes": notes}


def prompt_cases(task: str, lengths: list[int], s: Session, make) -> tuple[list, list[str]]:
    """`make(length)` at each length; lengths given explicitly must all fit the prompt, default
    ones (1x .. 64x) too short for it are skipped with a note."""
    cases, notes = [], []
    for length in lengths or default_lengths(s.train_len):
        try:
            cases += make(length)
        except ValueError as e:
            if lengths:
                raise EvalError(str(e)) from None
            notes.append(f"length {length} skipped: {e}")
    if not cases:
        raise EvalError(f"no {task} length fits the prompt: " + "; ".join(notes))
    return cases, notes


def run_passkey(s: Session) -> dict:
    c = s.cfg.passkey
    scalings, notes = s.scalings()
    cases, skipped = prompt_cases("passkey", c.lengths, s, lambda n: make_cases(
        s.tokenizer, n, c.n_cases, s.meta["prompt_seed"], c.depths, s.prefix, s.meta["prompt_stream"]))
    records = sweep_passkey(s.model, cases, c.modes, scalings, s.trained, s.cfg.progress, c.batch_tokens)
    return {"cases": records, "modes": list(c.modes), "notes": notes + skipped}


def run_recall(s: Session) -> dict | None:
    c = s.cfg.recall
    scalings, notes = s.scalings()
    try:
        recall_vocab(s.tokenizer)
    except ValueError as e:  # a tokenizer too small for recall keys: skipped unless asked for by name
        if s.cfg.task == "recall":
            raise EvalError(str(e)) from None
        print(f"recall skipped: {e}", file=sys.stderr)
        return None
    cases, skipped = prompt_cases("recall", c.lengths, s, lambda n: make_recall_cases(
        s.tokenizer, n, c.n_cases, c.queries, s.meta["prompt_seed"], s.prefix, s.meta["prompt_stream"]))
    records = sweep_recall(s.model, cases, scalings, s.trained, s.cfg.progress, c.batch_tokens)
    return {"cases": records, "queries": c.queries, "notes": notes + skipped}


def run_attention(s: Session) -> dict:
    c, n_layer = s.cfg.attention, s.train_cfg.model.n_layer
    length = c.length or 4 * s.train_len
    layers = c.layers or default_plot_layers(n_layer)
    if max(layers) > n_layer:
        raise EvalError(f"attention.layers: layer {max(layers)} > model.n_layer={n_layer}")
    scalings, notes = applicable([Scaling.parse(x) for x in c.scalings], s.train_cfg.model.design)
    (segment,) = s.documents(length, 1)
    rows, profiles = sweep_attention(s.model, segment, scalings, s.trained, layers, c.sigma, c.window, c.chunk)
    s.out.mkdir(parents=True, exist_ok=True)
    results.save_profiles(s.out / results.PROFILES_FILE, profiles)
    head_ids, head_lengths, skipped = head_segment(s, segment)
    heads = sweep_heads(s.model, head_ids, head_lengths, scalings, s.trained, s.train_len, c.chunk)
    return {"rows": rows, "length": length, "sigma": c.sigma, "window": c.window, "layers": layers,
            "heads": heads, "head_lengths": head_lengths, "distance_bins": distance_bins(max(head_lengths)),
            "notes": notes + skipped}


def head_segment(s: Session, segment: list[int]) -> tuple[list[int], list[int], list[str]]:
    """The ids and lengths of the per-head measures: `attention.head_lengths` (a document must reach
    the longest), or 1x, 4x and 16x the training length less those longer than every document, with
    a note for each skipped; the attention segment already read serves where it is long enough."""
    given = s.cfg.attention.head_lengths
    lengths, notes = sorted(set(given)) or [f * s.train_len for f in (1, 4, 16)], []
    while max(lengths) > len(segment):
        try:
            return s.documents(max(lengths), 1)[0], lengths, notes
        except EvalError as e:
            if given or len(lengths) == 1:
                raise
            notes.append(f"per-head measures at {lengths.pop()} tokens skipped: {e}")
    return segment, lengths, notes


def run_position_loss(s: Session) -> dict:
    c = s.cfg.position_loss
    length = c.length or max(s.cfg.ppl.lengths or default_lengths(s.train_len))
    scalings, notes = s.scalings()
    docs = s.documents(length + 1, c.n_docs)
    rows, curves = sweep_position_loss(s.model, docs, length, s.train_len, scalings, s.trained, s.cfg.progress)
    return {"rows": rows, "curves": curves, "length": length, "n_docs": len(docs), "notes": notes}


def run_ruler(s: Session) -> dict:
    """Every task at every length (default: 1x .. 32x, skipping with a note those a task's prompt
    does not fit; lengths given must fit), under each scaling."""
    c = s.cfg.ruler
    scalings, notes = s.scalings()
    lengths = c.lengths or default_lengths(s.train_len, 32)
    essay = None
    if any(RULER_TASKS[t].needs_corpus for t in c.names):
        try:
            essay = read_essay(s.data, max(lengths), s.cfg.split, s.cfg.seed, s.whole)
        except ValueError as e:
            raise EvalError(str(e)) from None
    encoder, cases, skipped = Encoder(s.tokenizer), [], {}
    for task in c.names:
        for length in lengths:
            try:
                cases += make_ruler_cases(task, s.tokenizer, length, c.cases, s.meta["prompt_seed"],
                                          stream=s.meta["prompt_stream"], settings=c.settings(), prefix=s.prefix,
                                          essay=essay, encoder=encoder)
            except TooShort as e:
                if c.lengths:
                    raise EvalError(f"ruler.lengths: {e}") from None
                skipped.setdefault(task, []).append((length, e.needed))
            except ValueError as e:
                raise EvalError(f"ruler: {e}") from None
    skipped_notes = [f"{task}: length {', '.join(str(n) for n, _ in fail)} skipped, shorter than its prompt without "
                     f"haystack and its answer budget (up to {max(k for _, k in fail)} tokens)"
                     for task, fail in skipped.items()]
    if not cases:
        raise EvalError("no RULER task fits any length: " + "; ".join(skipped_notes))
    records = sweep_ruler(s.model, cases, s.tokenizer, scalings, s.trained, c.batch_tokens, s.cfg.progress)
    return {"cases": records, "tasks": c.names, "budget": c.budget, "hops": c.hops, "chains": c.chains,
            "fewshot": c.fewshot, "essay": essay.source if essay else None, "notes": notes + skipped_notes}


TASK_RUNNERS = {"ppl": run_ppl, "passkey": run_passkey, "recall": run_recall, "attention": run_attention,
                "position_loss": run_position_loss, "ruler": run_ruler}


def evaluate(cfg: EvalConfig) -> dict[str, list[Path]]:
    """Run the configured tasks and write results; returns the files written, by task."""
    session = open_session(cfg)
    for task in cfg.tasks:
        start = time.perf_counter()
        result = TASK_RUNNERS[task](session)
        if result is None:
            continue
        payload = {"meta": session.meta, **result}
        payload["seconds"] = round(time.perf_counter() - start, 2)
        payload["peak_rss_mb"] = round(peak_rss_mb(), 1)
        results.save_json(session.out / f"{task}.json", payload)
    written = report.render(report.run_results(session.out), session.out)
    written.update(long_context_report.render_run(session.out))
    log_to_wandb(cfg, session.train_cfg, run_dir_of(Path(cfg.run)), session.out, written)
    return written


def run_dir_of(path: Path) -> Path:
    """The run directory of a run or of one of its checkpoints (`<run>/checkpoints/step_*`)."""
    return path.parent.parent if path.parent.name == "checkpoints" else path


def _step_of(run: Path) -> int | None:
    """The step in a checkpoint directory's name (`step_00001000`), when `run` is one."""
    name = run.name
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


USAGE = """usage: python -m eval run=<run dir or checkpoint> [task=ppl|passkey|recall|attention|position_loss|ruler|all]
             [key=value ...]
  e.g.  python -m eval run=runs/tiny task=ppl ppl.lengths=[128,512,2048] ppl.n_docs=5
        python -m eval run=runs/tiny task=ruler ruler.tasks=[niah_single_1,vt] ruler.lengths=[512,1024] ruler.cases=20
        python -m eval run=runs/tiny scalings=[none,dynamic:2,dynamic:4,dynamic:8]
        python -m eval run=runs/tiny task=passkey model.rope_scaling.type=dynamic model.rope_scaling.factor=4
  keys: eval/config.py (the schema; conf/eval.yaml composes it); --cfg job prints the composed config"""


def _register_schema() -> None:
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)


def compose_config(overrides: list[str]) -> DictConfig:
    """`conf/eval.yaml` with command-line overrides, type-checked against `EvalConfig` (a boolean
    takes only true or false)."""
    booleans_only(EvalConfig, overrides)
    return compose_tree("eval", overrides, _register_schema, job_name="eval")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(args):
        print(USAGE)
        return 0
    show = "--cfg" in args
    overrides = [a for a in args if a not in ("--cfg", "job")]
    flush_denormals()  # first: OpenMP's workers inherit it (model/denormals.py)
    try:
        dcfg = compose_config(overrides)
        if show:
            print(OmegaConf.to_yaml(dcfg))
            return 0
        cfg = validated(EvalConfig, dcfg)
        torch.manual_seed(cfg.seed)
        written = evaluate(cfg)
    except (UserError, HydraException, OmegaConfBaseException, ValueError, OSError) as e:
        return report_error(e, exit_code(e))
    for task, paths in written.items():
        print(f"{task}: " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
