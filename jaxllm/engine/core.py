"""The engine core: the KV pools, a table of `slots` rows (`engine.slots`) and each row's block
tables, and the calls that advance them on the device. Offline generation, logits, perplexity, the
bench and the server all drive this; the host decides which blocks each row holds (`engine.blocks`).

- `prefill` runs one forward over pieces of prompts: P rows of at most C tokens, row p a piece of
  the prompt of slot rows[p] starting at position start[p]. Several requests' pieces go in one
  forward, and a long prompt goes in several. A row whose piece ends its prompt samples the
  request's first token and makes its slot live. It can return the pieces' logits or the NLL of
  given targets instead (`Engine.logits`, perplexity).
- `decode` runs up to n steps of every live slot in one `lax.while_loop` (a step: `step`): each
  step feeds every slot its last token at its own position, samples with the slot's own
  parameters, and stops a slot at EOS or at its token limit; the loop ends early once no slot is
  live. Idle slots run at position -1, which writes nothing. The cache is read in place: nothing is
  sliced or copied around the loop.

- `fork` copies slots that have just ended their prompts into other slots (the slot-table entries,
  and the KV blocks the host gave the copies, the one a prompt's last partial block is in: the full
  blocks before it are shared), each copy drawing its own first token with its own seed from the
  logits its source drew from: a request for n answers prefills its prompt once.

A slot draws its k-th token with `fold_in(seed, k)`, so a request samples the same tokens whatever
else shares the cache and however its steps are split into calls.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.config.model import ModelConfig
from jaxllm.engine.sampling import (
    LogProbs,
    Penalties,
    TokenRules,
    apply_rules,
    mask_tokens,
    penalize,
    sample,
)
from jaxllm.engine.sampling import logprobs as _lp
from jaxllm.engine.slots import Forks, Pieces, Slots, State
from jaxllm.engine.speculative import Speculation, write_history
from jaxllm.engine.step import decode_step, ends_answer, model_weights, spec_cycle, step_advance, step_forward
from jaxllm.kv.paged import PagedCache, copy_blocks
from jaxllm.model.forward import forward, logits_from_hidden

LOGIT_ELEMENTS = 1 << 26  # float32 logits made at once when scoring, at most (256 MiB)


# -- prefill ---------------------------------------------------------------------------------------
def prefill(
    cfg: ModelConfig,
    weights,
    state: State,
    pieces: Pieces,
    targets=None,
    *,
    ops,
    out: str = "sample",
    logprobs: int = 0,
    spec: Speculation | None = None,
    dtype=jnp.bfloat16,
):
    """One forward over `pieces`, writing their K/V into the cache (and the draft model's).

    out="sample": final rows start their slots -> (state, first tokens [P]), or with `logprobs` n
    > 0 (state, (first tokens, their LogProbs [P] with the top n)), and with `targets` too (state,
    (first tokens, their LogProbs, LogProbs [N] of the targets)): the prompts' own tokens scored in
    the forward that prefills them (a server's `echo` with log-probabilities);
    out="logits": -> (state, float32 logits [P, C, V]); the slot table is left as it is;
    out="nll": -> (state, NLL [N]) of targets (flat token index [N] into the P x C tokens, target
    id [N]; a negative target scores 0), the logits made a few rows at a time;
    out="logprobs": -> (state, LogProbs [N] of the same targets, with the top `logprobs`).
    """
    weights, draft = model_weights(weights, spec)
    positions = pieces.positions()
    P, C = pieces.tokens.shape
    rows = jnp.arange(P, dtype=jnp.int32) if pieces.rows is None else pieces.rows
    tables = {n: jnp.take(t, rows, axis=0, mode="clip") for n, t in state.cache.tables.items()}
    h, view = forward(cfg, weights, pieces.tokens, positions, PagedCache(state.cache.pools, tables), ops, dtype)
    state = state.replace(cache=state.cache.replace(pools=view.pools))
    if draft is not None and out == "sample":
        _, dview = forward(
            spec.draft_cfg, draft, pieces.tokens, positions, PagedCache(state.draft_cache, tables), ops, dtype
        )
        state = state.replace(draft_cache=dview.pools)
    if out == "logits":
        return state, logits_from_hidden(cfg, weights, h, ops)
    if out in ("nll", "logprobs"):
        return state, _score(cfg, weights, h, *targets, ops=ops, top=logprobs if out == "logprobs" else None)
    last = jnp.clip(pieces.length - 1, 0, C - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    first_logits = logits_from_hidden(cfg, weights, h_last, ops)
    sl = state.slots
    B = sl.last.shape[0]
    rules = None if sl.rules is None else _rules(pieces, P)
    step0 = pieces.step0
    x = first_logits if rules is None else apply_rules(first_logits, rules, step0, cfg.eos_ids, pieces.ignore_eos)
    if sl.counts is not None:  # new prompts start their counts; prompt tokens are marked
        sl = _count_prompt(sl, pieces, rows, positions)
        in_prompt = jnp.take(sl.in_prompt, rows, axis=0, mode="clip")
        counts = jnp.take(sl.counts, rows, axis=0, mode="clip")  # a recomputed request's own so far
        pen = _penalties(pieces, P)
        first = sample(
            mask_tokens(penalize(x, pen, counts, in_prompt), pieces.allowed), pieces.params, step0, ops.top_p_by
        )
        sl = sl.replace(
            counts=sl.counts.at[jnp.where(pieces.final, rows, B), first].add(1, mode="drop"),
            penalties=jax.tree_util.tree_map(lambda a, v: a.at[rows].set(v, mode="drop"), sl.penalties, pen),
        )
    else:
        first = sample(mask_tokens(x, pieces.allowed), pieces.params, step0, ops.top_p_by)
    live = pieces.final & ~ends_answer(first, cfg.eos_ids, pieces.ignore_eos, rules) & (pieces.max_new > 1)

    def put(a, v):
        return a.at[rows].set(v, mode="drop")

    end = pieces.start + pieces.length
    slots = sl.replace(
        last=put(sl.last, first),
        pos=put(sl.pos, end),
        step=put(sl.step, step0 + 1),
        remaining=put(sl.remaining, pieces.max_new - 1),
        active=put(sl.active, live),
        ignore_eos=put(sl.ignore_eos, pieces.ignore_eos),
        params=jax.tree_util.tree_map(put, sl.params, pieces.params),
    )
    if rules is not None:
        slots = slots.replace(rules=jax.tree_util.tree_map(put, sl.rules, rules))
    if sl.hidden is not None:  # what `fork` draws the first tokens of a slot's copies from
        slots = slots.replace(
            hidden=sl.hidden.at[jnp.where(pieces.final, rows, B)].set(h_last.astype(sl.hidden.dtype), mode="drop")
        )
    if sl.spec is not None:  # the prompt's tokens and the first one, for drafting
        hist = write_history(sl.spec.history, pieces.rows, positions, pieces.tokens)
        hist = write_history(hist, pieces.rows, jnp.where(pieces.final, end, -1)[:, None], first[:, None])
        new_rows = jnp.where(pieces.first, rows, sl.last.shape[0])  # a new request's slot

        def reset(a, v):
            return a.at[new_rows].set(v, mode="drop")

        sp = sl.spec
        slots = slots.replace(spec=sp.replace(history=hist, rate=reset(sp.rate, 1.0), idle=reset(sp.idle, 0)))
    if logprobs:
        res = (first, _lp(first_logits, first, logprobs))
        if targets is not None:
            res += (_score(cfg, weights, h, *targets, ops=ops, top=logprobs),)
        return state.replace(slots=_by_rows(slots, ops.layout)), res
    return state.replace(slots=_by_rows(slots, ops.layout)), first


def _by_rows(slots: Slots, layout) -> Slots:
    """The slot table laid out as the engine made it, rows over "data": left to XLA, a [slots,
    vocab] table takes the layout of the logits it meets (the vocabulary over "model"), and the next
    call, compiled for the table's own layout, refuses it."""
    if layout is None:
        return slots
    return jax.tree_util.tree_map(lambda a: jax.lax.with_sharding_constraint(a, layout.batch_sharding(a.shape)), slots)


def _penalties(pieces: Pieces, P: int) -> Penalties:
    return pieces.penalties if pieces.penalties is not None else Penalties.make(P)


def _rules(pieces: Pieces, P: int) -> TokenRules:
    return pieces.rules if pieces.rules is not None else jax.tree_util.tree_map(jnp.asarray, TokenRules.make(P))


def _count_prompt(sl: Slots, pieces: Pieces, rows, positions) -> Slots:
    """A piece that starts its request zeroes its slot's token counts and prompt marks; every piece
    marks its tokens as its prompt's, or counts them as generated from `out_start` on (a request
    recomputed after preemption)."""
    B = sl.last.shape[0]
    new = jnp.where(pieces.first, rows, B)
    counts = sl.counts.at[new].set(0, mode="drop")
    in_prompt = sl.in_prompt.at[new].set(False, mode="drop")
    out = positions >= pieces.out_start[:, None]
    at = jnp.where((positions >= 0) & ~out, rows[:, None], B)
    gen = jnp.where((positions >= 0) & out, rows[:, None], B)
    return sl.replace(
        counts=counts.at[gen, pieces.tokens].add(1, mode="drop"),
        in_prompt=in_prompt.at[at, pieces.tokens].set(True, mode="drop"),
    )


def _score(cfg: ModelConfig, weights, h, where, target, *, ops, top: int | None):
    """Scores of target [N] given the hidden states at flat positions where [N] of h [P, C, D]: the
    NLL [N] (a negative target scores 0), or with `top` its LogProbs [N] and the top alternatives.
    Only scored positions pay for the vocabulary projection, a few rows at a time."""
    flat = h.reshape(-1, h.shape[-1])
    n = where.shape[0]
    rows = _divisor_at_most(n, max(1, LOGIT_ELEMENTS // cfg.vocab_size))

    def chunk(args):
        w, t = args
        logits = logits_from_hidden(cfg, weights, flat[w], ops)  # [rows, V] float32
        if top is not None:
            return _lp(logits, t, top)
        picked = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        return jnp.where(t >= 0, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)

    res = jax.lax.map(chunk, (where.reshape(n // rows, rows), target.reshape(n // rows, rows)))
    return jax.tree_util.tree_map(lambda a: a.reshape(n, *a.shape[2:]), res)


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


# -- decode ----------------------------------------------------------------------------------------
def decode(
    cfg: ModelConfig,
    weights,
    state: State,
    n_steps,
    stop=None,
    allowed=None,
    *,
    ops,
    max_steps: int,
    rows: int | None = None,
    logprobs: int = 0,
    spec: Speculation | None = None,
    dtype=jnp.bfloat16,
    fixed: bool = False,
):
    """Up to n_steps decode steps (speculative cycles, with `spec`) of the first `rows` slots (all
    for None; the others must not be live), ending once none is live or a row's next tokens would
    not fit the max_steps of the output. `stop` [rows]: slots to end first (a request cancelled or
    stopped by the host). `allowed` [rows, ceil(V / 32)] uint32: the tokens each slot may sample
    (`sampling.mask_tokens`), at every step of the block; a grammar's mask holds for one token, so
    the server runs one-step blocks while a slot is constrained.

    `fixed` (no speculation, no `allowed`, every live slot greedy; n_steps is not read): exactly
    max_steps steps, their sampling the argmax, with nothing in the call that branches on the
    device's values. A GPU decides a loop's next step or a conditional's branch on the host, which
    waits for the device at every step; this call it runs start to end with no such wait, so it
    returns at once and the host launches the next call while the device runs this one.

    -> (state, tokens [rows, max_steps], count [rows], LogProbs [rows, max_steps] with the top
    `logprobs` or None): slot b sampled tokens[b, :count[b]]."""
    full = state
    B = full.slots.last.shape[0] if rows is None else rows
    out = (jnp.zeros((B, max_steps), jnp.int32), LogProbs.zeros((B, max_steps), logprobs) if logprobs else None)
    main, draft = model_weights(weights, spec)  # as the loop reads them (`loop_weights`)
    main = ops.loop_weights(main, B * (1 if spec is None else spec.k + 1), state, dtype)
    weights = main if draft is None else (main, draft)

    if spec is None:

        def cond(c):
            i, s, _, _ = c
            return (i < jnp.minimum(n_steps, max_steps)) & jnp.any(s.slots.active)

        def body(c):
            i, s, out, count = c
            s, tok, live, logits = decode_step(cfg, weights, s, ops, dtype, allowed, greedy=fixed)
            new = (jnp.where(live, tok, 0), _lp(logits, tok, logprobs) if logprobs else None)
            out = jax.tree_util.tree_map(
                lambda o, v: jax.lax.dynamic_update_slice_in_dim(o, v[:, None], i, axis=1), out, new
            )
            return i + 1, s, out, count + live.astype(jnp.int32)
    else:
        T = spec.k + 1

        def cond(c):
            i, s, _, count = c
            room = jnp.max(jnp.where(s.slots.active, count, 0)) + T <= max_steps
            return (i < n_steps) & jnp.any(s.slots.active) & room

        def body(c):
            i, s, out, count = c
            s, new, n_new, lp = spec_cycle(cfg, weights, s, spec, ops, dtype, logprobs, allowed)
            j = jnp.arange(T, dtype=jnp.int32)[None, :]
            cols = jnp.where(j < n_new[:, None], count[:, None] + j, max_steps)
            out = jax.tree_util.tree_map(
                lambda o, v: o.at[jnp.arange(B)[:, None], cols].set(v, mode="drop"), out, (new, lp)
            )
            return i + 1, s, out, count + n_new

    init = (jnp.int32(0), _first_rows(state, rows, stop), out, jnp.zeros((B,), jnp.int32))
    if fixed:
        assert spec is None and allowed is None, "a fixed block neither speculates nor masks tokens"
        _, s, (out, lp), count = jax.lax.fori_loop(0, max_steps, lambda _, c: body(c), init)
    else:
        _, s, (out, lp), count = jax.lax.while_loop(cond, body, init)
    return _all_rows(full, s, ops.layout), out, count, lp


def _first_rows(state: State, rows: int | None, stop=None) -> State:
    """The state with the slot table and the block tables cut to their first `rows` slots (those in
    `stop` ended first)."""
    B = state.slots.last.shape[0] if rows is None else rows
    slots = jax.tree_util.tree_map(lambda a: a[:B], state.slots)
    if stop is not None:
        slots = slots.replace(active=slots.active & ~stop)
    tables = {n: t[:B] for n, t in state.cache.tables.items()}
    return state.replace(slots=slots, cache=state.cache.replace(tables=tables))


def _all_rows(full: State, state: State, layout) -> State:
    """`state` (its tables cut to the first rows) with the whole slot table and block tables of
    `full` back."""
    B = state.slots.last.shape[0]
    slots = state.slots
    if B < full.slots.last.shape[0]:
        slots = jax.tree_util.tree_map(lambda a, v: a.at[:B].set(v), full.slots, slots)
    return state.replace(slots=_by_rows(slots, layout), cache=state.cache.replace(tables=full.cache.tables))


def decode_forward(
    cfg: ModelConfig,
    weights,
    state: State,
    *,
    ops,
    rows: int | None = None,
    spec: Speculation | None = None,
    dtype=jnp.bfloat16,
):
    """The forward of a one-step decode block of the first `rows` slots, apart from its sampling
    (`decode_sample`), so that the host can write the next token's grammar masks while the device
    runs it. -> (state, float32 logits [rows, V], rows over the data axis)."""
    assert spec is None, "a decode block split in two has no speculation"
    s, logits = step_forward(cfg, weights, _first_rows(state, rows), ops, dtype)
    if ops.layout is not None:  # the layout the sampling call is compiled for
        logits = jax.lax.with_sharding_constraint(logits, ops.layout.batch_sharding(logits.shape))
    return s.replace(slots=state.slots, cache=s.cache.replace(tables=state.cache.tables)), logits


def decode_sample(
    cfg: ModelConfig,
    weights,
    state: State,
    logits,
    stop=None,
    allowed=None,
    *,
    ops,
    rows: int | None = None,
    logprobs: int = 0,
    greedy: bool = False,
    spec: Speculation | None = None,
    dtype=jnp.bfloat16,
):
    """The sampling of a one-step decode block whose forward `decode_forward` ran: each live slot's
    token from `logits` among those `allowed` lets it take, the slots advanced. -> what `decode`
    returns for a block of one step (tokens [rows, 1], count [rows], LogProbs [rows, 1] or None).
    `greedy` (every live slot's temperature is 0): a variant with no choice for the host to make,
    so that the call returns at once and the host launches the next forward while the device
    still runs this step's."""
    assert spec is None, "a decode block split in two has no speculation"
    full = state
    s, tok, live = step_advance(cfg, _first_rows(state, rows, stop), logits, ops, allowed, greedy)
    lp = None
    if logprobs:
        lp = jax.tree_util.tree_map(lambda a: a[:, None], _lp(logits, tok, logprobs))
    return _all_rows(full, s, ops.layout), jnp.where(live, tok, 0)[:, None], live.astype(jnp.int32), lp


# -- drafting history ------------------------------------------------------------------------------
def seed_history(
    cfg: ModelConfig, weights, state: State, rows, tokens, *, ops, spec: Speculation | None = None, dtype=jnp.bfloat16
):
    """The drafting history of slots rows [P] set to tokens [P, H]: the prompts of requests whose
    first positions came from the prefix cache, which no prefill piece of theirs writes (n-gram
    drafts look up the whole prompt)."""
    sp = state.slots.spec
    hist = sp.history.at[rows].set(tokens, mode="drop")
    return state.replace(slots=_by_rows(state.slots.replace(spec=sp.replace(history=hist)), ops.layout))


# -- fork ------------------------------------------------------------------------------------------
def fork(
    cfg: ModelConfig,
    weights,
    state: State,
    forks: Forks,
    copies: dict,
    *,
    ops,
    logprobs: int = 0,
    spec: Speculation | None = None,
    dtype=jnp.bfloat16,
):
    """Each slot forks.src[f], which has just ended its prompt (its first token drawn, nothing
    decoded since), is copied into slot forks.dst[f]: its slot-table entry with the seed
    forks.seed[f], and the KV blocks `copies` names ({kind: (src blocks [F], dst blocks [F])}, a
    dst past the pool for none; of the draft model's pools too): the host shares the full blocks
    and gives the copy its own of the blocks it will write. The copy then draws its own first token
    from the logits its source drew its first from, with its own seed, so it goes on exactly as the
    source's request would with that seed.

    -> (state, first tokens [F]), or with `logprobs` n > 0 (state, (first tokens, their LogProbs
    [F] with the top n)); entries without a fork return what nothing reads."""
    weights, _ = model_weights(weights, spec)
    sl = state.slots
    B = sl.last.shape[0]
    cache = state.cache.replace(pools=copy_blocks(state.cache.pools, copies))
    draft = None if state.draft_cache is None else copy_blocks(state.draft_cache, copies)
    src = jnp.clip(forks.src, 0, B - 1)
    child = jax.tree_util.tree_map(lambda a: a[src], sl)
    child = child.replace(params=child.params.replace(seed=forks.seed))
    logits = logits_from_hidden(cfg, weights, sl.hidden[src], ops)
    F = src.shape[0]
    step0 = jnp.zeros((F,), jnp.int32)
    x = logits if child.rules is None else apply_rules(logits, child.rules, step0, cfg.eos_ids, child.ignore_eos)
    if child.counts is not None:
        x = penalize(x, child.penalties, jnp.zeros_like(child.counts), child.in_prompt)
    first = sample(mask_tokens(x, forks.allowed), child.params, step0, ops.top_p_by)
    child = child.replace(
        last=first, active=(child.remaining > 0) & ~ends_answer(first, cfg.eos_ids, child.ignore_eos, child.rules)
    )
    if child.counts is not None:
        child = child.replace(counts=jax.nn.one_hot(first, child.counts.shape[1], dtype=child.counts.dtype))
    if child.spec is not None:  # its own first token in its history; its own counts of speculation
        hist = write_history(child.spec.history, None, child.pos[:, None], first[:, None])
        child = child.replace(spec=child.spec.replace(history=hist, stats=sl.spec.stats[jnp.clip(forks.dst, 0, B - 1)]))
    slots = jax.tree_util.tree_map(lambda a, v: a.at[forks.dst].set(v, mode="drop"), sl, child)
    state = State(
        cache.replace(pools=_by_layout(cache.pools, ops.layout)),
        _by_rows(slots, ops.layout),
        None if draft is None else _by_layout(draft, ops.layout),
    )
    return state, ((first, _lp(logits, first, logprobs)) if logprobs else first)


def _by_layout(cache, layout):
    """KV pools laid out as the engine made them (KV heads over "model"), as `_by_rows` the slots."""
    if layout is None:
        return cache
    return jax.tree_util.tree_map(jax.lax.with_sharding_constraint, cache, layout.cache_shardings(cache))
