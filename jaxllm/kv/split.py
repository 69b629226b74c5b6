"""The split KV cache for long contexts: sliding layers in a ring buffer of the window size,
global layers in a linear cache (int8 with a scale per token and head, or the compute dtype) read
blockwise with an online softmax.

Both cache types are pytrees whose leaves carry the layer axis first, like the core's cache dicts, so
the layer scan indexes them the same way; `model.attention_block` hands a layer's view of one to its
`update_and_attend` (or, for a layer reading another layer's cache, its `attend`). Tokens at a
negative position are padding: they are never written, so a
right-padded batch cannot push real keys out of a row's ring.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm import pytree
from jaxllm.config.model import KIND_NAMES, AttnSpec, ModelConfig
from jaxllm.errors import ModelError
from jaxllm.kv.blockwise import blockwise_attend, dequantize_kv, linear_loader, quantize_kv, to_store
from jaxllm.kv.linear import gather_rows, init_cache
from jaxllm.ops.xla import KeysFromValues, apply_rope, attend, attention_mask, inv_frequencies, rms_norm

KV_QUANT_MODES = ("auto", "int8", "none")


@dataclass(frozen=True)
class KVOptions:
    """Tunables of the KV cache. `threshold`: the longest max_ctx kept in the core full-length
    compute-dtype cache under kv_quant="auto"; `block`: slots per step of the blockwise attention;
    `prefill_chunk`: tokens per forward when a prompt is prefilled in pieces; `int8_rings`: with an
    int8 split cache, the sliding layers' rings in int8 as well, for batches whose rings would not
    fit in the compute dtype; `store_keys`: global layers whose V is their K (Gemma 4's k_eq_v)
    store their keys as well as their values. With False they store V alone, half those layers'
    cache, and decode attention rebuilds every cached key from it at every step (RMS norm and
    RoPE): on one H200 that attention measured 4x slower at batch 64 and above, and Gemma 4 31B
    decoded 1506 tok/s against 1798 at batch 64 (as fast at batch 1)."""
    threshold: int = 32768
    block: int = 8192
    prefill_chunk: int = 4096
    int8_rings: bool = False      # split cache: sliding-layer rings in int8 too (half the memory)
    store_keys: bool = True       # split cache: k_eq_v global layers store keys (False: rebuilt from V)
    spec_tokens: int = 0          # tokens a speculative cycle may write past a row's position

    def __post_init__(self):
        for name in ("threshold", "block", "prefill_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ModelError(f"KV option {name} must be a positive integer, got {v!r}")
        if not isinstance(self.spec_tokens, int) or self.spec_tokens < 0:
            raise ModelError(f"KV option spec_tokens must be a non-negative integer, got {self.spec_tokens!r}")
        for name in ("int8_rings", "store_keys"):
            if not isinstance(getattr(self, name), bool):
                raise ModelError(f"KV option {name} must be True or False, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class KVLayout:
    split: bool          # ring-buffered sliding layers, blockwise global layers
    int8: bool           # global layers hold int8 K/V with per-token, per-head scales

    @property
    def name(self) -> str:
        if not self.split:
            return "full-length compute-dtype"
        return "split (sliding ring buffer, " + ("int8" if self.int8 else "compute-dtype") + " global)"


def choose_layout(kv_quant: str, max_ctx: int, opts: KVOptions) -> KVLayout:
    if kv_quant not in KV_QUANT_MODES:
        raise ModelError(f"kv_quant must be one of {', '.join(KV_QUANT_MODES)}, got {kv_quant!r}")
    if kv_quant == "int8":
        return KVLayout(split=True, int8=True)
    long = max_ctx > opts.threshold
    return KVLayout(split=long, int8=long and kv_quant == "auto")


def _drop_index(positions: jax.Array, slots: jax.Array, keep: jax.Array, size: int) -> jax.Array:
    """Slot per token, or `size` (out of range, so the scatter drops it) for tokens not written."""
    return jnp.where(keep & (positions >= 0), slots, size)


def _scatter_rows(buf: jax.Array, idx: jax.Array, new: jax.Array) -> jax.Array:
    """buf [B, S, ...] <- new [B, T, ...] at slots idx [B, T]; out-of-range slots are dropped."""
    return jax.vmap(lambda b, i, n: b.at[i].set(to_store(n, b.dtype), mode="drop"))(buf, idx, new)


def _store(put, buf, scale, x):
    """Write x through `put(buffer, values)`: as is, or (scale given) as int8 plus its scales."""
    if scale is None:
        return put(buf, x), None
    xq, s = quantize_kv(x)
    return put(buf, xq), put(scale, s)


@pytree.dataclass
class RingKV:
    """Sliding-window layers: slot = position % W, with W the window (plus a prefill chunk where
    other layers read the ring); `pos` holds each slot's absolute position. With `KVOptions.int8_rings`
    K/V are int8 with a float32 scale per slot and head, as in the global layers."""
    k: jax.Array          # [n, B, W, K, hd] (one layer's view: [B, W, K, hd])
    v: jax.Array
    pos: jax.Array        # [n, B, W] int32, -1 = empty
    k_scale: jax.Array | None = None      # [n, B, W, K] float32, int8 rings only
    v_scale: jax.Array | None = None

    @classmethod
    def zeros(cls, n, batch, size, a: AttnSpec, dtype, int8: bool = False) -> "RingKV":
        shape = (n, batch, size, a.num_kv_heads, a.head_dim)
        pos = jnp.full((n, batch, size), -1, jnp.int32)
        if not int8:
            return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), pos)
        return cls(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), pos,
                   jnp.ones(shape[:-1], jnp.float32), jnp.ones(shape[:-1], jnp.float32))

    def kv(self, dtype) -> tuple[jax.Array, jax.Array]:
        """The ring's keys and values in the compute dtype."""
        return dequantize_kv(self.k, self.k_scale, dtype), dequantize_kv(self.v, self.v_scale, dtype)

    def update_and_attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, k, v, positions, ops):
        if k is None:                     # a layer reading a ring an earlier layer wrote
            return self.attend(cfg, a, k_norm, q, positions), self
        # The chunk attends to the ring as it was before the chunk plus its own keys, so a chunk
        # longer than the window still sees its own earlier tokens; ring slots at or past the
        # chunk's start are stale rewrites and are hidden.
        ring_pos = jnp.where(self.pos < positions[:, :1], self.pos, -1)
        rk, rv = self.kv(q.dtype)
        held = None
        if self.k_scale is not None:      # the chunk's own K/V as the ring will hold them
            held = quantize_kv(k), quantize_kv(v)
            k, v = (dequantize_kv(xq, sc, q.dtype) for xq, sc in held)
        keys = jnp.concatenate([rk, k.astype(rk.dtype)], axis=1)
        vals = jnp.concatenate([rv, v.astype(rv.dtype)], axis=1)
        mask = attention_mask(positions, jnp.concatenate([ring_pos, positions], axis=1), a.window)
        o = attend(q, keys, vals, mask, cfg.query_scale, cfg.attn_softcap)
        return o, self.write(k, v, positions, held)

    def attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, positions, ops=None):
        """For a layer reading a ring an earlier layer of this forward already wrote: correct while
        the ring holds window + T - 1 slots, which `make_cache` gives kinds that have such readers
        (with exactly `window` slots a chunk's early queries would lose keys the chunk overwrote)."""
        mask = attention_mask(positions, self.pos, a.window)
        return attend(q, *self.kv(q.dtype), mask, cfg.query_scale, cfg.attn_softcap)

    def write(self, k, v, positions, held=None) -> "RingKV":
        """Keep each row's last W real tokens of the chunk (distinct slots, so the scatter has no
        duplicate targets). `held`: K and V already quantized, for int8 rings."""
        W = self.k.shape[1]
        last = jnp.max(positions, axis=1, keepdims=True)
        idx = _drop_index(positions, positions % W, positions > last - W, W)

        def put(buf, x):
            return _scatter_rows(buf, idx, x)
        pos = put(self.pos, positions)
        if self.k_scale is None:
            return RingKV(put(self.k, k), put(self.v, v), pos)
        (kq, ks), (vq, vs) = held or (quantize_kv(k), quantize_kv(v))
        return RingKV(put(self.k, kq), put(self.v, vq), pos, put(self.k_scale, ks), put(self.v_scale, vs))


@pytree.dataclass
class BlockKV:
    """Global layers: slot s holds position s; read `block` slots at a time.

    `k_scale`/`v_scale` are None for a compute-dtype cache. With `shared` (Gemma 4's k_eq_v global
    layers, whose keys are the normed, rotated values) only V is stored and keys are rebuilt per
    block from it, halving the cache.
    """
    k: jax.Array | None            # [n, B, S, K, hd] int8 or compute dtype; None when shared
    v: jax.Array
    k_scale: jax.Array | None      # [n, B, S, K] float32
    v_scale: jax.Array | None
    block: int = pytree.static(8192)
    shared: bool = pytree.static(False)

    @classmethod
    def zeros(cls, n, batch, length, a: AttnSpec, dtype, int8: bool, block: int, shared: bool) -> "BlockKV":
        shape = (n, batch, length, a.num_kv_heads, a.head_dim)
        store = jnp.int8 if int8 else dtype

        def scale():
            return jnp.ones(shape[:-1], jnp.float32) if int8 else None
        return cls(None if shared else jnp.zeros(shape, store), jnp.zeros(shape, store),
                   None if shared else scale(), scale(), block=block, shared=shared)

    @property
    def quantized(self) -> bool:
        return self.v_scale is not None

    def write(self, k, v, positions) -> "BlockKV":
        S = self.v.shape[1]
        idx = _drop_index(positions, positions, positions < S, S)
        def put(buf, x):
            return _scatter_rows(buf, idx, x)
        nv, nvs = _store(put, self.v, self.v_scale, v)
        if self.shared:
            return self.replace(v=nv, v_scale=nvs)
        nk, nks = _store(put, self.k, self.k_scale, k)
        return self.replace(k=nk, v=nv, k_scale=nks, v_scale=nvs)

    def loader(self, cfg: ModelConfig, a: AttnSpec, k_norm, dtype):
        if not self.shared:
            return linear_loader(self.k, self.v, self.k_scale, self.v_scale, block=self.block, dtype=dtype)
        base = linear_loader(self.v, self.v, self.v_scale, self.v_scale, block=self.block, dtype=dtype)
        inv_freq = inv_frequencies(a.rope, a.head_dim)

        def load(start):
            _, v, pos = base(start)
            # k_norm(v_norm(x)) == k_norm(x) up to eps: RMS-normalizing an RMS-normalized vector
            # only rescales by (1 + eps)^-1/2, so the stored values give back the keys.
            k = rms_norm(v, k_norm, cfg.norm_eps, cfg.norm_offset) if k_norm is not None else v
            return apply_rope(k, pos, inv_freq), v, pos
        return load

    def update_and_attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, k, v, positions, ops):
        new = self if k is None else self.write(k, v, positions)
        return new.attend(cfg, a, k_norm, q, positions, ops), new

    def attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, positions, ops=None):
        return blockwise_attend(q, positions, self.loader(cfg, a, k_norm, q.dtype), n_slots=self.v.shape[1],
                                block=self.block, scale=cfg.query_scale, softcap=cfg.attn_softcap,
                                window=a.window)


@pytree.dataclass
class StackedLayer:
    """Layer `idx` of a kind's stacked split cache, for one new token per row with the GPU kernels:
    the token is written into the stacks in place and the decode-attention kernel reads the layer
    there. (Slicing the layer out and putting it back would move the whole cache twice a step.)"""
    stack: RingKV | BlockKV
    idx: jax.Array

    def update_and_attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, k, v, positions, ops):
        # The ring is written before it is read: the slot the token takes held position p - W,
        # which a sliding window of W positions no longer sees. k None: written already (by the
        # backend's decode prologue), or a layer reading another layer's cache.
        new = self if k is None else self.write(k, v, positions)
        return new.attend(cfg, a, k_norm, q, positions, ops), new

    def write(self, k, v, positions) -> "StackedLayer":
        c, p = self.stack, positions[:, 0]
        S = c.v.shape[2]
        slot = jnp.where(p >= 0, p % S if isinstance(c, RingKV) else p, S)    # S: dropped
        rows = jnp.arange(p.shape[0])

        def put(buf, x):
            return buf.at[self.idx, rows, slot].set(to_store(x, buf.dtype), mode="drop")

        def store(buf, scale, x):
            return _store(put, buf, scale, x[:, 0])
        if isinstance(c, RingKV):
            (nk, nks), (nv, nvs) = store(c.k, c.k_scale, k), store(c.v, c.v_scale, v)
            return StackedLayer(RingKV(nk, nv, put(c.pos, p), nks, nvs), self.idx)
        nv, nvs = store(c.v, c.v_scale, v)
        if c.shared:
            return StackedLayer(c.replace(v=nv, v_scale=nvs), self.idx)
        nk, nks = store(c.k, c.k_scale, k)
        return StackedLayer(c.replace(k=nk, v=nv, k_scale=nks, v_scale=nvs), self.idx)

    def kernel_stacks(self) -> tuple[dict, str]:
        """The stacks a kernel writes this layer's new token into, and how it picks the slot
        (`kernels.prologue.SLOTS`); `with_stacks` takes them back."""
        c = self.stack
        arrays = {"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale}
        if isinstance(c, RingKV):
            return {**arrays, "slot_pos": c.pos}, "ring"
        return arrays, "drop"

    def with_stacks(self, stacks: dict) -> "StackedLayer":
        stacks = dict(stacks)
        if isinstance(self.stack, RingKV):
            stacks["pos"] = stacks.pop("slot_pos")
        return StackedLayer(self.stack.replace(**stacks), self.idx)

    def attend(self, cfg: ModelConfig, a: AttnSpec, k_norm, q, positions, ops=None):
        c = self.stack
        keys = None
        if isinstance(c, RingKV):
            arrays = {"k": c.k, "v": c.v, "slot_pos": c.pos, "k_scale": c.k_scale, "v_scale": c.v_scale}
        else:
            arrays = {"k": c.k, "v": c.v, "k_scale": c.k_scale, "v_scale": c.v_scale}
            if c.shared:
                keys = KeysFromValues(inv_frequencies(a.rope, a.head_dim), k_norm, cfg.norm_eps, cfg.norm_offset)
        o = ops.stacked_attention(q, arrays, self.idx, positions, scale=cfg.query_scale, softcap=cfg.attn_softcap,
                              window=a.window, keys=keys)
        if o is None:
            o = jax.tree_util.tree_map(lambda x: gather_rows(x[self.idx], None, q.shape[0]), c).attend(
                cfg, a, k_norm, q, positions)
        return o


def layer_view(cache: RingKV | BlockKV, idx: jax.Array, tokens_per_row: int, ops, rows: jax.Array | None = None,
               batch: int | None = None):
    """What a layer's attention works on: the stacks themselves where the backend's decode attention
    reads them in place (`ops.reads_in_place`), else the layer sliced out, of the cache rows `rows`
    (or the first `batch`) where given (put back by the caller)."""
    if ops.reads_in_place(tokens_per_row, rows):
        return StackedLayer(cache, idx)
    return jax.tree_util.tree_map(lambda x: gather_rows(x[idx], rows, batch), cache)


def has_kv_readers(cfg: ModelConfig, kind: int) -> bool:
    """Whether some layer of `kind` attends over another layer's cache instead of its own."""
    return any(k == kind and cfg.kv_source(i) != i for i, k in enumerate(cfg.layer_kinds))


def check_shared_kv(cfg: ModelConfig, kind: int):
    a = cfg.attn[kind]
    if a.k_eq_v and cfg.v_norm and not cfg.qk_norm:
        raise ModelError("k_eq_v with a V norm but no K norm: keys cannot be rebuilt from the stored "
                         "values; use KVOptions(store_keys=True), or kv_quant='none' with max_ctx at or "
                         "below the threshold")
    if a.k_eq_v and has_kv_readers(cfg, kind):
        raise ModelError("k_eq_v layers whose KV cache other layers read are not supported by the split "
                         "KV cache unless they store their keys: use KVOptions(store_keys=True), or kv_quant='none'")


def global_length(length: int, block: int) -> tuple[int, int]:
    """(slots, block) for a global cache of `length` positions: whole blocks, one block if short."""
    if length <= block:
        return length, length
    return -(-length // block) * block, block


def make_cache(cfg: ModelConfig, layout: KVLayout, opts: KVOptions, batch: int, length: int, dtype,
               n_layers=None) -> dict:
    """An empty cache of `layout` for `batch` rows and `length` positions. `n_layers` (kind -> count)
    as in `cache.init_cache`, for families that share KV between layers."""
    if not layout.split:
        return init_cache(cfg, batch, length, dtype, n_layers)
    cache = {}
    for kind in cfg.kinds_used:
        a = cfg.attn[kind]
        n = cfg.cache_layers(kind) if n_layers is None else n_layers[kind]
        if a.window is not None:
            # Layers reading another layer's ring see it after this forward's write, so the ring
            # must still hold the window before a whole prefill chunk: window + chunk - 1 slots.
            # A speculative cycle writes drafts past the row's position that may be rejected: the
            # ring holds them beside the window rather than over keys a later query still sees.
            extra = max(opts.prefill_chunk - 1 if has_kv_readers(cfg, kind) else 0, opts.spec_tokens)
            cache[KIND_NAMES[kind]] = RingKV.zeros(n, batch, min(a.window + extra, length), a, dtype,
                                                   layout.int8 and opts.int8_rings)
        else:
            shared = a.k_eq_v and not opts.store_keys
            if shared:
                check_shared_kv(cfg, kind)
            S, block = global_length(length, opts.block)
            cache[KIND_NAMES[kind]] = BlockKV.zeros(n, batch, S, a, dtype, layout.int8, block, shared)
    return cache


def cache_shapes(cfg: ModelConfig, layout: KVLayout, opts: KVOptions, batch: int, length: int, dtype,
                 n_layers=None):
    """The cache as a pytree of jax.ShapeDtypeStruct (nothing allocated), e.g. to lower a compiled
    step ahead of time or to derive shardings."""
    return jax.eval_shape(lambda: make_cache(cfg, layout, opts, batch, length, dtype, n_layers))
