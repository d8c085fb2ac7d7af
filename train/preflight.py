"""The checks a run can fail in seconds, made before torch's process group and DeepSpeed start.

A config typo already fails at composition; these are the next most common mistakes: a run
directory that cannot be written, a run that already exists (and no `resume=`), an `init_from`
that is neither a checkpoint nor a Hugging Face directory this code reads (or a model shape that
disagrees with one: `hf.imports.combine`, `checkpoint.check_compatible`, exit 2 either way), and a
data source that is missing or empty. Each is one
line, in about the time of a config typo, instead of after DeepSpeed's start-up (and, on a first
start, its C++ op build). Every rank makes the same checks; they change nothing (`setup` applies
the model source to the config).
"""

from __future__ import annotations

from data.config import check_dir
from data.sources import check_sources
from hf.imports import combine
from train import checkpoint
from train.config import TrainConfig
from train.restore import checkpoint_to_resume


def preflight(cfg: TrainConfig) -> None:
    check_dir(cfg.run_dir, "run_dir")
    origin = checkpoint_to_resume(cfg)  # refuses to overwrite a run silently
    if cfg.init_from:
        origin = checkpoint.find_init(cfg.init_from)
    source = checkpoint.model_source(origin) if origin is not None else None
    if source is not None:
        combine(source.model, cfg.model, source.where)
    elif cfg.init_from and checkpoint.saved_model(origin).attention == cfg.model.attention:
        checkpoint.check_compatible(origin, cfg.model)  # a conversion checks its own shapes (exit 2 too)
    check_sources(cfg.data)
