"""Attention over a long linear KV cache, one block of slots at a time, with an online softmax.

The loop runs only over the blocks that hold a position some query can see (up to the highest query
position of the batch, from the lowest a sliding window still holds), so a decode step at 10K
tokens of a 128K context reads 10K tokens of KV.
The cache is read through `load_block(start) -> (k, v, kv_pos)` (positions start.. of every row,
gathered from the row's KV blocks by `kv.paged`), which dequantizes int8 or passes the compute
dtype through: one loop serves both storage formats, and prefill (T > 1) as well as decode (T = 1).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from jaxllm.ops.xla import NEG_INF, PACKED, attention_mask

BlockLoader = Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]


def to_store(x: jax.Array, store) -> jax.Array:
    """x as a cache whose buffers are of dtype `store` holds it."""
    if store == PACKED:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), PACKED)
    return x.astype(store)


def from_store(x: jax.Array, dtype) -> jax.Array:
    """Values read from a cache buffer, in `dtype` (bfloat16 bits unpacked)."""
    if x.dtype == PACKED:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    return x.astype(dtype)


def quantize_kv(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., hd] -> (int8 [..., hd], float32 scale [...]): symmetric, one scale per token and head."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(xf / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_kv(q: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    if scale is None:
        return from_store(q, dtype)
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def blocks_needed(q_pos: jax.Array, block: int) -> jax.Array:
    """How many leading blocks hold a position that some query of the batch can see."""
    return jnp.clip((jnp.max(q_pos) + block) // block, 0, None).astype(jnp.int32)


def first_block(q_pos: jax.Array, block: int, window: int | None) -> jax.Array:
    """The first block that holds a position some query of the batch can see: 0, or with a sliding
    window the block of the earliest position in the window of the earliest query."""
    if window is None:
        return jnp.int32(0)
    lo = jnp.min(jnp.where(q_pos >= 0, q_pos, jnp.iinfo(jnp.int32).max)) - window + 1
    return (jnp.clip(lo, 0, None) // block).astype(jnp.int32)


def blockwise_attend(
    q: jax.Array,
    q_pos: jax.Array,
    load_block: BlockLoader,
    *,
    block: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> jax.Array:
    """Grouped-query attention of q [B, T, H, hd] at absolute positions q_pos [B, T] (-1 = padding)
    over the positions `load_block` reads, `block` at a time -> [B, T, H, hd] in q's dtype.

    Equal to a plain softmax over all visible keys; queries that see no key (padding) give zeros.
    """
    B, T, H, hd = q.shape
    k0, _, _ = jax.eval_shape(load_block, jnp.int32(0))
    K = k0.shape[2]
    G = H // K
    qg = q.reshape(B, T, K, G, hd)

    def body(i, carry):
        m, l, acc = carry
        k, v, kv_pos = load_block(i * block)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        mask = attention_mask(q_pos, kv_pos, window)[:, None, None]  # [B, 1, 1, T, blk]
        s = jnp.where(mask, s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        l = l * corr + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l, acc * corr[..., None] + pv

    init = (
        jnp.full((B, K, G, T), NEG_INF, jnp.float32),
        jnp.zeros((B, K, G, T), jnp.float32),
        jnp.zeros((B, K, G, T, hd), jnp.float32),
    )
    n = blocks_needed(q_pos, block)
    _, l, acc = jax.lax.fori_loop(jnp.minimum(first_block(q_pos, block, window), n), n, body, init)
    o = acc / jnp.maximum(l, 1e-30)[..., None]  # [B, K, G, T, hd]
    return o.transpose(0, 3, 1, 2, 4).reshape(B, T, H, hd).astype(q.dtype)
