"""The forward pass: embed, one `lax.scan` over all layers, final norm and logits.

Each scan step gets (kind, index): `lax.cond` picks the sliding or global branch, and the branch
reads its weights and KV cache at `index` in that kind's stack. With a single kind (Qwen3) there is
no cond at all.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from . import cache as kv
from .config import GLOBAL, KIND_NAMES, SLIDING, ModelConfig
from .layers import attend, attention_mask, gated_mlp, inv_frequencies, project_qkv, rms_norm
from .quant import linear, matmul_rows, take_rows


def schedule(cfg: ModelConfig) -> dict:
    """Per-layer scan inputs: which kind, and the index within that kind's weight/cache stacks."""
    kinds = np.asarray(cfg.layer_kinds, np.int32)
    idx = np.zeros_like(kinds)
    seen = {SLIDING: 0, GLOBAL: 0}
    for i, k in enumerate(cfg.layer_kinds):
        idx[i] = seen[k]
        seen[k] += 1
    return {"kind": kinds, "idx": idx}


def embed(cfg: ModelConfig, weights: dict, tokens: jax.Array, dtype) -> jax.Array:
    x = take_rows(weights["embed"], tokens, dtype)
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    return x


def logits_from_hidden(cfg: ModelConfig, weights: dict, h: jax.Array) -> jax.Array:
    h = rms_norm(h, weights["final_norm"], cfg.norm_eps, cfg.norm_offset)
    if cfg.tie_embeddings:
        out = matmul_rows(h, weights["embed"])
    else:
        out = linear(h, weights["lm_head"]).astype(jnp.float32)
    if cfg.final_softcap is not None:
        out = jnp.tanh(out / cfg.final_softcap) * cfg.final_softcap
    return out


def attention_block(cfg, kind, w, h, positions, layer_cache, start):
    """Project, write this step's K/V into the layer's cache, attend over the cache, project out."""
    a = cfg.attn[kind]
    q, k, v = project_qkv(cfg, a, w, h, positions, inv_frequencies(a.rope, a.head_dim))
    ck = kv.write(layer_cache["k"], k, start)
    cv = kv.write(layer_cache["v"], v, start)
    B, S = ck.shape[0], ck.shape[1]
    mask = attention_mask(positions, kv.slot_positions(B, S), a.window)
    o = attend(q, ck, cv, mask, cfg.query_scale, cfg.attn_softcap)
    return linear(o, w["o"], 2), {"k": ck, "v": cv}


def decoder_layer(cfg, kind, w, x, positions, layer_cache, start):
    h = rms_norm(x, w["attn_norm"], cfg.norm_eps, cfg.norm_offset)
    a, layer_cache = attention_block(cfg, kind, w, h, positions, layer_cache, start)
    if cfg.sandwich_norms:
        a = rms_norm(a, w["post_attn_norm"], cfg.norm_eps, cfg.norm_offset)
    x = x + a
    h = rms_norm(x, w["mlp_norm"], cfg.norm_eps, cfg.norm_offset)
    m = gated_mlp(cfg, w, h)
    if cfg.sandwich_norms:
        m = rms_norm(m, w["post_mlp_norm"], cfg.norm_eps, cfg.norm_offset)
    return x + m, layer_cache


def take(tree, i):
    return jax.tree_util.tree_map(lambda a: a[i], tree)


def put(tree, i, new):
    return jax.tree_util.tree_map(lambda a, n: a.at[i].set(n), tree, new)


def forward(cfg: ModelConfig, weights: dict, tokens: jax.Array, positions: jax.Array,
            cache: dict, dtype=jnp.bfloat16):
    """tokens/positions [B, T] -> hidden states [B, T, D] and the updated cache.

    Tokens are written into the cache at their positions (contiguous per row, starting at
    positions[:, 0]) and attend to everything the cache holds at earlier positions.
    """
    x = embed(cfg, weights, tokens, dtype)
    start = positions[:, 0]
    sched = schedule(cfg)

    def branch(kind):
        name = KIND_NAMES[kind]

        def run(x, caches, idx):
            w = take(weights["layers"][name], idx)
            x, lc = decoder_layer(cfg, kind, w, x, positions, take(caches[name], idx), start)
            return x, {**caches, name: put(caches[name], idx, lc)}
        return run

    def step(carry, s):
        x, caches = carry
        kinds = cfg.kinds_used
        if len(kinds) == 1:
            x, caches = branch(kinds[0])(x, caches, s["idx"])
        else:
            x, caches = jax.lax.cond(s["kind"] == SLIDING, branch(SLIDING), branch(GLOBAL),
                                     x, caches, s["idx"])
        return (x, caches), None

    (x, cache), _ = jax.lax.scan(step, (x, cache), jax.tree_util.tree_map(jnp.asarray, sched))
    return x, cache
