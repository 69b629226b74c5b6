"""Continuous batching: a fixed set of slots sharing one batch KV cache.

A request is prefilled alone into its slot's rows of the cache, then joins the running decode batch;
every decode step advances all occupied slots at their own positions with their own sampling
parameters. Each slot counts its own sampling step, so a request draws the same tokens whether it
runs alone or next to others (sampling uses fold_in(seed, step)).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .cache import cache_length, init_cache
from .config import ModelConfig
from .engine import bucket
from .generate import is_eos
from .model import forward, logits_from_hidden
from .sampling import SamplingParams, sample


@struct.dataclass
class Slots:
    cache: dict                # KV stacks [n, B, S, K, hd]
    params: SamplingParams     # per-slot sampling parameters [B]
    last: jax.Array            # [B] token to feed next
    pos: jax.Array             # [B] its position
    step: jax.Array            # [B] tokens sampled so far (the sampling step of the next token)
    remaining: jax.Array       # [B] tokens the slot may still sample
    active: jax.Array          # [B] slot holds a request that is still generating
    ignore_eos: jax.Array      # [B] EOS does not end this slot (benchmarks ask for exact lengths)


def init_slots(cfg: ModelConfig, batch: int, length: int, dtype) -> Slots:
    def zeros(dtype=jnp.int32):        # distinct buffers: the whole state is donated
        return jnp.zeros((batch,), dtype)
    params = jax.tree_util.tree_map(jnp.array, SamplingParams.make(batch))
    return Slots(cache=init_cache(cfg, batch, length, dtype), params=params, last=zeros(), pos=zeros(),
                 step=zeros(), remaining=zeros(), active=zeros(bool), ignore_eos=zeros(bool))


def _row(tree, b):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, b, 1, axis=0), tree)


def _set_row(tree, b, row):
    return jax.tree_util.tree_map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, b, axis=0),
                                  tree, row)


def _cache_row(cache, b):
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_slice_in_dim(a, b, 1, axis=1), cache)


def _set_cache_row(cache, b, row):
    return jax.tree_util.tree_map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, b, axis=1),
                                  cache, row)


def prefill_slot(cfg: ModelConfig, weights, slots: Slots, b, tokens, length, params: SamplingParams,
                 max_new, ignore_eos, dtype=jnp.bfloat16):
    """Prefill one right-padded prompt tokens [1, T] (real length `length`) into slot b and sample
    its first token. -> (slots, first token [1])."""
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None, :]
    h, row_cache = forward(cfg, weights, tokens, positions, _cache_row(slots.cache, b), dtype)
    h_last = jax.lax.dynamic_slice_in_dim(h, length - 1, 1, axis=1)[:, 0]
    tok = sample(logits_from_hidden(cfg, weights, h_last), params, jnp.int32(0))
    ignore = jnp.full((1,), ignore_eos, bool)
    live = (ignore | ~is_eos(tok, cfg.eos_ids)) & (max_new > 1)
    one = jnp.ones((1,), jnp.int32)
    slots = slots.replace(
        cache=_set_cache_row(slots.cache, b, row_cache),
        params=_set_row(slots.params, b, params),
        last=_set_row(slots.last, b, tok), pos=_set_row(slots.pos, b, length * one),
        step=_set_row(slots.step, b, one), remaining=_set_row(slots.remaining, b, (max_new - 1) * one),
        active=_set_row(slots.active, b, live), ignore_eos=_set_row(slots.ignore_eos, b, ignore))
    return slots, tok


def decode_block(cfg: ModelConfig, weights, slots: Slots, n_steps: int, span: int, dtype=jnp.bfloat16):
    """n_steps decode steps over every slot on the device, attending over the first `span` cache
    positions only (the caller keeps every active slot's positions below it): short requests then
    do not pay for reading the whole --max-model-len cache at every step.

    -> (slots, tokens [B, n_steps], emitted [B, n_steps]); emitted marks the tokens an active slot
    sampled. A slot stops on EOS or when its token budget is spent; idle slots compute garbage that
    lands only in their own cache rows, at positions a later request writes before it reads them.
    """
    full = slots.cache
    if span < cache_length(full):
        slots = slots.replace(cache=jax.tree_util.tree_map(lambda a: a[:, :, :span], full))

    def body(s: Slots, _):
        h, cache = forward(cfg, weights, s.last[:, None], s.pos[:, None], s.cache, dtype)
        tok = sample(logits_from_hidden(cfg, weights, h[:, 0]), s.params, s.step)
        live = s.active
        inc = live.astype(jnp.int32)
        remaining = s.remaining - inc
        active = live & (s.ignore_eos | ~is_eos(tok, cfg.eos_ids)) & (remaining > 0)
        s = s.replace(cache=cache, last=jnp.where(live, tok, s.last), pos=s.pos + inc,
                      step=s.step + inc, remaining=remaining, active=active)
        return s, (tok, live)

    slots, (toks, emitted) = jax.lax.scan(body, slots, None, length=n_steps)
    if span < cache_length(full):
        slots = slots.replace(cache=jax.tree_util.tree_map(
            lambda a, v: jax.lax.dynamic_update_slice_in_dim(a, v, 0, axis=2), full, slots.cache))
    return slots, toks.T, emitted.T


def release_slot(slots: Slots, b) -> Slots:
    """Stop a slot early (stop string, disconnect, timeout); its cache rows are simply reused."""
    return slots.replace(active=slots.active.at[b].set(False))


@dataclass
class SlotBatch:
    """The compiled slot functions bound to one engine's model, plus the device state they update."""
    cfg: ModelConfig
    weights: dict
    dtype: object
    batch: int
    length: int
    n_steps: int = 4

    def __post_init__(self):
        self.reset()
        self._prefill = jax.jit(partial(prefill_slot, self.cfg, dtype=self.dtype), donate_argnames=("slots",))
        self._decode = jax.jit(partial(decode_block, self.cfg, dtype=self.dtype),
                               static_argnames=("n_steps", "span"), donate_argnames=("slots",))
        self._release = jax.jit(release_slot, donate_argnames=("slots",))

    @classmethod
    def for_engine(cls, engine, batch: int, length: int, n_steps: int = 4) -> "SlotBatch":
        return cls(engine.cfg, engine.weights, engine.dtype, batch, length, n_steps)

    def prefill(self, b: int, prompt_ids: list[int], max_new: int, temperature=0.0, top_k=None,
                top_p=None, seed=0, ignore_eos=False) -> int:
        """Start a request in slot b; returns its first sampled token."""
        n = len(prompt_ids)
        T = min(bucket(n), self.length)
        tokens = np.full((1, T), self.cfg.pad_id, np.int32)
        tokens[0, :n] = prompt_ids
        params = SamplingParams.make(1, temperature, top_k, top_p, seed)
        self.slots, tok = self._prefill(self.weights, self.slots, jnp.int32(b), jnp.asarray(tokens),
                                        jnp.int32(n), params, jnp.int32(max_new), jnp.bool_(ignore_eos))
        self.next_pos[b], self.busy[b] = n, True
        return int(tok[0])

    def decode(self) -> tuple[np.ndarray, np.ndarray]:
        """One block of decode steps -> (tokens [B, n_steps], emitted [B, n_steps]) on the host."""
        self.slots, toks, emitted = self._decode(self.weights, self.slots, n_steps=self.n_steps,
                                                 span=self.span())
        toks, emitted = jax.device_get((toks, emitted))
        self.next_pos += emitted.sum(axis=1)
        return toks, emitted

    def span(self) -> int:
        """Cache positions the next block must see: past every busy slot's last write, bucketed so
        that few spans get compiled."""
        need = int(self.next_pos[self.busy].max(initial=0)) + self.n_steps
        return min(bucket(need, lo=64), self.length)

    def warmup(self):
        """Compile the smallest prefill and the decode block of every span before serving, so that
        no request waits for a compile of the decode step."""
        self.prefill(0, [self.cfg.pad_id], 1)
        self.release(0)
        span = min(64, self.length)
        while True:
            self.slots, _, _ = self._decode(self.weights, self.slots, n_steps=self.n_steps, span=span)
            if span >= self.length:
                break
            span = min(2 * span, self.length)
        jax.block_until_ready(self.slots)

    def reset(self):
        """Fresh device state (also after a failed call left the donated state unusable)."""
        self.slots = init_slots(self.cfg, self.batch, self.length, self.dtype)
        self.next_pos = np.zeros(self.batch, np.int64)     # host mirror: each slot's next position
        self.busy = np.zeros(self.batch, bool)

    def release(self, b: int):
        self.slots = self._release(self.slots, jnp.int32(b))
        self.busy[b] = False

