"""Tiny random models for tests that compare engine paths with each other (no checkpoint needed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import GLOBAL, SLIDING, AttnSpec, ModelConfig, RopeSpec
from jaxllm.params import abstract_weights, init_random


def tiny_gemma3(window: int = 16, layers: int = 4, vocab: int = 97) -> ModelConfig:
    """Gemma 3's shape in miniature: sliding layers with a local RoPE, every third layer global."""
    kinds = tuple(GLOBAL if (i + 1) % 3 == 0 else SLIDING for i in range(layers))
    return ModelConfig(
        family="gemma3", vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=layers,
        layer_kinds=kinds,
        attn=(AttnSpec(4, 2, 16, RopeSpec(10_000.0), window=window),
              AttnSpec(4, 2, 16, RopeSpec(1_000_000.0, "linear", 8.0))),
        norm_offset=1.0, sandwich_norms=True, qk_norm=True, activation="gelu_tanh",
        embed_scale=64 ** 0.5, query_scale=16 ** -0.5, max_position=4096, bos_id=2, eos_ids=(),
        pad_id=0)


def tiny_gemma4_like(window: int = 16, layers: int = 4, vocab: int = 97) -> ModelConfig:
    """Gemma 4's KV traits on the core layer: global layers with k_eq_v, a V norm, a wider head."""
    cfg = tiny_gemma3(window, layers, vocab)
    return cfg.replace(v_norm=True, attn=(cfg.attn[SLIDING],
                                          AttnSpec(4, 1, 32, RopeSpec(1_000_000.0, "proportional", 1.0, 0.25),
                                                   k_eq_v=True)))


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Every tensor random, norms included (zero-initialized Gemma norms would hide bugs)."""
    w = init_random(abstract_weights(cfg), seed, jnp.float32)
    rng = np.random.default_rng(seed + 1)

    def perturb(path, a):
        if "norm" in jax.tree_util.keystr(path):
            a = a + 0.3 * rng.standard_normal(a.shape).astype(np.float32)
        return jnp.asarray(a, dtype)
    return jax.tree_util.tree_map_with_path(perturb, w)
