"""Tiny random HF checkpoints for the sharding, conversion and multi-process tests."""
from __future__ import annotations

import torch
import transformers as tf

BASE = {
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM,
              dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   max_position_embeddings=512, tie_word_embeddings=False)),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=16, sliding_window=8,
                    query_pre_attn_scalar=24, max_position_embeddings=512)),
}


def make(family: str, path, seed: int = 0, **overrides):
    """Save a tiny model with every parameter random (HF zero-inits Gemma's (1+w) norms)."""
    cfg_cls, model_cls, base = BASE[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**{**base, **overrides})).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    model.save_pretrained(path)
    return model
