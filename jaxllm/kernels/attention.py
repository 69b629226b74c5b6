"""Decode attention over one layer of the stacked KV cache, GQA-grouped and split over the sequence.

One query token per row, at absolute position `pos[b]`, attends over cache slots `s <= pos[b]`
(and `s > pos[b] - window` for a sliding layer) of layer `layer` in a `[layers, B, S, K, hd]` stack,
read in place. A program takes one (row, KV head, sequence chunk): it loads the query heads that
share that KV head once, streams the chunk's K/V blocks through an online softmax, and writes an
unnormalised partial with its running max and sum; XLA merges the chunks by log-sum-exp. Chunks
past the row's position, or before its window, load nothing.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from . import interpret, note
from .matmul import SMS, _pow2

NEG = -1e30


def _kernel(layer_ref, pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, G, hd, S, bs, chunk,
            scale, softcap, window, precision):
    b, h, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    gp, hdp = max(16, _pow2(G)), _pow2(hd)
    layer, pos = layer_ref[0], pos_ref[b]
    gi, di = jnp.arange(gp), jnp.arange(hdp)
    gmask, dmask = gi < G, di < hd
    q = plgpu.load(q_ref.at[b, h, pl.ds(0, gp), pl.ds(0, hdp)], mask=gmask[:, None] & dmask[None, :],
                   other=0.0)
    lo = sp * chunk
    hi = jnp.minimum(jnp.minimum(lo + chunk, pos + 1), S)
    if window is not None:
        lo = jnp.maximum(lo, pos - window + 1)
    t_lo = lo // bs
    t_hi = jnp.maximum(pl.cdiv(hi, bs), t_lo)

    def body(t, carry):
        acc, m, l = carry
        si = t * bs + jnp.arange(bs)
        valid = (si >= lo) & (si < hi)
        kv_mask = valid[:, None] & dmask[None, :]
        k = plgpu.load(k_ref.at[layer, b, pl.ds(t * bs, bs), h, pl.ds(0, hdp)], mask=kv_mask, other=0.0)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision) * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        s = jnp.where(valid[None, :], s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(valid[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        v = plgpu.load(v_ref.at[layer, b, pl.ds(t * bs, bs), h, pl.ds(0, hdp)], mask=kv_mask, other=0.0)
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=precision)
        return acc * corr[:, None] + pv, m_new, l * corr + jnp.sum(p, axis=1)

    init = (jnp.zeros((gp, hdp), jnp.float32), jnp.full((gp,), NEG, jnp.float32),
            jnp.zeros((gp,), jnp.float32))
    acc, m, l = jax.lax.fori_loop(t_lo, t_hi, body, init)
    plgpu.store(o_ref.at[sp, b, h, pl.ds(0, gp), pl.ds(0, hdp)], acc,
                mask=gmask[:, None] & dmask[None, :])
    plgpu.store(m_ref.at[sp, b, h, pl.ds(0, gp)], m, mask=gmask)
    plgpu.store(l_ref.at[sp, b, h, pl.ds(0, gp)], l, mask=gmask)


def choose_split(B: int, K: int, S: int, bs: int) -> int:
    """Sequence chunks per (row, KV head): enough programs for about two per multiprocessor."""
    want = -(-2 * SMS // (B * K))
    return max(1, min(want, -(-S // bs)))


def decode_attention(q, k_stack, v_stack, layer, pos, *, scale: float, softcap=None, window=None,
                     block: int | None = None, splits: int | None = None):
    """q [B, H, hd], k/v_stack [L, B, S, K, hd], layer [], pos [B] -> [B, H, hd] in q's dtype."""
    B, H, hd = q.shape
    _, _, S, K, _ = k_stack.shape
    G = H // K
    bs = block or (64 if hd <= 256 else 32)
    n = splits or choose_split(B, K, S, bs)
    chunk = -(-S // n)
    chunk = -(-chunk // bs) * bs
    n = -(-S // chunk)
    note("decode attention", (B, H, K, S, hd, str(k_stack.dtype)), f"pallas block={bs} splits={n}")
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, G=G, hd=hd, S=S, bs=bs, chunk=chunk, scale=scale,
                               softcap=softcap, window=window, precision=precision)
    out_shape = (jax.ShapeDtypeStruct((n, B, K, G, hd), jnp.float32),
                 jax.ShapeDtypeStruct((n, B, K, G), jnp.float32),
                 jax.ShapeDtypeStruct((n, B, K, G), jnp.float32))
    o, m, l = pl.pallas_call(kernel, out_shape=out_shape, grid=(B, K, n),
                             compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
                             interpret=interpret(), name="decode_attention")(
        jnp.reshape(layer, (1,)).astype(jnp.int32), pos.astype(jnp.int32),
        q.reshape(B, K, G, hd), k_stack, v_stack)
    top = jnp.max(m, axis=0)
    w = jnp.exp(m - top)                                        # [n, B, K, G]
    den = jnp.sum(l * w, axis=0)[..., None]           # 0 only for a row with no key to read
    out = jnp.where(den > 0, jnp.sum(o * w[..., None], axis=0) / jnp.where(den > 0, den, 1.0), 0.0)
    return out.reshape(B, H, hd).astype(q.dtype)
