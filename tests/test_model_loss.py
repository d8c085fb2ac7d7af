"""The chunked LM-head cross entropy against an unchunked float64 reference of its definition."""

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_module
from model.loss import linear_cross_entropy_sum, token_losses


def inputs(n=23, c=16, v=40, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(v, c, generator=g, dtype=dtype)).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    t[[2, 5, 6]] = -100
    return h, w, t


def reference(h, w, t):
    """sum_i (logsumexp(z_i) - z_i[t_i]) over kept rows, in float64 by explicit formula."""
    z = h.double() @ w.double().t()
    keep = t != -100
    return (torch.logsumexp(z[keep], -1) - z[keep].gather(1, t[keep, None]).squeeze(1)).sum()


@pytest.mark.parametrize("chunk_tokens", [1, 4, 7, 23, 100])
def test_sum_and_gradients_match_reference(chunk_tokens, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 40 * chunk_tokens)
    h, w, t = inputs()
    got = linear_cross_entropy_sum(h, w, t)
    want = reference(h, w, t)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # a non-unit upstream gradient (the trainer divides by the token count) scales both gradients
    got_grads = torch.autograd.grad(got * 0.37, (h, w))
    want_grads = torch.autograd.grad(want * 0.37, (h, w))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert got_grads[0][[2, 5, 6]].abs().max() == 0  # ignored tokens get no gradient


def test_token_losses_match_reference_per_token(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 40 * 5)
    h, w, t = inputs()
    got = token_losses(h, w, t)
    want = F.cross_entropy(h.detach() @ w.detach().t(), t, ignore_index=-100, reduction="none")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not got.requires_grad


def test_bf16_is_as_accurate_as_plain_autograd_in_bf16(monkeypatch):
    """bf16 weights: bf16 gradients, a float32 loss, and errors against float64 no larger than
    those of the unfused bf16 head (F.linear + cross_entropy under autograd), over 8 chunks."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 50 * 8)
    h, w, t = inputs(n=64, c=32, v=50)
    fused = [h.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()]
    plain = [x.detach().clone().requires_grad_() for x in fused]
    exact = [x.detach().double().requires_grad_() for x in fused]
    got = linear_cross_entropy_sum(*fused, t)
    assert got.dtype == torch.float32
    got.backward()
    assert fused[0].grad.dtype == fused[1].grad.dtype == torch.bfloat16
    F.cross_entropy(F.linear(*plain).float(), t, ignore_index=-100, reduction="sum").backward()
    want = reference(*exact, t)
    want.backward()
    # bf16 logits are rounded to ~3 digits (errors ~0.003 each, random in sign); a bf16 running sum
    # of ~300 would be off by ~1, far outside this.
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)
    for f, p, e in zip(fused, plain, exact):
        fused_error = (f.grad.double() - e.grad).abs().max()
        plain_error = (p.grad.double() - e.grad).abs().max()
        assert fused_error <= 1.25 * plain_error, (fused_error, plain_error)
