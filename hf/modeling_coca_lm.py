"""Hugging Face modelling code for coca-lm's designs other than Origin (which exports as GPT-NeoX or
Llama), shipped inside every such exported directory and loaded with `trust_remote_code=True`.

It imports only `torch`, `transformers` and coca-lm's own design package (`model/designs/`: RoPE
and its scalings, the registry, each design's q/k transform and bias), whose files the export
writes beside it, so the exported model runs the training code's math, not a copy, and a user
needs neither this project nor its config tree. Each layer computes q_eff, k_eff = design.qk(q, k,
rope) and softmax(q_eff k_eff^T / sqrt(D) [+ b_h(m, n)]) v, with the design's score bias module
(the training code's class, under `score_bias` in each attention layer); e.g.

    alibi        scores = q k^T / sqrt(D) - slope_h * (m - n)
    kerple       scores = q k^T / sqrt(D) - r1_h * log(1 + r2_h * (m - n))
    coca slack   q_eff = q * rope(q, m)              k_eff = rope(t, n)
    coca strict  q_eff = rope([|q_j|^2, 0], m)       k_eff = rope([t_j, 0], n)

with CoCA's t the K projection tied per rotary pair and ReLU'd. The decoder has either of coca-lm's
architectures (`config.arch`), laid out and named as its Hugging Face counterpart (GPTNeoXForCausalLM,
LlamaForCausalLM), so an export's weights carry GPT-NeoX's or Llama's names:

    arch   norm       mlp                             attention projections
    neox   LayerNorm  gelu MLP, biases                fused per-head qkv, biases
    llama  RMSNorm    SwiGLU: down(silu(gate) * up)   q, k, v, o; k and v of num_key_value_heads heads

(grouped-query attention: query head h uses key/value head h // (heads / kv heads), as Llama's).
Attention runs on `scaled_dot_product_attention` (a design with a score bias: over chunks of query
rows with an additive bias, so memory stays linear in the length; positions count from the first
token, padding included). The KV cache holds k_eff and v (and a gated bias's per-token terms, FoX's
log forget gates, beside them on the cache object); under dynamic NTK, `generate` rebuilds it when
the base changes (every cached key depends on the base), as coca-lm's own `generate` does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers < 5
    from transformers import PretrainedConfig as PreTrainedConfig

from .base import ScoreBias
from .registry import design_of
from .rope import Rope
from .sinks import sink_attention_rows
from .ssmax import key_counts, ssmax_init, ssmax_scale
from .temperature import length_temperature

BIAS_CHUNK = 256  # query rows per chunk of a score bias [H, rows, keys]
# The output's cache field: `cache` from transformers 5.2x on, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


class CocaLMConfig(PreTrainedConfig):
    """A coca-lm decoder of either architecture (module docstring).

    arch: neox (GPT-NeoX: biases, exact GELU, parallel residual by default) | llama (RMSNorm, SwiGLU,
    grouped-query attention with num_key_value_heads heads, no biases). layer_norm_eps is every
    norm's eps. attention: the design (coca-lm's `model.attention`: alibi, coca, ...); design_params:
    the design's parameters (coca-lm's `model.design_params.<attention>`: CoCA's form among them);
    length_temperature: the training length L0 of the length temperature, 0 when off (query i's
    scores times max(1, log(i + 1) / log(L0))); sinks: a learned logit per head in each softmax's
    denominator (`sinks.py`); ssmax: query i's scores times s_h log(i + 1) (`ssmax.py`; capped at a
    window). max_position_embeddings is the training length L0,
    which dynamic NTK scales from. rope_parameters (designs with RoPE only): rope_type
    default | linear | dynamic | yarn | llama3, rope_theta, partial_rotary_factor, factor, for yarn
    beta_fast and beta_slow, for llama3 low_freq_factor and high_freq_factor, and for both
    original_max_position_embeddings (the length they scale from; else L0).
    """

    model_type = "coca_lm"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 1024,
        arch: str = "neox",
        num_key_value_heads: int | None = None,
        max_position_embeddings: int = 128,
        layer_norm_eps: float = 1e-5,
        use_parallel_residual: bool = True,
        attention: str = "coca",
        rope_parameters: dict | None = None,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        design_params: dict | None = None,
        length_temperature: int = 0,
        sinks: bool = False,
        ssmax: bool = False,
        **kwargs,
    ):
        design = design_of(attention, {attention: design_params or {}})
        if design.native_hf and not (length_temperature or sinks or ssmax):
            raise ValueError(f"attention={attention!r} exports as its architecture's own class, not coca_lm")
        if design_params and design.params is None:
            raise ValueError(f"design_params={design_params}: attention={attention!r} has no parameters")
        kv_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        if arch not in LAYOUT or num_attention_heads % kv_heads or (arch == "neox" and kv_heads != num_attention_heads):
            raise ValueError(f"arch={arch!r}, num_key_value_heads={num_key_value_heads!r}: need neox|llama, and "
                             "key/value heads dividing num_attention_heads (neox: as many as query heads)")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.arch = arch
        self.num_key_value_heads = kv_heads
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.use_parallel_residual = use_parallel_residual
        self.attention = attention
        self.design_params = dict(design_params or {})
        if design.params is not None:
            design.params(**self.design_params)  # checks the values, naming the field
        self.length_temperature = length_temperature
        self.sinks, self.ssmax = sinks, ssmax
        self.use_cache = use_cache
        self.rope_parameters = dict(rope_parameters or UNSCALED)
        check_rope_parameters(self)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


UNSCALED = {"rope_type": "default", "rope_theta": 10000.0}
# arch -> where its Hugging Face model keeps the decoder and the embedding (the weights' names).
LAYOUT = {"neox": ("gpt_neox", "embed_in"), "llama": ("model", "embed_tokens")}


def _design(config: CocaLMConfig):
    """The design (its registry record) the config selects: its attention and parameters' form."""
    return design_of(config.attention, {config.attention: config.design_params})


def check_rope_parameters(config: CocaLMConfig) -> None:
    """Refuse a RoPE scaling on a design without RoPE (ALiBi), as coca-lm does: it would be accepted
    and change nothing. Checked when the config is made and again when a model is built from it
    (the README's recipe assigns `config.rope_parameters` after loading the config)."""
    p = config.rope_parameters or UNSCALED
    scaled = p.get("rope_type", "default") != "default" or float(p.get("factor") or 1.0) != 1.0
    design = _design(config)
    if not design.rope and (scaled or float(p.get("rope_theta", 10000.0)) != 10000.0):
        raise ValueError(f"rope_parameters={p} on an {design.name} model: {design.name} has no RoPE to scale; "
                         "leave rope_parameters unset")


# ---- position: RoPE from rope_parameters ---------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """`rope.Rope`'s scaling (type none | linear | dynamic | yarn | llama3) from `rope_parameters`."""

    type: str
    factor: float
    beta_fast: float
    beta_slow: float
    low_freq_factor: float
    high_freq_factor: float


def rope_from_config(config: CocaLMConfig, base: float | None = None) -> Rope:
    """RoPE under `config.rope_parameters` (rope_type default is our none; a static NTK base is
    exported as default with the scaled `rope_theta`), scaled from `original_max_position_embeddings`
    (yarn, llama3) or else `max_position_embeddings`, as transformers' own models do; at `base`
    instead of `rope_theta` where given (a layer's own: the hybrid's global RoPE layers)."""
    p = config.rope_parameters
    kind = p.get("rope_type", "default")
    if kind not in ("default", "linear", "dynamic", "yarn", "llama3"):
        raise ValueError(f"rope_parameters.rope_type={kind!r} is not one of default, linear, dynamic, yarn, llama3")
    scaling = RopeScaling("none" if kind == "default" else kind, float(p.get("factor") or 1.0),
                          float(p.get("beta_fast") or 32.0), float(p.get("beta_slow") or 1.0),
                          float(p.get("low_freq_factor") or 1.0), float(p.get("high_freq_factor") or 4.0))
    head_dim = config.hidden_size // config.num_attention_heads
    rotary_dims = int(head_dim * p.get("partial_rotary_factor", 1.0))
    design = _design(config)
    pairs = None if design.rotating_pairs is None else design.rotating_pairs(design_params(config), rotary_dims // 2)
    width = rotary_dims if design.rope_width is None else design.rope_width(rotary_dims)
    return Rope(width, float(base or p.get("rope_theta", 10000.0)),
                p.get("original_max_position_embeddings") or config.max_position_embeddings, scaling, pairs)


def design_params(config: CocaLMConfig):
    """The design's parameters (its dataclass) from `config.design_params`, or None."""
    design = _design(config)
    return None if design.params is None else design.params(**config.design_params)


# ---- attention -------------------------------------------------------------------------------------


def _gqa(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether k/v have fewer heads than q (grouped-query attention): SDPA's `enable_gqa`."""
    return k.shape[1] != q.shape[1]


def causal_sdpa(q, k, v, key_mask: torch.Tensor | None, window: int = 0) -> torch.Tensor:
    """Causal SDPA, query i at position Tk - Tq + i; key_mask [B, Tk] bool drops padded keys;
    window > 0: only the `window` most recent keys, the query's own included."""
    tq, tk, gqa = q.shape[-2], k.shape[-2], _gqa(q, k)
    if key_mask is None and not window:
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        if tq == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if window:
        mask &= ~torch.ones_like(mask).tril(tk - tq - window)
    if key_mask is not None:
        mask = _with_keys(mask, key_mask, tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _with_keys(mask: torch.Tensor, key_mask: torch.Tensor, first: int) -> torch.Tensor:
    """[rows, Tk] causal mask & [B, Tk] key mask -> [B, 1, rows, Tk]; a row keeps its own key so a
    padded query never attends to nothing (its output is ignored anyway)."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    own = torch.zeros_like(mask)
    own[rows, first + rows] = True
    return (mask & key_mask[:, None, None, :]) | own


def bias_sdpa(q, k, v, key_mask: torch.Tensor | None, bias: ScoreBias, terms: torch.Tensor | None) -> torch.Tensor:
    """SDPA over chunks of query rows with the additive bias b_h(m, n) of the layer's `bias` module
    (and the prefix sums of a gated bias's per-token `terms` [B, H, Tk], in float64); masked keys get
    the dtype's most negative finite value (never -inf, which has produced NaN in CPU SDPA)."""
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    prefix = None if terms is None else terms.to(torch.float64).cumsum(dim=-1)
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        m = torch.arange(offset + start, offset + end, device=q.device)[:, None]
        n = torch.arange(offset + end, device=q.device)[None, :]
        allowed = n <= m
        if key_mask is not None:
            allowed = _with_keys(allowed, key_mask[:, : offset + end], offset + start)
        gap = None
        if prefix is not None:
            gap = prefix[..., offset + start : offset + end, None] - prefix[..., None, : offset + end]
        scores = bias.rows(slice(None), m, torch.minimum(n, m), gap).to(q.dtype)
        scores = scores.masked_fill(~allowed, torch.finfo(q.dtype).min)
        out.append(F.scaled_dot_product_attention(q[..., start:end, :], k[..., : offset + end, :],
                                                  v[..., : offset + end, :], attn_mask=scores, enable_gqa=_gqa(q, k)))
    return torch.cat(out, dim=-2)


def sink_sdpa(q, k, v, key_mask: torch.Tensor | None, bias: ScoreBias | None, terms: torch.Tensor | None,
              sinks: torch.Tensor, window: int) -> torch.Tensor:
    """Attention with the sink logits a_h in each softmax's denominator (`sinks.sink_attention_rows`)
    over chunks of query rows, with the causal, window and key masks and a design's bias."""
    tq, tk = q.shape[-2], k.shape[-2]
    offset = tk - tq
    prefix = None if terms is None else terms.to(torch.float64).cumsum(dim=-1)
    out = []
    for start in range(0, tq, BIAS_CHUNK):
        end = min(tq, start + BIAS_CHUNK)
        m = torch.arange(offset + start, offset + end, device=q.device)[:, None]
        n = torch.arange(offset + end, device=q.device)[None, :]
        allowed = (n <= m) & (m - n < window) if window else n <= m
        if key_mask is not None:
            allowed = _with_keys(allowed, key_mask[:, : offset + end], offset + start)
        scores = None
        if bias is not None:
            gap = None
            if prefix is not None:
                gap = prefix[..., offset + start : offset + end, None] - prefix[..., None, : offset + end]
            scores = bias.rows(slice(None), m, torch.minimum(n, m), gap)
        out.append(sink_attention_rows(q[..., start:end, :], k[..., : offset + end, :], v[..., : offset + end, :],
                                       sinks, allowed, scores))
    return torch.cat(out, dim=-2)


class CocaLMAttention(nn.Module):
    """The projections of GPT-NeoX (`query_key_value`, fused per head, and `dense`, with biases) or
    of Llama (`q_proj`; `k_proj`, CoCA's T, and `v_proj` of num_key_value_heads heads; `o_proj`;
    no biases), then the design's q/k transform, the cache and the kernel."""

    def __init__(self, config: CocaLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.design = _design(config).layer(
            design_params(config), layer_idx, config.num_hidden_layers)
        self.fused = config.arch == "neox"
        width = config.hidden_size
        if self.fused:
            self.query_key_value = nn.Linear(width, 3 * width)
            self.dense = nn.Linear(width, width)
        else:
            kv = config.num_key_value_heads * self.head_dim
            self.q_proj = nn.Linear(width, width, bias=False)
            self.k_proj = nn.Linear(width, kv, bias=False)
            self.v_proj = nn.Linear(width, kv, bias=False)
            self.o_proj = nn.Linear(width, width, bias=False)
        bias = self.design.bias
        self.score_bias = bias(config.num_attention_heads, config.hidden_size) if bias else None
        heads = config.num_attention_heads
        transform, params = self.design.transform, design_params(config)
        self.qk_transform = transform(params, heads, rope_from_config(config).rotary_dims) if transform else None
        self.sinks = nn.Parameter(torch.zeros(heads)) if config.sinks else None
        init = ssmax_init(config.max_position_embeddings) if config.ssmax else 0.0
        self.ssmax = nn.Parameter(torch.full((heads,), init)) if config.ssmax else None

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, T, D]; k (CoCA's t) and v [B, num_key_value_heads, T, D]."""
        B, T, _ = x.shape
        if self.fused:
            return self.query_key_value(x).view(B, T, self.n_head, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        return tuple(proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
                     for proj in (self.q_proj, self.k_proj, self.v_proj))

    def forward(self, x, rope, cache: Cache | None, key_mask: torch.Tensor | None,
                q_scale: torch.Tensor | None = None, counts: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x)
        q, k = (self.design.qk if self.qk_transform is None else self.qk_transform)(q, k, rope)
        if q_scale is not None:
            q = q * q_scale
        if self.ssmax is not None:
            q = q * ssmax_scale(self.ssmax, counts, self.design.window).to(q.dtype)
        bias = self.score_bias
        terms = bias.terms(x) if bias is not None and bias.gated else None
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            if terms is not None:
                terms = _cached_terms(cache, self.layer_idx, terms)
        if self.sinks is not None:
            y = sink_sdpa(q, k, v, key_mask, bias, terms, self.sinks, self.design.window)
        elif bias is None:
            y = causal_sdpa(q, k, v, key_mask, self.design.window)
        else:
            y = bias_sdpa(q, k, v, key_mask, bias, terms)
        out = self.dense if self.fused else self.o_proj
        return out(y.transpose(1, 2).reshape(B, T, C))


def _cached_terms(cache: Cache, layer: int, terms: torch.Tensor) -> torch.Tensor:
    """A gated bias's per-token terms of every cached token, these appended: kept on the cache
    object beside its keys and values (per layer), cut to the cache's length first."""
    store = cache.__dict__.setdefault("coca_lm_terms", {})
    past = store.get(layer)
    keep = cache.get_seq_length(layer) - terms.shape[-1]
    if past is not None and keep > 0:
        terms = torch.cat((past[..., :keep], terms), dim=-1)
    store[layer] = terms
    return terms


# ---- block -----------------------------------------------------------------------------------------


def norm_layer(config: CocaLMConfig) -> nn.Module:
    """The architecture's norm: LayerNorm with bias (neox) or RMSNorm, weight only (llama)."""
    if config.arch == "llama":
        return nn.RMSNorm(config.hidden_size, eps=config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class CocaLMMLP(nn.Module):
    """GPT-NeoX's MLP (exact GELU)."""

    def __init__(self, config: CocaLMConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class SwiGLU(nn.Module):
    """Llama's gated MLP, no biases."""

    def __init__(self, config: CocaLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CocaLMLayer(nn.Module):
    """x + attention(input_layernorm(x)) + mlp(post_attention_layernorm(x)) (parallel residual), or
    the two in sequence. The attention sits where GPTNeoXLayer (`attention`) or LlamaDecoderLayer
    (`self_attn`) keeps it."""

    def __init__(self, config: CocaLMConfig, layer_idx: int):
        super().__init__()
        self.parallel, self.llama = config.use_parallel_residual, config.arch == "llama"
        self.input_layernorm = norm_layer(config)
        self.post_attention_layernorm = norm_layer(config)
        if self.llama:
            self.self_attn = CocaLMAttention(config, layer_idx)
            self.mlp = SwiGLU(config)
        else:
            self.attention = CocaLMAttention(config, layer_idx)
            self.mlp = CocaLMMLP(config)

    def attend(self, x, rope, cache, key_mask, q_scale, counts) -> torch.Tensor:
        attention = self.self_attn if self.llama else self.attention
        return attention(self.input_layernorm(x), rope, cache, key_mask, q_scale, counts)

    def forward(self, x, rope, cache, key_mask, q_scale=None, counts=None):
        if self.parallel:
            return (x + self.attend(x, rope, cache, key_mask, q_scale, counts)
                    + self.mlp(self.post_attention_layernorm(x)))
        x = x + self.attend(x, rope, cache, key_mask, q_scale, counts)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- models ----------------------------------------------------------------------------------------


class CocaLMPreTrainedModel(PreTrainedModel):
    config_class = CocaLMConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules = ["CocaLMLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(module.weight)
        if isinstance(module, nn.LayerNorm):
            nn.init.zeros_(module.bias)
        if isinstance(module, ScoreBias):
            module.reset_parameters()


class CocaLMModel(CocaLMPreTrainedModel):
    """Embedding, layers and final norm, named as GPTNeoXModel's (`embed_in`, `final_layer_norm`)
    or LlamaModel's (`embed_tokens`, `norm`)."""

    def __init__(self, config: CocaLMConfig):
        super().__init__(config)
        embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CocaLMLayer(config, i) for i in range(config.num_hidden_layers))
        if config.arch == "llama":
            self.embed_tokens, self.norm = embedding, norm_layer(config)
        else:
            self.embed_in, self.final_layer_norm = embedding, norm_layer(config)
        check_rope_parameters(config)
        self.rope = rope_from_config(config) if _design(config).rope else None
        bases = [layer.self_attn.design.rope_base if layer.llama else layer.attention.design.rope_base
                 for layer in self.layers]  # a layer's own RoPE base (the hybrid's global RoPE layers)
        self.layer_ropes = [self.rope if self.rope is None or base is None else rope_from_config(config, base)
                            for base in bases]
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens if self.config.arch == "llama" else self.embed_in

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        if self.config.arch == "llama":
            self.embed_tokens = value
        else:
            self.embed_in = value

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) if self.config.arch == "llama" else self.final_layer_norm(x)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache: Cache | None = None, use_cache: bool | None = None, **kwargs) -> torch.Tensor:
        """Final hidden states [B, T, C]; `cache` (a transformers Cache) is extended in place."""
        x = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            key_mask = attention_mask[:, -(past + T):].bool()
        positions = position_ids if position_ids is not None else torch.arange(past, past + T, device=x.device)
        counts = key_counts(positions)  # SSMax's n: the keys each query attends to, padding included
        if positions.dim() == 2:  # [B, T] -> [B, 1, T]: tables and scales broadcast over heads
            positions = positions[:, None, :]
        tables = {id(r): r.tables(positions, past + T, x.dtype) for r in self.layer_ropes if r is not None}
        q_scale = None
        if self.config.length_temperature:
            q_scale = length_temperature(positions, self.config.length_temperature).to(x.dtype)[..., None]
        for layer, rope in zip(self.layers, self.layer_ropes):
            x = layer(x, None if rope is None else tables[id(rope)], cache, key_mask, q_scale, counts)
        return self.final_norm(x)


class CocaLMForCausalLM(CocaLMPreTrainedModel, GenerationMixin):
    """The decoder, under `gpt_neox` (arch=neox, as in GPTNeoXForCausalLM) or `model` (arch=llama, as
    in LlamaForCausalLM), and the LM head. One class for both architectures: transformers' auto
    classes map a config class to one model class."""

    def __init__(self, config: CocaLMConfig):
        super().__init__(config)
        prefix, embedding = LAYOUT[config.arch]
        self.base_model_prefix = prefix  # transformers reads both from the model, not its class
        self._tied_weights_keys = {"lm_head.weight": f"{prefix}.{embedding}.weight"}
        setattr(self, prefix, CocaLMModel(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache: Cache | None = None, labels=None, use_cache: bool | None = None,
                logits_to_keep: int = 0, past_key_values: Cache | None = None, **kwargs) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = DynamicCache()
        h = self.base_model(input_ids, attention_mask, position_ids, inputs_embeds, cache if use_cache else None)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """Under dynamic NTK past the training length the RoPE base changes with the length, and
        with it every cached key (and, above the first layer, value): drop the cache and feed the
        whole sequence then, which is exact (one full forward per token)."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        rope = self.base_model.rope
        past = cache.get_seq_length() if cache is not None else 0
        if rope is not None and past and rope.base_at(past) != rope.base_at(input_ids.shape[1]):
            cache.crop(-past)  # drop every cached token (negative: how many to remove)
            inputs["input_ids"] = input_ids
            inputs.pop("position_ids", None)
            if inputs.get("cache_position") is not None:
                inputs["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return inputs
