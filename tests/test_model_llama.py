"""arch=llama (RMSNorm, SwiGLU, grouped-query attention, no biases, sequential residual): parity with
Hugging Face's LlamaForCausalLM, every attention against its float64 reference with kv heads shared
by query heads, document masking, flavors and counts, and a two-rank ZeRO-3 training run."""

import math
from itertools import islice

import pytest
import torch
from omegaconf import OmegaConf
from test_model_attention import per_query_head, reference_attention, reference_scores
from test_model_documents import assert_each_document_alone, reference_block_causal

from hf.names import llama_hf_names
from model import GPT, KVCache, ModelConfig, count_parameters, flavor
from model.attention import CausalSelfAttention
from model.designs import Rope
from model.documents import Documents

F64 = torch.float64
KINDS = ["origin", "slack", "strict", "alibi"]

pytestmark = pytest.mark.usefixtures("single_thread")


def llama(kind: str = "origin", **overrides) -> ModelConfig:
    attention = "coca" if kind in ("slack", "strict") else kind
    cfg = dict(arch="llama", parallel_residual=False, vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
               ffn_hidden=48, max_seq_len=64, attention=attention,
               design_params={"coca": {"form": kind}} if attention == "coca" else {})
    return ModelConfig(**{**cfg, **overrides})


def randomised(cfg: ModelConfig, seed: int = 0, std: float = 0.3) -> GPT:
    torch.manual_seed(seed)
    model = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():  # norm gains too: a mapping that swaps them must show
            p.normal_(0.0, std)
    return model


# ---- parity with transformers' LlamaForCausalLM ----------------------------------------------------


@pytest.mark.parametrize("kv_heads, tied, base", [(2, False, 10000.0), (1, False, 500000.0), (2, True, 10000.0)],
                         ids=["gqa-untied", "mqa-untied", "gqa-tied"])
def test_origin_matches_hugging_face_llama(kv_heads, tied, base):
    """Every parameter randomised in float64, mapped by `hf.names.llama_hf_names`; then our KV-cache
    decoding (a prompt, a chunk, single tokens) gives HF's full-forward logits too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden, heads, layers, ffn = 96, 64, 4, 3, 160
    hf_cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_act="silu", max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": base},
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).double().eval()
    with torch.no_grad():  # HF initialises RMSNorm gains to 1: randomise everything
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    ours = GPT(ModelConfig(arch="llama", parallel_residual=False, vocab_size=vocab, n_layer=layers, n_head=heads,
                           n_kv_head=kv_heads, n_embd=hidden, ffn_hidden=ffn, max_seq_len=64, rope_base=base,
                           tie_embeddings=tied)).double().eval()
    names = llama_hf_names(ours.cfg)
    theirs = hf.state_dict()
    assert set(names) == {name for name, _ in ours.named_parameters()}
    assert set(names.values()) == {name for name, _ in hf.named_parameters()}  # tied: one embedding
    state = {name: theirs[hf_name] for name, hf_name in names.items()}
    if tied:
        state["lm_head.weight"] = state["wte.weight"]
    ours.load_state_dict(state)
    if tied:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight and ours.lm_head.weight is ours.wte.weight
    idx = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=idx).logits
        got = ours(idx)
        cache = KVCache(layers)
        steps = [ours(idx[:, :9], cache=cache), ours(idx[:, 9:14], cache=cache)]
        steps += [ours(idx[:, t : t + 1], cache=cache) for t in range(14, 40)]
    # HF computes RoPE angles and RMSNorm in float32 even in a float64 model: 1e-6, not 1e-12.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-6, atol=1e-6)
    assert want.std() > 0.1
    assert cache.layers[0].keys.shape == (2, kv_heads, 40, hidden // heads)


# ---- the four attentions with kv heads shared by query heads ----------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("with_documents", [False, True])
def test_gqa_layer_matches_reference(kind, kv_heads, with_documents):
    """The llama layer (separate q, k-or-t, v without biases; kernels with enable_gqa) against the
    float64 reference of its attention where query head h uses kv head h // (n_head / n_kv_head),
    gradients included; with document masking (CPU kernel, one-token documents alone and in a run)
    against the block-diagonal reference."""
    cfg = llama(kind, n_kv_head=kv_heads, doc_mask=with_documents)
    torch.manual_seed(3)
    layer = CausalSelfAttention(cfg).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.5)
    assert all(name.endswith("weight") for name, _ in layer.named_parameters())  # no biases
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 3],
                         [0, 1, 1, 1, 2, 3, 4, 4, 4, 4, 5, 6, 7, 8]])
    b, t, h, d = docs.shape[0], docs.shape[1], cfg.n_head, cfg.head_dim
    if not with_documents:
        docs = torch.zeros_like(docs)
    x = torch.randn(b, t, cfg.n_embd, dtype=F64, requires_grad=True)
    positions = torch.arange(t)
    rope = None
    if cfg.attention != "alibi":
        rope = Rope(cfg.rotary_dims, cfg.rope_base, cfg.max_seq_len, cfg.rope_scaling).tables(positions, t, F64)
    out = layer(x, rope, documents=Documents(docs) if with_documents else None)

    def heads(weight: torch.Tensor) -> torch.Tensor:  # [B, heads, T, D] from a [heads * D, C] weight
        return torch.einsum("btc,hdc->bhtd", x, weight.view(-1, d, cfg.n_embd))

    q, k, v = heads(layer.q.weight), heads(layer.k.weight), heads(layer.v.weight)
    assert k.shape[1] == v.shape[1] == kv_heads
    k, v = per_query_head(k, h), per_query_head(v, h)
    scores = reference_scores(kind, q, k, positions, cfg.rotary_dims)
    want = layer.proj(reference_block_causal(scores, docs, v).transpose(1, 2).reshape(b, t, cfg.n_embd))
    if not with_documents:  # the same thing, by the plain causal reference
        plain = layer.proj(reference_attention(scores, v).transpose(1, 2).reshape(b, t, cfg.n_embd))
        torch.testing.assert_close(want, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (x, *layer.parameters()))
    expected = torch.autograd.grad((want * weights).sum(), (x, *layer.parameters()))
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_row_equals_each_document_alone(kind):
    """doc_positions on: a packed row's logits are each document's own, on arch=llama with GQA."""
    assert_each_document_alone(randomised(llama(kind, doc_mask=True, doc_positions=True)), [7, 1, 12, 5, 9], 1)


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    """`compile_blocks` on arch=llama: same logits and gradients (float32; inductor reorders sums)."""
    cfg = llama(vocab_size=64, max_seq_len=16)
    torch.manual_seed(0)
    eager = GPT(cfg).train()
    compiled = GPT(cfg).train()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = [m(idx[:, :-1], idx[:, 1:]) for m in (eager, compiled)]
    grads = [torch.autograd.grad(loss, list(m.parameters())) for loss, m in zip(losses, (eager, compiled))]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    assert set(compiled.state_dict()) == set(eager.state_dict())


# ---- flavors, counts, FLOPs, config plumbing ----------------------------------------------------------


@pytest.mark.parametrize("name, shape, total", [
    # (n_layer, n_embd, n_head, n_kv_head, ffn_hidden, vocab_size, rope_base, tied), HF's parameter count
    ("tinyllama_1.1b", (22, 2048, 32, 4, 5632, 32000, 10000.0, False), 1_100_048_384),
    ("llama3.2_1b", (16, 2048, 32, 8, 8192, 128256, 500000.0, True), 1_235_814_400),
])
def test_published_shapes_and_their_parameter_counts(name, shape, total):
    """The flavors have the published shapes; count_parameters gives the published totals and the
    module's own count (built on the meta device: no memory)."""
    cfg = flavor(name)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.ffn_hidden, cfg.vocab_size, cfg.rope_base,
            cfg.tie_embeddings) == shape
    assert cfg.arch == "llama" and not cfg.parallel_residual and cfg.rotary_pct == 1.0 and cfg.layernorm_eps == 1e-5
    with torch.device("meta"):
        model = GPT(cfg)
    assert count_parameters(cfg)["total"] == sum(p.numel() for p in model.parameters()) == total


def test_llama_tiny_flavor_and_flops():
    """llama_tiny's shape; FLOPs per token are 6 per matmul weight (the module's, LM head included,
    input embedding excluded) plus the attention scores, which GQA does not shrink."""
    from train.flops import flops_per_token

    cfg = flavor("llama_tiny")
    shape = (cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.n_embd, cfg.ffn_hidden, cfg.max_seq_len)
    assert shape == (4, 4, 2, 256, 688, 128) and cfg.arch == "llama"
    model = GPT(cfg)
    matmul = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("wte."))
    assert flops_per_token(cfg, 128) == 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * 128
    assert model.h[0].attn.k.weight.shape == (2 * cfg.head_dim, cfg.n_embd)


def test_flavors_are_hydra_options():
    from train.config import compose, to_train_config

    cfg = to_train_config(compose(["model=llama_tiny"]))
    assert (cfg.model.arch, cfg.model.n_kv_head, cfg.model.ffn_hidden) == ("llama", 2, 688)
    assert to_train_config(compose(["model=llama3.2_1b"])).model.max_seq_len == 8192
    assert to_train_config(compose([])).model.arch == "neox"  # the default run is unchanged


def _checkpoint_with(tmp_path, model: dict):
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    OmegaConf.save(OmegaConf.create({"model": model}), ckpt / "config.yaml")
    return ckpt


def test_arch_and_kv_heads_fix_the_shapes(tmp_path):
    from train import resume
    from train.checkpoint import CheckpointError, check_compatible

    for key in ("model.arch", "model.n_kv_head"):
        assert resume.rule(key) == (resume.REFUSE, "it fixes the parameter shapes")
    base = dict(vocab_size=4096, n_layer=4, n_head=4, n_embd=256, ffn_hidden=688, tie_embeddings=False,
                attention="origin")
    ckpt = _checkpoint_with(tmp_path, {**base, "arch": "llama", "n_kv_head": 2})
    check_compatible(ckpt, flavor("llama_tiny"))
    with pytest.raises(CheckpointError, match=r"model.n_kv_head=2, this run has model.n_kv_head=1"):
        check_compatible(ckpt, flavor("llama_tiny", n_kv_head=1))
    with pytest.raises(CheckpointError, match=r"model.arch=llama, this run has model.arch=neox"):
        check_compatible(ckpt, flavor("tiny", ffn_hidden=688))
    (tmp_path / "old").mkdir()
    old = _checkpoint_with(tmp_path / "old", {**base, "ffn_hidden": 1024})  # before arch and n_kv_head existed
    check_compatible(old, flavor("tiny"))
    with pytest.raises(CheckpointError, match=r"model.arch=neox, this run has model.arch=llama"):
        check_compatible(old, flavor("llama_tiny", ffn_hidden=1024, n_kv_head=None))


# ---- two ranks, ZeRO-3 ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_rank_zero3_llama_run_trains_and_reloads(tmp_path):
    """`deepspeed --module train` on two CPU ranks over gloo, ZeRO-3, model=llama_tiny shrunk to
    experiment=micro's size with 4 query heads sharing 2 kv heads: the loss is finite and falls,
    and the model `load_model` gathers from the ZeRO-3 partitions is arch=llama and gives, on both
    ranks' validation blocks, the validation loss the two-rank engine logged at the last step."""
    from test_train_e2e import train_two_ranks

    from data.loader import build_loader
    from data.synthetic import split_block
    from run_checks import losses, ok, val_losses
    from train.load import load_model

    run_dir = tmp_path / "run"
    ok(train_two_ranks(run_dir, tmp_path / "cache", "model=llama_tiny", "model.n_head=4", "model.n_kv_head=2",
                       "deepspeed=zero3", "micro_batch_size=2", "batch_size=4", "max_steps=12", "eval_every=12",
                       "ckpt_every=12"))
    loss = losses(run_dir)
    assert sorted(loss) == list(range(1, 13)) and all(math.isfinite(v) for v in loss.values())
    assert sum(loss[s] for s in range(10, 13)) / 3 < sum(loss[s] for s in range(1, 4)) / 3 - 0.3, loss

    model, cfg, tokenizer = load_model(str(run_dir))
    assert (cfg.model.arch, cfg.model.n_head, cfg.model.n_kv_head, cfg.model.n_layer) == ("llama", 4, 2, 1)
    assert model.h[0].attn.k.weight.shape == (2 * cfg.model.head_dim, cfg.model.n_embd)
    per_rank = [list(islice(build_loader(cfg.data, tokenizer, split="val", seq_len=cfg.model.max_seq_len,
                                         batch_size=cfg.micro_batch_size, rank=rank, world_size=2),
                            cfg.eval_batches)) for rank in (0, 1)]
    count = min(map(len, per_rank))  # as train.validate cuts them
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batches in per_rank:
            for batch in batches[:count]:
                idx, targets = split_block(batch)
                total += model(idx, targets, loss_tokens=1.0).item()
                tokens += int((targets != -100).sum())
    assert total / tokens == pytest.approx(val_losses(run_dir)[12], abs=1e-5)
