"""Prefill a long prompt in fixed-size chunks: consecutive forwards over position ranges, each writing
the cache the next one (and the decode loop) reads, so activation memory is bounded by the chunk.

With `mark_padding`, positions past a row's length become -1, which the split cache never writes
(a padded tail would otherwise overwrite real keys in a ring buffer). The core full-length cache
keeps plain positions: its padded tail lies past the row and is overwritten by decoding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .model import forward, logits_from_hidden


def chunk_positions(B: int, C: int, start, lengths, mark_padding: bool) -> jax.Array:
    pos = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
    return jnp.where(pos < lengths[:, None], pos, -1) if mark_padding else pos


def prefill_chunk(cfg: ModelConfig, weights, tokens, start, lengths, cache, h_last, *,
                  mark_padding: bool, dtype=jnp.bfloat16):
    """One chunk tokens [B, C] at positions start..start+C-1 -> (cache, h_last), where h_last [B, D]
    picks up the hidden state of each row's last prompt token when this chunk holds it."""
    B, C = tokens.shape
    h, cache = forward(cfg, weights, tokens, chunk_positions(B, C, start, lengths, mark_padding), cache, dtype)
    i = lengths - 1 - start
    here = jnp.take_along_axis(h, jnp.clip(i, 0, C - 1)[:, None, None], axis=1)[:, 0]
    return cache, jnp.where(((i >= 0) & (i < C))[:, None], here, h_last)


def logits_chunk(cfg: ModelConfig, weights, tokens, start, lengths, cache, *, mark_padding: bool,
                 dtype=jnp.bfloat16):
    """One chunk of a causal forward through the cache -> (float32 logits [B, C, V], cache)."""
    B, C = tokens.shape
    h, cache = forward(cfg, weights, tokens, chunk_positions(B, C, start, lengths, mark_padding), cache, dtype)
    return logits_from_hidden(cfg, weights, h), cache


def pad_rows(ids, length: int, pad_id: int) -> np.ndarray:
    out = np.full((len(ids), length), pad_id, np.int32)
    for b, x in enumerate(ids):
        out[b, :len(x)] = x
    return out


def run_prefill(chunk_fn, weights, tokens: np.ndarray, lengths, cache, chunk: int, hidden, dtype,
                mark_padding: bool):
    """Host loop over the chunks of tokens [B, T] (T a multiple of `chunk`) -> (cache, h_last [B, D])."""
    B, T = tokens.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    h_last = jnp.zeros((B, hidden), dtype)
    for s in range(0, T, chunk):
        cache, h_last = chunk_fn(weights, jnp.asarray(tokens[:, s:s + chunk]), jnp.int32(s), lengths,
                                 cache, h_last, mark_padding=mark_padding)
    return cache, h_last


def run_logits(chunk_fn, weights, tokens: np.ndarray, lengths, cache, chunk: int, mark_padding: bool,
               consume=None):
    """Causal logits of tokens [B, T] chunk by chunk. `consume(start, logits)` receives each chunk on
    the device (e.g. to reduce it to losses); without it the chunks are gathered to the host."""
    B, T = tokens.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    out = []
    for s in range(0, T, chunk):
        logits, cache = chunk_fn(weights, jnp.asarray(tokens[:, s:s + chunk]), jnp.int32(s), lengths,
                                 cache, mark_padding=mark_padding)
        out.append(consume(s, logits) if consume else np.asarray(logits))
    return out, cache
