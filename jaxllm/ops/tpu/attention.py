"""Ragged paged attention on a TPU TensorCore (Pallas, Mosaic): queries of any rows and positions
(decode, prefill chunks, speculative verifies, padding) over the KV blocks their block tables name.

Designed after vLLM tpu-inference's ragged paged attention and JAX's paged_attention kernel:

- The grid is (rows, query tiles), run in order. A work item is one row's tile of `tokens`
  queries of every local query head. Scalar prefetch puts in SMEM the layer, the rows' block
  tables (flattened) and each item's first logical block and block count: from the window's first
  block of its earliest query to its latest query's block, nothing else.
- The pool stays in HBM (memory space ANY). Each step of an item's loop DMAs `pages` blocks
  (every local KV head; int8 pools their scales too) into one of two VMEM buffers while it
  computes on the other; the last step starts the next item's first blocks, so rows follow one
  another without waiting on HBM. A block past the item's count is not fetched; the buffers are
  zeroed once, so what such a slot holds is finite and its weight is zero.
- A loop over the local KV heads (one body, not one per head: Mosaic compiles it once) takes each
  head's query heads (G of them) and the tile's tokens as the rows [tokens x G, hd] of one matmul
  against the step's keys [pages x block, hd]; an online softmax in float32 (max and sum per row,
  kept in VMEM) masks by logical position: causal, within the window, so a table column that
  holds a newer block than the one read contributes nothing. Int8 keys and values are widened to
  the query dtype, their per-position scales applied to the scores and probabilities.

The pool's arrays come in the order their device layout keeps them in memory (`Pages`): a block's
positions major and its heads minor, or the reverse, so a DMA copies whole (8, 128) tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxllm.ops.tpu import tiles as tiling
from jaxllm.ops.xla import NEG_INF


@dataclass(frozen=True)
class Pages:
    """A kind's pool of KV blocks as the kernel reads it: k and v [layers, blocks, block, heads,
    hd], or with `heads_major` [layers, blocks, heads, block, hd]; for int8 pools the float32
    scales as the pool keeps them, [layers, blocks, block, heads] (None otherwise)."""

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None
    v_scale: jax.Array | None
    heads_major: bool

    @property
    def int8(self) -> bool:
        return self.k_scale is not None

    @property
    def block_size(self) -> int:
        return self.k.shape[3 if self.heads_major else 2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2 if self.heads_major else 3]


@dataclass(frozen=True)
class Static:
    """What the kernel is compiled for."""

    heads: int  # local KV heads
    group: int  # query heads per KV head
    block: int  # positions a KV block holds
    width: int  # block-table columns
    tiles: tiling.Tiles
    scale: float
    softcap: float | None
    window: int | None
    heads_major: bool
    int8: bool


def _kernel(layer_ref, table_ref, first_ref, count_ref, q_ref, qpos_ref, *refs, s: Static):
    n_src = 4 if s.int8 else 2
    srcs, (o_ref, *rest) = refs[:n_src], refs[n_src:]
    bufs, (sems, m_ref, l_ref, acc_ref, state, *staged) = rest[:n_src], rest[n_src:]
    pages, P, M = s.tiles.pages, s.block, s.width
    nq = pl.num_programs(1)
    item = pl.program_id(0) * nq + pl.program_id(1)
    last_item = pl.num_programs(0) * nq - 1
    layer = layer_ref[0]

    def copies(it, step, slot):
        """(live, DMA descriptors) of each block of step `step` of work item `it` into `slot`."""
        row, base = it // nq, first_ref[it] + step * pages
        out = []
        for i in range(pages):
            blk = table_ref[row * M + (base + i) % M]
            descs = [
                pltpu.make_async_copy(
                    src.at[layer, blk] if a < 2 else src.at[blk], buf.at[slot, i], sems.at[slot, a]
                )  # k and v stacked, scales the layer's
                for a, (src, buf) in enumerate(zip(srcs, bufs))
            ]
            out.append((step * pages + i < count_ref[it], descs))
        return out

    def start(it, step, slot):
        for live, descs in copies(it, step, slot):

            @pl.when(live)
            def _():
                for d in descs:
                    d.start()

    def wait(it, step, slot):
        for live, descs in copies(it, step, slot):

            @pl.when(live)
            def _():
                for d in descs:
                    d.wait()

    @pl.when(item == 0)
    def _():
        for buf in bufs:
            buf[...] = jnp.zeros(buf.shape, buf.dtype)
        state[0] = 0  # the buffer the next fetch goes into
        state[1] = 0  # whether this item's first step was fetched by the item before

    steps = (count_ref[item] + pages - 1) // pages
    nxt = jnp.minimum(item + 1, last_item)
    next_fetched = (item < last_item) & (count_ref[nxt] > 0)

    @pl.when((steps > 0) & (state[1] == 0))
    def _():
        start(item, 0, state[0])

    m_ref[...] = jnp.full(m_ref.shape, NEG_INF, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
    qpos = qpos_ref[...]  # [rows, 1]

    def body(step, slot):
        @pl.when(step + 1 < steps)
        def _():
            start(item, step + 1, 1 - slot)

        @pl.when((step + 1 == steps) & next_fetched)
        def _():
            start(nxt, 0, 1 - slot)

        wait(item, step, slot)
        first = (first_ref[item] + step * pages) * P
        kpos = first + jax.lax.broadcasted_iota(jnp.int32, (1, pages * P), 1)
        mask = kpos <= qpos
        if s.window is not None:
            mask &= kpos > qpos - s.window
        kv, scales = _stage(slot, bufs, staged, q_ref.dtype, s)

        def head(h, carry):
            _attend_step(h, mask, q_ref, kv, scales, m_ref, l_ref, acc_ref, s)
            return carry

        jax.lax.fori_loop(0, s.heads, head, 0)
        return 1 - slot

    state[0] = jax.lax.fori_loop(0, steps, body, state[0])
    state[1] = jnp.where(steps > 0, next_fetched, False).astype(jnp.int32)
    for h in range(s.heads):
        l = l_ref[h][:, :1]
        o_ref[h] = (acc_ref[h] / jnp.where(l == 0.0, 1.0, l)).astype(o_ref.dtype)


def _slab(x, int8: bool, dtype):
    """A head's blocks [pages, block, hd] as one matrix [pages x block, hd] in `dtype`. Int8 widens
    to float32 first: Mosaic has no direct int8 to bfloat16 conversion of such a slab."""
    if int8:
        x = x.astype(jnp.float32)
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2]).astype(dtype)


def _stage(slot, bufs, staged, dtype, s: Static):
    """kv(a, h) -> head h's keys (a = 0) or values (a = 1) of the step, [pages x block, hd] in
    `dtype`, and scales(a, h) -> their int8 scales as a row [1, pages x block] (None for other
    pools), for a head h the loop over heads gives at run time. A head is a leading index of
    heads-major blocks; of the others, and of the scales, an index Mosaic takes only as a
    constant, so each head's are first copied out to `staged` buffers indexed by head."""
    refs = list(staged)
    if s.heads_major:

        def kv(a, h):
            return _slab(bufs[a][slot, :, h], s.int8, dtype)
    else:
        stage = refs.pop(0)  # [2, heads, pages x block, hd]
        for a in range(2):
            for h in range(s.heads):
                stage[a, h] = _slab(bufs[a][slot, :, :, h], s.int8, dtype)

        def kv(a, h):
            return stage[a, h]

    if not s.int8:
        return kv, None
    rows = refs.pop(0)  # [2, heads, 1, pages x block]
    for a in range(2):
        for h in range(s.heads):
            x = bufs[2 + a][slot, :, h]  # [pages, block]
            rows[a, h] = x.reshape(1, x.shape[0] * x.shape[1])
    return kv, lambda a, h: rows[a, h]


def _attend_step(h, mask, q_ref, kv, scales, m_ref, l_ref, acc_ref, s: Static):
    """One step of the online softmax for KV head h: its query heads' rows against the step's keys."""
    q = q_ref[h]  # [rows, hd]
    k, v = kv(0, h), kv(1, h)  # [n, hd]
    # the MXU's own passes: bfloat16 once, float32 in full (whatever the process's default precision)
    prec = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else jax.lax.Precision.DEFAULT
    sc = (
        jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
        * s.scale
    )
    if s.int8:
        sc = sc * scales(0, h)  # keys' scales by position
    if s.softcap is not None:
        sc = jnp.tanh(sc / s.softcap) * s.softcap
    sc = jnp.where(mask, sc, NEG_INF)
    m_prev, l_prev = m_ref[h][:, :1], l_ref[h][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if s.int8:
        p = p * scales(1, h)  # values' scales by position
    pv = jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32
    )
    acc_ref[h] = alpha * acc_ref[h] + pv
    m_ref[h] = jnp.broadcast_to(m_new, m_ref.shape[1:])
    l_ref[h] = jnp.broadcast_to(l_new, l_ref.shape[1:])


def work_items(positions, tokens: int, P: int, window: int | None):
    """(first logical block, block count) [B x tiles] of each row's query tiles: the blocks from the
    window's start of the tile's earliest query to its latest query's block (0 blocks for a tile of
    padding alone)."""
    B, Tp = positions.shape
    pos = positions.reshape(B, Tp // tokens, tokens)
    valid = pos >= 0
    hi = jnp.max(jnp.where(valid, pos, -1), axis=-1)
    lo = jnp.min(jnp.where(valid, pos, jnp.iinfo(jnp.int32).max), axis=-1)
    start = jnp.zeros_like(lo) if window is None else jnp.maximum(lo - window + 1, 0)
    first = jnp.where(hi >= 0, start // P, 0)
    count = jnp.where(hi >= 0, hi // P - first + 1, 0)
    return first.reshape(-1).astype(jnp.int32), count.reshape(-1).astype(jnp.int32)


def paged_attention(q, pages: Pages, layer, table, positions, *, scale: float, softcap, window, interpret=False):
    """Attention of q [B, T, H, hd] at positions [B, T] (-1: padding) over layer `layer` of `pages`,
    row b reading the blocks its table row table[b] names -> [B, T, H, hd] in q's dtype. Rows are
    split over several calls where their tables would not fit SMEM (`tiles.SMEM_TABLES`)."""
    B, M = table.shape
    per_call = max(1, tiling.SMEM_TABLES // (4 * M))
    if B > per_call:
        return jnp.concatenate(
            [
                paged_attention(
                    q[i : i + per_call],
                    pages,
                    layer,
                    table[i : i + per_call],
                    positions[i : i + per_call],
                    scale=scale,
                    softcap=softcap,
                    window=window,
                    interpret=interpret,
                )
                for i in range(0, B, per_call)
            ],
            axis=0,
        )
    _, T, H, hd = q.shape
    layer = jnp.asarray(layer, jnp.int32)
    K, P = pages.kv_heads, pages.block_size
    G = H // K
    t = tiling.choose(T, K, G, hd, P, q.dtype, pages.k.dtype, pages.int8)
    Tp = -(-T // t.tokens) * t.tokens
    nq, R = Tp // t.tokens, t.tokens * G
    s = Static(
        K, G, P, M, t, float(scale), None if softcap is None else float(softcap), window, pages.heads_major, pages.int8
    )
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)
    qt = jnp.pad(q.reshape(B, T, K, G, hd), ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0)))
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(B, K, Tp * G, hd)  # rows: token-major, then head
    qpos = jnp.repeat(pos, G, axis=1)[..., None]  # [B, Tp x G, 1]
    first, count = work_items(pos, t.tokens, P, window)
    # the layer's scales block-major, [blocks, heads, block]: a device lays the stack's out with
    # the blocks minor, which no DMA of a block's scales can read (one pass over them a call)
    scales = [jnp.swapaxes(a[layer], 1, 2) for a in (pages.k_scale, pages.v_scale)] if pages.int8 else []
    arrays = [pages.k, pages.v] + scales
    bufs = [pltpu.VMEM((2, t.pages) + a.shape[2 if i < 2 else 1 :], a.dtype) for i, a in enumerate(arrays)]
    tile = pl.BlockSpec((None, K, R, hd), lambda b, i, *_: (b, 0, i, 0))
    call = pl.pallas_call(
        functools.partial(_kernel, s=s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(B, nq),
            in_specs=[tile, pl.BlockSpec((None, R, 1), lambda b, i, *_: (b, i, 0))]
            + [pl.BlockSpec(memory_space=pl.ANY)] * len(arrays),
            out_specs=tile,
            scratch_shapes=bufs
            + [
                pltpu.SemaphoreType.DMA((2, len(arrays))),
                pltpu.VMEM((K, R, 128), jnp.float32),
                pltpu.VMEM((K, R, 128), jnp.float32),
                pltpu.VMEM((K, R, hd), jnp.float32),
                pltpu.SMEM((2,), jnp.int32),
            ]
            + ([] if pages.heads_major else [pltpu.VMEM((2, K, t.pages * P, hd), q.dtype)])
            + ([pltpu.VMEM((2, K, 1, t.pages * P), jnp.float32)] if pages.int8 else []),
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        # in order: an item starts the next one's first DMA, and the buffers carry over
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"), vmem_limit_bytes=tiling.VMEM_LIMIT
        ),
        interpret=interpret,
        name="ragged_paged_attention",
    )
    o = call(layer.reshape(1), table.astype(jnp.int32).reshape(-1), first, count, qt, qpos, *arrays)
    o = o.reshape(B, K, Tp, G, hd).transpose(0, 2, 1, 3, 4).reshape(B, Tp, H, hd)
    return o[:, :T]
