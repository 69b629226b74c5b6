"""Tiny random models for tests that compare engine paths with each other (no checkpoint needed)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config.model import GLOBAL, SLIDING, AttnSpec, ModelConfig, RopeSpec
from jaxllm.model.families import family_named, gemma4
from jaxllm.model.params import abstract_weights, is_spec


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


def gemma4_variant(name: str, window: int = 16) -> ModelConfig:
    """The Gemma 4 family's own config mapping of a shrunk real variant (see gemma4_refs): "31b" has
    k_eq_v global layers, "e2b" per-layer inputs and layers that read another layer's KV cache."""
    from gemma4_refs import BASE, VARIANTS
    hf = {**BASE, **VARIANTS[name], "sliding_window": window, "model_type": "gemma4_text"}
    return gemma4.config_from_hf(hf)


def gemma4_31b(window: int = 16) -> ModelConfig:
    return gemma4_variant("31b", window)


def gemma4_e2b(window: int = 16) -> ModelConfig:
    return gemma4_variant("e2b", window)


def init_random(tree: dict, seed: int, dtype) -> dict:
    """Small random weights of the described shapes, drawn with numpy (the reference weights these
    tests were tuned on)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=is_spec)
    rng = np.random.default_rng(seed)
    out = []
    for s in leaves:
        if s.init == "zeros":
            a = np.zeros(s.shape, np.float32)
        elif s.init == "ones":
            a = np.ones(s.shape, np.float32)
        else:
            lead = (1 if s.axes[0] == "layers" else 0) + s.n_batch
            fan_in = int(np.prod(s.shape[lead:][:max(s.n_contract, 1)]))
            a = rng.standard_normal(s.shape, dtype=np.float32) / np.sqrt(max(fan_in, 1))
        out.append(jnp.asarray(a, dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def random_weights(cfg: ModelConfig, seed: int = 0, dtype=jnp.float32) -> dict:
    """Every tensor random, norms included (zero-initialized Gemma norms would hide bugs)."""
    fam = family_named(cfg.family)
    tree = fam.abstract(cfg) if fam is not None else abstract_weights(cfg)
    w = init_random(tree, seed, jnp.float32)
    rng = np.random.default_rng(seed + 1)

    # Without a 1/sqrt(head_dim) query scale (Gemma 4) the q/k norm weights set the scale of the
    # attention scores; unit weights would make random attention nearly argmax, where any rounding
    # of the keys flips near-tied choices, so they are damped to give scores of unit scale.
    qk_gain = 0.4 if cfg.query_scale == 1.0 else 1.0

    def perturb(path, a):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            a = a + 0.3 * rng.standard_normal(a.shape).astype(np.float32)
        if "q_norm" in name or "k_norm" in name:
            a = a * qk_gain
        return jnp.asarray(a, dtype)
    return jax.tree_util.tree_map_with_path(perturb, w)
