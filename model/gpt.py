"""The decoder the framework trains and evaluates, in two architectures (`model.arch`):

    x -> wte -> [Block] x n_layer -> norm -> lm_head          (untied embeddings by default)

    Block, parallel residual (GPT-NeoX):     Block, sequential (Llama; NeoX optionally):
        x + attn(ln_1(x)) + mlp(ln_2(x))         x = x + attn(ln_1(x)); x + mlp(ln_2(x))

    arch    norm                mlp                                  attention projections
    neox    LayerNorm (+ bias)  MLP: proj(gelu(fc(x)))               fused per-head qkv, biases
    llama   RMSNorm (weight)    SwiGLU: down(silu(gate(x)) * up(x))  q, k, v (n_kv_head heads), no bias
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import AttentionInputs, CausalSelfAttention, LayerCache
from .config import ModelConfig
from .designs import Rope, RopeTables, ScoreBias, length_temperature
from .designs import key_counts as key_counts_of
from .documents import Documents, positions
from .loss import linear_cross_entropy_sum, token_losses
from .mup import attention_multiplier, output_multiplier, rescale_init
from .sampling import check_sampling, next_token
from .sequence_parallel import SequenceParallel


def norm(cfg: ModelConfig) -> nn.Module:
    """The architecture's norm: LayerNorm with bias (neox) or RMSNorm, weight only (llama)."""
    if cfg.arch == "llama":
        return nn.RMSNorm(cfg.n_embd, eps=cfg.layernorm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.layernorm_eps)


class MLP(nn.Module):
    """GPT-NeoX's MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # exact (erf) GELU, as GPT-NeoX's "gelu"


class SwiGLU(nn.Module):
    """Llama's gated MLP (Shazeer 2020), no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LMHead(nn.Linear):
    """The output projection. Given targets it returns the summed cross entropy instead of logits
    (chunked, see `model.loss`); going through `__call__` lets ZeRO-3 gather the weight for it.
    `multiplier` scales the logits (muP's output multiplier, `model.mup`; 1 otherwise)."""

    multiplier: float = 1.0

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = h * self.multiplier if self.multiplier != 1.0 else h
        if targets is None:
            return super().forward(h)
        return linear_cross_entropy_sum(h, self.weight, targets)

    def token_losses(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_losses(h * self.multiplier if self.multiplier != 1.0 else h, self.weight, targets)


def init_weights(module: nn.Module, std: float) -> None:
    """The model's initialisation, applied to every module: linears and embeddings normal(0, std),
    biases zero; a score bias (`model.designs`) then its own (`apply` visits children first)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, ScoreBias):
        module.reset_parameters()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.parallel = cfg.parallel_residual
        self.ln_1 = norm(cfg)
        self.attn = CausalSelfAttention(cfg, index)
        self.ln_2 = norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.arch == "llama" else MLP(cfg)

    def forward(self, x, rope: RopeTables | None, cache: LayerCache | None = None, capture=None, documents=None,
                queries: int = 0, q_scale: torch.Tensor | None = None, key_counts: torch.Tensor | None = None):
        """x [B, T, C] -> [B, T, C]; with `queries` > 0 only the last `queries` positions' outputs
        [B, queries, C] (keys and values still come from all T: see `CausalSelfAttention`)."""
        rows = x[:, -queries:] if queries else x
        attended = self.attn(self.ln_1(x), rope, cache, capture, documents, queries, q_scale, key_counts)
        if self.parallel:
            return rows + attended + self.mlp(self.ln_2(rows))
        rows = rows + attended
        return rows + self.mlp(self.ln_2(rows))


class KVCache:
    """Per-layer caches for `GPT.forward(idx, cache=...)`: feed the prompt, then one token at a time.

    The token ids are kept too: under dynamic NTK every new length beyond the training length has a
    new RoPE base, which changes the hidden states of *all* earlier tokens in every layer above the
    first, so no incremental cache can match a full forward there; the model then rebuilds the
    cache from the tokens (a full forward), which is what "the length actually processed" means.
    """

    def __init__(self, n_layer: int):
        self.n_layer = n_layer
        self.clear()

    def clear(self) -> None:
        self.layers = [LayerCache() for _ in range(self.n_layer)]
        self.tokens: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.tokens is None else self.tokens.shape[1]

    def record(self, idx: torch.Tensor) -> None:
        self.tokens = idx if self.tokens is None else torch.cat((self.tokens, idx), dim=1)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = norm(cfg)
        self.lm_head = LMHead(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.rope = (
            Rope(cfg.rope_width(), cfg.rope_base, cfg.rope_scaling.original_max_seq_len or cfg.max_seq_len,
                 cfg.rope_scaling, pairs=cfg.rope_pairs())
            if cfg.design.rope
            else None
        )
        # each layer's RoPE: the model's, or one at the layer's own base (the hybrid's global RoPE layers)
        self.layer_ropes = [
            self.rope if self.rope is None or cfg.layer_design(i).rope_base is None
            else Rope(cfg.rope_width(), cfg.layer_design(i).rope_base, self.rope.train_len, cfg.rope_scaling,
                      pairs=cfg.rope_pairs())
            for i in range(cfg.n_layer)
        ]
        self.sequence_parallel: SequenceParallel | None = None  # `model.sequence_parallel.enable`
        self.apply(lambda module: init_weights(module, cfg.init_std))
        if cfg.mup:
            rescale_init(self)
            self.lm_head.multiplier = output_multiplier(cfg)

    # ---- forward ---------------------------------------------------------------------------------

    def hidden_states(
        self,
        idx: torch.Tensor,
        cache: KVCache | None = None,
        capture: list | None = None,
        documents: torch.Tensor | None = None,
        keep: int = 0,
    ) -> torch.Tensor:
        """Final (ln_f) hidden states [B, T, C]. With a cache, idx continues the cached tokens.

        documents [B, T]: each token's document id in a packed row (non-decreasing), read where
        `cfg.doc_mask` is on (None: the row is one document); see `model.documents`.
        keep > 0: only the last `keep` positions' states [B, keep, C]. Nothing reads the last
        block's other outputs, so it runs its attention queries and MLP on those positions only
        (its keys and values on all): the same numbers, and for a shallow model at long lengths
        close to one block's work less (the passkey scorer needs a few positions of 8K)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be [batch, tokens], got shape {tuple(idx.shape)}")
        sp = self.sequence_parallel
        if sp is not None and (cache is not None or capture is not None or keep):
            raise ValueError("sequence parallelism shards training rows: the KV cache, capture_qk and "
                             "logits_to_keep run on one rank")
        if self.cfg.doc_mask and documents is not None:  # under sequence parallelism: the whole rows'
            documents = Documents(documents if sp is None else sp.documents(documents), self.cfg.doc_positions)
        else:
            documents = None
        if documents is not None and cache is not None:
            raise ValueError("document masking is for packed rows; a KV cache continues one document")
        T = idx.shape[1]
        past = 0
        if cache is not None:
            past = cache.length
            if past and self.rope is not None and self.rope.base_at(past) != self.rope.base_at(past + T):
                tokens = torch.cat((cache.tokens, idx), dim=1)  # dynamic NTK: every layer is stale
                cache.clear()
                rows = min(keep, T) if keep > 0 else T
                return self.hidden_states(tokens, cache, capture, keep=rows)[:, -rows:]
            cache.record(idx)
        first, length = (past, past + T) if sp is None else sp.span(T)  # global positions and length
        x = self.wte(idx)
        per_document = documents is not None and self.cfg.doc_positions
        # [B, T] (per row; heads broadcast) or [T]
        at = positions(documents.ids)[:, first : first + T] if per_document else torch.arange(first, first + T,
                                                                                             device=idx.device)
        tables = {}  # per Rope (layers at one base share their tables)
        for rope in self.layer_ropes:
            if rope is not None and id(rope) not in tables:
                cos, sin = rope.tables(at, length, x.dtype)
                tables[id(rope)] = (cos[:, None], sin[:, None]) if per_document else (cos, sin)
        q_scale = None
        if self.cfg.length_temperature:
            scale = length_temperature(at, self.cfg.max_seq_len).to(x.dtype)[..., None]
            q_scale = scale[:, None] if per_document else scale
        if self.cfg.mup and self.cfg.n_embd != self.cfg.mup_base_width:  # muP's 1/d attention
            factor = attention_multiplier(self.cfg)
            q_scale = factor if q_scale is None else q_scale * factor
        key_counts = None
        if self.cfg.ssmax:  # the keys each query attends to: within its document under doc_mask
            within = documents.positions[:, first : first + T] if documents is not None else at
            key_counts = key_counts_of(within)
        remat = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        keep = keep if 0 < keep < T and capture is None and documents is None else 0
        for i, block in enumerate(self.h):
            layer_cache = cache.layers[i] if cache is not None else None
            queries = keep if i == len(self.h) - 1 else 0
            rope = None if self.layer_ropes[i] is None else tables[id(self.layer_ropes[i])]
            if remat and layer_cache is None and capture is None:
                x = checkpoint(block, x, rope, None, None, documents, queries, q_scale, key_counts,
                               use_reentrant=False)
            else:
                x = block(x, rope, layer_cache, capture, documents, queries, q_scale, key_counts)
        return self.ln_f(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        logits_to_keep: int = 0,
        loss_tokens: float | torch.Tensor | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] (only the last `logits_to_keep` positions' if > 0: the LM head skips
        the rest); with `targets` [B, T], the summed cross entropy (-100 ignored) divided by
        `loss_tokens` instead: by default the number of counted targets (the mean). Training
        passes a share of the global batch's count, so that micro-batches and ranks are weighted
        by their tokens (`train.trainer`). `documents`: see `hidden_states`."""
        if targets is None:
            h = self.hidden_states(idx, cache, documents=documents, keep=logits_to_keep)
            return self.lm_head(h[:, -logits_to_keep:] if logits_to_keep > 0 else h)
        h = self.hidden_states(idx, cache, documents=documents)
        self._check_targets(h, targets)
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        counted = targets != -100
        if not bool(counted.all()):  # the LM head runs on counted positions only (answer-only rows: a few)
            h, targets = h[counted], targets[counted]
        return self.lm_head(h, targets) / (counted.sum() if loss_tokens is None else loss_tokens)

    @torch.no_grad()
    def token_losses(self, idx: torch.Tensor, targets: torch.Tensor,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token cross entropy [B, T] in float32 (0 where the target is -100); no gradient."""
        h = self.hidden_states(idx, documents=documents)
        self._check_targets(h, targets)
        losses = self.lm_head.token_losses(h.reshape(-1, h.shape[-1]), targets.reshape(-1))
        return losses.view(targets.shape).float()

    @staticmethod
    def _check_targets(h: torch.Tensor, targets: torch.Tensor) -> None:
        if targets.shape != h.shape[:2]:
            raise ValueError(f"targets shape {tuple(targets.shape)} != idx shape {tuple(h.shape[:2])}")

    def compile_blocks(self) -> None:
        """torch.compile each transformer block in place (the state dict keeps its names)."""
        for block in self.h:
            block.compile()

    # ---- inference tools -------------------------------------------------------------------------

    def set_rope_scaling(self, type: str, factor: float) -> None:
        """Switch RoPE scaling on a trained model (weights are unchanged)."""
        old = self.cfg.rope_scaling
        scaling = replace(old, type=type, factor=factor)  # YaRN's betas and the original length stay
        self.cfg = replace(self.cfg, rope_scaling=scaling)  # re-validates (e.g. a scaling on ALiBi)
        for rope in {id(r): r for r in self.layer_ropes if r is not None}.values():
            rope.scaling = scaling

    def set_length_temperature(self, on: bool) -> None:
        """Switch the length temperature (`ModelConfig.length_temperature`) on a trained model."""
        self.cfg = replace(self.cfg, length_temperature=on)

    @torch.no_grad()
    def capture_qk(self, idx: torch.Tensor) -> list[AttentionInputs]:
        """Each layer's (q_eff, k_eff, score bias), from which its attention scores follow."""
        capture: list[AttentionInputs] = []
        self.hidden_states(idx, capture=capture)
        return capture

    @torch.no_grad()
    def stream(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        greedy: bool = False,
        seed: int | None = None,
        stop: Collection[int] = (),
    ) -> Iterator[torch.Tensor]:
        """The decoding loop: yield the next token [B] of each row of idx [B, T], one step at a time
        over a KV cache, for `max_new_tokens` steps or until every row has produced a `stop` id (a
        row that stopped keeps going until then: the caller cuts it).

        Greedy takes the argmax; otherwise the logits / temperature, filtered by top_k and top_p,
        are sampled with a generator seeded with `seed` (None: torch's global generator), so a seed
        always gives the same tokens.
        """
        check_sampling(temperature, top_k, top_p, greedy)
        generator = None if seed is None else torch.Generator(device=idx.device).manual_seed(seed)
        stop_ids = torch.tensor(sorted(stop), dtype=idx.dtype, device=idx.device)
        stopped = torch.zeros(idx.shape[0], dtype=torch.bool, device=idx.device)
        cache = KVCache(self.cfg.n_layer)
        logits = self.lm_head(self.hidden_states(idx, cache, keep=1)[:, -1])
        for step in range(max_new_tokens):
            token = next_token(logits, temperature, top_k, top_p, greedy, generator)
            yield token
            stopped |= torch.isin(token, stop_ids)
            if step + 1 == max_new_tokens or bool(stopped.all()):
                return
            logits = self.lm_head(self.hidden_states(token[:, None], cache)[:, -1])

    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        greedy: bool = False,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Collection[int] = (),
    ) -> torch.Tensor:
        """idx [B, T] continued by `stream` (same arguments): [B, T + the steps taken]."""
        steps = self.stream(idx, max_new_tokens, temperature, top_k, top_p, greedy, seed, stop)
        return torch.cat([idx, *(token[:, None] for token in steps)], dim=1)
