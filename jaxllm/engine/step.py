"""One step of every live slot, as `core.decode` loops over it: the forward that feeds each slot its
last token (`step_forward`), the sampling that draws each slot's next token with its own rules,
penalties and mask and advances the slot table (`step_advance`), both in one (`decode_step`), and
with speculation the cycle that verifies drafted tokens in one forward, accepting some of them and
drawing one more (`spec_cycle`). A constrained step runs its forward and its sampling as two
calls (`core.decode_forward`, `core.decode_sample`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.model import ModelConfig
from jaxllm.engine.sampling import LogProbs, TokenRules, apply_rules, mask_tokens, penalize, sample
from jaxllm.engine.sampling import logprobs as _lp
from jaxllm.engine.slots import Slots, State
from jaxllm.engine.speculative import (
    Speculation,
    accept,
    ngram_draft,
    update_rate,
    wants_draft,
    worth_verifying,
    write_history,
)
from jaxllm.kv.paged import PagedCache
from jaxllm.model.forward import forward, logits_from_hidden


def is_eos(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[..., None] == jnp.asarray(eos_ids, jnp.int32), axis=-1)


def ends_answer(tok: jax.Array, eos_ids: tuple[int, ...], ignore_eos: jax.Array, rules: TokenRules | None):
    """tok [B] or [B, T]: the tokens that end their row's answer: EOS (unless the row ignores it)
    and the row's stop token ids."""
    lead = (slice(None),) + (None,) * (tok.ndim - 1)
    end = ~ignore_eos[lead] & is_eos(tok, eos_ids)
    if rules is None:
        return end
    return end | jnp.any(tok[..., None] == rules.stop_ids[lead], axis=-1)


def model_weights(weights, spec: Speculation | None):
    """(the model's weights, the draft model's or None) of what the engine passes."""
    return tuple(weights) if spec is not None and spec.draft_cfg is not None else (weights, None)


def _sampling_logits(eos_ids, logits, sl: Slots, drafts=None):
    """The logits [B, V] that sampling sees: the slots' rules (`apply_rules`: logit_bias,
    min_tokens), then their penalties; rows without either get theirs back exactly. With drafts
    [B, K], logits [B, K + 1, V] of a verify forward, position j the slot's sampling step + j."""
    if sl.rules is not None and drafts is None:
        logits = apply_rules(logits, sl.rules, sl.step, eos_ids, sl.ignore_eos)
    elif sl.rules is not None:
        B, T, V = logits.shape
        rep = jax.tree_util.tree_map(lambda a: jnp.repeat(a, T, axis=0), sl.rules)
        steps = (sl.step[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]).reshape(-1)
        logits = apply_rules(logits.reshape(B * T, V), rep, steps, eos_ids, jnp.repeat(sl.ignore_eos, T)).reshape(
            B, T, V
        )
    return _penalized(logits, sl, drafts)


def _penalized(logits, sl: Slots, drafts=None):
    """The logits [B, V] with the slots' penalties (rows without penalties get theirs back exactly);
    with drafts [B, K], logits [B, K + 1, V] of a verify forward, position j counting drafts[:, :j]
    as generated (built only when a live slot has a penalty: it is K + 1 times the step's counts)."""
    if sl.counts is None:
        return logits
    if drafts is None:
        return penalize(logits, sl.penalties, sl.counts, sl.in_prompt)
    on = sl.penalties.any_on(sl.active)
    B, T, V = logits.shape

    def each_position():
        fed = jnp.cumsum(jax.nn.one_hot(drafts, V, dtype=jnp.int32), axis=1)  # [B, K, V]
        counts = sl.counts[:, None] + jnp.pad(fed, ((0, 0), (1, 0), (0, 0)))
        rep = jax.tree_util.tree_map(lambda a: jnp.repeat(a, T, axis=0), sl.penalties)
        return penalize(
            logits.reshape(B * T, V), rep, counts.reshape(B * T, V), jnp.repeat(sl.in_prompt, T, axis=0)
        ).reshape(B, T, V)

    return jax.lax.cond(on, each_position, lambda: logits)


def decode_step(cfg: ModelConfig, weights, state: State, ops, dtype=jnp.bfloat16, allowed=None, greedy: bool = False):
    """One token for every live slot (among the tokens `allowed` [B, ceil(V / 32)] lets each take,
    where given; `greedy`: every live slot's temperature is 0) -> (state, sampled tokens [B], live
    [B], float32 logits [B, V])."""
    state, logits = step_forward(cfg, weights, state, ops, dtype)
    state, tok, live = step_advance(cfg, state, logits, ops, allowed, greedy)
    return state, tok, live, logits


def step_forward(cfg: ModelConfig, weights, state: State, ops, dtype=jnp.bfloat16):
    """A decode step's forward: each live slot's last token fed at its position, its keys and
    values written there -> (state, float32 logits [B, V]). Run twice, it writes the same values."""
    sl = state.slots
    pos = jnp.where(sl.active, sl.pos, -1)
    h, cache = forward(cfg, weights, sl.last[:, None], pos[:, None], state.cache, ops, dtype)
    return state.replace(cache=cache), logits_from_hidden(cfg, weights, h[:, 0], ops)


def draft_view(state: State) -> PagedCache:
    """The draft model's pools under the rows' block tables (its blocks are the model's)."""
    return PagedCache(state.draft_cache, state.cache.tables)


def step_advance(cfg: ModelConfig, state: State, logits, ops, allowed=None, greedy: bool = False):
    """A decode step's sampling from its forward's logits [B, V]: each live slot's token (its rules,
    penalties and `allowed` mask applied; `greedy`: every live slot's temperature is 0), and the slot
    table advanced -> (state, tokens [B], live [B])."""
    sl = state.slots
    live = sl.active
    tok = sample(
        mask_tokens(_sampling_logits(cfg.eos_ids, logits, sl), allowed), sl.params, sl.step, ops.top_p_by, greedy
    )
    inc = live.astype(jnp.int32)
    remaining = sl.remaining - inc
    active = live & ~ends_answer(tok, cfg.eos_ids, sl.ignore_eos, sl.rules) & (remaining > 0)
    slots = sl.replace(
        last=jnp.where(live, tok, sl.last), pos=sl.pos + inc, step=sl.step + inc, remaining=remaining, active=active
    )
    if sl.counts is not None:
        slots = slots.replace(counts=sl.counts.at[jnp.arange(tok.shape[0]), tok].add(inc))
    if sl.spec is not None:
        hist = write_history(sl.spec.history, None, jnp.where(live, sl.pos + 1, -1)[:, None], tok[:, None])
        slots = slots.replace(spec=sl.spec.replace(history=hist, idle=sl.spec.idle + 1))
    return state.replace(slots=slots), tok, live


def spec_cycle(
    cfg: ModelConfig,
    weights,
    state: State,
    spec: Speculation,
    ops,
    dtype=jnp.bfloat16,
    n_logprobs: int = 0,
    allowed=None,
):
    """One speculative cycle for every live slot (or the plain step where drafting would not pay)
    -> (state, new tokens [B, K + 1], how many of them each row made [B], their LogProbs [B, K + 1]
    with the top n_logprobs, or None). A row that `allowed` masks (a grammar's, for its next token
    only) does not draft: it takes one token, sampled among those its mask allows."""
    weights, draft = model_weights(weights, spec)
    sl = state.slots
    live, K = sl.active, spec.k
    B = live.shape[0]
    drafting = wants_draft(sl.spec, live, spec.min_accept) & (sl.remaining > 1)
    if allowed is not None:
        drafting &= jnp.all(allowed == jnp.uint32(0xFFFFFFFF), axis=-1)

    def plain(state):
        state, tok, live, logits = decode_step(cfg, weights, state, ops, dtype, allowed)
        if draft is not None:  # the draft cache learns the token the model was fed
            _, dview = forward(
                spec.draft_cfg,
                draft,
                sl.last[:, None],
                jnp.where(live, sl.pos, -1)[:, None],
                draft_view(state),
                ops,
                dtype,
            )
            state = state.replace(draft_cache=dview.pools)
        new = jnp.zeros((B, K + 1), jnp.int32).at[:, 0].set(tok)
        lp = None
        if n_logprobs:
            lp = jax.tree_util.tree_map(
                lambda z, v: z.at[:, 0].set(v), LogProbs.zeros((B, K + 1), n_logprobs), _lp(logits, tok, n_logprobs)
            )
        return state, new, live.astype(jnp.int32), lp

    def verify(state, drafts, n_draft):
        j = jnp.arange(K + 1, dtype=jnp.int32)[None, :]
        tokens = jnp.concatenate([sl.last[:, None], drafts], axis=1)
        positions = jnp.where(live[:, None] & (j <= n_draft[:, None]), sl.pos[:, None] + j, -1)
        h, cache = forward(cfg, weights, tokens, positions, state.cache, ops, dtype)
        logits = logits_from_hidden(cfg, weights, h, ops)
        scores = _sampling_logits(cfg.eos_ids, logits, sl, drafts)
        if allowed is not None:  # a masked row drafted nothing: its one token comes from position 0
            scores = scores.at[:, 0].set(mask_tokens(scores[:, 0], allowed))
        a, nxt = accept(scores, drafts, n_draft, sl.params, sl.step, ops.top_p_by)
        new = jnp.where(j < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), 0)
        new = jnp.where(j == a[:, None], nxt[:, None], new)
        n_new = jnp.minimum(a + 1, sl.remaining)
        eos = (j < n_new[:, None]) & ends_answer(new, cfg.eos_ids, sl.ignore_eos, sl.rules)
        n_new = jnp.where(jnp.any(eos, 1), jnp.argmax(eos, 1) + 1, n_new)
        n_new = jnp.where(live, n_new, 0)
        last = jnp.take_along_axis(new, jnp.maximum(n_new - 1, 0)[:, None], axis=1)[:, 0]
        remaining = sl.remaining - n_new
        hist = write_history(sl.spec.history, None, jnp.where(j < n_new[:, None], sl.pos[:, None] + 1 + j, -1), new)
        slots = sl.replace(
            last=jnp.where(live, last, sl.last),
            pos=sl.pos + n_new,
            step=sl.step + n_new,
            remaining=remaining,
            active=live & ~jnp.any(eos, 1) & (remaining > 0),
            spec=update_rate(sl.spec.replace(history=hist), drafting, n_draft, a),
        )
        if sl.counts is not None:
            slots = slots.replace(
                counts=sl.counts.at[jnp.arange(B)[:, None], new].add((j < n_new[:, None]).astype(jnp.int32))
            )
        lp = _lp(logits, new, n_logprobs) if n_logprobs else None
        return state.replace(cache=cache, slots=slots), new, n_new, lp

    if draft is None:  # n-gram lookup is cheap: look first, verify where something matched
        drafts, n_draft = ngram_draft(sl.spec.history, sl.pos, K, spec.ngram)
        n_draft = jnp.where(drafting, jnp.minimum(n_draft, sl.remaining - 1), 0)
        go = worth_verifying(sl.spec, n_draft, live, spec)
        return jax.lax.cond(go, lambda st: verify(st, drafts, n_draft), plain, state)

    def with_draft_model(state):
        def step(carry, j):  # K greedy proposals, and the last one fed too (its K/V kept)
            tok, dcache = carry
            pos = jnp.where(live, sl.pos + j, -1)
            h, dcache = forward(spec.draft_cfg, draft, tok[:, None], pos[:, None], dcache, ops, dtype)
            nxt = jnp.argmax(logits_from_hidden(spec.draft_cfg, draft, h[:, 0], ops), axis=-1).astype(jnp.int32)
            return (nxt, dcache), nxt

        (_, dview), props = jax.lax.scan(step, (sl.last, draft_view(state)), jnp.arange(K + 1, dtype=jnp.int32))
        return verify(state.replace(draft_cache=dview.pools), props[:K].T, n_draft)

    n_draft = jnp.where(drafting, jnp.minimum(K, sl.remaining - 1), 0)
    return jax.lax.cond(worth_verifying(sl.spec, n_draft, live, spec), with_draft_model, plain, state)
