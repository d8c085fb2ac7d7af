"""What an attention design is: one record that says what the design computes and how every part
of the framework (config, kernels, evaluation, plots, export, conversion, benchmarks) treats it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .rope import RopeTables

QKTransform = Callable[[torch.Tensor, torch.Tensor, Optional[RopeTables]], tuple[torch.Tensor, torch.Tensor]]


def unchanged(q: torch.Tensor, k: torch.Tensor, rope: RopeTables | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The q/k transform of a design that scores q . k as they are (no rotation)."""
    return q, k


class ScoreBias(nn.Module):
    """One layer's additive score bias b_h(m, n), for query position m and key position n <= m,
    added to the scaled scores q_eff . k_eff / sqrt(D). A design with a bias builds one per layer
    (`Design.bias`); its parameters are the layer's (`attn.score_bias.*`), so they train, shard
    and export with it. The kernels (`model.bias_attention`, `model.flex`, the exported model) read
    it two ways:

    - `rows`: the bias of a block of query rows over their keys, as one tensor (the CPU kernel, the
      remote-code model, evaluation); differentiable with respect to the parameters.
    - `element` on `flex_tensors`: the same value elementwise from a few tensors (FlexAttention's
      score_mod on GPU, with the tensors captured: gradients flow to them).

    Both serve the query heads `heads` (a slice: all of them, or one rank's share under sequence
    parallelism) and take positions (m [..., rows, 1] of the queries, n [..., 1, keys] of the keys;
    from the document start under `doc_positions`) and, for a data-dependent bias (`gated`), the
    sum of its per-token terms `terms(x)` over the gap, g = sum_{l = n+1}^{m} term_l (exact: a
    difference of float64 prefix sums on CPU, of float32 hi/lo pairs in FlexAttention). By default
    `rows` is `element` on broadcast tensors.
    """

    n_head: int
    gated: bool = False  # whether the bias reads the layer input (`terms`): FoX's forget gates
    separable: bool = False  # whether b_h(m, n) = c_h(n) - c_h(m) (`key_values`): ALiBi's, FoX's

    def reset_parameters(self) -> None:
        """The design's own initialisation of its parameters, run after the model's (which draws
        every linear layer's weights): none by default."""

    def terms(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token terms [B, H, T] (float32) from the layer input x [B, T, C] (gated biases only);
        the bias sees their sums over each gap, within a document."""
        raise NotImplementedError(f"{type(self).__name__} reads no per-token terms")

    def tensors(self, heads: slice, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What `element` reads, for the query heads `heads` (per-head tensors sliced by them)."""
        return ()

    def flex_tensors(self, heads: slice, device: torch.device) -> tuple[torch.Tensor, ...]:
        """What `element` reads in FlexAttention's score_mod: `tensors` by default. Inductor lowers a
        score_mod's backward to a GPU only where it reads each tensor that needs gradients by one
        index (`t[h]`, once): a design whose `element` reads one more often gives copies here
        (FIRE's), and its `element` then reads this form."""
        return self.tensors(heads, device)

    @staticmethod
    def element(t: tuple[torch.Tensor, ...], h: torch.Tensor, m: torch.Tensor, n: torch.Tensor,
                gap: torch.Tensor | None) -> torch.Tensor:
        """b_h(m, n) from `tensors` elementwise (broadcasting); a static function of tensors only, so
        FlexAttention compiles one score_mod per design for every layer."""
        raise NotImplementedError

    def key_values(self, heads: slice, n: torch.Tensor, prefix: torch.Tensor | None) -> torch.Tensor:
        """c_h(n) [1 or B, heads, keys] in float64 for a `separable` bias, b_h(m, n) = c_h(n) - c_h(m),
        at key positions n [keys] (a gated bias: from the prefix sums F [B, heads, keys]). Softmax
        drops the per-row -c_h(m), so the bias rides the fused kernel as one more q/k dimension
        (`model.bias_attention._KeyBiasAttention`)."""
        raise NotImplementedError(f"{type(self).__name__} is not separable")

    def distance_table(self, heads: slice, distances: torch.Tensor,
                       t: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
        """b_h at the given distances [distances] ([heads, distances]) from `tensors` t, for a bias
        of the distance alone (KERPLE's); None otherwise. `causal_block` then builds a tile's bias
        as a Toeplitz view of it."""
        return None

    def prepared(self, t: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """What `causal_block` reads, from `tensors` t: t itself by default; a design whose tiles
        share work derived from its parameters (FIRE's linear pieces) derives it here, once per
        kernel call and not per tile (differentiably: the kernel's backward takes the tiles'
        gradients with respect to these and then to t)."""
        return t

    def causal_block(self, heads: slice, first: int, rows: int, keys: slice, start: int,
                     t: tuple[torch.Tensor, ...], device: torch.device, dtype: torch.dtype,
                     shift: torch.Tensor | None = None) -> torch.Tensor:
        """b_h(m, n) [heads, rows, keys] as `dtype` of query rows first..first+rows-1 over the keys
        `keys` (indices, keys.stop <= first + rows; positions add `start`), with the dtype's lowest
        value where n > m (exp of it underflows to 0, so the masked pairs' probabilities are 0 in
        forward and backward): the CPU kernel's bias of one tile, from `prepared` t (their
        gradients flow), a fresh contiguous tensor. `shift` [heads, rows, 1], a constant, is added
        to every row where given (the kernel's backward: -lse, in the same pass where a design can).
        By default `rows`, masked; a bias of the distance alone is a Toeplitz matrix: windows of
        its `distance_table` reversed and padded with the masked value, no per-pair index or mask
        (a masked value stays the lowest under a shift: far under half its ulp)."""
        lowest = torch.finfo(dtype).min
        width = keys.stop - keys.start
        farthest, nearest = first + rows - 1 - keys.start, first - (keys.stop - 1)  # m - n < 0: masked
        table = self.distance_table(heads, torch.arange(max(nearest, 0), farthest + 1, device=device), t)
        if table is not None:  # row i, key keys.start + j: padded[rows - 1 - i + j], `rows` windows
            masked = table.new_full((table.shape[0], max(0, -nearest)), lowest, dtype=dtype)
            padded = torch.cat([table.flip(-1).to(dtype), masked], -1)
            block = padded.unfold(-1, width, 1).flip(1)
            return block if shift is None else block.add_(shift)
        m = torch.arange(first, first + rows, device=device)[:, None] + start
        n = torch.arange(keys.start, keys.stop, device=device)[None, :] + start
        values = self.rows(heads, m, torch.minimum(n, m), None, t).to(dtype)
        return (values if shift is None else values + shift).masked_fill(n > m, lowest)

    def rows(self, heads: slice, m: torch.Tensor, n: torch.Tensor, gap: torch.Tensor | None = None,
             t: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """b_h(m, n) for the query heads `heads`: [heads, rows, keys] (or [B, heads, rows, keys] for a
        gated bias: gap is [B, heads, rows, keys]), float32 or wider; from `t`, this module's
        `tensors(heads)` where given (a kernel that takes their gradients itself), else its own."""
        t = self.tensors(heads, m.device) if t is None else t
        served = len(range(*heads.indices(self.n_head)))
        return self.element(t, torch.arange(served, device=m.device)[:, None, None], m, n, gap)


@dataclass(frozen=True)
class Design:
    """One attention design of the registry (`model.designs.registry`).

    key: its name in run folders, figures and the study's comparisons (`coca_strict`).
    attention, form: the config values that select it (`model.attention`; and, for a design of
      several forms, `model.design_params.<attention>.form`: CoCA's slack and strict; None where
      the design has no forms).
    label: its name in evaluation results (`coca-strict`); name: in sentences (`CoCA strict`).
    colour: its colour in every figure. summary: one line on what it is.
    qk: q [B, H, T, D], k [B, kv heads, T, D] (the layer's K projection: CoCA's T), RoPE tables of
      the T positions (None where `rope` is False) -> the kernel's q_eff, k_eff. Scores are
      q_eff . k_eff / sqrt(D), plus the bias below; the KV cache holds k_eff.
    rope: whether the design rotates with RoPE: the model builds tables and RoPE scalings apply.
    bias: (n_head, n_embd) -> a layer's `ScoreBias` module, b_h(m, n) added to the scores of query
      position m and key position n and run on the bias kernels; None: no bias (fused SDPA).
      ALiBi's is fixed slopes; KERPLE's, FIRE's and FoX's learn.
    native_hf: exported as the architecture's own Hugging Face class (GPTNeoXForCausalLM,
      LlamaForCausalLM); otherwise as the remote-code model shipped with the export.
    from_origin: how an Origin model's weights become this design's (`model.convert`): "keep"
      (every tensor as it is, a bias's parameters drawn afresh; where the design's params have a
      `t_init`, "fresh" draws K's rows afresh: CoCA's T), None (refused).
    window: a sliding window of this many keys (the query's own included; 0: every earlier key).
    rotating_pairs: (params, rotary pairs) -> how many pairs rotate, the highest frequencies first
      (the rest get frequency 0: `Rope(pairs=...)`); None: all of them.
    rope_base: a RoPE base of this layer's own (the hybrid's global RoPE layers); None: model.rope_base.
    rope_width: (rotary dims r) -> the width of the RoPE tables its `qk` reads (PoPE's 2r: one
      frequency per component, base^(-c/r)); None: r (RoPE's r/2 frequencies, duplicated).
    transform: (params, n_head, rope width) -> a module whose call replaces `qk` with learned
      parameters of its own (the layer's `qk_transform`: PoPE's phase bias), or None where
      `qk` serves; None: `qk` always.
    params: the dataclass of the design's parameters, with their defaults and checks (the config's
      `model.design_params.<attention>.<name>`, the export's `design_params`; the forms of one
      attention share it); None: it has none.
    for_layer: (params, layer index, n_layer) -> the Design layer `index` runs (a parametrised
      transform, another design in some layers, a window); None: this record in every layer.
    attend: (n_head, head_dim) -> a layer's module that replaces softmax attention altogether
      (the layer's `attend`, called as attend(q_eff, k_eff, v, document ids [B, Tk] or None, query
      heads served) -> [B, H, Tq, D], with parameters of its own: stick-breaking's); None: softmax
      on the shared kernels. Such a design has no softmax for sinks, SSMax or the length
      temperature to modify (`softmax`).
    weights: for a design with `attend`: (scores [..., rows, keys], causal mask n <= m of that
      shape) -> (its attention weights, the keys its queries see), in the scores' dtype, for the
      attention statistics (`eval.attention_stats`; `GPT.capture_qk` refuses a design with `attend`
      and none); None: softmax over the causal keys.
    pro: (n_head, kv heads, head_dim, n_embd, eps) -> a layer's module of the Forgetting Transformer
      paper's "Pro" block parts around the kernel (the layer's `pro`: `inputs` shifts k and v and
      normalises q and k per head before the q/k transform, `output` norms and gates the attention's
      output before the projection; FoX Pro's); None: none.
    """

    key: str
    attention: str
    label: str
    name: str
    colour: str
    summary: str
    qk: QKTransform = unchanged
    rope: bool = True
    bias: Optional[Callable[[int, int], ScoreBias]] = None
    form: Optional[str] = None
    native_hf: bool = False
    from_origin: Optional[str] = None
    window: int = 0
    rotating_pairs: Optional[Callable[[Any, int], int]] = None
    rope_width: Optional[Callable[[int], int]] = None
    rope_base: Optional[float] = None
    transform: Optional[Callable[[Any, int, int], Optional[nn.Module]]] = None
    params: Optional[type] = None
    for_layer: Optional[Callable[[Any, int, int], Design]] = None
    attend: Optional[Callable[[int, int], nn.Module]] = None
    weights: Optional[Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None
    pro: Optional[Callable[[int, int, int, int, float], nn.Module]] = None

    @property
    def softmax(self) -> bool:
        """Whether the design's attention is a softmax over scores (every design but one with `attend`)."""
        return self.attend is None

    def settings(self) -> dict[str, Any]:
        """The model-config fields that select this design (`ModelConfig(**settings())`), e.g.
        {"attention": "coca", "design_params": {"coca": {"form": "strict"}}}."""
        form = {"design_params": {self.attention: {"form": self.form}}} if self.form else {}
        return {"attention": self.attention, **form}

    def overrides(self) -> list[str]:
        """`settings()` as command-line overrides, e.g. ["model.attention=coca",
        "model.design_params.coca.form=strict"]."""
        form = [f"model.design_params.{self.attention}.form={self.form}"] if self.form else []
        return [f"model.attention={self.attention}", *form]

    def layer(self, params: Any, index: int, n_layer: int) -> Design:
        """The design layer `index` of `n_layer` runs, under this design's `params`."""
        return self if self.for_layer is None else self.for_layer(params, index, n_layer)
