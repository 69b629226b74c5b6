"""The forward pass: embed, one `lax.scan` over all layers, final norm and logits.

Each scan step gets its layer's schedule entry (`model.schedule`): `lax.switch` picks the branch
(sliding or global, plus any family-specific groups such as Gemma 4's KV-sharing layers), and the
branch reads its weights at `idx` in its group's stack and its KV cache at `cache_idx` in its
kind's stack. With a single branch (Qwen3) there is no switch at all. The scan carries the residual
stream and the stream normed for the layer ahead: each layer ends with its residual add and the
next layer's input norm (the final norm after the last), one operation of the backend.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.model import KIND_NAMES, ModelConfig
from jaxllm.kv.paged import PagedCache
from jaxllm.model.families import abstract, family_named
from jaxllm.model.layers import decoder_layer
from jaxllm.model.schedule import Branch, branches, counted_layers, layer_period, schedule


def family_hooks(cfg: ModelConfig):
    """The family module, for its optional `decoder_layer` and `layer_inputs` overrides."""
    return family_named(cfg.family)


def embed(cfg: ModelConfig, weights: dict, tokens: jax.Array, dtype, ops) -> jax.Array:
    x = ops.embed(weights["embed"], tokens, dtype)
    if cfg.embed_scale is not None:
        x = x * jnp.asarray(cfg.embed_scale, dtype)
    return x


def logits_from_hidden(cfg: ModelConfig, weights: dict, h: jax.Array, ops) -> jax.Array:
    h = ops.rms_norm(h, weights["final_norm"], cfg.norm_eps, cfg.norm_offset)
    head = weights["embed"] if cfg.tie_embeddings else weights["lm_head"]
    out = ops.output_head(h, head, cfg.tie_embeddings)
    if cfg.final_softcap is not None:
        out = jnp.tanh(out / cfg.final_softcap) * cfg.final_softcap
    return out


def next_input_norms(cfg: ModelConfig, weights: dict) -> dict:
    """Per layer group, a stack [layers in the group, D] of the input norm weight of the layer after
    each (the final norm's after the last layer), in the group's own order."""
    idx = schedule(cfg)["idx"]

    def after(i):
        if i + 1 == cfg.num_layers:
            return weights["final_norm"]
        return weights["layers"][cfg.group_of(i + 1)]["attn_norm"][int(idx[i + 1])]

    groups = {}
    for i in range(cfg.num_layers):
        groups.setdefault(cfg.group_of(i), []).append(after(i))
    return {g: jnp.stack(rows) for g, rows in groups.items()}


def cache_positions(cache: PagedCache) -> int:
    """Positions the largest pool holds (blocks x block size)."""
    return max((p.num_blocks * p.block_size for p in cache.pools.values()), default=0)


def forward(
    cfg: ModelConfig, weights: dict, tokens: jax.Array, positions: jax.Array, cache: PagedCache, ops, dtype=jnp.bfloat16
):
    """tokens/positions [B, T] -> hidden states [B, T, D] and the updated cache, on backend `ops`.

    Each token's keys and values are written into its row's KV blocks at its position (a negative
    position is padding, never written), and it attends to everything its row holds at earlier
    positions (`cache.tables` [B, ...]: the blocks of each batch row).
    """
    hooks = family_hooks(cfg)
    x = embed(cfg, weights, tokens, dtype, ops)
    xs = jax.tree_util.tree_map(jnp.asarray, schedule(cfg))
    if getattr(hooks, "layer_inputs", None) is not None:
        xs["inputs"] = hooks.layer_inputs(cfg, weights, tokens, x, ops)  # leading axis: layers
    layer_fn = getattr(hooks, "decoder_layer", None)
    brs = branches(cfg)
    unroll = ops.scan_unroll(cfg.num_layers, *tokens.shape)
    norms = next_input_norms(cfg, weights)
    groups = {g: {**stacks, "next_norm": norms[g]} for g, stacks in weights["layers"].items()}
    # each stack's description, for the backend; the next layers' input norms stacked like the group's own
    specs = {g: {**s, "next_norm": s["attn_norm"]} for g, s in abstract(cfg)["layers"].items()}
    first = weights["layers"][cfg.group_of(0)]["attn_norm"][0]
    carry0 = (ops.next_input(x, first, cfg.norm_eps, cfg.norm_offset), cache)

    def branch(b: Branch):
        name = KIND_NAMES[b.kind]

        def run(xh, caches, s):
            w = ops.layer_weights(groups[b.group], s["idx"], specs[b.group])
            lc = caches.layer(name, s["cache_idx"])
            if layer_fn is None:
                xh, lc = decoder_layer(cfg, b, w, *xh, positions, lc, ops)
            else:
                xh, lc = layer_fn(cfg, b, w, *xh, positions, lc, s.get("inputs"), ops)
            return xh, (caches.with_layer(name, lc) if b.own_kv else caches)

        return run

    def step(carry, s):
        xh, caches = carry
        if len(brs) == 1:
            xh, caches = branch(brs[0])(xh, caches, s)
        elif len(brs) == 2:  # sliding or global
            xh, caches = jax.lax.cond(s["branch"] == 0, branch(brs[0]), branch(brs[1]), xh, caches, s)
        else:
            xh, caches = jax.lax.switch(s["branch"], [branch(b) for b in brs], xh, caches, s)
        return (xh, caches), None

    p = layer_period(cfg) if len(brs) > 1 and ops.layer_scan(cache_positions(cache)) == "period" else None
    if p is None and counted_layers(cfg) and "inputs" not in xs:
        # Layer i reads stack entry i and cache i: the scan carries i itself instead of slicing the
        # schedule, whose index clamp was a kernel of its own each layer on GPUs.
        def counted(carry, _):
            c, i = carry
            c, _ = step(c, {"idx": i, "cache_idx": i})
            return (c, i + 1), None

        (((x, _), cache), _), _ = jax.lax.scan(
            counted, (carry0, jnp.int32(0)), None, length=cfg.num_layers, unroll=unroll
        )
        return x, cache
    if p is None:
        ((x, _), cache), _ = jax.lax.scan(step, carry0, xs, unroll=unroll)
        return x, cache
    # One scan step per period of the branch pattern (Gemma's 5 sliding + 1 global), each layer of
    # it on its own static branch; the layers past the last whole period follow, unrolled.
    pattern = schedule(cfg)["branch"][:p]
    n = cfg.num_layers // p

    def period_step(carry, s):
        for j in range(p):
            carry = branch(brs[pattern[j]])(*carry, jax.tree_util.tree_map(lambda a: a[j], s))
        return carry, None

    periods = jax.tree_util.tree_map(lambda a: a[: n * p].reshape((n, p) + a.shape[1:]), xs)
    carry, _ = jax.lax.scan(period_step, carry0, periods, unroll=max(1, unroll // p))
    for i in range(n * p, cfg.num_layers):
        carry = branch(brs[pattern[i % p]])(*carry, jax.tree_util.tree_map(lambda a: a[i], xs))
    ((x, _), cache) = carry
    return x, cache
