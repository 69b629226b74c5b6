"""Per-row sampling inside the compiled loop: greedy, temperature, top-k, top-p, seeded.

Each row carries its own parameters and seed, so a request samples the same tokens whether it runs
alone or inside a batch (the server relies on this).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import pytree
from jaxllm.engine.request import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, nth_seed


@pytree.dataclass
class SamplingParams:
    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32; 1 = off
    seed: jax.Array  # [B] uint32
    min_p: jax.Array  # [B] float32; 0 = off

    @staticmethod
    def make(batch: int, temperature=0.0, top_k=None, top_p=None, seed=0, min_p=0.0) -> "SamplingParams":
        """One setting for `batch` rows; row b samples with seed + b (`nth_seed`, as choice b of a
        request does), so the rows draw apart and one seed reproduces them all."""

        def arr(v, dtype):
            return jnp.broadcast_to(jnp.asarray(v, dtype), (batch,))

        seeds = jnp.asarray(np.array([nth_seed(seed, b) for b in range(batch)], np.uint32))
        return SamplingParams(
            arr(temperature, jnp.float32),
            arr(top_k or 0, jnp.int32),
            arr(1.0 if top_p is None else top_p, jnp.float32),
            seeds,
            arr(min_p, jnp.float32),
        )


def _keep_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Tokens whose probability (after temperature) is at least min_p times the likeliest one's,
    vLLM's min-p: logit >= max + log(min_p); min_p = 0 keeps every token."""
    floor = jnp.max(scaled, -1) + jnp.log(min_p)
    return jnp.where(scaled >= floor[:, None], scaled, -jnp.inf)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 in the same order (the radix-sort key): negative numbers have every bit
    flipped, the others their sign bit set. -0.0 is taken as 0.0, which it equals."""
    b = jnp.where(x == 0, jnp.uint32(0), jax.lax.bitcast_convert_type(x, jnp.uint32))
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_key(lo: jax.Array, hi: jax.Array, enough) -> jax.Array:
    """Per row, the largest key u in [lo, hi] with enough(u), where enough holds up to some key and
    not past it (lo where it fails at once): 32 halvings of a uint32 range, so the answer is exact."""

    def halve(_, bounds):
        lo, hi = bounds
        mid = hi - (hi - lo) // 2
        ok = enough(mid[:, None]) | (mid <= lo)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _budget(top_p, mass):
    """The mass a top-p cut-off must keep; with top_p = 1, more than any prefix holds."""
    return jnp.where(top_p < 1, top_p, 2.0) * mass


def _kth_key(keys, k):
    """Each row's k-th largest key, by bisection (its smallest where no row has k < V)."""
    lo, hi = jnp.min(keys, axis=-1), jnp.max(keys, axis=-1)
    return jax.lax.cond(
        jnp.any(k < keys.shape[-1]), lambda: _largest_key(lo, hi, lambda u: jnp.sum(keys >= u, -1) >= k), lambda: lo
    )


def _keep_by_bisection(scaled, k, top_p):
    """`filtered`'s kept tokens without a sort: bisection on the values' order, one reduction over
    the vocabulary per halving."""
    keys = _order_keys(scaled)
    kth, hi = _kth_key(keys, k), jnp.max(keys, axis=-1)
    e = jnp.where(keys >= kth[:, None], jnp.exp(scaled - jnp.max(scaled, -1, keepdims=True)), 0.0)
    budget = _budget(top_p, jnp.sum(e, -1))
    cut = jax.lax.cond(
        jnp.any(top_p < 1),
        lambda: _largest_key(kth, hi, lambda u: jnp.sum(jnp.where(keys >= u, e, 0.0), -1) >= budget),
        lambda: kth,
    )
    return keys >= cut[:, None]


def _keep_by_sorting(scaled, k, top_p):
    """`filtered`'s kept tokens from the sorted values: one sort, one cumulative sum."""
    srt = jnp.sort(scaled, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    csum = jnp.cumsum(jnp.where(srt >= kth, jnp.exp(srt - srt[:, :1]), 0.0), axis=-1)
    reached = csum >= _budget(top_p, csum[:, -1])[:, None]
    first = jnp.take_along_axis(srt, jnp.argmax(reached, axis=-1)[:, None], axis=-1)
    return scaled >= jnp.where(jnp.any(reached, -1, keepdims=True), first, kth)


def filtered(logits: jax.Array, p: SamplingParams, by: str = "bisection") -> jax.Array:
    """logits / temperature, with every token below min-p and outside the top-k set to -inf, then
    every token outside the top-p of what is left (renormalized). The cut-off is the largest value whose tokens
    and those above it hold at least top_p of the mass; tokens tied with a cut-off stay.

    `by`: "sort" sorts the values, "bisection" finds the cut-off by bisection; the backend says
    which suits its device (`XlaOps.top_p_by`)."""
    V = logits.shape[-1]
    t = jnp.where(p.temperature > 0, p.temperature, 1.0)[:, None]
    scaled = _keep_min_p(logits / t, p.min_p)
    k = jnp.where(p.top_k > 0, jnp.minimum(p.top_k, V), V)
    keep = {"sort": _keep_by_sorting, "bisection": _keep_by_bisection}[by](scaled, k, p.top_p)
    return jnp.where(keep, scaled, -jnp.inf)


BLOCK_TOP_K = 128  # on GPUs, top-k up to this from the blocks with the largest maxima, above it a sort


def _kth_from_blocks(scaled: jax.Array, k: jax.Array, cap: int = BLOCK_TOP_K, width: int = 128) -> jax.Array:
    """Each row's k-th largest value for k <= cap, without sorting the vocabulary: the k largest
    values all lie in the `cap` blocks of `width` tokens with the largest maxima (a block left out
    has a maximum no larger than each of those `cap` maxima), so only those blocks are sorted."""
    B, V = scaled.shape
    nb = -(-V // width)
    x = jnp.pad(scaled, ((0, 0), (0, nb * width - V)), constant_values=-jnp.inf).reshape(B, nb, width)
    n = min(cap, nb)
    top = jax.lax.top_k(jnp.max(x, -1), n)[1]
    best = jax.lax.top_k(jnp.take_along_axis(x, top[:, :, None], axis=1).reshape(B, n * width), min(cap, n * width))[0]
    return jnp.take_along_axis(best, (jnp.clip(k, 1, best.shape[-1]) - 1)[:, None], -1)


def _keep_top_k(scaled: jax.Array, k: jax.Array, by: str) -> jax.Array:
    """Tokens at or above each row's k-th largest value (all where k = V): by bisection, or where
    sorting suits the device (`by="sort"`) from the blocks with the largest maxima where every k is
    at most BLOCK_TOP_K (else a sort)."""
    V = scaled.shape[-1]
    if by != "sort":
        keys = _order_keys(scaled)
        return keys >= _kth_key(keys, k)[:, None]
    kth = jax.lax.cond(
        jnp.any((k > BLOCK_TOP_K) & (k < V)),
        lambda: jnp.take_along_axis(jnp.sort(scaled, axis=-1)[:, ::-1], (k - 1)[:, None], -1),
        lambda: _kth_from_blocks(scaled, k),
    )
    return (scaled >= kth) | (k[:, None] >= V)


def _row_keys(p: SamplingParams, step: jax.Array) -> jax.Array:
    steps = jnp.broadcast_to(step, p.seed.shape)  # one step for all rows, or one per row
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(p.seed, steps)


def _draw_top_p(scaled: jax.Array, top_p: jax.Array, keys: jax.Array) -> jax.Array:
    """`jax.random.categorical` over each row's top-p set, without finding the set's cut-off.

    A categorical draw is the argmax of the values plus Gumbel noise. A token belongs to the
    top-p set exactly when the tokens above its value hold less than top_p of the mass, which one
    reduction decides. So: take the argmax over all tokens; while it falls outside the set, take
    the argmax over the tokens above its value. The noise stays the same, so this ends on the
    argmax over the set, which is the draw from the filtered logits with the same key; with
    top_p = 0.95 the first argmax is in the set about 95% of the time. Every round raises the
    floor past a value, so the loop ends."""
    mx = jnp.max(scaled, -1, keepdims=True)
    e = jnp.exp(scaled - mx)
    budget = _budget(top_p, jnp.sum(e, -1))
    noisy = scaled + jax.vmap(lambda k: jax.random.gumbel(k, scaled.shape[-1:], scaled.dtype))(keys)

    def round_(state):
        floor, tok, done = state
        cand = jnp.argmax(jnp.where(scaled > floor[:, None], noisy, -jnp.inf), -1).astype(jnp.int32)
        v = jnp.take_along_axis(scaled, cand[:, None], -1)
        ok = (
            (jnp.sum(jnp.where(scaled > v, e, 0.0), -1) < budget) | (v[:, 0] >= mx[:, 0]) | ~(v[:, 0] > floor)
        )  # nothing above the floor (or NaNs): stop, never spin
        return jnp.where(done | ok, floor, v[:, 0]), jnp.where(done, tok, cand), done | ok

    B = scaled.shape[0]
    first = round_((jnp.full((B,), -jnp.inf, scaled.dtype), jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)))
    return jax.lax.while_loop(lambda s: ~jnp.all(s[2]), round_, first)[1]


def sample(
    logits: jax.Array, p: SamplingParams, step: jax.Array, by: str = "bisection", greedy: bool = False
) -> jax.Array:
    """logits [B, V] float32 -> tokens [B]; step is a scalar or per row [B]; `by` as in `filtered`;
    `greedy`: the caller knows no row samples (every temperature 0), so the argmax alone.

    A row with a temperature draws what `jax.random.categorical` draws from `filtered`'s logits
    with the row's key, whichever other rows share its batch, without a sort of the vocabulary
    for top-k up to 128: the min-p floor, the top-k cut-off (`_keep_top_k`, only where some row of the batch has
    one), then `_draw_top_p`. When no row samples, the batch takes the argmax alone: on GPUs that
    choice is made on the host, which waits for the logits first, so a caller that knows no row
    samples says so (`greedy`)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampling = p.temperature > 0

    def draw(top_k: bool):
        scaled = _keep_min_p(logits / jnp.where(sampling, p.temperature, 1.0)[:, None], p.min_p)
        if top_k:
            V = logits.shape[-1]
            scaled = jnp.where(
                _keep_top_k(scaled, jnp.where(p.top_k > 0, jnp.minimum(p.top_k, V), V), by), scaled, -jnp.inf
            )
        return _draw_top_p(scaled, jnp.where(sampling, p.top_p, 1.0), _row_keys(p, step))

    any_top_k = jnp.any(sampling & (p.top_k > 0) & (p.top_k < logits.shape[-1]))
    branch = jnp.where(jnp.any(sampling), jnp.where(any_top_k, 2, 1), 0)
    drawn = jax.lax.switch(branch, [lambda: greedy, lambda: draw(False), lambda: draw(True)])
    return jnp.where(sampling, drawn, greedy)


@pytree.dataclass
class Penalties:
    """Per-row penalties on tokens already seen, as vLLM and OpenAI define them (neutral: 0, 0, 1)."""

    presence: jax.Array  # [B] float32: subtracted once from each generated token's logit
    frequency: jax.Array  # [B] float32: subtracted per time a token was generated
    repetition: jax.Array  # [B] float32: Hugging Face's, on prompt and generated tokens

    @staticmethod
    def make(batch: int, presence=0.0, frequency=0.0, repetition=1.0) -> Penalties:
        def arr(v):
            return jnp.broadcast_to(jnp.asarray(v, jnp.float32), (batch,))

        return Penalties(arr(presence), arr(frequency), arr(repetition))

    def any_on(self, rows: jax.Array | None = None) -> jax.Array:
        """Whether some row (of `rows` [B] bool, where given) has a penalty."""
        on = (self.presence != 0) | (self.frequency != 0) | (self.repetition != 1)
        return jnp.any(on if rows is None else on & rows)


def penalize(logits: jax.Array, pen: Penalties, counts: jax.Array, in_prompt: jax.Array) -> jax.Array:
    """logits [N, V] float32, with counts [N, V] of the tokens each row generated so far and
    in_prompt [N, V] its prompt's tokens -> the logits sampling sees (vLLM's order): a token seen in
    the prompt or generated has a positive logit divided by the repetition penalty and a negative
    one multiplied by it; then frequency * count and presence * (count > 0) are subtracted. A row
    without penalties (repetition 1, the others 0) gets its logits back exactly. Computed for every
    row, with no branch: one elementwise pass, where a conditional costs a GPU a host round trip a
    step (the Qwen3-4B server at 16 clients on an H100 spent 3.1 ms a token with one, 2.8 without)."""
    made = counts > 0
    r = pen.repetition[:, None]
    x = jnp.where(made | in_prompt, jnp.where(logits > 0, logits / r, logits * r), logits)
    return x - pen.frequency[:, None] * counts - pen.presence[:, None] * made


def mask_tokens(logits: jax.Array, allowed: jax.Array | None) -> jax.Array:
    """logits [N, V] with every token whose bit is clear in allowed [N, ceil(V / 32)] uint32 (bit j
    of word w is token 32 w + j) set to -inf: a structured-output request's grammar mask, applied
    after penalties and before temperature and top-k/top-p, so greedy takes the best allowed token.
    A row of all ones gets its logits back exactly; None: no mask."""
    if allowed is None:
        return logits
    N, V = logits.shape
    bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return jnp.where(bits.reshape(N, -1)[:, :V] == 1, logits, -jnp.inf)


@pytree.dataclass
class TokenRules:
    """Per-row rules on which tokens a row samples (neutral: no entries, min_tokens 0): OpenAI's
    logit_bias, kept sparse as token ids and their biases (id -1: unused), and vLLM's
    stop_token_ids (-1: unused), which end the answer as EOS does, and min_tokens, the tokens a row
    samples before EOS or a stop id may come."""

    bias_ids: jax.Array  # [B, MAX_LOGIT_BIAS] int32
    bias: jax.Array  # [B, MAX_LOGIT_BIAS] float32
    stop_ids: jax.Array  # [B, MAX_STOP_TOKEN_IDS] int32
    min_tokens: jax.Array  # [B] int32

    @staticmethod
    def make(batch: int, logit_bias=None, stop_ids=None, min_tokens=None) -> "TokenRules":
        """Host arrays for `batch` rows; each argument None (neutral) or one entry per row: a dict
        {token id: bias}, a list of token ids, an int."""
        ids = np.full((batch, MAX_LOGIT_BIAS), -1, np.int32)
        bias = np.zeros((batch, MAX_LOGIT_BIAS), np.float32)
        stops = np.full((batch, MAX_STOP_TOKEN_IDS), -1, np.int32)
        for b, row in enumerate(logit_bias or []):
            ids[b, : len(row)] = list(row)
            bias[b, : len(row)] = list(row.values())
        for b, row in enumerate(stop_ids or []):
            stops[b, : len(row)] = row
        mins = np.zeros((batch,), np.int32) if min_tokens is None else np.asarray(min_tokens, np.int32)
        return TokenRules(ids, bias, stops, np.broadcast_to(mins, (batch,)).copy())


def apply_rules(
    logits: jax.Array, rules: TokenRules, step: jax.Array, eos_ids: tuple[int, ...], ignore_eos: jax.Array
) -> jax.Array:
    """logits [N, V] float32 -> with each row's logit_bias added and, while the row's sampling step
    [N] is below its min_tokens, its stop ids and (unless it ignores EOS) the EOS ids at -inf.
    Both are scatters of the rows' own entries, unused ones aimed past the vocabulary and dropped,
    so a row without rules gets its logits back exactly, with no branch (see `penalize`)."""
    N, V = logits.shape
    rows = jnp.arange(N)[:, None]
    x = logits.at[rows, jnp.where(rules.bias_ids >= 0, rules.bias_ids, V)].add(rules.bias, mode="drop")
    eos = jnp.broadcast_to(jnp.asarray(eos_ids or (-1,), jnp.int32), (N, max(len(eos_ids), 1)))
    banned = jnp.concatenate([jnp.where(ignore_eos[:, None], -1, eos), rules.stop_ids], axis=1)
    early = (step < rules.min_tokens)[:, None]
    return x.at[rows, jnp.where(early & (banned >= 0), banned, V)].set(-jnp.inf, mode="drop")


@pytree.dataclass
class LogProbs:
    """Log-probabilities under the model's own distribution (log_softmax of the raw float32 logits,
    before temperature, top-k/top-p or penalties: what vLLM reports by default)."""

    token: jax.Array  # [...] of the chosen token
    top_ids: jax.Array  # [..., n] int32: the n most likely tokens, most likely first
    top: jax.Array  # [..., n] their log-probabilities

    @staticmethod
    def zeros(shape: tuple, n: int) -> "LogProbs":
        return LogProbs(
            jnp.zeros(shape, jnp.float32), jnp.zeros((*shape, n), jnp.int32), jnp.zeros((*shape, n), jnp.float32)
        )


def top_k(x: jax.Array, n: int, width: int = 128) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(x, n)` over the last axis (values and ids, ties to the lower id) without sorting
    it whole: the n largest values lie in the n blocks of `width` with the largest maxima, taken in
    id order, so only n * width candidates are ranked. (Ranking a vocabulary of 262144 for every row
    of every decode step is what a top-k of more than a few made cost.)"""
    V = x.shape[-1]
    nb = -(-V // width)
    if nb <= 2 * n:
        return jax.lax.top_k(x, n)
    lead = x.shape[:-1]
    flat = x.reshape(-1, V)
    blocks = jnp.pad(flat, ((0, 0), (0, nb * width - V)), constant_values=-jnp.inf).reshape(-1, nb, width)
    chosen = jnp.sort(jax.lax.top_k(jnp.max(blocks, -1), n)[1], axis=-1)  # [rows, n] in id order
    cand = jnp.take_along_axis(blocks, chosen[:, :, None], axis=1).reshape(-1, n * width)
    vals, at = jax.lax.top_k(cand, n)
    ids = jnp.take_along_axis(chosen, at // width, axis=1) * width + at % width
    return vals.reshape(*lead, n), ids.reshape(*lead, n)


def logprobs(logits: jax.Array, tokens: jax.Array, n: int) -> LogProbs:
    """logits [..., V] float32, tokens [...] -> LogProbs [...] with the top n (a vocabulary smaller
    than n: its V tokens, then entries of logprob -inf)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, jnp.maximum(tokens, 0)[..., None], axis=-1)[..., 0]
    V = logits.shape[-1]
    top, ids = top_k(logits, min(n, V))
    if n > V:
        pad = [(0, 0)] * (top.ndim - 1) + [(0, n - V)]
        top, ids = jnp.pad(top, pad, constant_values=-jnp.inf), jnp.pad(ids, pad)
    return LogProbs(picked - lse, ids.astype(jnp.int32), top - lse[..., None])
