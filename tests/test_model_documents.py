"""Document masking (`model.doc_mask`, `model.doc_positions`) against its definition, in float64.

The definition: in a packed row, a token attends to the earlier tokens of its own document only.
So a packed row must give, position by position, the logits of each document run on its own: with
`doc_positions` (positions restart at each document) exactly so for every attention; without, as
each document at its offset in the row (the layer test below, against the explicit float64
reference of each attention at those positions, with a block-diagonal causal mask).
"""

import math

import pytest
import torch
from test_model_attention import reference_scores

from model import GPT, ModelConfig
from model.attention import CausalSelfAttention, causal_attention
from model.bias_attention import LayerBias
from model.designs import Rope
from model.designs.alibi import AlibiBias
from model.documents import Documents, document_block_mask, positions, starts

F64 = torch.float64
KINDS = ["origin", "slack", "strict", "alibi"]

pytestmark = pytest.mark.usefixtures("single_thread")


def config(kind: str, **extra) -> ModelConfig:
    attention = "coca" if kind in ("slack", "strict") else kind
    return ModelConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=16, ffn_hidden=32, max_seq_len=64,
                       attention=attention, design_params={"coca": {"form": kind}} if attention == "coca" else {},
                       **extra)


def random_model(cfg: ModelConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [1, T] and document ids [1, T] of documents of these lengths, back to back."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 50, (1, sum(lengths)), generator=g)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    return idx, docs


def reference_block_causal(scores: torch.Tensor, docs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax over the pairs doc[m] == doc[n], n <= m, the plain way ([B, H, T, T] scores)."""
    t = scores.shape[-1]
    allowed = (docs[:, None, :, None] == docs[:, None, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def assert_each_document_alone(model: GPT, lengths: list[int], seed: int) -> None:
    """A packed row's logits, document by document, equal each document's own run (1e-10)."""
    idx, docs = packed_row(lengths, seed=seed)
    packed = model(idx, documents=docs)
    start = 0
    for n in lengths:
        alone = model(idx[:, start : start + n])  # one document: no `documents` needed
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-10, atol=1e-10)
        start += n


def test_starts_and_positions():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 3, 3], [5, 5, 5, 5, 5, 5, 5, 6]])
    assert starts(docs).tolist() == [[0, 0, 0, 3, 3, 5, 6, 6], [0, 0, 0, 0, 0, 0, 0, 7]]
    assert positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0]]


@pytest.mark.parametrize("kind", KINDS)
def test_packed_row_equals_each_document_alone(kind):
    """doc_positions on: the packed row's logits are each document's own, for every attention."""
    assert_each_document_alone(random_model(config(kind, doc_mask=True, doc_positions=True)), [7, 1, 12, 5, 9], 1)


@pytest.mark.parametrize("kind", ["origin", "strict", "alibi"])
def test_relative_attentions_ignore_the_offset(kind):
    """doc_positions off: Origin, CoCA strict and ALiBi score by distance only, so a document at
    its offset gives its own logits too (CoCA slack does not: the layer test covers it)."""
    assert_each_document_alone(random_model(config(kind, doc_mask=True)), [6, 10, 4], 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("doc_positions", [False, True])
def test_layer_matches_block_diagonal_reference(kind, doc_positions):
    """One layer on three rows of different document layouts (one document; several; one-token
    documents in a run and alone, as a synthetic row's padding), with gradients, against the
    float64 reference at each token's position (absolute, or within its document)."""
    cfg = config(kind, doc_mask=True, doc_positions=doc_positions)
    torch.manual_seed(3)
    layer = CausalSelfAttention(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 3],
                         [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4],
                         [0, 1, 1, 1, 2, 3, 4, 4, 4, 4, 5, 6, 7, 8]])
    b, t, h, d = docs.shape[0], docs.shape[1], cfg.n_head, cfg.head_dim
    x = torch.randn(b, t, cfg.n_embd, dtype=F64, requires_grad=True)
    pos = positions(docs) if doc_positions else torch.arange(t).expand(b, t)
    rope = None
    if cfg.attention != "alibi":
        cos, sin = Rope(cfg.rotary_dims, cfg.rope_base, cfg.max_seq_len, cfg.rope_scaling).tables(pos, t, F64)
        rope = cos[:, None], sin[:, None]
    out = layer(x, rope, documents=Documents(docs))

    w, bias = layer.qkv.weight.view(h, 3, d, cfg.n_embd), layer.qkv.bias.view(h, 3, d)
    q, k, v = (torch.einsum("btc,hdc->bhtd", x, w[:, i]) + bias[None, :, i, None, :] for i in range(3))
    rows = []
    for row in range(b):
        scores = reference_scores(kind, q[row : row + 1], k[row : row + 1], pos[row], cfg.rotary_dims)
        rows.append(reference_block_causal(scores, docs[row : row + 1], v[row : row + 1]))
    want = layer.proj(torch.cat(rows).transpose(1, 2).reshape(b, t, cfg.n_embd))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (x, *layer.parameters()))
    expected = torch.autograd.grad((want * weights).sum(), (x, *layer.parameters()))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


def test_one_document_is_plain_causal_attention():
    """A row that is one document gives the unmasked model's logits (the fused is_causal path)."""
    masked = random_model(config("origin", doc_mask=True))
    plain = random_model(config("origin"))
    idx = torch.randint(0, 50, (2, 20))
    torch.testing.assert_close(masked(idx, documents=torch.zeros_like(idx)), plain(idx), rtol=1e-10, atol=1e-10)


def test_documents_are_ignored_without_doc_mask():
    model = random_model(config("origin"))
    idx, docs = packed_row([5, 5], seed=4)
    torch.testing.assert_close(model(idx, documents=docs), model(idx), rtol=0, atol=0)


def test_doc_positions_needs_doc_mask():
    with pytest.raises(ValueError, match="doc_positions=true needs model.doc_mask=true"):
        config("origin", doc_positions=True)


def test_kv_cache_with_documents_is_refused():
    from model.gpt import KVCache

    model = random_model(config("origin", doc_mask=True))
    idx, docs = packed_row([3, 3], seed=5)
    with pytest.raises(ValueError, match="KV cache"):
        model.hidden_states(idx, KVCache(2), documents=docs)


@pytest.mark.parametrize("alibi", [False, True])
def test_cpu_kernel_keeps_linear_memory_for_backward(alibi):
    """What autograd keeps for the backward pass grows linearly with the row length (no mask)."""

    def saved_bytes(t: int) -> int:
        q, k, v = (torch.randn(1, 2, t, 8, requires_grad=True) for _ in range(3))
        docs = (torch.arange(t) // 300)[None]
        total = 0

        def pack(x):
            nonlocal total
            total += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            causal_attention(q, k, v, LayerBias(AlibiBias(2)) if alibi else None, documents=Documents(docs))
        return total

    assert saved_bytes(2048) <= 2.2 * saved_bytes(1024)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_in_half_precision_matches_each_document_alone(dtype):
    """Training in bf16/fp16: the packed row's output and gradients are those of the fused causal
    kernel on each document alone, at that precision (the kernel's log-sum-exp stays float32)."""
    torch.manual_seed(0)
    docs = torch.tensor([[0] * 40 + [1] * 25 + [2] + [3] * 30, [5] * 96])
    pieces = [(0, 0, 40), (0, 40, 65), (0, 65, 66), (0, 66, 96), (1, 0, 96)]
    q, k, v = (torch.randn(2, 4, 96, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    out = causal_attention(q, k, v, documents=Documents(docs))
    weights = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), weights)
    want_out, want = torch.zeros_like(out), [torch.zeros_like(x) for x in (q, k, v)]
    for row, lo, hi in pieces:
        alone = [x[row : row + 1, :, lo:hi].detach().requires_grad_() for x in (q, k, v)]
        piece = torch.nn.functional.scaled_dot_product_attention(*alone, is_causal=True)
        want_out[row : row + 1, :, lo:hi] = piece
        for total, grad in zip(want, torch.autograd.grad(piece, alone, weights[row : row + 1, :, lo:hi])):
            total[row : row + 1, :, lo:hi] = grad
    torch.testing.assert_close(out, want_out)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


# ---- the GPU kernel's block mask, checked element by element on CPU ------------------------------------------


@pytest.mark.parametrize("lengths", [[300, 1, 1, 1, 97, 600], [1000], [128, 128, 256], [5] * 40])
def test_block_mask_covers_exactly_the_allowed_pairs(lengths):
    """Tiles marked full hold only allowed pairs, tiles left out hold none, partial tiles hold some
    (none is computed for nothing), and the mask function is the definition: so FlexAttention sees
    exactly doc[m] == doc[n], n <= m."""
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]
    t = docs.shape[1]
    mask = document_block_mask(docs)
    block = mask.BLOCK_SIZE[0]
    allowed = (docs[0][:, None] == docs[0][None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    tiles = math.ceil(t / block)
    full = torch.zeros(tiles, tiles, dtype=torch.bool)
    partial = torch.zeros(tiles, tiles, dtype=torch.bool)
    for i in range(tiles):
        full[i, mask.full_kv_indices[0, 0, i, : mask.full_kv_num_blocks[0, 0, i]].long()] = True
        partial[i, mask.kv_indices[0, 0, i, : mask.kv_num_blocks[0, 0, i]].long()] = True
    assert not (full & partial).any()
    m, n = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    mod = mask.mask_mod(torch.tensor(0), torch.tensor(0), m, n)
    assert torch.equal(mod, allowed)
    for i in range(tiles):
        for j in range(tiles):
            tile = allowed[i * block : (i + 1) * block, j * block : (j + 1) * block]
            if full[i, j]:
                assert tile.all()
            elif partial[i, j]:
                assert tile.any() and not tile.all() or i == j  # tight: no tile computed for nothing
            else:
                assert not tile.any()


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("alibi", [False, True])
def test_flex_kernel_matches_cpu_kernel(alibi, kv_heads):
    """The GPU kernel (compiled FlexAttention; forward runs on CPU too, ~30 s compile) agrees with the
    CPU kernel on a packed row with documents across tile edges, with GQA too (the one-token
    documents' outputs are their kv head's values)."""
    from model.flex import _flex_bias
    from model.kernel_path import run_flex

    g = torch.Generator().manual_seed(6)
    lengths = [300, 1, 1, 97, 400, 225]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(2, -1).contiguous()
    q, k, v = (torch.randn(2, heads, docs.shape[1], 16, generator=g) for heads in (4, kv_heads, kv_heads))
    with torch.no_grad():
        bias = LayerBias(AlibiBias(4)) if alibi else None
        if alibi:
            flex = _flex_bias(q, k, v, bias, Documents(docs))
        else:
            flex = run_flex(q, k, v, block_mask=document_block_mask(docs), enable_gqa=kv_heads != 4)
        segments = causal_attention(q, k, v, bias, documents=Documents(docs))  # the CPU kernel
    torch.testing.assert_close(flex, segments, rtol=1e-4, atol=1e-5)
