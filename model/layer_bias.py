"""`LayerBias`: a layer's score bias b_h(m, n) bound to one forward, read by every bias kernel (the
CPU ones in `model.bias_attention`, FlexAttention's score modification in `model.flex`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .designs import ScoreBias


@dataclass(frozen=True)
class LayerBias:
    """A layer's score bias bound to one forward: the module, the per-token terms of its keys
    (a gated bias's, e.g. FoX's log forget gates [B, H, Tk]; None otherwise), the position of key
    0 (`start`: a document piece's offset in its row where positions do not restart) and the query
    heads served."""

    module: ScoreBias
    terms: torch.Tensor | None = None
    start: int = 0
    heads: slice = field(default_factory=lambda: slice(None))

    def prefix(self) -> torch.Tensor | None:
        """F [B, H, Tk]: the running sums of the terms, in float64 (exact differences F_m - F_n)."""
        return None if self.terms is None else self.terms.to(torch.float64).cumsum(dim=-1)

    def rows(self, first: int, rows: int, keys: int, prefix: torch.Tensor | None,
             device: torch.device, t: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """b_h(m, n) of queries first..first+rows-1 over keys 0..keys-1 (indices; positions add
        `start`): [B, H, rows, keys], or [H, rows, keys] for a bias that is the same in every row
        (from the module's `tensors` t where given: `ScoreBias.rows`)."""
        m = torch.arange(first, first + rows, device=device)[:, None] + self.start
        n = torch.arange(keys, device=device)[None, :] + self.start
        n = torch.minimum(n, m)  # masked pairs (n > m) read n = m: the formulas stay finite there
        gap = None
        if prefix is not None:  # float64: F_m - F_n exact
            gap = prefix[..., first : first + rows, None] - prefix[..., None, :keys]
        return self.module.rows(self.heads, m, n, gap, t)

    def key_values(self, keys: int, prefix: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """c_h(n) of keys 0..keys-1 (positions add `start`) of a separable bias (b = c_h(n) -
        c_h(m)): [1 or B, H, keys], float64."""
        n = torch.arange(keys, device=device) + self.start
        return self.module.key_values(self.heads, n, None if prefix is None else prefix[..., :keys])

    def scores(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Batch row 0's bias of queries start..end-1 over keys 0..end-1: [H, rows, end] (what
        evaluation adds to q_eff . k_eff / sqrt(D))."""
        prefix = self.prefix()
        values = self.rows(start, end - start, end, None if prefix is None else prefix[:1, :, :end], device)
        return values[0] if values.dim() == 4 else values
