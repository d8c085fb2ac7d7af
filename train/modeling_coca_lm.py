"""Hugging Face modelling code for coca-lm's ALiBi and CoCA models, shipped inside every exported
directory and loaded with `trust_remote_code=True`.

It imports only `torch` and `transformers`, so a user needs neither this project nor its config
tree. The math is that of the training code (coca-lm `model/attention.py`, `model/rope.py`):

    alibi        scores = q k^T / sqrt(D) - slope_h * (m - n)
    coca slack   q_eff = q * rope(q, m)              k_eff = rope(t, n)
    coca strict  q_eff = rope([|q_j|^2, 0], m)       k_eff = rope([t_j, 0], n)

with CoCA's t the K projection tied per rotary pair and ReLU'd. RoPE angles are computed in float64
for the positions and length processed, then cast, exactly as in training. Attention runs on
`scaled_dot_product_attention` (ALiBi: over chunks of query rows with an additive bias, so memory
stays linear in the length). The KV cache holds k_eff and v; under dynamic NTK, `generate` rebuilds
it when the base changes (every cached key depends on the base), as coca-lm's own `generate` does.
"""

from __future__ import annotations

import math
from dataclasses import fields

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

ALIBI_CHUNK = 256  # query rows per chunk of the ALiBi bias [H, rows, keys]
# The output's cache field: `cache` from transformers 5.2x on, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


class CocaLMConfig(PreTrainedConfig):
    """A coca-lm decoder: GPT-NeoX layout (fused per-head qkv, parallel residual, exact GELU).

    attention: alibi | coca; coca_form: slack | strict. max_position_embeddings is the training
    length L0. rope_parameters (CoCA only): rope_type default | linear | dynamic | yarn, rope_theta,
    partial_rotary_factor, factor, and for yarn beta_fast, beta_slow.
    """

    model_type = "coca_lm"

    def __init__(
        self,
        vocab_size: int = 4096,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 1024,
        max_position_embeddings: int = 128,
        layer_norm_eps: float = 1e-5,
        use_parallel_residual: bool = True,
        attention: str = "coca",
        coca_form: str = "slack",
        rope_parameters: dict | None = None,
        tie_word_embeddings: bool = False,
        use_cache: bool = True,
        **kwargs,
    ):
        if attention not in ("alibi", "coca") or coca_form not in ("slack", "strict"):
            raise ValueError(f"attention={attention!r}, coca_form={coca_form!r}: need alibi|coca and slack|strict")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_norm_eps = layer_norm_eps
        self.use_parallel_residual = use_parallel_residual
        self.attention = attention
        self.coca_form = coca_form
        self.use_cache = use_cache
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# ---- position: RoPE tables and ALiBi slopes --------------------------------------------------------


class Rope:
    """cos/sin tables [T, r] for positions under rope_parameters, in float64 then cast."""

    def __init__(self, config: CocaLMConfig):
        p = config.rope_parameters
        head_dim = config.hidden_size // config.num_attention_heads
        self.dims = int(head_dim * p.get("partial_rotary_factor", 1.0))
        self.type = p.get("rope_type", "default")
        if self.type not in ("default", "linear", "dynamic", "yarn"):
            raise ValueError(f"rope_parameters.rope_type={self.type!r} is not one of default, linear, dynamic, yarn")
        self.base = float(p.get("rope_theta", 10000.0))
        self.factor = float(p.get("factor") or 1.0)
        self.beta_fast = float(p.get("beta_fast") or 32.0)
        self.beta_slow = float(p.get("beta_slow") or 1.0)
        self.train_len = config.max_position_embeddings

    def base_at(self, length: int) -> float:
        """The base when `length` tokens are processed (only dynamic NTK varies with length)."""
        r = self.dims
        if self.type == "dynamic" and length > self.train_len:
            return self.base * (self.factor * length / self.train_len - (self.factor - 1)) ** (r / (r - 2))
        return self.base

    def tables(self, positions: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.dims
        inv = self.base_at(length) ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        scale = 1.0
        if self.type == "linear":
            inv = inv / self.factor
        elif self.type == "yarn":
            inv = self._yarn(inv)
            scale = 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0
        angles = positions.to(torch.float64)[..., None] * inv.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)

    def _yarn(self, inv: torch.Tensor) -> torch.Tensor:
        r = self.dims

        def pair_at(rotations: float) -> float:
            return r * math.log(self.train_len / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low = max(math.floor(pair_at(self.beta_fast)), 0)
        high = min(math.ceil(pair_at(self.beta_slow)), r - 1)
        ramp = (torch.arange(r // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)
        keep = 1.0 - ramp.clamp(0.0, 1.0)
        return inv / self.factor * (1.0 - keep) + inv * keep


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading r dims of x [..., T, D], rotate-half pairing (j with j + r/2)."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    out = rot * cos + torch.cat((-rot[..., half:], rot[..., :half]), dim=-1) * sin
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def alibi_slopes(n_head: int) -> torch.Tensor:
    """Press et al.'s head slopes (float64), with their rule for a head count not a power of 2."""

    def power_of_2(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_head).is_integer():
        return torch.tensor(power_of_2(n_head), dtype=torch.float64)
    closest = 2 ** math.floor(math.log2(n_head))
    extra = alibi_slopes(2 * closest)[0::2][: n_head - closest]
    return torch.cat((torch.tensor(power_of_2(closest), dtype=torch.float64), extra))


# ---- attention -------------------------------------------------------------------------------------


def coca_tie(t: torch.Tensor, rotary_dims: int) -> torch.Tensor:
    half = rotary_dims // 2
    tied = F.relu((t[..., :half] + t[..., half:rotary_dims]) / 2)
    return torch.cat((tied, tied, F.relu(t[..., rotary_dims:])), dim=-1)


def coca_slack_qk(q, t, cos, sin):
    return q * apply_rope(q, cos, sin), apply_rope(t, cos, sin)


def coca_strict_qk(q, t, cos, sin):
    half = cos.shape[-1] // 2
    r = 2 * half
    cos, sin = cos[..., :half], sin[..., :half]
    sq = q[..., :half] ** 2 + q[..., half:r] ** 2
    th = t[..., :half]
    q_eff = torch.cat((sq * cos, sq * sin, q[..., r:] ** 2), dim=-1)
    k_eff = torch.cat((th * cos, th * sin, t[..., r:]), dim=-1)
    return q_eff, k_eff


def causal_sdpa(q, k, v, key_mask: torch.Tensor | None) -> torch.Tensor:
    """Causal SDPA, query i at position Tk - Tq + i; key_mask [B, Tk] bool drops padded keys."""
    tq, tk = q.shape[-2], k.shape[-2]
    if key_mask is None:
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if tq == 1:
            return F.scaled_dot_product_attention(q, k, v)
    mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if key_mask is not None:
        mask = _with_keys(mask, key_mask, tk - tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _with_keys(mask: torch.Tensor, key_mask: torch.Tensor, first: int) -> torch.Tensor:
    """[rows, Tk] causal mask & [B, Tk] key mask -> [B, 1, rows, Tk]; a row keeps its own key so a
    padded query never attends to nothing (its output is ignored anyway)."""
    rows = torch.arange(mask.shape[0], device=mask.device)
    own = torch.zeros_like(mask)
    own[rows, first + rows] = True
    return (mask & key_mask[:, None, None, :]) | own


def alibi_sdpa(q, k, v, key_mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA over chunks of query rows with the additive ALiBi bias; masked keys get the dtype's
    most negative finite value (never -inf, which has produced NaN in CPU SDPA)."""
    tq, tk = q.shape[-2], k.shape[-2]
    slopes = alibi_slopes(q.shape[1]).to(q.device)[:, None, None]
    offset = tk - tq
    out = []
    for start in range(0, tq, ALIBI_CHUNK):
        end = min(tq, start + ALIBI_CHUNK)
        m = torch.arange(offset + start, offset + end, device=q.device)[:, None]
        n = torch.arange(offset + end, device=q.device)[None, :]
        allowed = n <= m
        if key_mask is not None:
            allowed = _with_keys(allowed, key_mask[:, : offset + end], offset + start)
        bias = (-slopes * (m - n)).to(q.dtype).masked_fill(~allowed, torch.finfo(q.dtype).min)
        out.append(F.scaled_dot_product_attention(q[..., start:end, :], k[..., : offset + end, :],
                                                  v[..., : offset + end, :], attn_mask=bias))
    return torch.cat(out, dim=-2)


class CocaLMAttention(nn.Module):
    def __init__(self, config: CocaLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.attention, self.form = config.attention, config.coca_form
        p = config.rope_parameters
        self.rotary_dims = int(self.head_dim * p.get("partial_rotary_factor", 1.0))
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x, rope, cache: Cache | None, key_mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.query_key_value(x).view(B, T, self.n_head, 3, self.head_dim).transpose(1, 2).unbind(dim=3)
        if self.attention == "coca":
            t = coca_tie(k, self.rotary_dims)
            q, k = (coca_slack_qk if self.form == "slack" else coca_strict_qk)(q, t, *rope)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        y = alibi_sdpa(q, k, v, key_mask) if self.attention == "alibi" else causal_sdpa(q, k, v, key_mask)
        return self.dense(y.transpose(1, 2).reshape(B, T, C))


class CocaLMMLP(nn.Module):
    def __init__(self, config: CocaLMConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class CocaLMLayer(nn.Module):
    def __init__(self, config: CocaLMConfig, layer_idx: int):
        super().__init__()
        self.parallel = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = CocaLMAttention(config, layer_idx)
        self.mlp = CocaLMMLP(config)

    def forward(self, x, rope, cache, key_mask):
        if self.parallel:
            return x + self.attention(self.input_layernorm(x), rope, cache, key_mask) + self.mlp(self.post_attention_layernorm(x))
        x = x + self.attention(self.input_layernorm(x), rope, cache, key_mask)
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
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


class CocaLMModel(CocaLMPreTrainedModel):
    def __init__(self, config: CocaLMConfig):
        super().__init__(config)
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(CocaLMLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.rope = Rope(config) if config.attention == "coca" else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_in

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_in = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache: Cache | None = None, use_cache: bool | None = None, **kwargs) -> torch.Tensor:
        """Final hidden states [B, T, C]; `cache` (a transformers Cache) is extended in place."""
        x = self.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.shape[1]
        past = cache.get_seq_length() if cache is not None else 0
        key_mask = None
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            key_mask = attention_mask[:, -(past + T):].bool()
        rope = None
        if self.rope is not None:
            positions = position_ids if position_ids is not None else torch.arange(past, past + T, device=x.device)
            if positions.dim() == 2:  # [B, T] -> [B, 1, T]: tables broadcast over heads
                positions = positions[:, None, :]
            rope = self.rope.tables(positions, past + T, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, cache, key_mask)
        return self.final_layer_norm(x)


class CocaLMForCausalLM(CocaLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "gpt_neox.embed_in.weight"}

    def __init__(self, config: CocaLMConfig):
        super().__init__(config)
        self.gpt_neox = CocaLMModel(config)
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
        h = self.gpt_neox(input_ids, attention_mask, position_ids, inputs_embeds, cache if use_cache else None)
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
        rope = self.gpt_neox.rope
        past = cache.get_seq_length() if cache is not None else 0
        if rope is not None and past and rope.base_at(past) != rope.base_at(input_ids.shape[1]):
            cache.crop(-past)  # drop every cached token (negative: how many to remove)
            inputs["input_ids"] = input_ids
            inputs.pop("position_ids", None)
            if inputs.get("cache_position") is not None:
                inputs["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return inputs
