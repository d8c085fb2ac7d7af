"""Hugging Face's face of coca-lm's own decoder, for every design but Origin (which exports as
GPT-NeoX or Llama): shipped inside each such export and loaded with `trust_remote_code=True`.

The export writes this file beside the model's own code, flat: `model/gpt.py` and every file it
imports (`model/designs/` among them, its `__init__` as `designs.py`), all torch only. So the
exported model is `model.gpt.GPT` itself, built from the config by `model.hf_layout.model_config`
(the conversion `hf.imports` runs too): what it computes is what training and evaluation compute,
with no second copy of the blocks. This file adds only what transformers needs: the config class,
our modules placed under GPT-NeoX's or Llama's names (`model.hf_layout.slots`, so an export's
weights carry those names), the KV cache, and generation's inputs.

Inputs it takes, and refuses in one line:
- `input_ids` only (no `inputs_embeds`);
- `attention_mask` [B, cached + new tokens] (or [B, new tokens]) whose zeros in each row are
  padding before its real tokens (left padding, as batched `generate` and lm-eval's generation
  tasks pad), after them (right padding), or both; each row then computes what it computes alone:
  its positions count from its first real token, and its padding is no key of any real token
  (its own logits there are zeros or mean nothing). Without a cache the batch runs at once, the
  padding as a document of its own (`model.documents`); with one (`generate`), each row's real
  tokens run on their own over that row's part of the cache, whose padded places hold zeros.
  Padding inside a row (a zero between real tokens; right padding continued over a cache) is
  refused: the row without it would be a different computation, which no document mask gives.
  So is padding under dynamic NTK, whose RoPE base follows each row's own length;
- `position_ids` only as those positions count anyway (from each row's first real token, one per
  token; transformers' own `attention_mask.cumsum(-1) - 1`).
Weights are shared between the places transformers names and the decoder's own modules; one
device: `device_map` cannot split it.
"""

from __future__ import annotations

from dataclasses import fields, replace

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

from .designs import ScoreBias, design_of, ssmax_init
from .gpt import GPT
from .hf_layout import OUTSIDE, model_config, slots

# The output's cache field: `cache` from transformers 5.2x on, `past_key_values` before.
_CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"
UNSCALED = {"rope_type": "default", "rope_theta": 10000.0}
# arch -> where its Hugging Face model keeps the decoder and the embedding (the weights' names).
LAYOUT = {arch: tuple(places["wte"].split(".")) for arch, places in OUTSIDE.items()}


class CocaLMConfig(PreTrainedConfig):
    """A coca-lm decoder of either architecture, as `hf.export` writes it (read into coca-lm's
    `ModelConfig` by `hf_layout.model_config`).

    arch: neox (GPT-NeoX: biases, exact GELU, parallel residual by default) | llama (RMSNorm, SwiGLU,
    grouped-query attention with num_key_value_heads heads, no biases). layer_norm_eps is every
    norm's eps. attention: the design (coca-lm's `model.attention`: alibi, coca, ...); design_params:
    the design's parameters (coca-lm's `model.design_params.<attention>`: CoCA's form among them);
    length_temperature: the training length L0 of the length temperature, 0 when off (query i's
    scores times max(1, log(i + 1) / log(L0))); sinks: a learned logit per head in each softmax's
    denominator; ssmax: query i's scores times s_h log(i + 1); qk_norm: RMSNorm of q and k (each
    over all its heads' channels, a learned scale per channel) before the design's transform;
    mup_base_width: muP's base width (0: off), whose output multiplier and 1/d attention the model applies.
    max_position_embeddings is the training length L0, which dynamic NTK scales from.
    rope_parameters (designs with RoPE only): rope_type default | linear | dynamic | yarn | llama3,
    rope_theta, partial_rotary_factor, factor, for yarn beta_fast and beta_slow, for llama3
    low_freq_factor and high_freq_factor, and for both original_max_position_embeddings (the
    length they scale from; else L0).
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
        qk_norm: bool = False,
        mup_base_width: int = 0,
        **kwargs,
    ):
        design = design_of(attention, {attention: design_params or {}})
        if design.native_hf and not (length_temperature or sinks or ssmax or qk_norm or mup_base_width):
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
        self.sinks, self.ssmax, self.qk_norm = sinks, ssmax, qk_norm
        self.mup_base_width = mup_base_width  # muP's base width (0: standard; `model.mup`)
        self.use_cache = use_cache
        self.rope_parameters = dict(rope_parameters or UNSCALED)
        check_rope_parameters(self)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


def check_rope_parameters(config: CocaLMConfig) -> None:
    """Refuse a RoPE scaling on a design without RoPE (ALiBi), as coca-lm does: it would be accepted
    and change nothing. Checked when the config is made and again when a model is built from it
    (the README's recipe assigns `config.rope_parameters` after loading the config)."""
    p = config.rope_parameters or UNSCALED
    scaled = p.get("rope_type", "default") != "default" or float(p.get("factor") or 1.0) != 1.0
    design = design_of(config.attention, {config.attention: config.design_params})
    if not design.rope and (scaled or float(p.get("rope_theta", 10000.0)) != 10000.0):
        raise ValueError(f"rope_parameters={p} on an {design.name} model: {design.name} has no RoPE to scale; "
                         "leave rope_parameters unset")


def decoder_config(config: CocaLMConfig):
    """coca-lm's `ModelConfig` of this config, as it stands (a RoPE scaling set after loading
    included), with document masking and restarting positions on: a padded batch's padding runs as
    a document of its own (`CocaLMForCausalLM._padded`); a batch without documents is unchanged."""
    check_rope_parameters(config)
    return replace(model_config({**config.to_dict(), "model_type": "coca_lm"}, "config"), doc_mask=True,
                   doc_positions=True)


# ---- the KV cache: our KVCache's interface over a transformers Cache --------------------------------


class _LayerCache:
    """One layer's `LayerCache` interface: keys and values in the transformers cache, a gated bias's
    per-token terms (FoX's log forget gates) beside them on the cache object."""

    def __init__(self, cache: Cache, index: int):
        self.cache, self.index = cache, index

    def append(self, k: torch.Tensor, v: torch.Tensor, terms: torch.Tensor | None = None):
        k, v = self.cache.update(k, v, self.index)
        if terms is not None:
            store = self.cache.__dict__.setdefault("coca_lm_terms", {})
            keep = k.shape[-2] - terms.shape[-1]  # cut to the cache (generate may crop it)
            if keep > 0:
                terms = torch.cat((store[self.index][..., :keep], terms), dim=-1)
            store[self.index] = terms
        return k, v, terms

    def previous_inputs(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FoX Pro's last unshifted k and v beside the cache (`LayerCache.previous_inputs`); a cache
        cut or filled elsewhere since (generate's cropping) no longer has them: refused."""
        store = self.cache.__dict__.setdefault("coca_lm_last", {})
        length = self.cache.get_seq_length(self.index)
        kept = store.get(self.index)
        if length and (kept is None or kept[0] != length):
            raise ValueError("FoX Pro shifts each key and value toward its predecessor's, which this cache no "
                             "longer holds (it was cropped or filled elsewhere): generate without cropping")
        store[self.index] = (length + k.shape[-2], (k[..., -1:, :], v[..., -1:, :]))
        return kept[1] if length else None


class _Cache:
    """`model.gpt.KVCache`'s interface (what `GPT.hidden_states` reads) over a transformers Cache;
    the token ids kept on it too, cut to its length (under dynamic NTK the decoder rebuilds from them)."""

    def __init__(self, cache: Cache, n_layer: int):
        self.cache = cache
        self.layers = [_LayerCache(cache, i) for i in range(n_layer)]

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def tokens(self) -> torch.Tensor | None:
        tokens = self.cache.__dict__.get("coca_lm_tokens")
        return None if tokens is None else tokens[:, : self.length]

    def record(self, idx: torch.Tensor) -> None:
        tokens = self.tokens
        self.cache.__dict__["coca_lm_tokens"] = idx if tokens is None else torch.cat((tokens, idx), dim=1)

    def clear(self) -> None:
        if self.length:
            self.cache.crop(-self.length)  # negative: how many tokens to remove
        self.cache.__dict__.pop("coca_lm_tokens", None)


class _RowLayerCache:
    """One layer's `LayerCache` interface for one row of a padded batch: that row's real cached
    keys, values and terms (those after its padding); what it appends now (`new`, FoX Pro's `last`)
    is kept for `_RowCache.commit`, which writes every row's into the batch's cache at once."""

    def __init__(self, cache: Cache, index: int, row: int, pad: int, past: int):
        self.cache, self.index, self.past = cache, index, past
        self.rows, self.tokens = slice(row, row + 1), slice(pad, past)
        self.new: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor, terms: torch.Tensor | None = None):
        self.new = (k, v, terms)
        if self.tokens.start >= self.past:  # none of this row's real tokens is cached yet
            return k, v, terms
        layer = self.cache.layers[self.index]
        k = torch.cat((layer.keys[self.rows, :, self.tokens], k), dim=-2)
        v = torch.cat((layer.values[self.rows, :, self.tokens], v), dim=-2)
        if terms is not None:
            held = self.cache.__dict__["coca_lm_terms"][self.index]
            terms = torch.cat((held[self.rows, :, self.tokens], terms), dim=-1)
        return k, v, terms

    def previous_inputs(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FoX Pro's last unshifted k and v of this row (`_LayerCache.previous_inputs`)."""
        self.last = (k[..., -1:, :], v[..., -1:, :])
        if self.tokens.start >= self.past:
            return None
        kept = self.cache.__dict__.get("coca_lm_last", {}).get(self.index)
        if kept is None or kept[0] != self.past:
            raise ValueError("FoX Pro shifts each key and value toward its predecessor's, which this cache no "
                             "longer holds (it was cropped or filled elsewhere): generate without cropping")
        return kept[1][0][self.rows], kept[1][1][self.rows]


def _placed(parts: list[torch.Tensor | None], tokens: int, dim: int) -> torch.Tensor:
    """One row's tensors [1, ...] (None: a row with nothing) as a batch with `tokens` places along
    `dim`: each row's at the end, zeros before (its padding)."""
    like = next(part for part in parts if part is not None)
    shape = [len(parts), *like.shape[1:]]
    shape[dim] = tokens
    out = like.new_zeros(shape)
    for b, part in enumerate(parts):
        if part is not None:
            out[b : b + 1].narrow(dim, tokens - part.shape[dim], part.shape[dim]).copy_(part)
    return out


class _RowCache:
    """`model.gpt.KVCache`'s interface for one row of a padded batch over a transformers Cache: the
    row's real tokens only (its cached ones after its padding), so that the decoder computes what
    the row computes alone. The batch's cache is written by `commit`, once every row has run."""

    def __init__(self, cache: Cache, n_layer: int, row: int, pad: int):
        past = cache.get_seq_length()
        self.layers = [_RowLayerCache(cache, i, row, pad, past) for i in range(n_layer)]
        self.length = max(0, past - pad)
        self.tokens = None  # read only under dynamic NTK, which padding refuses

    def record(self, idx: torch.Tensor) -> None:
        """No token ids are kept for a padded batch: only dynamic NTK reads them."""

    @staticmethod
    def commit(cache: Cache, rows: list[_RowCache | None], tokens: int) -> None:
        """Append every row's new keys, values and terms (at the end of `tokens` places, zeros before:
        its padding; a row that ran nothing (None) zeros only) to the batch's cache, each layer's,
        and FoX Pro's last inputs of the rows that ran beside it."""
        past = cache.get_seq_length()
        ran = next(row for row in rows if row is not None)
        for i, layer in enumerate(ran.layers):
            new = [None if row is None else row.layers[i].new for row in rows]
            k, v = (_placed([None if n is None else n[part] for n in new], tokens, -2) for part in (0, 1))
            terms = None if layer.new[2] is None else _placed([None if n is None else n[2] for n in new], tokens, -1)
            _LayerCache(cache, i).append(k, v, terms)
            if layer.last is not None:
                store = cache.__dict__.setdefault("coca_lm_last", {})
                held = store.get(i, (past, tuple(x.new_zeros(len(rows), *x.shape[1:]) for x in layer.last)))[1]
                last = tuple(x.clone() for x in held)
                for b, row in enumerate(rows):
                    if row is not None:
                        last[0][b], last[1][b] = row.layers[i].last[0][0], row.layers[i].last[1][0]
                store[i] = (past + tokens, last)


def padding(attention_mask: torch.Tensor | None, T: int, past: int, held: torch.Tensor | None) -> torch.Tensor | None:
    """The batch's mask over its cached and new tokens [B, past + T] (True: a real token), or None
    where every token is real. held: the mask the cache was filled under (None: all real). Refused
    in one line: a mask of another length, one that disagrees with the cache's, padding inside a
    row, a row without a real token."""
    if attention_mask is None and held is None:
        return None
    B = attention_mask.shape[0] if attention_mask is not None else held.shape[0]
    device = attention_mask.device if attention_mask is not None else held.device
    before = torch.ones(B, past, dtype=torch.bool, device=device)
    if held is not None:
        n = min(past, held.shape[-1])
        before[:, :n] = held[:, :n].to(device)
    if attention_mask is None:
        mask = torch.cat((before, torch.ones(B, T, dtype=torch.bool, device=device)), dim=1)
    else:
        given = attention_mask.bool()
        if given.dim() != 2 or given.shape[-1] not in (T, past + T):
            raise ValueError(f"attention_mask must be [batch, cached + new tokens] = [B, {past + T}] (or [B, {T}]), "
                             f"got {tuple(attention_mask.shape)}")
        if given.shape[-1] == past + T and past and not torch.equal(given[:, :past], before):
            raise ValueError("attention_mask's cached part disagrees with the padding the cache was filled with")
        mask = torch.cat((before, given[:, -T:]), dim=1)
    if bool(mask.all()):
        return None
    real = mask.sum(dim=-1)
    first = mask.int().argmax(dim=-1)
    last = mask.shape[-1] - 1 - mask.flip(-1).int().argmax(dim=-1)
    if bool((real == 0).any()) or bool((last - first + 1 != real).any()):
        raise ValueError("the exported coca-lm decoder takes padding before or after a row's real tokens, not "
                         "between them (nor right padding continued over a cache), and no row of padding only")
    return mask


def check_inputs(input_ids, attention_mask, position_ids, inputs_embeds, past: int,
                 held: torch.Tensor | None) -> torch.Tensor | None:
    """Refuse in one line the inputs the decoder cannot take (module docstring); the batch's mask
    over the cached and new tokens (`padding`), None where every token is real."""
    if inputs_embeds is not None or input_ids is None:
        raise ValueError("the exported coca-lm decoder takes input_ids, not inputs_embeds")
    T = input_ids.shape[1]
    mask = padding(attention_mask, T, past, held)
    if position_ids is None:
        return mask
    wrong = position_ids.shape[-1] != T
    if not wrong:  # a padded token's position is not read (generate writes 0 there)
        counted = torch.arange(past, past + T, device=position_ids.device)
        if mask is None:
            wrong = bool((position_ids != counted).any())
        else:
            real = mask[:, -T:].to(position_ids.device)
            pads = (mask.cumsum(dim=-1) == 0).sum(dim=-1).to(position_ids.device)
            wrong = bool(((position_ids != counted - pads[:, None]) & real).any())
    if wrong:
        raise ValueError(f"position_ids must count from each row's first real token, one per token (here from the "
                         f"cache's length, {past}, less the row's padding): the exported coca-lm decoder computes its "
                         "positions itself")
    return mask


# ---- the model ---------------------------------------------------------------------------------------


class CocaLMPreTrainedModel(PreTrainedModel):
    config_class = CocaLMConfig
    base_model_prefix = "gpt_neox"
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        """coca-lm's initialisation (`model.gpt.init_weights`), norms and bare parameters included."""
        std = getattr(self.config, "initializer_range", 0.02)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            nn.init.ones_(module.weight)
        if isinstance(module, nn.LayerNorm):
            nn.init.zeros_(module.bias)
        if isinstance(module, ScoreBias):
            module.reset_parameters()
        if isinstance(module._parameters.get("sinks"), nn.Parameter):
            nn.init.normal_(module.sinks, mean=0.0, std=std)
        if isinstance(module._parameters.get("ssmax"), nn.Parameter):
            nn.init.constant_(module.ssmax, ssmax_init(self.decoder.cfg.max_seq_len))


class CocaLMForCausalLM(CocaLMPreTrainedModel, GenerationMixin):
    """coca-lm's `GPT`, its modules registered where GPTNeoXForCausalLM (arch=neox: `gpt_neox.*`) or
    LlamaForCausalLM (arch=llama: `model.*`) keeps theirs, and the LM head. One class for both
    architectures: transformers' auto classes map a config class to one model class."""

    def __init__(self, config: CocaLMConfig):
        super().__init__(config)
        prefix, embedding = LAYOUT[config.arch]
        self.base_model_prefix = prefix  # transformers reads both from the model, not its class
        self._tied_weights_keys = {"lm_head.weight": f"{prefix}.{embedding}.weight"}
        gpt = GPT(decoder_config(config))
        # The decoder is not a submodule: its modules are, under transformers' names (`_place`), so
        # that the state dict, loading and tying see those names only, and each weight once.
        self.__dict__["decoder"] = gpt
        self._slots = [self._place(ours, theirs) for ours, theirs in slots(gpt).items()]
        self.post_init()

    def _place(self, ours: str, theirs: str) -> tuple[nn.Module, str, nn.Module, str]:
        """Register our module (or bare parameter) `ours` at `theirs`, making plain containers (a
        ModuleList for the layers) along the way; (our parent, name, their parent, name)."""
        parent: nn.Module = self
        path, name = theirs.rsplit(".", 1) if "." in theirs else ("", theirs)
        for part in path.split(".") if path else []:
            if part not in parent._modules:  # layers are placed in order: a ModuleList appends them
                parent.add_module(part, nn.ModuleList() if part == "layers" else nn.Module())
            parent = parent._modules[part]
        our_path, our_name = ours.rsplit(".", 1) if "." in ours else ("", ours)
        owner = self.decoder.get_submodule(our_path)
        setattr(parent, name, getattr(owner, our_name))
        return owner, our_name, parent, name

    def _sync(self) -> None:
        """Point the decoder at whatever transformers left in its places: loading, tying or
        resizing may replace a module or a bare parameter there, not in the decoder."""
        for owner, ours, parent, theirs in self._slots:
            placed = getattr(parent, theirs)
            if getattr(owner, ours) is not placed:
                setattr(owner, ours, placed)

    def train(self, mode: bool = True):
        self.decoder.train(mode)
        return super().train(mode)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.base_model.get_submodule(LAYOUT[self.config.arch][1])

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        setattr(self.base_model, LAYOUT[self.config.arch][1], value)

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
        cache = cache if use_cache else None
        past = cache.get_seq_length() if cache is not None else 0
        held = cache.__dict__.get("coca_lm_mask") if cache is not None else None
        mask = check_inputs(input_ids, attention_mask, position_ids, inputs_embeds, past, held)
        self._sync()
        gpt = self.decoder
        keep = logits_to_keep if labels is None else 0
        if mask is not None:
            if any(r is not None and r.scaling.type == "dynamic" for r in gpt.layer_ropes):
                raise ValueError("a padded batch under dynamic NTK: the RoPE base follows each row's own length, "
                                 "which one batch cannot have; run its rows one by one")
            if cache is not None:
                cache.__dict__["coca_lm_mask"] = mask  # what a continuation without a mask is padded as
        if mask is None or bool(mask[:, 0].all()):
            # no padding before any row's real tokens: causal attention keeps them as they are (padding
            # after them is no key of theirs), as one batch
            h = gpt.hidden_states(input_ids, None if cache is None else _Cache(cache, gpt.cfg.n_layer), keep=keep)
        else:
            h = self._padded(input_ids, mask, cache, keep)
        logits = gpt.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def _padded(self, input_ids: torch.Tensor, mask: torch.Tensor, cache: Cache | None, keep: int) -> torch.Tensor:
        """Final hidden states of a left-padded batch (`padding`'s mask), each row's as it computes alone.
        Without a cache the batch runs at once as documents (`model.documents`): the padding before
        a row's real tokens one document, those tokens the next, with positions restarting at each;
        with one, each row's real tokens run on their own over its part of the cache (`_RowCache`),
        the padding's states zeros. Padding after a row's real tokens only follows them (causal)."""
        gpt = self.decoder
        T = input_ids.shape[1]
        if cache is None:
            starts = torch.ones_like(mask)
            starts[:, 1:] = mask[:, 1:] != mask[:, :-1]
            return gpt.hidden_states(input_ids, documents=starts.long().cumsum(dim=-1))
        past = mask.shape[-1] - T
        pads = (mask.cumsum(dim=-1) == 0).sum(dim=-1).tolist()
        width = keep if 0 < keep < T else T
        h = gpt.wte.weight.new_zeros(input_ids.shape[0], width, gpt.cfg.n_embd)
        rows: list[_RowCache | None] = []
        for b, pad in enumerate(pads):
            first = max(0, pad - past)  # the row's first real token among these
            if first == T:  # none here: its padding goes on
                rows.append(None)
                continue
            rows.append(_RowCache(cache, gpt.cfg.n_layer, b, pad))
            out = gpt.hidden_states(input_ids[b : b + 1, first:], rows[-1], keep=min(width, T - first) if keep else 0)
            h[b, width - out.shape[1] :] = out[0, -width:]
        if all(row is None for row in rows):
            raise ValueError("these tokens are padding in every row: feed a padded batch with its real tokens")
        _RowCache.commit(cache, rows, T)
        return h

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """Under dynamic NTK past the training length the RoPE base changes with the length, and
        with it every cached key (and, above the first layer, value): drop the cache and feed the
        whole sequence then, which is exact (one full forward per token), as coca-lm's `generate`."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        cache = inputs.get("cache", inputs.get("past_key_values"))
        rope = self.decoder.rope
        past = cache.get_seq_length() if cache is not None else 0
        if rope is not None and past and rope.base_at(past) != rope.base_at(input_ids.shape[1]):
            cache.crop(-past)  # drop every cached token (negative: how many to remove)
            inputs["input_ids"] = input_ids
            inputs.pop("position_ids", None)
            if inputs.get("cache_position") is not None:
                inputs["cache_position"] = torch.arange(input_ids.shape[1], device=input_ids.device)
        return inputs
