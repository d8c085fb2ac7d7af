"""The checks a run can fail in seconds, made before torch's process group and DeepSpeed start.

A config typo already fails at composition; these are the next most common mistakes: a run
directory that cannot be written, a run that already exists (and no `resume=`), an `init_from`
that is neither a checkpoint nor a Hugging Face directory this code reads (or a model shape that
disagrees with one: `hf.imports.combine`, `checkpoint.check_compatible`, exit 2 either way), and a
data source that is missing or empty. Each is one
line, in about the time of a config typo, instead of after DeepSpeed's start-up (and, on a first
start, its C++ op build). Every rank makes the same checks; they change nothing. What the start is
(`train.start.plan_start`) is decided here, once, and returned for the run to be built from.
"""

from __future__ import annotations

from collections.abc import Sequence

from data.config import check_dir
from data.sources import check_sources
from train.config import TrainConfig
from train.start import Start, plan_start


def preflight(cfg: TrainConfig, overrides: Sequence[str] = ()) -> Start:
    """The checks, and the start `plan_start` decides (`overrides`: the command line's)."""
    check_dir(cfg.run_dir, "run_dir")
    start = plan_start(cfg, overrides)  # refuses to overwrite a run silently, and a model its source disagrees with
    check_sources(cfg.data)
    return start
