"""QK-clip (MuonClip, Kimi K2): after a step, shrink the q and k projections of every head whose
largest attention logit over the step's batch exceeded `optim.qk_clip`.

The logit measured is the q.k term the projections control, q_eff . k_eff / sqrt(D) over the causal
(and windowed) pairs, as `GPT.capture_qk` gives q_eff and k_eff: RoPE, CoCA's transform, the length
temperature, SSMax and muP's attention factor are in it; a design's additive score bias (ALiBi,
KERPLE, FIRE, FoX) is not, since no weight of the projections scales it. It is measured after the
optimizer step, with the weights the next step starts from, on this rank's micro-batches, and the
per-head maxima are all-reduced (max) so every replica clips alike. Under document masking the
capture sees whole rows, so the maximum is over a superset of the attended pairs (an upper bound).

Clipping a head by s = threshold / max scales its logits by exactly s: the q.k term is homogeneous of
degree a in the head's q rows and b in its k rows (a = b = 1 for q.k designs, a = 2 for CoCA, whose
q_eff is quadratic in q), found once by probing layer 0 (`degrees`), so q rows x s^(1/(a+b)) and k
rows x s^(1/(a+b)) (MuonClip's sqrt for q.k). Under grouped-query attention a k head serves several
query heads, so all of s goes to the q rows (q rows x s^(1/a)) and the other heads keep theirs.
A design whose q.k does not scale so (QK-norm, FoX Pro's per-head norms: degree 0; PoPE: not
homogeneous) is refused in one line.

The maximum never materialises a [T, T] score matrix: scores are formed `rows` queries at a time
against the keys they can see, in float32.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as torch_dist
from torch import nn

from errors import ConfigError


def max_logits(q: torch.Tensor, k: torch.Tensor, window: int = 0, rows: int = 256) -> torch.Tensor:
    """max over batch, query m and visible keys n (n <= m, m - n < window if window) of
    q[b, h, m] . k[b, h, n] / sqrt(D): [H] float32. q [B, H, Tq, D], k [B, H, Tk, D] (query i at
    position Tk - Tq + i)."""
    _, H, Tq, D = q.shape
    offset = k.shape[-2] - Tq
    best = torch.full((H,), -math.inf, dtype=torch.float32, device=q.device)
    for first in range(0, Tq, rows):
        last = min(first + rows, Tq)
        keys = offset + last
        scores = torch.einsum("bhqd,bhkd->bhqk", q[:, :, first:last].float(), k[:, :, :keys].float()) / math.sqrt(D)
        m = torch.arange(first, last, device=q.device)[:, None] + offset
        n = torch.arange(keys, device=q.device)[None, :]
        visible = (n <= m) & ((m - n < window) if window else True)
        best = torch.maximum(best, scores.masked_fill(~visible, -math.inf).amax(dim=(0, 2, 3)))
    return best


def _rows(attn: nn.Module, which: int, head: int) -> list[tuple[torch.Tensor, slice]]:
    """The weight (and bias) rows of a q (which=0) or k (which=1) head: NeoX's fused per-head
    [H, 3, D] rows of `qkv` (`model.hf_layout`), or Llama's separate `q` / `k`."""
    D = attn.head_dim
    if attn.fused:
        rows = slice(head * 3 * D + which * D, head * 3 * D + (which + 1) * D)
        return [(attn.qkv.weight, rows), (attn.qkv.bias, rows)]
    return [((attn.q, attn.k)[which].weight, slice(head * D, (head + 1) * D))]


@torch.no_grad()
def _scale(attn: nn.Module, which: int, head: int, factor: float) -> None:
    for tensor, rows in _rows(attn, which, head):
        tensor[rows] *= factor


def _layer_logits(model: nn.Module, idx: torch.Tensor) -> list[torch.Tensor]:
    return [max_logits(c.q_eff, c.k_eff, c.window) for c in model.capture_qk(idx)]


@torch.no_grad()
def degrees(model: nn.Module) -> tuple[int, int]:
    """(a, b): the q.k term's degree in the q rows and in the k rows, probed on layer 0 (doubling all its
    q rows, then all its k rows); a one-line ConfigError where it is not a positive whole power."""
    attn = model.h[0].attn
    idx = torch.randint(0, model.cfg.vocab_size, (1, min(16, model.cfg.max_seq_len)),
                        generator=torch.Generator().manual_seed(0)).to(attn.proj.weight.device)
    base = model.capture_qk(idx)[0]
    found = []
    scores = torch.einsum("bhqd,bhkd->bhqk", base.q_eff.double(), base.k_eff.double())
    for which, heads in ((0, attn.n_head), (1, attn.kv_heads)):
        for head in range(heads):
            _scale(attn, which, head, 2.0)
        probe = model.capture_qk(idx)[0]
        for head in range(heads):
            _scale(attn, which, head, 0.5)
        scaled = torch.einsum("bhqd,bhkd->bhqk", probe.q_eff.double(), probe.k_eff.double())
        degree = round(math.log2(max(float((scaled * scores).sum() / (scores * scores).sum()), 1e-9)))
        if degree < 1 or not torch.allclose(scaled, 2.0 ** degree * scores, rtol=1e-5,
                                            atol=1e-6 * float(scores.abs().max())):
            raise ConfigError(f"optim.qk_clip: {model.cfg.design.name}'s q.k logits do not scale as a power of its "
                              "q and k projections (normalised or non-homogeneous q/k): there is nothing to clip")
        found.append(degree)
    return found[0], found[1]


@torch.no_grad()
def clip(model: nn.Module, inputs: list[torch.Tensor], threshold: float,
         degree: tuple[int, int]) -> dict[str, float]:
    """Measure each layer's per-head max logit over `inputs` (this rank's token batches), all-reduced
    across ranks, and rescale the heads above `threshold`; returns the metrics record's fields
    (`qk_max_logit/<layer>`, the layer's largest, and `qk_clipped/<layer>`, its heads clipped)."""
    per_layer = torch.stack([torch.stack(layer) for layer in zip(*(_layer_logits(model, idx) for idx in inputs))])
    maxima = per_layer.amax(dim=1)  # [layers, H]
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.all_reduce(maxima, op=torch_dist.ReduceOp.MAX)
    a, b = degree
    record: dict[str, float] = {}
    for layer, (block, heads) in enumerate(zip(model.h, maxima.tolist(), strict=True)):
        attn, clipped = block.attn, 0
        grouped = attn.kv_heads != attn.n_head
        for head, top in enumerate(heads):
            if top <= threshold:
                continue
            clipped += 1
            s = threshold / top
            if grouped:
                _scale(attn, 0, head, s ** (1.0 / a))
            else:
                _scale(attn, 0, head, s ** (1.0 / (a + b)))
                _scale(attn, 1, head, s ** (1.0 / (a + b)))
        record[f"qk_max_logit/{layer}"] = max(heads)
        record[f"qk_clipped/{layer}"] = clipped
    return record
