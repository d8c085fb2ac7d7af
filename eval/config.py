"""Typed evaluation configuration: the schema of `conf/eval.yaml` (Hydra type-checks overrides).

Lengths left empty default to multiples of the run's training length (`model.max_seq_len`):
1x, 2x, 4x ... 64x, the paper's 512 .. 32K at a training length of 512.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from data.config import SourceConfig, check_split
from data.ruler.tasks import TASKS as RULER_TASKS
from data.ruler.tasks import Settings
from model.config import parse_scaling

TASKS = ("ppl", "passkey", "recall", "attention", "position_loss")  # `all`; `ruler` is asked for by name
TASK_CHOICES = TASKS + ("ruler", "all")
PASSKEY_MODES = ("teacher", "generate")
WANDB_MODES = ("auto", "offline", "online", "disabled")
PROMPT_SEEDS = ("run", "fixed")  # or a non-negative integer


@dataclass(frozen=True)
class Scaling:
    """A RoPE scaling applied at evaluation (`none` is plain RoPE), with or without the length
    temperature (`model.length_temperature`), written `+temp` after it: `dynamic:8+temp`, `none+temp`."""

    type: str
    factor: float = 1.0
    temperature: bool = False

    @property
    def label(self) -> str:
        rope = "none" if self.type == "none" else f"{self.type}:{self.factor:g}"
        return rope + (TEMPERATURE if self.temperature else "")

    @classmethod
    def parse(cls, text: str) -> Scaling:
        """`none`, `dynamic:4`, `linear:2.5`, `dynamic:8+temp` ... (`model.config.parse_scaling`)."""
        rope, temperature = (text[: -len(TEMPERATURE)], True) if text.endswith(TEMPERATURE) else (text, False)
        scaling = parse_scaling(rope or "none")  # `+temp`: the temperature alone
        return cls(scaling.type, scaling.factor, temperature)


TEMPERATURE = "+temp"  # a scaling's suffix that switches the length temperature on


@dataclass
class EvalRopeScaling:
    """The RoPE scaling to evaluate with when `scalings` is empty; type null: as trained."""

    type: Optional[str] = None
    factor: float = 1.0

    def __post_init__(self) -> None:
        if self.type is not None:
            try:
                Scaling.parse(f"{self.type}:{self.factor}")
            except ValueError as e:
                raise ValueError(f"model.rope_scaling: {e}") from None


@dataclass
class EvalModelConfig:
    rope_scaling: EvalRopeScaling = field(default_factory=EvalRopeScaling)


@dataclass
class PerplexityConfig:
    """Sliding-window perplexity (Press et al.).

    lengths: evaluation lengths (window sizes); empty: 1x .. 64x the training length.
    stride: tokens each window adds (paper: 512 at training length 512); null: the training length;
      clamped to the length for lengths below it.
    n_docs: documents of the evaluation split with at least max(lengths) + 1 tokens.
    batch_tokens: windows are batched up to this many tokens per forward.
    """

    lengths: list[int] = field(default_factory=list)
    stride: Optional[int] = None
    n_docs: int = 5
    batch_tokens: int = 16384

    def __post_init__(self) -> None:
        _positive_list("ppl.lengths", self.lengths)
        for name in ("n_docs", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ppl.{name}={getattr(self, name)} must be >= 1")
        if self.stride is not None and self.stride < 1:
            raise ValueError(f"ppl.stride={self.stride} must be >= 1")


@dataclass
class PasskeyConfig:
    """Passkey retrieval with the paper's prompt.

    lengths: total prompt + key tokens; empty: 1x .. 64x the training length.
    n_cases: cases per length (per depth when `depths` is set); the paper uses 100.
    depths: a depth sweep (fractions of the filler before the key); empty: a random depth per case.
    modes: teacher (one forward, argmax over the key tokens) and/or generate (greedy decoding).
    batch_tokens: teacher-forced cases of equal token count share a forward, up to this many tokens.
    """

    lengths: list[int] = field(default_factory=list)
    n_cases: int = 20
    depths: list[float] = field(default_factory=list)
    modes: list[str] = field(default_factory=lambda: ["teacher"])
    batch_tokens: int = 16384

    def __post_init__(self) -> None:
        _positive_list("passkey.lengths", self.lengths)
        if self.n_cases < 1 or self.batch_tokens < 1:
            raise ValueError(f"passkey.n_cases={self.n_cases} and passkey.batch_tokens={self.batch_tokens} "
                             "must be >= 1")
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"passkey.depths: {bad[0]} is not in [0, 1]")
        if not self.modes:
            raise ValueError(f"passkey.modes is empty: use one or both of {', '.join(PASSKEY_MODES)}")
        for mode in self.modes:
            if mode not in PASSKEY_MODES:
                raise ValueError(f"passkey.modes: {mode!r} is not one of {', '.join(PASSKEY_MODES)}")


@dataclass
class RecallConfig:
    """Multi-query associative recall (the prompt family of `data.synthetic` task recall).

    lengths: prompt tokens (pairs fill them); empty: 1x .. 64x the training length.
    n_cases: cases per length; queries: queried pairs per case (accuracy counts each query).
    batch_tokens: cases of equal token count share a forward, up to this many tokens.
    """

    lengths: list[int] = field(default_factory=list)
    n_cases: int = 20
    queries: int = 8
    batch_tokens: int = 16384

    def __post_init__(self) -> None:
        _positive_list("recall.lengths", self.lengths)
        if min(self.n_cases, self.queries, self.batch_tokens) < 1:
            raise ValueError(f"recall.n_cases={self.n_cases}, recall.queries={self.queries} and "
                             f"recall.batch_tokens={self.batch_tokens} must be >= 1")


@dataclass
class AttentionConfig:
    """Attention-score statistics on one long segment of the evaluation split (paper Figure 11).

    length: segment length; null: 4x the training length.
    layers: layers (from 1) whose last-query scores are plotted; empty: 4 evenly spaced, ending
      with the last (the paper's 6, 12, 18, 24 of 24).
    scalings: settings compared side by side (paper: without and with dynamic NTK).
    sigma: a score is an outlier above its query row's mean + sigma x std.
    window: local mass is the attention probability on the nearest `window` keys.
    chunk: queries scored at once (memory: chunk x length per head).
    head_lengths: segment lengths of the per-head measures (sink share, entropy, largest logit by
      distance: `eval.attention_stats`), each the start of one document; empty: 1x, 4x and 16x the
      training length, skipping with a note those no document of the corpus reaches.
    """

    length: Optional[int] = None
    layers: list[int] = field(default_factory=list)
    scalings: list[str] = field(default_factory=lambda: ["none", "dynamic:4"])
    sigma: float = 6.0
    window: int = 16
    chunk: int = 256
    head_lengths: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.length is not None and self.length < 2:
            raise ValueError(f"attention.length={self.length} must be >= 2")
        _positive_list("attention.layers", self.layers)
        if any(n < 2 for n in self.head_lengths):
            raise ValueError(f"attention.head_lengths: {min(self.head_lengths)} must be >= 2")
        for s in self.scalings:
            Scaling.parse(s)
        if not self.scalings:
            raise ValueError("attention.scalings is empty: use at least [none]")
        if self.sigma <= 0 or self.window < 1 or self.chunk < 1:
            raise ValueError("attention.sigma must be > 0, attention.window and attention.chunk >= 1")


@dataclass
class RulerConfig:
    """RULER's synthetic tasks (`data.ruler` builds the prompts, `eval.ruler` scores them).

    tasks: task names of RULER's synthetic.yaml; empty: all eleven (the essay haystacks are read
      from the evaluation corpus, `sources`/`split`). qa_1 and qa_2 need SQuAD / HotpotQA: not here.
    lengths: tokens of prompt + answer budget (RULER's max_seq_length), in the model's tokens;
      empty: 1x .. 32x the training length, skipping with a note those too short for a task
      (lengths given must all fit).
    cases: cases per task, length and scaling.
    budget: answer tokens generated (greedy); null: RULER's per task (NIAH 128, VT 30, CWE 120, FWE 50).
    hops, chains: variable tracking's chains (RULER's vt: 4 hops, 1 chain).
    fewshot: RULER's one-shot example in the VT and CWE prompts (off: the task prompt alone, shorter).
    batch_tokens: cases of one task and length share a forward and KV cache, up to this many tokens.
    """

    tasks: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    cases: int = 20
    budget: Optional[int] = None
    hops: int = 4
    chains: int = 1
    fewshot: bool = True
    batch_tokens: int = 16384

    def __post_init__(self) -> None:
        for task in self.tasks:
            if task not in RULER_TASKS:
                extra = " (RULER's qa tasks need SQuAD / HotpotQA downloads)" if task.startswith("qa") else ""
                raise ValueError(f"ruler.tasks: {task!r} is not one of {', '.join(RULER_TASKS)}{extra}")
        _positive_list("ruler.lengths", self.lengths)
        for name in ("cases", "hops", "chains", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ruler.{name}={getattr(self, name)} must be >= 1")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"ruler.budget={self.budget} must be >= 1 (null: RULER's per task)")

    @property
    def names(self) -> list[str]:
        return list(self.tasks) or list(RULER_TASKS)

    def settings(self) -> Settings:
        return Settings(budget=self.budget, hops=self.hops, chains=self.chains, fewshot=self.fewshot)


@dataclass
class PositionLossConfig:
    """Mean loss at each token position over held-out documents read whole (`eval.position_loss`).

    length: positions; null: the longest perplexity length (`ppl.lengths`, else 64x the training length).
    n_docs: documents of the evaluation split with at least length + 1 tokens (the same as ppl's
      when they have the same length).
    """

    length: Optional[int] = None
    n_docs: int = 5

    def __post_init__(self) -> None:
        if self.length is not None and self.length < 2:
            raise ValueError(f"position_loss.length={self.length} must be >= 2")
        if self.n_docs < 1:
            raise ValueError(f"position_loss.n_docs={self.n_docs} must be >= 1")


@dataclass
class EvalWandbConfig:
    """W&B logging of the tables and figures; mode null: the run's logger mode (auto: online with
    credentials, else offline)."""

    mode: Optional[str] = None
    project: Optional[str] = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={self.mode!r} is not one of {', '.join(WANDB_MODES)}")


@dataclass
class EvalConfig:
    """`python -m eval run=<run dir or checkpoint> task=ppl|passkey|recall|attention|position_loss|ruler|all ...`

    run: a training run directory (newest complete checkpoint) or one checkpoint directory.
    task: one task, or all (every task but ruler, which generates and is asked for by name).
    scalings: RoPE scalings swept for ppl, passkey, recall, position_loss and ruler, e.g. [none, dynamic:2];
      empty: just `model.rope_scaling` (type null: the trained setting).
    sources/split: the evaluation corpus; empty sources: the run's training sources (their `split`).
      Explicit `files` sources without `{split}` are read whole, whatever `split` (the file given
      is the corpus); `{split}` paths, stdlib and hub sources read `split`.
    device: cpu, cuda or cuda:N (checked before the model loads).
    seed: orders the evaluation documents (the same for every run), and seeds the `fixed` prompts.
    prompt_seed: the passkey and recall prompts: `run` (default) draws them from the run's own
      stream, seeded by its training `seed`, so replicates see different prompts; an integer N
      draws the stream a run of seed N gets; `fixed` gives the prompts every run shared before
      (seeded by `seed` alone; the first study's published cases).
    out_dir: where results go; null: <run>/eval.
    """

    run: str = ""
    task: str = "all"
    device: str = "cpu"
    seed: int = 0
    prompt_seed: str = "run"
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    scalings: list[str] = field(default_factory=list)
    sources: list[SourceConfig] = field(default_factory=list)
    split: str = "test"
    out_dir: Optional[str] = None
    progress: bool = True
    ppl: PerplexityConfig = field(default_factory=PerplexityConfig)
    passkey: PasskeyConfig = field(default_factory=PasskeyConfig)
    recall: RecallConfig = field(default_factory=RecallConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    position_loss: PositionLossConfig = field(default_factory=PositionLossConfig)
    ruler: RulerConfig = field(default_factory=RulerConfig)
    wandb: EvalWandbConfig = field(default_factory=EvalWandbConfig)

    def __post_init__(self) -> None:
        if not self.run:
            raise ValueError("run is required: python -m eval run=<run dir or checkpoint dir>")
        if self.task not in TASK_CHOICES:
            raise ValueError(f"task={self.task!r} is not one of {', '.join(TASK_CHOICES)}")
        check_split(self.split)
        for s in self.scalings:
            Scaling.parse(s)
        if self.prompt_seed not in PROMPT_SEEDS and not self.prompt_seed.isdigit():
            raise ValueError(f"prompt_seed={self.prompt_seed!r} is not run, fixed or a non-negative integer")

    @property
    def tasks(self) -> tuple[str, ...]:
        return TASKS if self.task == "all" else (self.task,)

    def prompt_stream(self, run_seed: int) -> tuple[str, int]:
        """The case stream (`data.tasks.CASE_STREAMS`) and its seed, for a run trained with `run_seed`."""
        if self.prompt_seed == "fixed":
            return "fixed", self.seed
        return "eval", run_seed if self.prompt_seed == "run" else int(self.prompt_seed)


def _positive_list(name: str, values: list[int]) -> None:
    bad = [v for v in values if v < 1]
    if bad:
        raise ValueError(f"{name}: {bad[0]} must be >= 1")


def default_lengths(train_len: int, max_factor: int = 64) -> list[int]:
    """train_len x 1, 2, 4 ... max_factor."""
    return [train_len * 2**i for i in range(max_factor.bit_length()) if 2**i <= max_factor]
