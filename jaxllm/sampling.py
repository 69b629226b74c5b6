"""Per-row sampling inside the compiled loop: greedy, temperature, top-k, top-p, seeded.

Each row carries its own parameters and seed, so a request samples the same tokens whether it runs
alone or inside a batch (the server relies on this).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class SamplingParams:
    temperature: jax.Array   # [B] float32; 0 = greedy
    top_k: jax.Array         # [B] int32; 0 = off
    top_p: jax.Array         # [B] float32; 1 = off
    seed: jax.Array          # [B] uint32

    @staticmethod
    def make(batch: int, temperature=0.0, top_k=None, top_p=None, seed=0) -> "SamplingParams":
        def arr(v, dtype):
            return jnp.broadcast_to(jnp.asarray(v, dtype), (batch,))
        return SamplingParams(arr(temperature, jnp.float32), arr(top_k or 0, jnp.int32),
                              arr(1.0 if top_p is None else top_p, jnp.float32), arr(seed, jnp.uint32))


def _sample_rows(logits: jax.Array, p: SamplingParams, step: jax.Array) -> jax.Array:
    V = logits.shape[-1]
    t = jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    srt = jnp.sort(logits / t, axis=-1)[:, ::-1]                               # descending
    rank_ok = jnp.arange(V)[None, :] < jnp.where(p.top_k > 0, p.top_k, V)[:, None]
    probs = jax.nn.softmax(jnp.where(rank_ok, srt, -jnp.inf), axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < p.top_p[:, None]
    cut = jnp.where(rank_ok & keep, srt, -jnp.inf)
    threshold = jnp.min(jnp.where(jnp.isfinite(cut), cut, jnp.inf), axis=-1, keepdims=True)
    scaled = logits / t
    masked = jnp.where(scaled >= threshold, scaled, -jnp.inf)
    steps = jnp.broadcast_to(step, p.seed.shape)      # one step for all rows, or one per row
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(p.seed, steps)
    return jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)


def sample(logits: jax.Array, p: SamplingParams, step: jax.Array) -> jax.Array:
    """logits [B, V] float32 -> tokens [B]; step is a scalar or per row [B]. Sorting is skipped when
    every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drawn = jax.lax.cond(jnp.any(p.temperature > 0), lambda: _sample_rows(logits, p, step),
                         lambda: greedy)
    return jnp.where(p.temperature > 0, drawn, greedy)
