"""Model configuration: a typed dataclass, named presets ("flavors") and parameter counts.

Field types are the ones OmegaConf structured configs accept (no `Literal`), so Hydra type-checks
overrides; allowed values are checked in `__post_init__` with messages naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any, Optional

from .designs import ATTENTIONS, DESIGNS, Design, design_of

ARCHS = ("neox", "llama")
ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")
# The attention kernels (`model.kernel_path.takes_gpu_path`): auto, FlexAttention on CUDA tensors and
# the CPU kernels elsewhere; flex, FlexAttention on any device (on CPU forward only: torch has no
# CPU FlexAttention backward), which is how the GPU path runs and is tested on a CPU.
KERNELS = ("auto", "flex")


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} must be a positive integer")


@dataclass
class RopeScaling:
    """How RoPE is stretched beyond the training length (changeable on a trained model).

    type: none | linear (position interpolation) | ntk (static NTK-aware base) |
          dynamic (NTK base recomputed for the length actually processed) | yarn |
          llama3 (Llama 3.1's: wavelengths beyond L0 / low_freq_factor divided by the factor,
          below L0 / high_freq_factor kept, a smooth ramp between).
    factor: the stretch factor (>= 1).
    beta_fast, beta_slow: YaRN's correction range in rotations (used only by `yarn`).
    low_freq_factor, high_freq_factor: Llama 3's bounds (used only by `llama3`; its defaults 1, 4).
    original_max_seq_len: the length the scaling stretches from, YaRN's, llama3's and dynamic
      NTK's L0 (None: `model.max_seq_len`). Set it to the pretraining length when a model continues
      training at a longer one with a scaling (HF's `original_max_position_embeddings`).
    """

    type: str = "none"
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: Optional[int] = None

    def __post_init__(self) -> None:
        _one_of("model.rope_scaling.type", self.type, ROPE_SCALINGS)
        if not self.factor >= 1.0:
            raise ValueError(f"model.rope_scaling.factor={self.factor!r} must be >= 1.0")
        if self.original_max_seq_len is not None:
            _positive("model.rope_scaling.original_max_seq_len", self.original_max_seq_len)
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"model.rope_scaling.beta_fast={self.beta_fast!r}, beta_slow={self.beta_slow!r}: "
                "need beta_fast > beta_slow > 0"
            )
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"model.rope_scaling.high_freq_factor={self.high_freq_factor!r}, low_freq_factor="
                f"{self.low_freq_factor!r}: need high_freq_factor > low_freq_factor > 0"
            )


def parse_scaling(spec: str) -> RopeScaling:
    """`none` or `type:factor` (linear | ntk | dynamic | yarn | llama3, factor >= 1), e.g. `dynamic:4`: the one
    syntax of eval's `scalings`, generate's and the exporter's `rope_scaling=`."""
    kind, _, factor = spec.partition(":")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"scaling {spec!r}: type {kind!r} is not one of {', '.join(ROPE_SCALINGS)}")
    if kind == "none":
        return RopeScaling()
    try:
        value = float(factor)
    except ValueError:
        raise ValueError(f"scaling {spec!r}: write type:factor, e.g. dynamic:4") from None
    if not value >= 1.0:
        raise ValueError(f"scaling {spec!r}: factor must be >= 1")
    return RopeScaling(kind, value)


# `model.design_params.<attention>.<name>`: one field per design that has parameters (the forms of
# one attention, CoCA's slack and strict, share theirs), holding its own dataclass of them
# (`Design.params`), so that Hydra type-checks an override and each design's defaults are its
# record's. Generated from the registry: a new design adds no field here.
_SECTIONS = {d.attention: d.params for d in DESIGNS.values() if d.params}
DesignParams = make_dataclass("DesignParams", [(key, params, field(default_factory=params))
                                               for key, params in _SECTIONS.items()])
DesignParams.__module__ = __name__  # picklable and printable as model.config.DesignParams

# Keys this schema had before CoCA's parameters joined `design_params` (its last own fields), and
# where they went. A saved config (a run's config.yaml, a checkpoint's, an export's config.json) is
# read with them moved (`upgrade_saved`); a new override naming one is refused (`legacy_override`).
MOVED = {"model.coca_form": "model.design_params.coca.form", "t_init": "model.design_params.coca.t_init"}


def design_params(values: Any) -> Any:
    """A `DesignParams` from itself or a plain dict of dicts (a checkpoint's or an export's)."""
    if isinstance(values, DesignParams):
        return values
    given = dict(values or {})
    unknown = sorted(set(given) - {f for f in DesignParams.__dataclass_fields__})
    if unknown:
        raise ValueError(f"model.design_params.{unknown[0]}: no design with parameters has that key; "
                         f"those that have: {', '.join(DesignParams.__dataclass_fields__) or 'none'}")
    return DesignParams(**{key: _SECTIONS[key](**value) if isinstance(value, dict) else value
                           for key, value in given.items()})


def upgrade_saved(tree: dict[str, Any], model_only: bool = False) -> dict[str, Any]:
    """A saved config (plain dicts) as this schema reads it: a run config's `t_init` and
    `model.coca_form` (a model config's `coca_form`, with `model_only`) moved into
    `model.design_params.coca` (`MOVED`). A new dict comes back, equal where nothing moved."""
    tree = dict(tree)
    model = dict(tree if model_only else tree.get("model") or {})
    coca = {}
    if "coca_form" in model:
        coca["form"] = model.pop("coca_form")
    if not model_only and "t_init" in tree:
        coca["t_init"] = tree.pop("t_init")
    if not coca:
        return tree
    params = dict(model.get("design_params") or {})
    params["coca"] = {**coca, **dict(params.get("coca") or {})}
    model["design_params"] = params
    return model if model_only else {**tree, "model": model}


def unselected_params(cfg: ModelConfig) -> str | None:
    """The one-line refusal of a parameter set (away from its default) for a design the config does
    not select, e.g. `model.design_params.prope.p=0.5` with `model.attention=origin`, or None. Checked
    where a run's config is given (`python -m train`), not where one is read: nothing reads it."""
    for section, params in _SECTIONS.items():
        if section == cfg.attention:
            continue
        given, default = getattr(cfg.design_params, section), params()
        changed = [f"model.design_params.{section}.{name}={getattr(given, name)}"
                   for name in default.__dataclass_fields__ if getattr(given, name) != getattr(default, name)]
        if changed:
            return (f"{', '.join(changed)}: a parameter of attention={section}, but model.attention="
                    f"{cfg.attention} does not read it; drop it, or set model.attention={section}")
    return None


def legacy_override(overrides: list[str]) -> str | None:
    """The one-line refusal of a command-line override naming a key that moved (`MOVED`), or None."""
    for override in overrides:
        key = override.lstrip("+~").partition("=")[0]
        if key in MOVED:
            return f"{key} is now {MOVED[key]} (CoCA's parameters live in model.design_params.coca)"
    return None


@dataclass
class ModelConfig:
    """A decoder of one of two architectures (`model.gpt`), both with rotate-half RoPE:

    arch: neox (GPT-NeoX: LayerNorm with bias, GELU MLP, biased fused qkv, parallel residual by
          default) | llama (RMSNorm, SwiGLU MLP, separate q/k/v without biases, grouped-query
          attention, sequential residual and full rotary, which it requires).
    n_kv_head: key/value heads (llama only), dividing n_head; null: n_head (multi-head attention),
          1: multi-query attention. Query head h uses kv head h // (n_head / n_kv_head).
    attention: the design (`model.designs.registry`; origin is RoPE); CoCA's form, slack (released
          code) | strict (Eq. 9), is its parameter `design_params.coca.form`.
    design_params: each design's parameters, `design_params.<attention>.<name>` (only the selected
          design's are read: `ModelConfig.params`; a value set for another is refused where a
          run's config is checked: `unselected_params`).
    length_temperature: query i's dot-product scores are multiplied by max(1, log(i + 1) / log(L0)),
          L0 = max_seq_len, i counted from the document start under doc_positions.
    sinks: a learned logit per head and layer in the softmax's denominator, with no value (gpt-oss's
          attention sinks: `model.designs.sinks`); any design.
    ssmax: scalable softmax, query i's dot-product scores times s_h log n_i with a learned s_h per
          head and layer, n_i the keys it attends to (`model.designs.ssmax`); any design.
    qk_norm: RMSNorm of the query and key projections' outputs before the design's q/k transform
          (before RoPE), each over all its heads' channels with a learned scale per channel
          (`attn.q_norm` [n_head * D], `attn.k_norm` [n_kv_head * D]; CoCA: k is its T), as
          DroPE's released code (OLMo 2's form); eps = layernorm_eps. Any design.
    max_seq_len: the training length (dynamic NTK and YaRN scale relative to it, or to
      `rope_scaling.original_max_seq_len` when set).
    rotary_pct: fraction of each head's dimensions that RoPE rotates (NeoX style, leading dims).
    doc_mask: within a packed row, a token attends only to earlier tokens of its own document.
    doc_positions: with doc_mask, positions restart at 0 at each document's first token.
    kernel: the attention kernels, auto (FlexAttention on a GPU, the fused CPU kernels on a CPU) |
          flex (FlexAttention, the GPU path, on any device; on a CPU compiled through C++ and
          forward only: evaluation and generation, not training).
    layernorm_eps: the eps of every norm (LayerNorm for neox, RMSNorm for llama).
    mup: maximal update parametrization relative to a model of width `mup_base_width` (the same
          config with n_embd = mup_base_width and ffn_hidden scaled alike; `model.mup`): its
          initialisation, per-layer lr factors, output multiplier and 1/d attention. At the base
          width the model is the standard one.
    """

    arch: str = "neox"
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: Optional[int] = None
    n_embd: int = 256
    ffn_hidden: int = 1024
    max_seq_len: int = 128
    attention: str = "origin"
    design_params: DesignParams = field(default_factory=DesignParams)
    length_temperature: bool = False
    sinks: bool = False
    ssmax: bool = False
    qk_norm: bool = False
    rotary_pct: float = 1.0
    rope_base: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    parallel_residual: bool = True
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False
    activation_checkpointing: bool = False
    doc_mask: bool = False
    doc_positions: bool = False
    kernel: str = "auto"
    mup: bool = False
    mup_base_width: int = 256

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self.design_params = design_params(self.design_params)
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "ffn_hidden", "max_seq_len"):
            _positive(f"model.{name}", getattr(self, name))
        _one_of("model.arch", self.arch, ARCHS)
        _one_of("model.attention", self.attention, ATTENTIONS)
        _one_of("model.kernel", self.kernel, KERNELS)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}"
            )
        self._check_arch()
        if self.head_dim % 2:
            raise ValueError(
                f"head dimension model.n_embd/model.n_head={self.head_dim} must be even "
                "(RoPE and CoCA pair dimensions j and j + head_dim/2)"
            )
        if not 0.0 < self.rotary_pct <= 1.0:
            raise ValueError(f"model.rotary_pct={self.rotary_pct!r} must be in (0, 1]")
        if self.design.rope and (self.rotary_dims < 2 or self.rotary_dims % 2):
            raise ValueError(
                f"model.rotary_pct={self.rotary_pct} gives {self.rotary_dims} rotary dims of "
                f"head dimension {self.head_dim}; they must be even and >= 2 to form pairs"
            )
        if not self.rope_base > 1.0:
            raise ValueError(f"model.rope_base={self.rope_base!r} must be > 1")
        scaling = self.rope_scaling.type
        if not self.design.rope and scaling != "none":
            raise ValueError(
                f"model.rope_scaling.type={scaling!r} with model.attention={self.attention!r}: "
                f"{self.design.name} has no RoPE to scale; allowed: none"
            )
        if scaling in ("ntk", "dynamic", "yarn") and self.rotary_dims <= 2:
            raise ValueError(
                f"model.rope_scaling.type={scaling!r} needs more than 2 rotary dims "
                f"(got {self.rotary_dims}); raise model.rotary_pct or the head dimension"
            )
        if self.doc_positions and not self.doc_mask:
            raise ValueError("model.doc_positions=true needs model.doc_mask=true (positions restart at "
                             "each document only where attention stays within it)")
        if self.length_temperature and self.max_seq_len < 2:
            raise ValueError("model.length_temperature=true needs model.max_seq_len >= 2 (it divides by log(L0))")
        if self.ssmax and self.max_seq_len < 2:
            raise ValueError("model.ssmax=true needs model.max_seq_len >= 2 (s starts at 1 / log(L0))")
        modifiers = [f"model.{name}=true" for name in ("sinks", "ssmax", "length_temperature") if getattr(self, name)]
        if modifiers and not self.design.softmax:
            raise ValueError(f"{', '.join(modifiers)} with model.attention={self.attention}: {self.design.name} "
                             "attention has no softmax for it to modify")
        if self.qk_norm and self.design.pro:
            raise ValueError(f"model.qk_norm=true with {self.design.name}: its Pro block normalises q and k per head "
                             "itself; leave model.qk_norm=false")
        if self.mup:
            self._check_mup()
        if self.init_std <= 0 or self.layernorm_eps <= 0:
            raise ValueError("model.init_std and model.layernorm_eps must be > 0")

    def _check_arch(self) -> None:
        """What each architecture fixes: GQA only in llama's separate k/v; llama's own block form."""
        if self.n_kv_head is not None:
            _positive("model.n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head}")
            if self.arch == "neox" and self.n_kv_head != self.n_head:
                raise ValueError(
                    f"model.n_kv_head={self.n_kv_head} needs model.arch=llama: GPT-NeoX's fused qkv has one "
                    f"key/value head per query head (n_kv_head={self.n_head} or null)"
                )
        if self.arch == "llama" and self.parallel_residual:
            raise ValueError("model.arch='llama' is a sequential-residual block: set model.parallel_residual=false")
        if self.arch == "llama" and self.rotary_pct != 1.0:
            raise ValueError(f"model.arch='llama' rotates every head dimension: set model.rotary_pct=1.0 "
                             f"(got {self.rotary_pct})")

    def _check_mup(self) -> None:
        """muP's base model must be buildable: the same heads at width mup_base_width."""
        base = self.mup_base_width
        _positive("model.mup_base_width", base)
        if base % self.n_head or (base // self.n_head) % 2 or (self.ffn_hidden * base) % self.n_embd:
            raise ValueError(f"model.mup_base_width={base} must be divisible by model.n_head={self.n_head} into an "
                             f"even head dimension, and scale model.ffn_hidden={self.ffn_hidden} to a whole width")

    @property
    def design(self) -> Design:
        """The attention design this config selects (`model.designs.registry`)."""
        return design_of(self.attention, self.design_params)

    @property
    def params(self) -> Any:
        """The selected design's parameters (its `Design.params` dataclass), or None."""
        return getattr(self.design_params, self.attention, None)

    def layer_design(self, index: int) -> Design:
        """The design layer `index` runs (`Design.for_layer`: a design whose layers differ)."""
        return self.design.layer(self.params, index, self.n_layer)

    def rope_pairs(self) -> Optional[int]:
        """How many rotary pairs rotate (p-RoPE), or None for all (`Rope(pairs=...)`)."""
        d = self.design
        return None if d.rotating_pairs is None else d.rotating_pairs(self.params, self.rotary_dims // 2)

    def rope_width(self) -> int:
        """The width of the RoPE tables the design reads (`Design.rope_width`; RoPE's: rotary_dims)."""
        d = self.design
        return self.rotary_dims if d.rope_width is None else d.rope_width(self.rotary_dims)

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head where it is null."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rotary_dims(self) -> int:
        """Leading dims of each head that RoPE rotates (as GPT-NeoX: int(head_dim * rotary_pct))."""
        return int(self.head_dim * self.rotary_pct)


# Named presets. `350m` is the paper's released GPT-NeoX configuration (about 302M non-embedding
# parameters); `125m` and `1.3b` follow the Pythia shapes of the same family. The llama flavors
# are arch=llama: a CPU-sized one, and the shapes of TinyLlama-1.1B and Llama-3.2-1B (their HF
# configs' sizes; training sets vocab_size from the tokenizer, conf/config.yaml).
_LLAMA = dict(arch="llama", parallel_residual=False, rotary_pct=1.0)
FLAVORS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=256, ffn_hidden=1024, max_seq_len=128),
    "125m": dict(n_layer=12, n_head=12, n_embd=768, ffn_hidden=3072, max_seq_len=512),
    "350m": dict(n_layer=24, n_head=16, n_embd=1024, ffn_hidden=4096, max_seq_len=512),
    "1.3b": dict(n_layer=24, n_head=16, n_embd=2048, ffn_hidden=8192, max_seq_len=512),
    "llama_tiny": dict(**_LLAMA, n_layer=4, n_head=4, n_kv_head=2, n_embd=256, ffn_hidden=688, max_seq_len=128),
    "tinyllama_1.1b": dict(**_LLAMA, n_layer=22, n_head=32, n_kv_head=4, n_embd=2048, ffn_hidden=5632,
                           vocab_size=32000, rope_base=10000.0, max_seq_len=2048, tie_embeddings=False),
    # Llama-3.2-1B's HF config says max_position_embeddings=131072, reached by its 'llama3' RoPE
    # scaling (factor 32, low/high_freq_factor 1/4, from 8192) on a model pretrained at 8192 tokens:
    # 8192 is its training length, the L0 every scaling stretches from. init_from its directory
    # takes that scaling; the flavor alone is unscaled (model.rope_scaling.type=llama3 adds it).
    "llama3.2_1b": dict(**_LLAMA, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192,
                        vocab_size=128256, rope_base=500000.0, max_seq_len=8192, tie_embeddings=True),
}


def flavor(name: str, **overrides: Any) -> ModelConfig:
    """The named preset with `overrides` applied, e.g. `flavor("350m", attention="coca")`."""
    if name not in FLAVORS:
        raise ValueError(f"flavor {name!r} is not one of {', '.join(FLAVORS)}")
    return ModelConfig(**{**FLAVORS[name], **overrides})


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts from the shapes alone (no model is built).

    `embedding` is the token embedding plus the LM head when untied; the rest is `non_embedding`.
    """
    c, f = cfg.n_embd, cfg.ffn_hidden
    if cfg.arch == "neox":
        norm = 2 * c  # LayerNorm weight and bias
        attention = (c * 3 * c + 3 * c) + (c * c + c)
        mlp = (c * f + f) + (f * c + c)
    else:  # llama: no biases; k and v have n_kv_head heads; SwiGLU's three matrices
        kv = cfg.kv_heads * cfg.head_dim
        norm = c  # RMSNorm weight
        attention = c * c + 2 * c * kv + c * c
        mlp = 3 * c * f
    per_layer = 2 * norm + attention + mlp
    non_embedding = cfg.n_layer * per_layer + norm  # + final norm
    embedding = cfg.vocab_size * c * (1 if cfg.tie_embeddings else 2)
    return dict(embedding=embedding, non_embedding=non_embedding, total=embedding + non_embedding)

