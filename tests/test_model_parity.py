"""Parity with Hugging Face's GPTNeoXForCausalLM: the Origin model is GPT-NeoX after a weight mapping."""

import pytest
import torch

from model import GPT, ModelConfig

pytestmark = pytest.mark.usefixtures("single_thread")


def hf_to_ours(hf_state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    names = {
        "gpt_neox.embed_in.weight": "wte.weight",
        "gpt_neox.final_layer_norm.weight": "ln_f.weight",
        "gpt_neox.final_layer_norm.bias": "ln_f.bias",
        "lm_head.weight": "lm_head.weight",  # `embed_out` in checkpoints, renamed on load by HF
    }
    layer = {
        "input_layernorm": "ln_1",
        "post_attention_layernorm": "ln_2",
        "attention.query_key_value": "attn.qkv",
        "attention.dense": "attn.proj",
        "mlp.dense_h_to_4h": "mlp.fc",
        "mlp.dense_4h_to_h": "mlp.proj",
    }
    for i in range(n_layer):
        for theirs, ours in layer.items():
            for p in ("weight", "bias"):
                names[f"gpt_neox.layers.{i}.{theirs}.{p}"] = f"h.{i}.{ours}.{p}"
    return {names[k]: v for k, v in hf_state.items() if k in names}


@pytest.mark.parametrize("rotary_pct, parallel", [(1.0, True), (0.25, False)])
def test_origin_matches_hugging_face_gpt_neox(rotary_pct, parallel):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    vocab, hidden, heads, layers, ffn = 96, 64, 4, 3, 160
    hf_cfg = GPTNeoXConfig(
        vocab_size=vocab, hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers,
        intermediate_size=ffn, hidden_act="gelu", rotary_pct=rotary_pct, rotary_emb_base=10000,
        max_position_embeddings=64, layer_norm_eps=1e-5, use_parallel_residual=parallel,
        tie_word_embeddings=False, attention_bias=True,
    )
    torch.manual_seed(0)
    hf = GPTNeoXForCausalLM(hf_cfg).double().eval()
    with torch.no_grad():  # HF zero-initialises biases and LayerNorm shifts: randomise everything
        for p in hf.parameters():
            p.normal_(0.0, 0.2)
    ours = GPT(ModelConfig(vocab_size=vocab, n_layer=layers, n_head=heads, n_embd=hidden, ffn_hidden=ffn,
                           max_seq_len=64, rotary_pct=rotary_pct, parallel_residual=parallel)).double().eval()
    state = hf_to_ours(hf.state_dict(), layers)
    assert set(state) == set(ours.state_dict())
    ours.load_state_dict(state)
    idx = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=idx).logits
        got = ours(idx)
    # HF computes its rotation angles in float32 even in a float64 model, hence 1e-6 and not 1e-12.
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert want.std() > 0.1
