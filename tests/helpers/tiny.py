"""Tiny random checkpoints written by transformers itself (real safetensors, real HF names)."""
from __future__ import annotations

import numpy as np
import torch
import transformers as tf

QWEN3 = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
GEMMA3 = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
              query_pre_attn_scalar=24, max_position_embeddings=512,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 1000000.0}})
QWEN3_MOE = dict(QWEN3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)

FAMILIES = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, QWEN3),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, GEMMA3),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, QWEN3_MOE),
}
# Routers (Qwen3-MoE's `mlp.gate`) drawn this much wider than the other weights: each token's top k
# stand clear of the other experts, so no float32 rounding flips a routing decision.
ROUTER_GAIN = 8.0


def randomize(model: torch.nn.Module, seed: int, scale: float = 0.15):
    """HF zero-initialises Gemma's (1+w) norms; random values everywhere make each tensor count."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def make(family: str, path, seed: int = 0, **overrides):
    """Save a random tiny model of `family` under `path`; returns the torch model (float32, eval)."""
    cfg_cls, model_cls, base = FAMILIES[family]
    cfg = cfg_cls(**{**base, **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    randomize(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".mlp.gate.weight"):
                p.mul_(ROUTER_GAIN)
    model.save_pretrained(path)
    return model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())
