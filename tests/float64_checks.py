"""What the float64 layer tests of the designs share: RoPE written from its definition, the two
architectures' small shapes, a random double-precision model, and the check that an output and
its gradients equal a reference's."""

from __future__ import annotations

import torch

from model import GPT, ModelConfig

F64 = torch.float64
ARCHS = {  # neox rotates half of each head (rotary_pct 0.5); llama: 4 query heads over 2 kv heads
    "neox": dict(n_head=2, n_embd=32, rotary_pct=0.5),
    "llama": dict(arch="llama", parallel_residual=False, n_head=4, n_kv_head=2, n_embd=32),
}


def rotate(x: torch.Tensor, pos: torch.Tensor, r: int, base: float = 10000.0) -> torch.Tensor:
    """Pair (j, j + r/2) of x [..., T, D] turned by pos * base^(-2j/r); dimensions past r kept."""
    out = x.clone()
    for j in range(r // 2):
        theta = base ** (-2 * j / r)
        c, s = torch.cos(pos.to(F64) * theta), torch.sin(pos.to(F64) * theta)
        out[..., j] = x[..., j] * c - x[..., j + r // 2] * s
        out[..., j + r // 2] = x[..., j] * s + x[..., j + r // 2] * c
    return out


def random_gpt(max_seq_len: int, **config) -> GPT:
    """A small float64 model in eval mode, every parameter drawn from N(0, 0.3^2) (seed 0), so that
    each part of a design moves the logits visibly."""
    shape = dict(vocab_size=64, n_layer=2, n_head=2, n_embd=32, ffn_hidden=64, max_seq_len=max_seq_len)
    torch.manual_seed(0)
    model = GPT(ModelConfig(**{**shape, **config})).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def assert_same_with_gradients(out: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    """out equals want, and so do the gradients of a random projection of each with respect to
    `inputs` (1e-10: both in float64)."""
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(out.shape, dtype=F64)
    for got, expected in zip(torch.autograd.grad((out * weights).sum(), inputs),
                             torch.autograd.grad((want * weights).sum(), inputs)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
