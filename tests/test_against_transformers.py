"""Logits and greedy tokens against transformers' KimiLinearForCausalLM on tiny random configs."""
from __future__ import annotations

import pytest
import torch

import deltafin

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5)

VARIANTS = {
    "basic": dict(num_hidden_layers=4, q_lora_rank=None,
                  linear_attn_config=dict(head_dim=16, num_heads=4, short_conv_kernel_size=4,
                                          kda_layers=[1, 2, 3], full_attn_layers=[4])),
    "qlora-grouped": dict(num_hidden_layers=5, q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3,
                          linear_attn_config=dict(head_dim=16, num_heads=2, short_conv_kernel_size=4,
                                                  kda_layers=[1, 3, 4], full_attn_layers=[2, 5])),
    "more-heads-2shared": dict(num_hidden_layers=3, q_lora_rank=None, num_attention_heads=8,
                               num_key_value_heads=8, n_shared_experts=2, first_k_dense_replace=2,
                               linear_attn_config=dict(head_dim=8, num_heads=8, short_conv_kernel_size=3,
                                                       kda_layers=[1, 2], full_attn_layers=[3])),
}


def _make(tmp_path, name, seed=0):
    cfg = transformers.KimiLinearConfig(**{**BASE, **VARIANTS[name]})
    torch.manual_seed(seed)
    ref = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # make every term matter: non-zero correction bias, non-trivial norms
        for n, p in ref.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn_like(p) * 0.1)
            elif "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "A_log" in n or "dt_bias" in n:
                continue
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
        for buf_name, b in ref.named_buffers():
            if buf_name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    out = tmp_path / name
    ref.save_pretrained(out)
    return ref, out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_and_greedy_match_transformers(tmp_path, name):
    ref, path = _make(tmp_path, name)
    m = deltafin.load(path, device="cpu", stream="off")
    g = torch.Generator().manual_seed(1)
    for n in (1, 7, 75):
        ids = torch.randint(3, 320, (n,), generator=g)
        with torch.no_grad():
            want = ref(ids[None]).logits[0].float()
        got = m.logits(ids.tolist())
        assert got.shape == want.shape
        diff = (got - want).abs().max().item()
        assert diff <= 1e-4, f"{name} len {n}: max |diff| {diff}"
    # 32 greedy tokens, our cached decode vs transformers' own generate with its cache
    prompt = torch.randint(3, 320, (9,), generator=g)
    with torch.no_grad():
        want = ref.generate(prompt[None], max_new_tokens=32, do_sample=False, eos_token_id=None,
                            min_new_tokens=32)[0, 9:].tolist()
    st = m.new_state()
    logits = m.forward(prompt.tolist(), st)
    got = []
    for _ in range(32):
        nxt = int(logits[-1].argmax())
        got.append(nxt)
        logits = m.forward([nxt], st)
    assert got == want
