"""Prefill attention: many query tokens a row over one layer of a paged KV pool, in one kernel.

A program takes one (row, query head, block of queries): it loads its queries once and streams the
K/V tiles any of them can see (from the first position of the earliest query's window to the
latest query's position) through an online softmax, reading the pool in place through the row's
block table (`pages`: a tile of `bk` positions gathered from the pages that hold it). Scores are
masked by logical position, causal and within the window, per query; a padding query (a negative
position) sees nothing and gives zeros. int8 pools fold their scales into the scores and the
probabilities, as the decode kernel does.

The same kernel serves a prompt's chunks (the XLA path materializes [B, H, T, S] scores, or loops
over the pool's blocks a read at a time) and a speculative verify's few tokens a row.

    prefill_attention(q [B, T, H, hd], pool {"k", "v"[, "k_scale", "v_scale"]}, layer, table [B, M],
                      positions [B, T]) -> [B, T, H, hd]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import note, pages, pallas_call
from jaxllm.ops.gpu.matmul import _pow2

NEG = -1e30


@dataclass(frozen=True)
class Blocks:
    bq: int  # queries a program
    bk: int  # keys a step (a power of two; any page size)
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


def _kernel(*refs, names, G, T, P, M, hd, blk: Blocks, n_q, scale, softcap, window, precision):
    r = dict(zip(names, refs))
    o_ref = refs[len(names)]
    b, h = pl.program_id(0), pl.program_id(1)
    i = n_q - 1 - pl.program_id(2)  # the blocks that see the most keys first
    bq, bk = blk.bq, blk.bk
    hdp = _pow2(max(hd, 16))
    layer, kvh = r["layer"][0], h // G
    rows = i * bq + jnp.arange(bq)
    rmask = rows < T
    dmask = jnp.arange(hdp) < hd
    cols = jnp.arange(hdp)[None, :]
    qp = plgpu.load(r["pos"].at[b, pl.ds(i * bq, bq)], mask=rmask, other=-1)
    q = plgpu.load(r["q"].at[b, pl.ds(i * bq, bq), h, pl.ds(0, hdp)], mask=rmask[:, None] & dmask[None, :], other=0.0)
    dt = q.dtype
    # the positions any of this block's queries can see, [first, last], and their tiles
    last = jnp.max(qp)
    hi = pl.cdiv(last + 1, bk)
    first = jnp.int32(0)
    if window is not None:
        first = jnp.maximum(jnp.min(jnp.where(qp >= 0, qp, jnp.iinfo(jnp.int32).max)) - window + 1, 0)
    lo = jnp.minimum(first // bk, jnp.maximum(hi, 0))
    int8 = "k_scale" in r

    def step(t, blocks, carry):
        acc, m, l = carry
        si = t * bk + jnp.arange(bk)
        seen = (si >= first) & (si <= last)  # no query of the block sees the others
        # a tile within one page is a slice of consecutive pool rows (loads vectorized along the
        # head, as a contiguous cache's); over several pages, a gather of their rows
        at = pl.ds(blocks[0] * P + (t * bk) % P, bk) if bk <= P else pages.tile_rows(blocks, t, bs=bk, P=P)
        kvmask = seen[:, None] & dmask[None, :]
        if bk <= P:
            kb = plgpu.load(r["k"].at[layer, at, kvh, pl.ds(0, hdp)], mask=kvmask, other=0)
            vb = plgpu.load(r["v"].at[layer, at, kvh, pl.ds(0, hdp)], mask=kvmask, other=0)
        else:
            kb = plgpu.load(r["k"].at[layer, at[:, None], kvh, cols], mask=kvmask, other=0)
            vb = plgpu.load(r["v"].at[layer, at[:, None], kvh, cols], mask=kvmask, other=0)
        s = jax.lax.dot_general(
            q, kb.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32, precision=precision
        )
        if int8:
            s = s * plgpu.load(r["k_scale"].at[layer, at, kvh], mask=seen, other=0.0)[None, :]
        s = s * scale
        if softcap is not None:
            s = jnp.tanh(s / softcap) * softcap
        valid = seen[None, :] & (si[None, :] <= qp[:, None])
        if window is not None:
            valid &= si[None, :] > qp[:, None] - window
        s = jnp.where(valid, s, NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
        l = l * corr + jnp.sum(p, axis=1)
        if int8:  # V's scales folded into the probabilities
            p = p * plgpu.load(r["v_scale"].at[layer, at, kvh], mask=seen, other=0.0)[None, :]
        acc = acc * corr[:, None] + jax.lax.dot_general(
            p.astype(dt),
            vb.astype(dt),
            (((1,), (0,)), ((), ())),
            preferred_element_type=jnp.float32,
            precision=precision,
        )
        return acc, m_new, l

    init = (jnp.zeros((bq, hdp), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    ids = functools.partial(pages.tile_pages, r["table"], b, bs=bk, P=P, M=M)
    acc, _, l = pages.fori(lo, jnp.maximum(hi, lo), ids, 2, step, init)
    out = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)  # 0: no key to read
    plgpu.store(
        o_ref.at[b, pl.ds(i * bq, bq), h, pl.ds(0, hdp)], out.astype(o_ref.dtype), mask=rmask[:, None] & dmask[None, :]
    )


def prefill_attention(
    q, pool: dict, layer, table, positions, *, scale: float, softcap=None, window=None, blocks: Blocks | None = None
):
    """q [B, T, H, hd] at `positions` [B, T] over layer `layer` of a kind's pool, `pool` its arrays
    (k, v [L, N, P, K, hd]; k_scale, v_scale [L, N, P, K] where int8), through the rows' block
    table table [B, M], read in place -> [B, T, H, hd] in q's dtype."""
    B, T, H, hd = q.shape
    _, _, P, K, _ = pool["v"].shape
    M = table.shape[1]
    blk = blocks or choose_blocks(hd, T)
    if blk.bk & (blk.bk - 1):
        raise ValueError(f"a step of keys must be a power of two, got {blk.bk}")
    n_q = pl.cdiv(T, blk.bq)
    note("prefill attention", (B, T, H, K, M * P, hd, str(pool["v"].dtype)), blk.label() + f" page={P}")
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    ins = {
        "layer": jnp.reshape(layer, (1,)).astype(jnp.int32),
        "pos": positions.astype(jnp.int32),
        "table": table.astype(jnp.int32),
        "q": q,
    }
    ins.update({name: pages.flat(pool[name]) for name in ("k", "v", "k_scale", "v_scale") if name in pool})
    kernel = functools.partial(
        _kernel,
        names=tuple(ins),
        G=H // K,
        T=T,
        P=P,
        M=M,
        hd=hd,
        blk=blk,
        n_q=n_q,
        scale=scale,
        softcap=softcap,
        window=window,
        precision=precision,
    )
    return pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(B, H, n_q),
        compiler_params=plgpu.CompilerParams(num_warps=blk.warps, num_stages=blk.stages),
        name="prefill_attention",
    )(*ins.values())
