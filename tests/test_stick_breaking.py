"""Stick-breaking attention (Tan et al. 2025, `model.designs.stick_breaking`) against a float64
reference written from the paper's definition (explicit products over the keys between, not the
kernel's log-space sums): the kernel's output and gradients (q, k, v, the remainder's head vector)
with grouped-query attention, a KV-cache offset, document masking and chunks; the layer and the
model around it (training, the KV cache, packed rows, capture_qk), and what the design refuses."""

from __future__ import annotations

import math

import pytest
import torch

import model.designs.stick_breaking as sb
from model import GPT, KVCache, ModelConfig
from model.attention import CausalSelfAttention
from model.convert import convert
from model.designs.stick_breaking import StickBreaking, stick_breaking
from model.documents import Documents

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("single_thread")


def reference(q, k, v, head_bias, documents=None):
    """o_i = sum_{j < i} A_ij v_j + (1 - sum_j A_ij) b_h, A_ij = beta_ij prod_{j<k<i} (1 - beta_ik),
    beta_ij = sigmoid(q_i . k_j / sqrt(D)) for keys j of the query's document (else absent: 0);
    query r at position Tk - Tq + r; query head h reads kv head h // (H / Hkv). -> (o, A)."""
    B, H, Tq, D = q.shape
    Tk = k.shape[-2]
    group = H // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    z = q @ k.transpose(-1, -2) / math.sqrt(D)
    beta, unbroken = torch.sigmoid(z), torch.sigmoid(-z)  # [B, H, Tq, Tk]; 1 - beta without its cancellation
    rows = []
    for r in range(Tq):
        i = Tk - Tq + r
        row = [torch.zeros(B, H, dtype=q.dtype)] * Tk
        for j in range(i):
            if documents is not None:  # per batch row: beta = 0 for a key of another document
                same = (documents[:, j] == documents[:, i]).to(q.dtype)[:, None]
            else:
                same = 1.0
            kept = torch.ones(B, H, dtype=q.dtype)
            for m in range(j + 1, i):
                other = 1.0 if documents is None else (documents[:, m] == documents[:, i]).to(q.dtype)[:, None]
                kept = kept * (other * unbroken[:, :, r, m] + (1 - other))  # 1 - beta, or 1 if absent
            row[j] = same * beta[:, :, r, j] * kept
        rows.append(torch.stack(row, dim=-1))
    A = torch.stack(rows, dim=-2)  # [B, H, Tq, Tk]
    rem = 1 - A.sum(-1)
    return A @ v + rem[..., None] * head_bias[:, None, :], A


CASES = {  # (H, Hkv, Tq, Tk, documents)
    "mha": (2, 2, 19, 19, False),
    "gqa": (4, 2, 19, 19, False),
    "mqa, cache offset": (4, 1, 7, 19, False),
    "cache, one query": (2, 2, 1, 19, False),
    "documents": (2, 2, 19, 19, True),
    "gqa, documents": (4, 2, 19, 19, True),
}
DOCS = torch.tensor([[0] * 5 + [1] * 9 + [2] + [3] * 4, [0] * 19])


def inputs(H, Hkv, Tq, Tk, B=2, D=8, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g, dtype=dtype) * 1.5
    k = torch.randn(B, Hkv, Tk, D, generator=g, dtype=dtype) * 1.5 + 0.3  # some large beta, some small
    v = torch.randn(B, Hkv, Tk, D, generator=g, dtype=dtype)
    b = torch.randn(H, D, generator=g, dtype=dtype)
    return q, k, v, b


def float64_layer(head_bias: torch.Tensor) -> StickBreaking:
    layer = StickBreaking(*head_bias.shape).double()
    with torch.no_grad():
        layer.head_bias.copy_(head_bias)
    return layer


def assert_matches_the_definition(layer: StickBreaking, q, k, v, docs) -> None:
    """The layer's output and the gradients of q, k, v and the head vector equal the reference's at 1e-10."""
    leaves = [x.requires_grad_() for x in (q, k, v)] + [layer.head_bias]
    got = layer(q, k, v, docs)
    want, _ = reference(q, k, v, layer.head_bias, docs)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn(got.shape, dtype=F64, generator=torch.Generator().manual_seed(9))
    for name, g_got, g_want in zip("qkvb", torch.autograd.grad((got * weights).sum(), leaves),
                                   torch.autograd.grad((want * weights).sum(), leaves)):
        torch.testing.assert_close(g_got, g_want, rtol=1e-10, atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("case", CASES)
def test_kernel_output_and_gradients_match_the_definition(case, chunk, monkeypatch):
    """At 1e-10 in float64, with chunks of 4 rows (several per row, the last one short) and of 64
    (one): q, k, v and the head vector's gradients included."""
    monkeypatch.setattr(sb, "CHUNK", chunk)
    H, Hkv, Tq, Tk, documents = CASES[case]
    q, k, v, b = inputs(H, Hkv, Tq, Tk)
    docs = DOCS if documents else None
    layer = float64_layer(b)
    assert_matches_the_definition(layer, q, k, v, docs)


LONG = {"gqa": (4, 2, 48, 48, None), "mqa, cache offset": (4, 1, 16, 48, None),
        "gqa, documents": (4, 2, 48, 48, torch.tensor([[0] * 10 + [1] * 30 + [2] + [3] * 7, [0] * 48]))}


@pytest.mark.parametrize("case", LONG)
def test_a_chunk_stops_where_every_rows_stick_is_used_up(case, monkeypatch):
    """With large logits every row's stick is used up within a few keys (log rem below the log of
    float64's smallest normal): in chunks of 4 rows and blocks of 3 keys the forward goes through
    fewer keys than the chunks hold (counted), and the output and every gradient still equal the
    definition's at 1e-10."""
    monkeypatch.setattr(sb, "CHUNK", 4)
    H, Hkv, Tq, Tk, docs = LONG[case]
    q, k, v, b = inputs(H, Hkv, Tq, Tk, seed=3)
    q = q * 150  # |z| in the hundreds: a key with z > 0 takes all but e^-z of what is left
    layer = float64_layer(b)
    weights_of, keys = sb._weights, []
    monkeypatch.setattr(sb, "_weights", lambda *a: keys.append(a[1].shape[-2]) or weights_of(*a))
    visited = {}
    for block in (Tk, 3):  # one block per chunk: every key; then blocks of 3
        monkeypatch.setattr(sb, "BLOCK", block)
        keys.clear()
        with torch.no_grad():
            layer(q, k, v, docs)
        visited[block] = sum(keys)
    assert visited[3] < visited[Tk] * 0.75, visited
    assert_matches_the_definition(layer, q, k, v, docs)


def test_weights_sum_to_at_most_one_and_the_remainder_is_what_is_left():
    """sum_j A_ij (the output for v = 1) <= 1, rem = prod (1 - beta) >= 0 and the two add to 1, in
    float32 with large logits (|z| up to 280: rows whose stick is all but used up, and rows that keep
    most of it): within float32's rounding of log A = z + sum log(1 - beta), about ulp(|z|) = 3e-5
    relative at 280 (4e-6 seen); exactly (1e-12) in the float64 reference."""
    q, k, _, _ = inputs(2, 2, 300, 300, dtype=torch.float32)
    q, k = q * 4, k * 4
    ones = torch.ones(2, 2, 300, 8)
    mass, log_rem = stick_breaking(q, k, ones)
    rem = log_rem.exp()
    assert bool((rem >= 0).all()) and bool((mass <= 1 + 1e-5).all())
    torch.testing.assert_close(mass[..., 0] + rem, torch.ones_like(rem), rtol=0, atol=1e-5)
    assert float(rem.min()) < 1e-6 and float(rem[..., 1:].max()) > 0.5  # both kinds of rows are there
    _, A = reference(*(x.double() for x in (q[:, :, :40], k[:, :, :40], ones[:, :, :40])), torch.zeros(2, 8, dtype=F64))
    assert bool((A.sum(-1) <= 1 + 1e-12).all()) and bool((A >= 0).all())


def test_the_first_token_of_each_document_outputs_its_head_vector():
    """Strictly causal: a query sees no key of its own position, so a document's first token has its
    whole stick left and outputs b_h, whatever q, k and v are."""
    q, k, v, b = inputs(4, 2, 19, 19)
    layer = StickBreaking(4, 8).double()
    with torch.no_grad():
        layer.head_bias.copy_(b)
        out = layer(q, k, v, DOCS)
    for row, firsts in ((0, (0, 5, 14, 15)), (1, (0,))):
        for i in firsts:
            torch.testing.assert_close(out[row, :, i], b, rtol=0, atol=0)
    assert not torch.allclose(out[0, :, 1], b)


def test_low_precision_inputs_compute_wide_and_return_their_dtype():
    q, k, v, b = inputs(4, 2, 150, 150, dtype=torch.float32)
    layer = StickBreaking(4, 8)
    with torch.no_grad():
        layer.head_bias.copy_(b)
        out = layer(q.bfloat16(), k.bfloat16(), v.bfloat16())
        want = layer.double()(*(x.bfloat16().double() for x in (q, k, v)))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), want, rtol=0, atol=2e-2)


def test_a_share_of_the_heads_is_those_heads_of_the_whole():
    """Sequence parallelism gives a rank whole rows of some heads (kv heads with their query heads):
    the kernel on heads 2..3 with `heads` equals those heads of the whole layer."""
    q, k, v, b = inputs(4, 2, 19, 19)
    layer = StickBreaking(4, 8).double()
    with torch.no_grad():
        layer.head_bias.copy_(b)
        whole = layer(q, k, v, DOCS)
        share = layer(q[:, 2:], k[:, 1:], v[:, 1:], DOCS, heads=slice(2, 4))
    torch.testing.assert_close(share, whole[:, 2:], rtol=0, atol=0)


ARCHS = {"neox": {}, "llama": dict(arch="llama", parallel_residual=False, n_kv_head=2)}


@pytest.mark.parametrize("arch", ARCHS)
def test_the_layer_is_the_kernel_between_its_projections(arch):
    """CausalSelfAttention with attention=stick_breaking: q, k, v of its projections (no RoPE), the
    reference, the output projection; the gradients of x and of every weight, documents masked."""
    cfg = ModelConfig(n_layer=1, n_head=4, n_embd=32, ffn_hidden=64, attention="stick_breaking", doc_mask=True,
                      **ARCHS[arch])
    torch.manual_seed(0)
    layer = CausalSelfAttention(cfg).double()
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.4)
    assert [n for n, _ in layer.named_parameters() if "attend" in n] == ["attend.head_bias"]
    B, T, C = 2, 19, 32
    x = torch.randn(B, T, C, dtype=F64, requires_grad=True)
    out = layer(x, None, documents=Documents(DOCS))
    q, k, v = layer.heads(x)
    y, _ = reference(q, k, v, layer.attend.head_bias, DOCS)
    want = layer.proj(y.transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    params = [x, *layer.parameters()]
    for got, expected in zip(torch.autograd.grad(out.square().sum(), params),
                             torch.autograd.grad(want.square().sum(), params)):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def gpt(**overrides) -> GPT:
    cfg = dict(vocab_size=64, n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, max_seq_len=32,
               attention="stick_breaking", **ARCHS["llama"])
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**cfg, **overrides}))


def test_a_model_trains_on_a_repeated_batch():
    model = gpt().train()
    idx = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.5, losses
    assert all(bool(layer.attn.attend.head_bias.abs().sum() > 0) for layer in model.h)  # it learns from zeros


def test_generation_with_the_kv_cache_equals_full_forwards():
    model = gpt().double().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    cache = KVCache(model.cfg.n_layer)
    with torch.no_grad():
        logits = model(prompt, cache=cache)[:, -1]
        seq = prompt
        for _ in range(12):
            nxt = logits.argmax(-1, keepdim=True)
            full = model(seq)[:, -1]
            torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-10)
            seq = torch.cat((seq, nxt), dim=1)
            logits = model(nxt, cache=cache)[:, -1]
        greedy = prompt
        for _ in range(12):
            greedy = torch.cat((greedy, model(greedy)[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(seq, greedy)


def test_document_masking_in_a_packed_row_equals_separate_rows():
    model = gpt(doc_mask=True).double().eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(1, 64, (n,), generator=g) for n in (7, 1, 12, 4)]
    packed = torch.cat(docs)[None]
    ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    with torch.no_grad():
        together = model(packed, documents=ids)
        apart = torch.cat([model(d[None]) for d in docs], dim=1)
        unmasked = model(packed)
    torch.testing.assert_close(together, apart, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(unmasked, apart)


@pytest.mark.parametrize("modifier", ["sinks", "ssmax", "length_temperature"])
def test_softmax_modifiers_are_refused(modifier):
    with pytest.raises(ValueError, match=f"model.{modifier}=true with model.attention=stick_breaking: "
                                         "Stick-breaking attention has no softmax"):
        ModelConfig(attention="stick_breaking", **{modifier: True})


def test_capture_qk_gives_the_layers_scores_and_the_definitions_weights():
    """What the attention statistics read: capture_qk's q_eff and k_eff (each kv head repeated for its
    query heads) are the layer's, and the design's weights from their scores are the reference's A,
    over the keys n < m only."""
    model = gpt().double().eval()
    for p in model.parameters():  # weights far from uniform
        torch.nn.init.normal_(p, std=0.4)
    attn, seen = model.h[1].attn, {}
    attn.register_forward_hook(lambda mod, args, out: seen.update(x=args[0]))
    captured = model.capture_qk(torch.randint(0, 64, (1, 19), generator=torch.Generator().manual_seed(3)))[1]
    q, k, v = attn.heads(seen["x"])
    _, want = reference(q, k, v, attn.attend.head_bias)
    torch.testing.assert_close(captured.q_eff, q, rtol=0, atol=0)
    torch.testing.assert_close(captured.k_eff, k.repeat_interleave(2, dim=1), rtol=0, atol=0)
    m = torch.arange(19)
    scores = captured.q_eff @ captured.k_eff.transpose(-1, -2) / math.sqrt(8)
    weights, keys = captured.weights(scores, (m[:, None] >= m[None, :]).expand_as(scores))
    torch.testing.assert_close(weights, want, rtol=1e-10, atol=1e-10)
    assert torch.equal(keys, (m[:, None] > m[None, :]).expand_as(scores))


def test_an_origin_model_converts_with_a_zero_head_vector():
    origin = gpt(attention="origin")
    target = gpt().cfg
    state, done = convert(origin.state_dict(), origin.cfg, target)
    assert done.fresh == [f"h.{i}.attn.attend.head_bias" for i in range(2)]
    model = GPT(target)
    model.load_state_dict(state)  # strict: every tensor there
    assert all(bool((layer.attn.attend.head_bias == 0).all()) for layer in model.h)
