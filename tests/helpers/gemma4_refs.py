"""Tiny Gemma 4 reference models (transformers), shrunk from the real 31B / 26B-A4B / E4B / E2B
configs with their distinguishing features kept, every parameter randomized."""
from __future__ import annotations

import numpy as np
import torch

S, G = "sliding_attention", "full_attention"

BASE = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=16, global_head_dim=32,
            sliding_window=4, final_logit_softcapping=30.0, rms_norm_eps=1e-6, max_position_embeddings=512,
            pad_token_id=0, bos_token_id=2, eos_token_id=1, hidden_activation="gelu_pytorch_tanh",
            rope_parameters={S: {"rope_type": "default", "rope_theta": 10_000.0},
                             G: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                 "rope_theta": 1_000_000.0}},
            tie_word_embeddings=True)

VARIANTS = {
    # dense, k_eq_v global layers with fewer KV heads, 5:1 pattern
    "31b": dict(num_hidden_layers=8, layer_types=[S] * 5 + [G, S, G], num_key_value_heads=2,
                num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=96,
                hidden_size_per_layer_input=0),
    # the same plus a routed MoE block beside a narrow dense MLP
    "26b-a4b": dict(num_hidden_layers=8, layer_types=[S] * 5 + [G, S, G], num_key_value_heads=2,
                    num_global_key_value_heads=1, attention_k_eq_v=True, intermediate_size=48,
                    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8, top_k_experts=3,
                    moe_intermediate_size=24),
    # per-layer inputs and KV-shared trailing layers
    "e4b": dict(num_hidden_layers=8, layer_types=[S, S, G, S, S, G, S, G], num_key_value_heads=2,
                attention_k_eq_v=False, intermediate_size=96, hidden_size_per_layer_input=16,
                vocab_size_per_layer_input=256, num_kv_shared_layers=3),
    # one KV head, more shared layers, and double-wide MLPs in them
    "e2b": dict(num_hidden_layers=8, layer_types=[S, G, S, S, G, S, S, G], num_key_value_heads=1,
                attention_k_eq_v=False, intermediate_size=64, hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=256, num_kv_shared_layers=4, use_double_wide_mlp=True),
}


def randomize(model, seed: int = 0, std: float = 0.2):
    """Matrices ~ N(0, std); vectors (norm weights, scales, layer scalars) ~ U(0.5, 1.5) so that
    neither a 1+w nor a w convention can pass by accident."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            else:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand(b.shape, generator=g) + 0.5)
    return model


def forced_router(E: int, D: int, rng) -> np.ndarray:
    """Router rows c_e * v: tokens with h.v > 0 pick experts 0-2, the others 5-7; 3 and 4 get none,
    and every chosen expert serves several tokens."""
    v = rng.standard_normal(D).astype(np.float32)
    c = np.array([5.0, 4.0, 3.0, 0.2, 0.1, -3.0, -4.0, -5.0], np.float32)[:E]
    return c[:, None] * v[None, :]


def build(variant: str, seed: int = 0, std: float = 0.2, **overrides):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    cfg = Gemma4TextConfig(**{**BASE, **VARIANTS[variant], **overrides}, architectures=["Gemma4ForCausalLM"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomize(Gemma4ForCausalLM(cfg).eval(), seed, std)
    if cfg.enable_moe_block:        # half the layers route unevenly on purpose
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            for layer in model.model.layers[::2]:
                layer.router.proj.weight.copy_(torch.from_numpy(forced_router(cfg.num_experts, cfg.hidden_size, rng)))
    return model


def hf_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()
