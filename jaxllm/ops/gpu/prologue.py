"""Decode attention's prologue in one kernel: from a layer's raw Q/K/V projections of one token per
row to the rotated queries, with this step's keys and values written into the paged KV pool.

On the XLA path this is a chain of small kernels per layer (the per-head norms of Q and K, RoPE on
each, the casts, the two cache scatters and their index arithmetic, and for an int8 cache the
quantization), each a launch of a microsecond or two for a few kilobytes at batch 1. Here one
program takes one (row, head): a query head is normed and rotated; a KV head's key is normed,
rotated and stored, and its value (normed, where the family norms values) stored beside it, in the
pool's dtype, or as int8 with a float32 scale per position and head. The pool's arrays are aliased
to the outputs, so the write is in place.

A token at position p of row b goes to block table[b, (p // P) % M] at offset p % P of the layer's
pool (`kv.paged`); nothing is written at a negative position.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxllm.ops.gpu import note, pallas_call
from jaxllm.ops.gpu.matmul import _pow2
from jaxllm.ops.xla import HeadPrep


def _round_even(y):
    """Round to nearest, ties to even (as `jnp.round`, which the Triton lowering lacks)."""
    r = jnp.floor(y + 0.5)
    odd = r - 2.0 * jnp.floor(r * 0.5) != 0
    return jnp.where((r - y == 0.5) & odd, r - 1.0, r)


def _kernel(*refs, names, outs, H, hd, P, M, eps, offset, v_norm, split):
    r = dict(zip(names, refs))
    o = dict(zip(outs, refs[len(names) :]))
    b, j = pl.program_id(0), pl.program_id(1)
    w = hd // 2
    wp = _pow2(w)
    dm = jnp.arange(wp) < w
    dt = o["q"].dtype
    pos = r["pos"][b]
    freq = plgpu.load(r["inv_freq"].at[pl.ds(0, wp)], mask=dm, other=0.0)
    ang = pos.astype(jnp.float32) * freq
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def head(name, i):
        if not split:
            return [
                plgpu.load(r[name].at[b, i, jnp.int32(s), pl.ds(0, wp)], mask=dm, other=0.0).astype(jnp.float32)
                for s in (0, 1)
            ]
        # A K-split projection's partials: summed, scaled and rounded as the matmul would have stored it.
        parts = [
            [
                plgpu.load(r[name].at[jnp.int32(p), b, i, jnp.int32(s), pl.ds(0, wp)], mask=dm, other=0.0)
                for p in range(split)
            ]
            for s in (0, 1)
        ]
        scale = [
            plgpu.load(r[name + "_w_scale"].at[r["scale_idx"][0], i, jnp.int32(s), pl.ds(0, wp)], mask=dm, other=0.0)
            if name + "_w_scale" in r
            else 1.0
            for s in (0, 1)
        ]
        return [(sum(ps) * sc).astype(dt).astype(jnp.float32) for ps, sc in zip(parts, scale)]

    def norm(x, wname):  # the weight's load is issued before the reduction
        ws = (
            []
            if wname is None
            else [
                plgpu.load(r[wname].at[r["norm_layer"][0], jnp.int32(s), pl.ds(0, wp)], mask=dm, other=0.0).astype(
                    jnp.float32
                )
                for s in (0, 1)
            ]
        )
        inv = jax.lax.rsqrt(sum(jnp.sum(a * a) for a in x) / hd + eps)
        if wname is None:
            return [(a * inv).astype(dt).astype(jnp.float32) for a in x]
        return [(a * inv * (offset + wv)).astype(dt).astype(jnp.float32) for a, wv in zip(x, ws)]

    def rope(x):
        return [
            (x[0] * cos - x[1] * sin).astype(dt).astype(jnp.float32),
            (x[1] * cos + x[0] * sin).astype(dt).astype(jnp.float32),
        ]

    @pl.when(j < H)
    def _query():
        x = head("q", j)
        if "q_norm" in r:
            x = norm(x, "q_norm")
        for s, a in enumerate(rope(x)):
            plgpu.store(o["q"].at[b, j, jnp.int32(s), pl.ds(0, wp)], a.astype(dt), mask=dm)

    if "v" not in o:
        return

    @pl.when(j >= H)
    def _key_value():
        h = j - H
        layer = r["layer"][0]
        ok = pos >= 0
        blk = r["table"][b, jnp.where(ok, pos // P, 0) % M]
        off = jnp.where(ok, pos % P, 0)
        one = jnp.full((1,), ok)  # the mask of a single-element store

        def put(name, x):
            if name + "_scale" in o:  # int8: a symmetric scale per position and head
                amax = jnp.maximum(jnp.max(jnp.abs(x[0])), jnp.max(jnp.abs(x[1])))
                scale = jnp.where(amax > 0, amax / 127.0, 1.0)
                x = [jnp.clip(_round_even(a / scale), -127.0, 127.0) for a in x]
                plgpu.store(o[name + "_scale"].at[layer, blk, pl.ds(off, 1), h], jnp.full((1,), scale), mask=one)
            for s, a in enumerate(x):
                plgpu.store(
                    o[name].at[layer, blk, off, h, jnp.int32(s), pl.ds(0, wp)], a.astype(o[name].dtype), mask=dm & ok
                )

        v = head("v", h)
        if "k" in o:
            k = head("k", h)
            if "k_norm" in r:
                k = norm(k, "k_norm")
            put("k", rope(k))
        put("v", norm(v, None) if v_norm else v)


@dataclass(frozen=True)
class SplitQKV:
    """Q/K/V handed over as the float32 partial products [n, B, heads, hd] of a matmul that split
    its K dimension: the kernel sums them, scales them per channel by the stacks `scales` ([L,
    heads, hd] each, or None) at `idx`, and rounds them to `dtype`, as the matmul would have."""

    scales: tuple
    idx: jax.Array | int
    dtype: object


def decode_prologue(q, k, v, prep: HeadPrep, pos, pool: dict, layer, table=None, *, split: SplitQKV | None = None):
    """q [B, H, hd] and k, v [B, K, hd] (raw projections; v is k itself where a family's values are
    its raw keys), positions pos [B], and the arrays of the pool to write at layer `layer` through
    the rows' block table table [B, M]: `k` (absent where keys are rebuilt from values), `v`
    [L, N, P, K, hd], with `k_scale`, `v_scale` [L, N, P, K] where int8. With an empty pool only
    q is prepared. With `split`, q, k and v are K-split partials [n, B, heads, hd] (see
    `SplitQKV`). Returns (q rotated [B, H, hd], the pool's arrays written)."""
    n = 0 if split is None else q.shape[0]
    B, H, hd = q.shape[1:] if split else q.shape
    dtype = q.dtype if split is None else split.dtype
    if hd % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {hd}")
    pool = {n: a for n, a in pool.items() if a is not None}
    K = 0 if "v" not in pool else pool["v"].shape[3]
    P = 1 if "v" not in pool else pool["v"].shape[2]

    def segs(x):
        return None if x is None else x.reshape(*x.shape[:-1], 2, hd // 2)

    def stack(w):
        return None if w is None else segs(w if w.ndim == 2 else w[None])

    ins = {
        "layer": jnp.reshape(layer, (1,)).astype(jnp.int32),
        "pos": pos.astype(jnp.int32),
        "table": table.astype(jnp.int32) if K else None,
        "norm_layer": jnp.reshape(prep.norm_layer, (1,)).astype(jnp.int32),
        "inv_freq": jnp.asarray(np.asarray(prep.inv_freq, np.float32)),
        "q": segs(q),
        "k": segs(k) if K and "k" in pool else None,
        "v": segs(v) if K else None,
        "q_norm": stack(prep.q_norm),
        "k_norm": stack(prep.k_norm) if K else None,
    }
    if split is not None:
        sq, sk, sv = split.scales
        ins.update(
            scale_idx=jnp.reshape(split.idx, (1,)).astype(jnp.int32),
            q_w_scale=segs(sq),
            k_w_scale=segs(sk) if K and "k" in pool else None,
            v_w_scale=segs(sv) if K else None,
        )
    ins = {n: a for n, a in ins.items() if a is not None}
    written = {n: segs(a) if n in ("k", "v") else a for n, a in pool.items()}
    names = tuple(ins) + tuple("old_" + n for n in written)  # aliased to the outputs, which are written
    outs = ("q",) + tuple(written)
    out_shape = (jax.ShapeDtypeStruct(ins["q"].shape[1:] if split else ins["q"].shape, dtype),) + tuple(
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in written.values()
    )
    M = 1 if table is None else table.shape[1]
    note(
        "decode prologue",
        (B, H, K, hd, str(pool["v"].dtype) if K else "-"),
        "pallas" + (f" summing {n} partials" if split else ""),
    )
    kernel = functools.partial(
        _kernel,
        names=names,
        outs=outs,
        H=H,
        hd=hd,
        P=P,
        M=M,
        eps=prep.eps,
        offset=prep.offset,
        v_norm=prep.v_norm,
        split=n,
    )
    got = pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, H + K),
        input_output_aliases={len(ins) + i: 1 + i for i in range(len(written))},
        compiler_params=plgpu.CompilerParams(num_warps=1 if hd <= 256 else 2, num_stages=1),
        name="decode_prologue",
    )(*ins.values(), *written.values())
    return got[0].reshape(B, H, hd), {n: a.reshape(pool[n].shape) for n, a in zip(written, got[1:])}
