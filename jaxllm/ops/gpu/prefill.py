"""Prefill attention: many query tokens per row over one layer of the stacked linear KV cache, in one
pass with an online softmax, so the scores are never written to memory.

XLA's formulation (`layers.attend`) forms every head's float32 scores against the whole cache
length, masks them, and reads them back for the softmax and again for the values: for a 2048-token
prompt of Qwen3-4B that is 0.5 GB a layer written and read several times, and a longer prompt (or
a longer cache) grows it with the square. Here a program takes one (row, query head, block of
queries): it loads the block's queries once, streams the K/V blocks they can see through an
online softmax in float32, and writes the normalised output.

Slot s of a linear cache holds position s, so a block visits only the K/V blocks between its first
query's window start and its last query's position: the causal upper triangle, the slots past the
prompt and, for sliding layers, those before the window are not read. Masks come from the query
positions, so any positions work (a prompt continued at an offset, right-padded rows). The
programs of the query blocks that see the most keys are started first.

    prefill_attention(q [B, T, H, hd], stacks {k, v: [L, R, S, K, hd]}, layer, positions [B, T],
                      rows=, scale=, softcap=, window=) -> [B, T, H, hd]
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import note, pallas_call
from jaxllm.ops.gpu.matmul import _pow2

NEG = -1e30


@dataclass(frozen=True)
class Blocks:
    bq: int           # queries a program
    bk: int           # keys a step
    warps: int
    stages: int = 2

    def label(self) -> str:
        return f"pallas bq={self.bq} bk={self.bk} warps={self.warps} stages={self.stages}"


def choose_blocks(hd: int, T: int) -> Blocks:
    """Blocks by head width: a program's float32 accumulator (bq x hd) and its query and K/V tiles
    must stay in registers and shared memory, so the widest heads take fewer queries and keys a
    step. Measured on one H100 (`scripts/prefill_attention_bench.py`, one prompt of 2048 to 8192
    tokens, ms a layer): head_dim 128 (Qwen3-4B) 0.27 at 2048 tokens against 0.31-0.65 for the
    other blocks tried (at 8192, 2.58 against 2.46 in steps of 32 keys); head_dim 256, 4096 tokens,
    0.35 (Gemma 3 270M's global layers) and 1.09 (Gemma 4 31B's sliding ones) against 0.46 and 1.27
    with 32 keys a step; head_dim 512 (Gemma 4's global layers) 3.47 with 4 warps against 6.55
    with 8, and 64 x 64 blocks do not fit in shared memory."""
    hdp = _pow2(hd)
    if hdp <= 128:
        b = Blocks(bq=64, bk=64, warps=4)
    elif hdp <= 256:
        b = Blocks(bq=64, bk=64, warps=8)
    else:
        b = Blocks(bq=32, bk=32, warps=4)
    return Blocks(bq=max(16, min(b.bq, _pow2(T))), bk=b.bk, warps=b.warps, stages=b.stages)


def _kernel(layer_ref, pos_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, *, G, T, S, R, hd, blk: Blocks, n_q,
            scale, softcap, window, precision):
    b, h = pl.program_id(0), pl.program_id(1)
    row = jnp.clip(rows_ref[b], 0, R - 1)      # the cache row this batch row reads
    i = n_q - 1 - pl.program_id(2)            # the blocks that see the most keys first
    bq, bk = blk.bq, blk.bk
    hdp = _pow2(max(hd, 16))
    layer, kvh = layer_ref[0], h // G
    rows = i * bq + jnp.arange(bq)
    rmask = rows < T
    dmask = jnp.arange(hdp) < hd
    qp = plgpu.load(pos_ref.at[b, pl.ds(i * bq, bq)], mask=rmask, other=-1)
    q = plgpu.load(q_ref.at[b, pl.ds(i * bq, bq), h, pl.ds(0, hdp)], mask=rmask[:, None] & dmask[None, :],
                   other=0.0)
    dt = q.dtype
    # the K/V blocks any of this block's queries can see
    hi = jnp.minimum(pl.cdiv(jnp.max(qp) + 1, bk), pl.cdiv(S, bk))
    lo = jnp.int32(0)
    if window is not None:
        first = jnp.min(jnp.where(qp >= 0, qp, jnp.iinfo(jnp.int32).max))
        lo = jnp.minimum(jnp.maximum(first - window + 1, 0) // bk, hi)

    def step(t, carry):
        acc, m, l = carry
        si = t * bk + jnp.arange(bk)
        smask = si < S
        kvmask = smask[:, None] & dmask[None, :]
        kb = plgpu.load(k_ref.at[layer, row, pl.ds(t * bk, bk), kvh, pl.ds(0, hdp)], mask=kvmask, other=0.0)
        vb = plgpu.load(v_ref.at[layer, row, pl.ds(t * bk, bk), kvh, pl.ds(0, hdp)], mask=kvmask, other=0.0)
        s = jax.lax.dot_general(q, kb.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=precision) * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        valid = smask[None, :] & (si[None, :] <= qp[:, None])
        if window is not None:
            valid &= si[None, :] > qp[:, None] - window
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + jax.lax.dot_general(
            p.astype(dt), vb.astype(dt), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
            precision=precision)
        return acc, m_new, l

    init = (jnp.zeros((bq, hdp), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(lo, hi, step, init)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)   # 0: no key to read
    plgpu.store(o_ref.at[b, pl.ds(i * bq, bq), h, pl.ds(0, hdp)], out.astype(o_ref.dtype),
                mask=rmask[:, None] & dmask[None, :])


def prefill_attention(q, stacks: dict, layer, positions, *, rows=None, scale: float, softcap=None, window=None,
                      blocks: Blocks | None = None):
    """q [B, T, H, hd] at `positions` [B, T] over layer `layer` of a linear cache's stacks {"k", "v":
    [L, R, S, K, hd]}, cache row rows[b] for batch row b (b where None), read in place ->
    [B, T, H, hd] in q's dtype."""
    B, T, H, hd = q.shape
    k, v = stacks["k"], stacks["v"]
    R, S, K = v.shape[1], v.shape[2], v.shape[3]
    rows = jnp.arange(B, dtype=jnp.int32) if rows is None else rows
    blk = blocks or choose_blocks(hd, T)
    n_q = pl.cdiv(T, blk.bq)
    note("prefill attention", (B, T, H, K, S, hd, str(v.dtype)), blk.label())
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(_kernel, G=H // K, T=T, S=S, R=R, hd=hd, blk=blk, n_q=n_q, scale=scale,
                               softcap=softcap, window=window, precision=precision)
    return pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(B, H, n_q),
                       compiler_params=plgpu.CompilerParams(num_warps=blk.warps, num_stages=blk.stages),
                       name="prefill_attention")(
        jnp.reshape(layer, (1,)).astype(jnp.int32), positions.astype(jnp.int32), rows.astype(jnp.int32), q, k, v)
