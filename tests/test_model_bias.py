"""The learned score biases (KERPLE-log, FIRE, FoX) against float64 references written from their
papers' definitions: the layer's output and the gradients of its input and every parameter (the
bias's included), with GQA, at shifted positions (a KV cache's queries) and under document
masking; FoX at 32K tokens in float32 and bfloat16; the CPU kernel's memory for backward."""

import math

import pytest
import torch

import model.bias_attention as attention_module
from model import ModelConfig
from model.attention import CausalSelfAttention, LayerCache
from model.bias_attention import LayerBias, _chunked_bias
from model.designs.alibi import AlibiBias, alibi_slopes
from model.designs.fox import ForgetBias
from model.documents import Documents, positions

F64 = torch.float64
DESIGNS = ["kerple", "fire", "fox"]

pytestmark = pytest.mark.usefixtures("single_thread")


def layer_of(design: str, arch: str, doc_positions: bool = False) -> CausalSelfAttention:
    """A float64 layer with large random weights and bias parameters in their meaningful range."""
    extra = dict(arch="llama", n_kv_head=2, parallel_residual=False) if arch == "llama" else {}
    cfg = ModelConfig(n_head=4, n_embd=32, attention=design, doc_mask=doc_positions, doc_positions=doc_positions,
                      **extra)
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)
        bias = layer.score_bias
        if design == "kerple":
            bias.r1.uniform_(0.2, 2.0)
            bias.r2.uniform_(0.2, 1.0)
        if design == "fire":
            bias.c.fill_(0.3)
            bias.l_multiplier.fill_(6 / 512)  # L = 6: rows below and beyond the threshold
    return layer


def reference_bias(design: str, layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor,
                   docs: torch.Tensor) -> torch.Tensor:
    """b[b, h, m, n] for n <= m of one document at token positions pos [B, T], from the papers'
    definitions, one pair at a time (other pairs 0)."""
    bias = layer.score_bias
    B, T, _ = x.shape
    H = layer.n_head
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            cells = []
            for m in range(T):
                for n in range(T):
                    i, j = int(pos[b, m]), int(pos[b, n])
                    if n > m or docs[b, n] != docs[b, m]:
                        cells.append(torch.zeros((), dtype=F64))
                    elif design == "kerple":  # -r1 log(1 + r2 (i - j))
                        cells.append(-bias.r1[h] * torch.log(1 + bias.r2[h] * (i - j)))
                    elif design == "fire":  # f(psi(i - j) / psi(max(L, i))), psi(d) = log(c d + 1)
                        c, L = bias.c.abs(), (bias.l_multiplier * 512).abs()
                        psi_d = torch.log(c * (i - j) + 1)
                        psi_n = torch.log(c * torch.maximum(torch.tensor(float(i), dtype=F64), L) + 1) + 1e-6
                        hidden = torch.relu(bias.mlp_in.weight[:, 0] * (psi_d / psi_n) + bias.mlp_in.bias)
                        cells.append(bias.mlp_out.weight[h] @ hidden + bias.mlp_out.bias[h])
                    else:  # FoX: sum over l = n+1..m of log sigmoid(w_h . x_l + b_h)
                        total = torch.zeros((), dtype=F64)
                        for t in range(n + 1, m + 1):
                            z = bias.gate.weight[h] @ x[b, t] + bias.gate.bias[h]
                            total = total + torch.log(torch.sigmoid(z))
                        cells.append(total)
            heads.append(torch.stack(cells).view(T, T))
        rows.append(torch.stack(heads))
    return torch.stack(rows)


def reference_layer(design: str, layer: CausalSelfAttention, x: torch.Tensor, pos: torch.Tensor,
                    docs: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + b) v over n <= m of the same document, then the output projection."""
    B, T, C = x.shape
    H, D = layer.n_head, layer.head_dim
    if layer.fused:
        w, b = layer.qkv.weight.view(H, 3, D, C), layer.qkv.bias.view(H, 3, D)
        q, k, v = (torch.einsum("btc,hdc->bhtd", x, w[:, i]) + b[None, :, i, None, :] for i in range(3))
    else:
        group = H // layer.kv_heads
        q = torch.einsum("btc,hdc->bhtd", x, layer.q.weight.view(H, D, C))
        k, v = (torch.einsum("btc,hdc->bhtd", x, p.weight.view(-1, D, C))[:, [h // group for h in range(H)]]
                for p in (layer.k, layer.v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + reference_bias(design, layer, x, pos, docs)
    allowed = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    y = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v
    return layer.proj(y.transpose(1, 2).reshape(B, T, C))


def assert_same_with_gradients(out: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor]) -> None:
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)
    expected = torch.autograd.grad((want * weights).sum(), inputs, allow_unused=True)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ["neox", "llama"])
@pytest.mark.parametrize("design", DESIGNS)
def test_layer_matches_the_papers_definition(design, arch, monkeypatch):
    """Output and gradients (x, projections, bias parameters), 13 tokens (FIRE's L = 6 inside) in
    chunks of 5 query rows (3 in the additive kernel's backward, over tiles of 4 keys; keys in
    blocks of 2 in the fused kernel's backward), so the kernels' chunk boundaries are crossed."""
    monkeypatch.setattr(attention_module, "BIAS_CHUNK", 5)
    monkeypatch.setattr(attention_module, "SCORE_ROWS", 3)
    monkeypatch.setattr(attention_module, "SCORE_KEYS", 4)
    monkeypatch.setattr(attention_module, "BACKWARD_KEYS", 2)  # FoX's backward: earlier keys in blocks
    layer = layer_of(design, arch)
    x = torch.randn(2, 13, 32, dtype=F64, requires_grad=True)
    t = x.shape[1]
    want = reference_layer(design, layer, x, torch.arange(t).expand(2, t), torch.zeros(2, t, dtype=torch.long))
    assert_same_with_gradients(layer(x, None), want, [x, *layer.parameters()])


@pytest.mark.parametrize("design", DESIGNS)
def test_kv_cache_queries_at_shifted_positions(design, monkeypatch):
    """A cache of 9 tokens then 4 more: the new queries sit at positions 9..12 (FIRE reads them),
    with FoX's cached gates; the same as the full reference's last rows, with gradients (chunks of
    3 query rows, tiles of 4 keys in the additive kernel's backward)."""
    monkeypatch.setattr(attention_module, "BIAS_CHUNK", 3)
    monkeypatch.setattr(attention_module, "SCORE_ROWS", 3)
    monkeypatch.setattr(attention_module, "SCORE_KEYS", 4)
    layer = layer_of(design, "llama")
    x = torch.randn(1, 13, 32, dtype=F64, requires_grad=True)
    cache = LayerCache()
    with torch.no_grad():
        layer(x[:, :9], None, cache)
    out = layer(x[:, 9:], None, cache)
    want = reference_layer(design, layer, x, torch.arange(13)[None], torch.zeros(1, 13, dtype=torch.long))[:, 9:]
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out)
    # the new tokens' inputs and, for the positional biases, their parameters (FoX's cached gates
    # were made without a graph, which the reference's gate gradients would go through)
    inputs = [x] + ([] if design == "fox" else list(layer.score_bias.parameters()))
    got = torch.autograd.grad((out * weights).sum(), inputs)
    expected = torch.autograd.grad((want * weights).sum(), inputs)
    torch.testing.assert_close(got[0][:, 9:], expected[0][:, 9:], rtol=1e-10, atol=1e-10)
    for a, e in zip(got[1:], expected[1:]):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("doc_positions", [False, True])
@pytest.mark.parametrize("design", DESIGNS)
def test_document_masking(design, doc_positions):
    """Packed rows (several documents, one-token ones, one document): positions from each document's
    start under doc_positions (else the row's), FoX's sums restarted per document."""
    layer = layer_of(design, "neox", doc_positions)
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 3], [4] * 12, [0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 3]])
    x = torch.randn(3, 12, 32, dtype=F64, requires_grad=True)
    pos = positions(docs) if doc_positions else torch.arange(12).expand(3, 12)
    out = layer(x, None, documents=Documents(docs, doc_positions))
    assert_same_with_gradients(out, reference_layer(design, layer, x, pos, docs), [x, *layer.parameters()])


def fox_rows_reference(q, k, v, log_f, rows: list[int]) -> torch.Tensor:
    """Float64 outputs of the given query rows, each from its own backward sums of log f."""
    out = []
    for m in rows:
        after = log_f[..., 1 : m + 1].flip(-1).cumsum(-1).flip(-1)  # key n < m: sum of log f over n+1..m
        gaps = torch.cat((after, log_f.new_zeros(*log_f.shape[:-1], 1)), -1)
        s = q[..., m : m + 1, :] @ k[..., : m + 1, :].transpose(-1, -2) / math.sqrt(q.shape[-1]) + gaps[..., None, :]
        out.append(torch.softmax(s, dim=-1) @ v[..., : m + 1, :])
    return torch.cat(out, dim=-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_fox_at_32k_tokens(dtype, tol):
    """32K tokens, one head: the kernel's output is finite and its rows (first, middle, last) are the
    float64 definition's on the same (rounded) inputs, with gates near 1 and near 0.5 (|F| ~ 1e4)."""
    t = 32768
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, t, 8, generator=g).to(dtype) for _ in range(3))
    logits = torch.randn(1, 1, t, generator=g) * 2 + 2
    log_f = torch.nn.functional.logsigmoid(logits)
    bias = LayerBias(ForgetBias(1, 8), log_f)
    with torch.no_grad():
        out = _chunked_bias(q, k, v, bias)
    assert torch.isfinite(out).all()
    rows = [0, 1, 255, 256, t // 2, t - 2, t - 1]
    want = fox_rows_reference(*(x.to(F64) for x in (q, k, v, log_f)), rows)
    torch.testing.assert_close(out[..., rows, :].to(F64), want, rtol=tol, atol=tol)


def rows_reference(q, k, v, bias_row, rows: list[int]) -> torch.Tensor:
    """Float64 outputs of the given query rows with bias_row(m) [H, m + 1] over keys 0..m."""
    out = []
    for m in rows:
        s = q[..., m : m + 1, :] @ k[..., : m + 1, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out.append(torch.softmax(s + bias_row(m)[..., None, :], dim=-1) @ v[..., : m + 1, :])
    return torch.cat(out, dim=-2)


@pytest.mark.parametrize("t", [8192, 32768])
@pytest.mark.parametrize("design", ["alibi", "fox"])
def test_fused_separable_bias_error_in_float32(design, t):
    """ALiBi and FoX in float32 ride the fused kernel with the bias as an extra q/k column centred
    on each chunk's middle row (`_KeyBiasAttention`). Its error against the float64 definition (same
    rounded inputs) is float32's rounding of that column near each row's diagonal: per score at
    most 2^-24 x the bias's span over half a chunk (ALiBi: s_h x 64, <= 45 for 16 heads' largest
    slope, 2^-0.5; FoX: the largest |F_m - F_centre| in the data), moving the output by at most
    that times |v_n - out| (< 5 here). Measured here (128-row chunks): ALiBi 1.7e-6 (8K), 3.1e-6
    (32K); FoX 1.8e-6, 2.1e-6; this bound: 1.3e-5 (ALiBi), 1.0e-5 and 1.2e-5 (FoX). (The exact
    additive path's error: ~3e-7. Centred on key 0 instead, the fused path's error is 1.1e-4 to
    9.5e-4: this test fails.)"""
    g = torch.Generator().manual_seed(0)
    heads = 2 if design == "alibi" else 1
    q, k, v = (torch.randn(1, heads, t, 8, generator=g) for _ in range(3))
    half = attention_module.BIAS_CHUNK // 2
    if design == "alibi":  # heads 0 and 1 of 16: the largest slopes, 2^-0.5 and 2^-1
        bias = LayerBias(AlibiBias(16), heads=slice(0, heads))
        slopes = alibi_slopes(16)[:heads]
        span = float(slopes.max()) * half

        def bias_row(m: int) -> torch.Tensor:
            return -slopes[:, None] * (m - torch.arange(m + 1, dtype=F64))
    else:  # the 32K test's gates: near 1 and near 0.5 (|F| ~ 1e4)
        log_f = torch.nn.functional.logsigmoid(torch.randn(1, heads, t, generator=g) * 2 + 2)
        bias = LayerBias(ForgetBias(heads, 8), log_f)
        prefix = log_f.to(F64).cumsum(-1)
        span = max(float((prefix[..., s : s + 2 * half] - prefix[..., s + (min(t, s + 2 * half) - s - 1) // 2, None])
                         .abs().max()) for s in range(0, t, 2 * half))

        def bias_row(m: int) -> torch.Tensor:
            return (prefix[0, :, m, None] - prefix[0, :, : m + 1])
    with torch.no_grad():
        out = attention_module._cpu_bias(q, k, v, bias)  # causal_attention: compiled FlexAttention here (no grad)
    assert torch.isfinite(out).all()
    rows = [0, 1, 127, 128, 255, 256, 383, t // 2, t // 2 + 200, t - 129, t - 2, t - 1]
    want = rows_reference(*(x.to(F64) for x in (q, k, v)), bias_row, rows)
    tol = 5 * span * 2.0**-24
    assert 1e-6 < tol < 1e-4
    torch.testing.assert_close(out[..., rows, :].to(F64), want, rtol=0, atol=tol)


@pytest.mark.parametrize("design", DESIGNS)
def test_cpu_kernel_keeps_linear_memory_for_backward(design):
    """What autograd keeps for the backward pass grows linearly with the length (checkpointed chunks:
    no bias, score or probability is kept)."""
    layer = layer_of(design, "neox").float()

    def saved_bytes(t: int) -> int:
        x = torch.randn(1, t, 32, requires_grad=True)
        storages = {}  # each chunk saves views of k and v: count the memory they share once

        def pack(tensor):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(x, None)
        return sum(storages.values())

    assert saved_bytes(2048) <= 2.2 * saved_bytes(1024)


def test_fire_pieces_are_the_mlp():
    """FIRE's MLP evaluated as its linear pieces (`fire.pieces`) equals the MLP written out, values
    and gradients of every weight and of x, in float64 over x spanning every breakpoint (a unit
    with w1 = 0 included)."""
    from model.designs.fire import pieces

    g = torch.Generator().manual_seed(3)
    w1, b1, w2, b2 = (torch.randn(*shape, dtype=F64, generator=g) for shape in ((32,), (32,), (4, 32), (4,)))
    w1[5] = 0.0
    weights = [p.requires_grad_() for p in (w1, b1, w2, b2)]
    x = torch.linspace(-6, 6, 4001, dtype=F64).requires_grad_()
    breaks, slope, intercept = pieces(*weights)
    segment = torch.searchsorted(breaks, x.detach())
    assert len(segment.unique()) > 20  # the grid crosses most breakpoints
    got = slope[:, segment] * x + intercept[:, segment]
    want = w2 @ torch.relu(w1[:, None] * x + b1[:, None]) + b2[:, None]
    assert_same_with_gradients(got, want, [*weights, x])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_fire_tile_is_the_masked_mlp(dtype):
    """The CPU kernel's FIRE tile (`FireBias.causal_block`: the tile's lowest piece plus a step per
    breakpoint it crosses, its own backward) equals the generic tile (`ScoreBias.causal_block`:
    every pair's piece searched, then masked, autograd's gradients): values and the gradients of
    every FIRE tensor at 1e-10 in float64; in float32 values to its rounding (the two sum their
    terms differently), the masked pairs exactly. Breakpoints spread over x's range (a unit with
    w1 = 0 included): tiles crossing none, a few, and all 32 (matmuls of BREAKS_AT_ONCE), rows
    below, at (torch.maximum's tie) and beyond L, tiles not at key 0, tiles ending before their
    rows' diagonal (no masked key), shifted positions, with and without the backward's shift."""
    from model.designs.base import ScoreBias
    from model.designs.fire import FireBias, fire_input

    torch.manual_seed(0)
    fire = FireBias(4).to(dtype)
    with torch.no_grad():
        fire.mlp_in.weight.normal_(0, 1)
        fire.mlp_in.bias.copy_(-fire.mlp_in.weight[:, 0] * torch.rand(32, dtype=dtype))  # breaks in (0, 1)
        fire.mlp_in.weight[3] = 0.0
        fire.l_multiplier.fill_(40 / 512)
        fire.c.fill_(0.3)
    lowest = torch.finfo(dtype).min
    cases = [(0, 7, 0, 7, 0), (30, 9, 0, 39, 5), (100, 16, 0, 116, 0), (3, 1, 0, 4, 2), (200, 128, 0, 328, 0),
             (200, 128, 150, 328, 0), (100, 16, 100, 116, 3), (60, 20, 64, 80, 1),
             (300, 8, 0, 4, 0), (300, 8, 100, 160, 7), (40, 30, 0, 50, 0)]  # (first, rows, keys, start)
    crossed = set()
    for i, (first, rows, key, stop, start) in enumerate(cases):
        keys = slice(key, stop)
        tensors = tuple(t.detach().requires_grad_() for t in fire.tensors(slice(None), "cpu"))
        prepared = fire.prepared(tensors)
        shift = torch.randn(4, rows, 1, dtype=dtype) * 5 if i % 2 else None
        got = fire.causal_block(slice(None), first, rows, keys, start, prepared, "cpu", dtype, shift=shift)
        want = ScoreBias.causal_block(fire, slice(None), first, rows, keys, start, tensors, "cpu", dtype,
                                      shift=shift)
        masked = sum(min(max(stop - 1 - m, 0), stop - key) for m in range(first, first + rows))
        assert (got == lowest).sum() == (want == lowest).sum() == 4 * masked
        tol = 1e-10 if dtype == F64 else None
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        m = torch.arange(first, first + rows)[:, None] + start
        x = fire_input(prepared[0], prepared[1], m, torch.minimum(torch.arange(key, stop)[None, :] + start, m))
        crossed.add(int(((prepared[2] > x.min()) & (prepared[2] < x.max())).sum()))
        if dtype == F64:
            weights = torch.randn_like(got)
            for a, e in zip(torch.autograd.grad((got * weights).sum(), tensors),
                            torch.autograd.grad((want * weights).sum(), tensors)):
                torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)
    assert min(crossed) == 0 and max(crossed) > 24  # no breakpoint in a tile, and nearly all of them
