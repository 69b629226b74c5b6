"""Paged KV memory: each attention kind keeps its keys and values in a pool of fixed-size blocks,
and every sequence (a row of the engine's slot table) names the blocks it uses in a block table.

A pool is a stack over the kind's layers, [layers, blocks, block_size, KV heads, head_dim] (int8
pools carry a float32 scale per token and head beside it, [layers, blocks, block_size, KV heads]).
Block 0 is never handed out: table entries that name no block point at it, and nothing is
written there (a token is written only at a non-negative position, into a block its row holds).

Position p of a row lies in its logical block j = p // block_size, at table column j % width. A
global kind's table is as wide as the longest sequence, so a column holds one logical block; a
sliding kind's holds only the window and what one call writes past it (`table_width`), so its
columns are reused as the row advances, a ring of blocks: the host gives each new logical block a
fresh block (and lets the one it replaces go to the prefix cache), or a lockstep batch that never
returns to the host keeps writing the same blocks. Attention reads logical blocks and masks by
the positions they stand for, causal and within the window, so a column that holds a newer block
than the one read is always masked: only what the row wrote at a position can be seen there.

`PagedCache` is what the model's forward works on: the pools of every kind and the tables of the
rows in the batch. A layer's view (`LayerKV`) writes the step's keys and values and attends over its
row's blocks, through the backend's paged attention where it has one, else XLA's blockwise loop
(`kv.blockwise`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import pytree
from jaxllm.config.kv import KVOptions
from jaxllm.config.model import KIND_NAMES, ModelConfig
from jaxllm.errors import ModelError
from jaxllm.kv.blockwise import blockwise_attend, dequantize_kv, quantize_kv, to_store
from jaxllm.kv.options import KVLayout
from jaxllm.ops.xla import KeysFromValues, apply_rope, rms_norm

NULL_BLOCK = 0


@dataclass(frozen=True)
class KindSpec:
    """One attention kind's pool in one model: its layers that keep KV, their heads and storage."""

    name: str  # "sliding" or "global"
    layers: int
    kv_heads: int
    head_dim: int
    window: int | None
    int8: bool
    keys_from_values: bool  # k_eq_v layers storing V alone (`KVOptions.store_keys` False)

    def block_bytes(self, block_size: int, itemsize: int) -> int:
        """Bytes one block of this kind takes over all its layers."""
        per_token = self.kv_heads * (self.head_dim * (1 if self.int8 else itemsize) + (4 if self.int8 else 0))
        return self.layers * block_size * per_token * (1 if self.keys_from_values else 2)


def kind_specs(cfg: ModelConfig, layout: KVLayout, opts: KVOptions) -> list[KindSpec]:
    """The pools `cfg` needs under `layout`: one per attention kind whose layers keep KV."""
    out = []
    for kind in cfg.kinds_used:
        a = cfg.attn[kind]
        n = cfg.cache_layers(kind)
        if not n:
            continue
        sliding = a.window is not None
        shared = a.k_eq_v and not opts.store_keys and not sliding
        if shared:
            check_keys_from_values(cfg, kind)
        out.append(
            KindSpec(
                KIND_NAMES[kind],
                n,
                a.num_kv_heads,
                a.head_dim,
                a.window,
                layout.int8_sliding if sliding else layout.int8,
                shared,
            )
        )
    return out


def check_keys_from_values(cfg: ModelConfig, kind: int):
    a = cfg.attn[kind]
    if cfg.v_norm and not cfg.qk_norm:
        raise ModelError(
            "k_eq_v with a V norm but no K norm: keys cannot be rebuilt from the stored "
            "values; use KVOptions(store_keys=True)"
        )
    if any(k == kind and cfg.kv_source(i) != i for i, k in enumerate(cfg.layer_kinds)) and a.k_eq_v:
        raise ModelError(
            "k_eq_v layers whose KV other layers read must store their keys: use KVOptions(store_keys=True)"
        )


def table_width(window: int | None, block_size: int, max_len: int, span: int) -> int:
    """Columns of a kind's block table for sequences of up to `max_len` positions: every logical
    block for a global kind; for a sliding one, the blocks its window covers (from the first
    position a query still sees) plus those a call writes past a row's lowest position (`span`,
    at least a token), at most the global width."""
    full = -(-max_len // block_size)
    if window is None:
        return full
    return min(full, -(-(window - 1 + max(span, 1)) // block_size) + 1)


@pytree.dataclass
class KVPool:
    """One attention kind's blocks over its layers (see the module's docstring). `k` is None where
    keys are rebuilt from the values (`KindSpec.keys_from_values`); the scales are None unless int8.
    `read`: positions a step of XLA's attention reads."""

    k: jax.Array | None
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    read: int = pytree.static(1024)

    @classmethod
    def zeros(cls, spec: KindSpec, num_blocks: int, block_size: int, dtype, read: int) -> "KVPool":
        """`dtype`: what a compute-dtype pool stores (the backend's `kv_dtype`)."""
        shape = (spec.layers, num_blocks, block_size, spec.kv_heads, spec.head_dim)
        store = jnp.int8 if spec.int8 else dtype

        def scale():
            return jnp.ones(shape[:-1], jnp.float32) if spec.int8 else None

        shared = spec.keys_from_values
        return cls(
            None if shared else jnp.zeros(shape, store),
            jnp.zeros(shape, store),
            None if shared else scale(),
            scale(),
            read=read,
        )

    @property
    def block_size(self) -> int:
        return self.v.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.v.shape[1]

    @property
    def keys_from_values(self) -> bool:
        return self.k is None


@pytree.dataclass
class LayerKV:
    """Layer `idx` of a kind's pool as the rows of a forward see it: `table` [B, width] their
    blocks. Writes go into the pool in place (a scatter XLA updates in place; slicing the layer out
    and putting it back would move every layer twice a step)."""

    pool: KVPool
    idx: jax.Array
    table: jax.Array

    @property
    def keys_from_values(self) -> bool:
        return self.pool.keys_from_values

    def blocks_at(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(block, offset) [B, T] of each position; block past the pool (dropped by a scatter)
        for a negative position."""
        P, M = self.pool.block_size, self.table.shape[1]
        col = jnp.where(positions >= 0, positions // P, 0) % M
        blk = jnp.take_along_axis(self.table, col, axis=1)
        return jnp.where(positions >= 0, blk, self.pool.num_blocks), jnp.where(positions >= 0, positions % P, 0)

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> "LayerKV":
        """k/v [B, T, K, hd] at positions [B, T]; negative positions are not written."""
        blk, off = self.blocks_at(positions)
        pool = self.pool

        def put(buf, x):
            return buf.at[self.idx, blk, off].set(to_store(x, buf.dtype), mode="drop")

        def store(buf, scale, x):
            if scale is None:
                return put(buf, x), None
            xq, s = quantize_kv(x)
            return put(buf, xq), put(scale, s)

        nv, nvs = store(pool.v, pool.v_scale, v)
        if pool.keys_from_values:
            return self.replace(pool=pool.replace(v=nv, v_scale=nvs))
        nk, nks = store(pool.k, pool.k_scale, k)
        return self.replace(pool=pool.replace(k=nk, v=nv, k_scale=nks, v_scale=nvs))

    def attend(
        self,
        q: jax.Array,
        positions: jax.Array,
        ops,
        *,
        scale: float,
        softcap,
        window,
        keys: KeysFromValues | None = None,
    ) -> jax.Array:
        """Attention of q [B, T, H, hd] at positions [B, T] over the row's blocks: the backend's
        paged attention where it has one, else XLA's blockwise loop. `keys`: how keys are rebuilt
        from the stored values, for a pool that keeps no keys."""
        o = ops.paged_attention(q, self, positions, scale=scale, softcap=softcap, window=window, keys=keys)
        if o is not None:
            return o
        P, M = self.pool.block_size, self.table.shape[1]
        read = min(self.pool.read, P * M)
        return blockwise_attend(
            q, positions, self.loader(q.dtype, read, keys), block=read, scale=scale, softcap=softcap, window=window
        )

    def loader(self, dtype, read: int, keys: KeysFromValues | None):
        """load(start) -> (k, v [B, read, K, hd] in `dtype`, positions [B, read]) of logical positions
        start.. of every row, gathered from its blocks."""
        pool, table = self.pool, self.table
        P, M = pool.block_size, table.shape[1]
        B, r = table.shape[0], read // P

        def load(start):
            cols = (start // P + jnp.arange(r, dtype=jnp.int32)) % M
            blocks = table[:, cols]  # [B, r]

            def gather(a):
                if a is None:
                    return None
                x = a[self.idx, blocks]  # [B, r, P, ...]
                return x.reshape(B, r * P, *x.shape[3:])

            pos = jnp.broadcast_to(start + jnp.arange(read, dtype=jnp.int32), (B, read))
            v = dequantize_kv(gather(pool.v), gather(pool.v_scale), dtype)
            if keys is None:
                k = dequantize_kv(gather(pool.k), gather(pool.k_scale), dtype)
            else:
                k = rebuild_keys(v, pos, keys)
            return k, v, pos

        return load

    def arrays(self) -> dict:
        """The pool's arrays a kernel reads or writes in place (those it has)."""
        p = self.pool
        return {
            n: a for n, a in (("k", p.k), ("v", p.v), ("k_scale", p.k_scale), ("v_scale", p.v_scale)) if a is not None
        }

    def with_arrays(self, arrays: dict) -> "LayerKV":
        return self.replace(pool=self.pool.replace(**arrays))


def rebuild_keys(v: jax.Array, positions: jax.Array, keys: KeysFromValues) -> jax.Array:
    """Keys of stored values v [B, S, K, hd] at positions [B, S]: k_norm(v_norm(x)) == k_norm(x)
    up to eps (RMS-normalizing an RMS-normalized vector only rescales it by (1 + eps)^-1/2), so the
    stored values, normed and rotated, give back the keys."""
    k = v if keys.norm_w is None else rms_norm(v, keys.norm_w, keys.eps, keys.offset)
    return apply_rope(k, positions, keys.inv_freq)


@pytree.dataclass
class PagedCache:
    """What a forward works on: every kind's pool (by kind name) and the block tables of the
    forward's rows ({kind name: [B, width]})."""

    pools: dict
    tables: dict

    def layer(self, name: str, idx) -> LayerKV:
        return LayerKV(self.pools[name], idx, self.tables[name])

    def with_layer(self, name: str, layer: LayerKV) -> "PagedCache":
        return self.replace(pools={**self.pools, name: layer.pool})


def make_pools(specs: list[KindSpec], blocks: dict, block_size: int, dtype, read: int) -> dict:
    """Zeroed pools: {kind name: KVPool of blocks[name] blocks}."""
    return {s.name: KVPool.zeros(s, blocks[s.name], block_size, dtype, read) for s in specs}


def copy_blocks(pools: dict, copies: dict) -> dict:
    """Pools with block dst[i] <- block src[i] of every layer, copies {kind name: (src [F], dst
    [F])}: a dst past the pool is no copy. Under tensor parallelism the blocks keep their heads'
    sharding."""
    out = dict(pools)
    for name, (src, dst) in copies.items():

        def leaf(x):
            N = x.shape[1]
            return x.at[:, dst].set(jnp.take(x, jnp.clip(src, 0, N - 1), axis=1), mode="drop")

        out[name] = jax.tree_util.tree_map(leaf, pools[name])
    return out


def static_tables(widths: dict, rows: int) -> dict:
    """Block tables {kind: [rows, width]} of a lockstep batch: row b holds blocks 1 + b * width ..,
    its own for its whole run (block 0 is the null block)."""
    return {n: (1 + np.arange(rows * w, dtype=np.int32)).reshape(rows, w) for n, w in widths.items()}
