"""The RoPE-scaling sweep: every task run under each scaling on one loaded model.

Scaling is switched in place with `model.set_rope_scaling` (no reload, no retraining) and put back
to the trained setting afterwards. A design without RoPE (ALiBi) takes none of a sweep's RoPE
scalings: they are skipped with a note that ends up in the report, and their length temperature
(`dynamic:8+temp`) is kept (`none+temp`). A single scaling asked for (`model.rope_scaling`) that the
design cannot take is refused, as generate's and the exporter's `rope_scaling=` are.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch
from tqdm import tqdm

from data.ruler.tasks import RulerCase
from data.tasks import PasskeyCase, RecallCase
from eval.attention_stats import attention_statistics, head_statistics, last_query_scores
from eval.config import Scaling
from eval.passkey import score_cases
from eval.perplexity import evaluate_perplexity
from eval.position_loss import position_losses, span_rows
from eval.recall import score_recall
from eval.ruler import generation
from model import Design, ModelConfig


def applicable(scalings: Sequence[Scaling], design: Design) -> tuple[list[Scaling], list[str]]:
    """The scalings as this design takes them, and notes about what was skipped: without RoPE, each
    scaling's RoPE part is dropped and its length temperature kept (`dynamic:8+temp` -> `none+temp`),
    each setting once."""
    if design.rope:
        return list(scalings), []
    kept = list(dict.fromkeys(Scaling("none", 1.0, s.temperature) for s in scalings))
    skipped = [s.label for s in scalings if s.type != "none"]
    notes = [f"{design.name} has no RoPE: scaling {', '.join(skipped)} skipped"] if skipped else []
    instead = [s.label for s in kept if s not in scalings]
    if instead:
        notes.append(f"evaluated as {', '.join(instead)} instead")
    return kept, notes


def rope_request_refusal(requested: str | None, factor: float, model: ModelConfig) -> str | None:
    """Why the run's model cannot take `model.rope_scaling` (type `requested`, None: as trained), in
    one line naming the key (`ModelConfig`'s own check, as generate and the exporter meet it)."""
    if requested is None:
        return None
    try:
        replace(model, rope_scaling=replace(model.rope_scaling, type=requested, factor=factor))
    except ValueError as error:
        return str(error)
    return None


@contextmanager
def scaled(model, scaling: Scaling, trained: Scaling) -> Iterator[None]:
    """Evaluate under `scaling` (and its temperature), then restore the trained setting."""
    model.set_rope_scaling(scaling.type, scaling.factor)
    model.set_length_temperature(scaling.temperature)
    try:
        yield
    finally:
        model.set_rope_scaling(trained.type, trained.factor)
        model.set_length_temperature(trained.temperature)


def sweep_ppl(
    model, documents, lengths: Sequence[int], stride: int, scalings: Sequence[Scaling], trained: Scaling,
    batch_tokens: int, progress: bool,
) -> list[dict]:
    rows = []
    for s in scalings:
        with scaled(model, s, trained):
            for r in evaluate_perplexity(model, documents, lengths, stride, batch_tokens, progress):
                rows.append({"scaling": s.label, **r.as_dict()})
    return rows


def sweep_passkey(
    model, cases: Sequence[PasskeyCase], modes: Sequence[str], scalings: Sequence[Scaling], trained: Scaling,
    progress: bool, batch_tokens: int,
) -> list[dict]:
    records = []
    for s in scalings:
        with scaled(model, s, trained):
            for length in dict.fromkeys(c.length for c in cases):
                group = [c for c in cases if c.length == length]
                scored = score_cases(model, group, modes, progress, batch_tokens)
                records += [{"scaling": s.label, **r} for r in scored]
    return records


def sweep_recall(
    model, cases: Sequence[RecallCase], scalings: Sequence[Scaling], trained: Scaling, progress: bool,
    batch_tokens: int,
) -> list[dict]:
    records = []
    for s in scalings:
        with scaled(model, s, trained):
            for length in dict.fromkeys(c.length for c in cases):
                group = [c for c in cases if c.length == length]
                scored = score_recall(model, group, progress, batch_tokens)
                records += [{"scaling": s.label, **r} for r in scored]
    return records


def sweep_position_loss(
    model, documents, length: int, train_len: int, scalings: Sequence[Scaling], trained: Scaling, progress: bool,
) -> tuple[list[dict], dict[str, list[float]]]:
    """Per scaling: the span rows and the whole per-position curve."""
    rows, curves = [], {}
    for s in scalings:
        with scaled(model, s, trained):
            curve = position_losses(model, documents, length, progress, desc=f"position loss {s.label}")
        rows += [{"scaling": s.label, **r} for r in span_rows(curve, train_len)]
        curves[s.label] = [round(float(x), 5) for x in curve]
    return rows, curves


def sweep_ruler(
    model, cases: Sequence[RulerCase], tokenizer, scalings: Sequence[Scaling], trained: Scaling, batch_tokens: int,
    progress: bool,
) -> list[dict]:
    """Every case answered and scored under each scaling, one progress bar per scaling."""
    records = []
    for s in scalings:
        with scaled(model, s, trained), tqdm(total=len(cases), desc=f"ruler {s.label}", unit="case",
                                             disable=not progress) as bar:
            for task in dict.fromkeys(c.task for c in cases):
                for length in dict.fromkeys(c.length for c in cases if c.task == task):
                    group = [c for c in cases if c.task == task and c.length == length]
                    scored = generation.score_cases(model, group, tokenizer, batch_tokens, bar)
                    records += [{"scaling": s.label, **r} for r in scored]
    return records


@torch.inference_mode()
def sweep_attention(
    model, ids: Sequence[int], scalings: Sequence[Scaling], trained: Scaling, plot_layers: Sequence[int],
    sigma: float, window: int, chunk: int,
) -> tuple[list[dict], dict[str, dict[int, np.ndarray]]]:
    """Per-layer statistics for each scaling, and the last query's scores for `plot_layers`."""
    device = next(model.parameters()).device
    idx = torch.tensor([list(ids)], device=device)
    rows, profiles = [], {}
    for s in scalings:
        with scaled(model, s, trained):
            layers = model.capture_qk(idx)
        rows += [{"scaling": s.label, **r} for r in attention_statistics(layers, sigma, window, chunk)]
        profiles[s.label] = {i: last_query_scores(layers[i - 1]).cpu().numpy() for i in plot_layers}
        del layers
    return rows, profiles


@torch.inference_mode()
def sweep_heads(
    model, ids: Sequence[int], lengths: Sequence[int], scalings: Sequence[Scaling], trained: Scaling, train_len: int,
    chunk: int,
) -> list[dict]:
    """Per scaling and length, each head's mechanism measures on the first `length` ids (one forward
    each: a dynamic scaling depends on the length read)."""
    device = next(model.parameters()).device
    rows = []
    for s in scalings:
        for length in lengths:
            with scaled(model, s, trained):
                layers = model.capture_qk(torch.tensor([list(ids[:length])], device=device))
            rows += [{"scaling": s.label, "length": length, **r} for r in head_statistics(layers, train_len, chunk)]
            del layers
    return rows


def default_plot_layers(n_layer: int, n: int = 4) -> list[int]:
    """n evenly spaced layers ending with the last: 6, 12, 18, 24 of 24."""
    return sorted({max(1, round(n_layer * (i + 1) / n)) for i in range(n)})
