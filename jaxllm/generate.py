"""Prefill, one decode step, and the fused on-device decode loop.

The loop is a single `lax.while_loop`: sampling, EOS checks and the token buffer all live on the
device, so the host only launches it and reads the tokens back at the end.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from .config import ModelConfig
from .model import forward, logits_from_hidden
from .sampling import SamplingParams, sample


@struct.dataclass
class DecodeState:
    cache: dict
    tokens: jax.Array      # [B, N] generated tokens (N = the largest max_new of the batch)
    last: jax.Array        # [B] the token to feed next
    pos: jax.Array         # [B] its position
    done: jax.Array        # [B] row has finished (EOS or its max_new)
    n_new: jax.Array       # [B] tokens generated so far
    max_new: jax.Array     # [B] per-row limit
    step: jax.Array        # scalar: loop iteration


def is_eos(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=-1)


def prefill(cfg: ModelConfig, weights, tokens, lengths, cache, params: SamplingParams,
            max_new, n_out: int, dtype=jnp.bfloat16):
    """Run the whole (right-padded) prompt batch in one forward and sample each row's first token."""
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h, cache = forward(cfg, weights, tokens, positions, cache, dtype)
    h_last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return begin_decode(cfg, weights, h_last, lengths, cache, params, max_new, n_out)


def begin_decode(cfg: ModelConfig, weights, h_last, lengths, cache, params: SamplingParams,
                 max_new, n_out: int):
    """Sample each row's first token from the hidden state of its last prompt token [B, D]."""
    B = h_last.shape[0]
    logits = logits_from_hidden(cfg, weights, h_last)
    tok = sample(logits, params, jnp.int32(0))
    done = is_eos(tok, cfg.eos_ids) | (max_new <= 1)
    out = jnp.zeros((B, n_out), jnp.int32).at[:, 0].set(tok)
    return DecodeState(cache=cache, tokens=out, last=tok, pos=lengths.astype(jnp.int32), done=done,
                       n_new=jnp.ones((B,), jnp.int32), max_new=max_new.astype(jnp.int32),
                       step=jnp.int32(1)), logits


def decode_step(cfg: ModelConfig, weights, tokens, pos, cache, dtype=jnp.bfloat16):
    """One token per row at positions pos [B] -> logits [B, V] and the updated cache."""
    h, cache = forward(cfg, weights, tokens[:, None], pos[:, None], cache, dtype)
    return logits_from_hidden(cfg, weights, h[:, 0]), cache


def advance(cfg: ModelConfig, state: DecodeState, logits, params: SamplingParams) -> DecodeState:
    """Sample from this step's logits and fold the token into the state (rows already done keep still)."""
    tok = sample(logits, params, state.step)
    live = ~state.done
    tokens = state.tokens.at[:, state.step].set(jnp.where(live, tok, 0))
    n_new = state.n_new + live.astype(jnp.int32)
    done = state.done | (live & (is_eos(tok, cfg.eos_ids) | (n_new >= state.max_new)))
    return state.replace(tokens=tokens, last=jnp.where(live, tok, state.last),
                         pos=state.pos + live.astype(jnp.int32), done=done, n_new=n_new,
                         step=state.step + 1)


def decode_loop(cfg: ModelConfig, weights, state: DecodeState, params: SamplingParams,
                dtype=jnp.bfloat16) -> DecodeState:
    """Decode until every row is done or the token buffer is full, entirely on the device."""
    n_out = state.tokens.shape[1]

    def cond(s):
        return (s.step < n_out) & ~jnp.all(s.done)

    def body(s):
        logits, cache = decode_step(cfg, weights, s.last, s.pos, s.cache, dtype)
        return advance(cfg, s.replace(cache=cache), logits, params)

    return jax.lax.while_loop(cond, body, state)
