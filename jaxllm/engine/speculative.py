"""Speculative decoding inside the decode loop: each cycle drafts up to K tokens per row, verifies
them with one forward of the model over K + 1 positions, and keeps the longest acceptable prefix
plus one token of the model's own, all on the device.

Drafts come from the row's own tokens (n-gram prompt lookup: the latest earlier occurrence of its
last n tokens, longest n first, proposes what followed it) or from a smaller draft model sharing
the tokenizer (K greedy steps over its own KV cache). Both propose deterministically, so the
acceptance rule is the same: a greedy row keeps drafts while they equal the model's argmax; a
sampled row keeps draft d with probability p(d) and on a rejection samples from p with d removed
(renormalized), which leaves the output distribution exactly the model's (the standard rule with
a point-mass proposal). A row whose drafts keep failing stops drafting for a while; a cycle where
no row drafts runs the plain one-token step instead, so text with nothing to look up decodes at
the plain speed.

Rejected drafts leave K/V at positions past the row's new position: the causal mask never shows
them and the row overwrites them next; a sliding layer's table holds `spec_tokens` more positions
than the window (`KVOptions.spec_tokens`), so they never displace keys a later query still sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxllm import pytree
from jaxllm.config.engine import check_method
from jaxllm.config.model import ModelConfig
from jaxllm.engine.sampling import SamplingParams, _row_keys, filtered
from jaxllm.errors import ModelError

PROBE_EVERY = 16  # a row that stopped drafting tries again this many cycles later
MIN_ACCEPT = 0.15  # a row drafts while its running acceptance rate stays at or above this
MAX_BATCH = 4  # speculate while at most this many rows are live (None: at any batch)


@dataclass(frozen=True)
class Speculation:
    """How the decode loop speculates (static: part of what is compiled)."""

    method: str = "ngram"
    k: int = 4  # tokens drafted a cycle
    ngram: tuple[int, int] = (1, 3)  # n-gram lengths looked up, longest first
    draft_cfg: ModelConfig | None = None  # the draft model's configuration (method "draft")
    min_accept: float = MIN_ACCEPT  # 0: rows draft every cycle whatever they accept (a cycle's cost)
    max_batch: int | None = MAX_BATCH  # cycles with more live rows run the plain step

    def __post_init__(self):
        check_method(self.method, self.k)
        lo, hi = self.ngram
        if not 1 <= lo <= hi <= 8:
            raise ModelError(f"n-gram lengths must satisfy 1 <= min <= max <= 8, got {self.ngram}")
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or self.max_batch < 1):
            raise ModelError(f"speculative max batch must be a positive integer or None, got {self.max_batch!r}")
        if (self.method == "draft") != (self.draft_cfg is not None):
            raise ModelError("a draft model is needed for method 'draft', and only there")


@pytree.dataclass
class SpecSlots:
    """What speculation keeps per slot [B, ...]."""

    history: jax.Array  # [B, H] int32: the slot's tokens by position (prompt, then generated)
    rate: jax.Array  # [B] float32: running acceptance rate of its drafts
    idle: jax.Array  # [B] int32: cycles since it last drafted
    stats: jax.Array  # [B, 3] int32: cycles, tokens drafted, drafts accepted (since the core was made)

    @staticmethod
    def empty(batch: int, length: int) -> "SpecSlots":
        return SpecSlots(
            jnp.zeros((batch, length), jnp.int32),
            jnp.ones((batch,), jnp.float32),
            jnp.zeros((batch,), jnp.int32),
            jnp.zeros((batch, 3), jnp.int32),
        )


def write_history(history: jax.Array, rows, positions: jax.Array, tokens: jax.Array) -> jax.Array:
    """history [B, H] <- tokens [P, T] at positions [P, T] of rows [P] (negative positions, and rows
    past the end, are dropped)."""
    P, T = tokens.shape
    H = history.shape[1]
    r = jnp.arange(P, dtype=jnp.int32) if rows is None else rows
    cols = jnp.where((positions >= 0) & (positions < H), positions, H)
    return history.at[jnp.broadcast_to(r[:, None], (P, T)), cols].set(tokens, mode="drop")


# -- drafting -------------------------------------------------------------------------------------
def ngram_draft(history: jax.Array, pos: jax.Array, k: int, ngram: tuple[int, int]):
    """Per row, the k tokens that followed the latest earlier occurrence of its last n tokens
    (history[pos - n + 1 .. pos]), for the longest n in the range that occurs.
    -> (drafts [B, k], how many of them exist [B])."""
    B, H = history.shape
    idx = jnp.arange(H, dtype=jnp.int32)[None, :]
    best = jnp.full((B,), -1, jnp.int32)
    for n in range(ngram[1], ngram[0] - 1, -1):
        ok = (idx >= n - 1) & (idx < pos[:, None]) & (pos[:, None] >= n - 1)
        for m in range(n):  # the token m before each candidate end, against the pattern's
            want = jnp.take_along_axis(history, jnp.maximum(pos - m, 0)[:, None], axis=1)
            ok &= jnp.roll(history, m, axis=1) == want
        end = jnp.max(jnp.where(ok, idx, -1), axis=1)
        best = jnp.where(best < 0, end, best)
    take = jnp.clip(best[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :], 0, H - 1)
    drafts = jnp.take_along_axis(history, take, axis=1)
    return drafts, jnp.where(best >= 0, jnp.clip(pos - best, 0, k), 0).astype(jnp.int32)


# -- acceptance -----------------------------------------------------------------------------------
def accept(
    logits: jax.Array, drafts: jax.Array, n_draft: jax.Array, p: SamplingParams, step: jax.Array, by: str = "bisection"
):
    """logits [B, K + 1, V] of the model at the row's last token and after each draft, drafts [B, K]
    (the first n_draft[b] real). -> (accepted count a [B], the token after them [B]): greedy rows
    keep drafts equal to the argmax; sampled rows keep draft d with probability p(d), and the token
    after is drawn from p with the rejected draft removed (or from p after all K)."""
    B, T, V = logits.shape
    K = T - 1
    valid = jnp.arange(K)[None, :] < n_draft[:, None]
    greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    greedy_ok = (drafts == greedy_tok[:, :K]) & valid
    sampling = p.temperature > 0

    def sampled():
        rep = jax.tree_util.tree_map(lambda x: jnp.repeat(x, T, axis=0), p)
        f = filtered(logits.reshape(B * T, V), rep, by).reshape(B, T, V)  # -inf outside top-k/p
        logp = jax.nn.log_softmax(f, axis=-1)
        keys = jax.vmap(lambda key: jax.random.split(key, 2))(_row_keys(p, step))  # [B, 2]
        u = jax.vmap(lambda key: jax.random.uniform(key, (K,)))(keys[:, 0])
        p_draft = jnp.exp(jnp.take_along_axis(logp[:, :K], drafts[..., None], axis=-1)[..., 0])
        ok = (u < p_draft) & valid
        a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
        at = jnp.take_along_axis(f, a[:, None, None], axis=1)[:, 0]  # [B, V]
        rejected = jnp.take_along_axis(drafts, jnp.minimum(a, K - 1)[:, None], axis=1)[:, 0]
        residual = jnp.where((a < n_draft)[:, None] & (jnp.arange(V)[None, :] == rejected[:, None]), -jnp.inf, at)
        nxt = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys[:, 1], residual).astype(jnp.int32)
        return a, nxt

    a_g = jnp.sum(jnp.cumprod(greedy_ok.astype(jnp.int32), axis=1), axis=1)
    nxt_g = jnp.take_along_axis(greedy_tok, a_g[:, None], axis=1)[:, 0]
    a_s, nxt_s = jax.lax.cond(jnp.any(sampling), sampled, lambda: (a_g, nxt_g))
    return jnp.where(sampling, a_s, a_g), jnp.where(sampling, nxt_s, nxt_g)


def wants_draft(spec: SpecSlots, live: jax.Array, min_accept: float) -> jax.Array:
    """Rows that draft this cycle: live ones whose drafts have been paying, and the others now and
    then, to find out whether they would again."""
    return live & ((spec.rate >= min_accept) | (spec.idle >= PROBE_EVERY))


def worth_verifying(slots: SpecSlots, n_draft: jax.Array, live: jax.Array, spec: Speculation) -> jax.Array:
    """Whether this cycle verifies: a verify forward costs every live row K + 1 positions, and costs
    more over a plain step the more rows there are (a Gemma 3 12B shape on an H100: 1.12x a plain
    step at 8 rows, 1.43x at 32), so it runs when the drafts are expected to add at least
    `min_accept` tokens per live row for each live row (a row's expectation: its running acceptance
    rate, `min_accept` for a probe, times its drafts), and while no more than `max_batch` rows are
    live. One row alone verifies whenever it drafts; in a batch, one row probing among rows with
    nothing to draft does not make them all pay for a verify. (Before both limits, the Qwen3-4B
    server lost half its throughput at 16 clients to drafts accepted a quarter of the time.)"""
    n_live = jnp.sum(live).astype(jnp.float32)
    expected = jnp.sum(jnp.maximum(slots.rate, spec.min_accept) * n_draft.astype(jnp.float32))
    go = jnp.any(n_draft > 0) & (expected >= spec.min_accept * n_live * n_live)
    return go if spec.max_batch is None else go & (n_live <= spec.max_batch)


def update_rate(spec: SpecSlots, drafting: jax.Array, n_draft: jax.Array, a: jax.Array) -> SpecSlots:
    tried = drafting & (n_draft > 0)
    frac = a.astype(jnp.float32) / jnp.maximum(n_draft, 1).astype(jnp.float32)
    rate = jnp.where(tried, 0.7 * spec.rate + 0.3 * frac, spec.rate)
    idle = jnp.where(drafting, 0, spec.idle + 1)
    stats = spec.stats + jnp.stack(
        [tried.astype(jnp.int32), jnp.where(tried, n_draft, 0), jnp.where(tried, a, 0)], axis=1
    )
    return spec.replace(rate=rate, idle=idle, stats=stats)
