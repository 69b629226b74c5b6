"""The engine core's data: the slot table (`Slots`) and the state the core's calls advance (`State`:
the KV pools, the rows' block tables and the slot table), and what the host hands a call (`Pieces`
of prompts to prefill, `Forks` of slots to copy). All are pytrees: the host makes them with numpy
leaves, the engine puts them on the mesh (`Engine.put_rows`), the core's calls take and return them on the device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import pytree
from jaxllm.engine.sampling import Penalties, SamplingParams, TokenRules
from jaxllm.engine.speculative import SpecSlots
from jaxllm.kv.paged import PagedCache


@pytree.dataclass
class Slots:
    """The slot table, one entry per cache row [B]."""

    last: jax.Array  # the token to feed next
    pos: jax.Array  # its position
    step: jax.Array  # tokens sampled so far (the sampling step of the next one)
    remaining: jax.Array  # tokens the slot may still sample
    active: jax.Array  # the slot holds a request that is still generating
    ignore_eos: jax.Array  # EOS does not end this slot (benchmarks ask for exact lengths)
    params: SamplingParams
    spec: SpecSlots | None = None  # with speculative decoding: the slots' tokens, acceptance
    # With penalties (a slot table made with the vocabulary size): each slot's, the count of each
    # token it generated [B, V] and its prompt's tokens [B, V].
    penalties: Penalties | None = None
    counts: jax.Array | None = None
    in_prompt: jax.Array | None = None
    rules: TokenRules | None = None  # logit_bias, stop_token_ids, min_tokens
    hidden: jax.Array | None = None  # [B, D]: the hidden state the slot's first token was drawn from

    @staticmethod
    def empty(
        batch: int, length: int, spec: bool = False, vocab: int | None = None, hidden: tuple | None = None
    ) -> "Slots":
        """`hidden` (width, dtype): keep each slot's last prompt hidden state, for `fork`."""

        def zeros(dtype=jnp.int32):  # distinct buffers: the whole state is donated
            return jnp.zeros((batch,), dtype)

        params = jax.tree_util.tree_map(jnp.array, SamplingParams.make(batch))
        slots = Slots(
            zeros(),
            zeros(),
            zeros(),
            zeros(),
            zeros(bool),
            zeros(bool),
            params,
            SpecSlots.empty(batch, length) if spec else None,
            rules=jax.tree_util.tree_map(jnp.array, TokenRules.make(batch)),
            hidden=None if hidden is None else jnp.zeros((batch, hidden[0]), hidden[1]),
        )
        if vocab is None:
            return slots
        return slots.replace(
            penalties=jax.tree_util.tree_map(jnp.array, Penalties.make(batch)),
            counts=jnp.zeros((batch, vocab), jnp.int32),
            in_prompt=jnp.zeros((batch, vocab), bool),
        )


@pytree.dataclass
class State:
    cache: PagedCache  # the KV pools and each slot's block tables (the host's to set)
    slots: Slots
    draft_cache: dict | None = None  # the draft model's pools (with one): the same tables name its blocks


@pytree.dataclass
class Pieces:
    """One prefill forward: P rows of C tokens. Row p holds length[p] tokens of a prompt, at
    positions start[p] onwards, for cache row rows[p] (None: row p is cache row p; a row past the
    cache is padding). `final` rows end their prompt: their slot gets the sampling parameters, the
    token limit `max_new` and `ignore_eos`, samples its first token and goes live, among the tokens
    whose bits are set in its row of `allowed` where given (a structured-output request's grammar
    mask, `sampling.mask_tokens`). A `first` piece begins its request's prefill (its slot's counts
    and drafting history start afresh; with a cached prefix it starts past position 0). A request
    recomputed after preemption carries the tokens it had generated as prompt: from position
    `out_start` on they count as generated, and it samples its next token as its `step0`-th."""

    tokens: jax.Array  # [P, C] int32
    start: jax.Array  # [P] int32
    length: jax.Array  # [P] int32
    final: jax.Array  # [P] bool
    max_new: jax.Array  # [P] int32
    ignore_eos: jax.Array  # [P] bool
    params: SamplingParams  # [P]
    rows: jax.Array | None = None
    penalties: Penalties | None = None  # [P] (None: none)
    rules: TokenRules | None = None  # [P] (None: none)
    allowed: jax.Array | None = None  # [P, ceil(V / 32)] uint32 (None: every token)
    first: jax.Array | None = None  # [P] bool
    step0: jax.Array | None = None  # [P] int32
    out_start: jax.Array | None = None  # [P] int32

    @staticmethod
    def make(
        tokens,
        start=None,
        length=None,
        final=None,
        rows=None,
        params: SamplingParams | None = None,
        max_new=None,
        ignore_eos=None,
        penalties: Penalties | None = None,
        rules: TokenRules | None = None,
        allowed=None,
        first=None,
        step0=None,
        out_start=None,
    ) -> "Pieces":
        """Host arrays -> Pieces (numpy leaves; the engine puts them on the mesh)."""
        P = len(tokens)

        def col(v, dtype, default):
            return np.full((P,), default, dtype) if v is None else np.broadcast_to(np.asarray(v, dtype), (P,)).copy()

        params = params or SamplingParams.make(P)
        start = col(start, np.int32, 0)
        return Pieces(
            np.asarray(tokens, np.int32),
            start,
            col(length, np.int32, 0),
            col(final, bool, False),
            col(max_new, np.int32, 1),
            col(ignore_eos, bool, False),
            jax.tree_util.tree_map(np.asarray, params),
            None if rows is None else np.asarray(rows, np.int32),
            jax.tree_util.tree_map(np.asarray, penalties or Penalties.make(P)),
            rules or TokenRules.make(P),
            None if allowed is None else np.asarray(allowed, np.uint32),
            start == 0 if first is None else col(first, bool, False),
            col(step0, np.int32, 0),
            col(out_start, np.int32, np.iinfo(np.int32).max),
        )

    @staticmethod
    def shapes(P: int, C: int, rows: bool = True, mask_words: int = 0) -> "Pieces":
        """Pieces of P rows of C tokens as shape structs (to compile for them ahead); with
        `mask_words`, with an `allowed` mask of that many words a row."""
        host = Pieces.make(
            np.zeros((P, C), np.int32),
            rows=np.zeros(P, np.int32) if rows else None,
            allowed=np.zeros((P, mask_words), np.uint32) if mask_words else None,
        )
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), host)

    def positions(self) -> jax.Array:
        """[P, C]: each token's position, -1 past the row's length (padding, never written)."""
        C = self.tokens.shape[1]
        t = jnp.arange(C, dtype=jnp.int32)[None, :]
        return jnp.where(t < self.length[:, None], self.start[:, None] + t, -1)


@pytree.dataclass
class Forks:
    """Slots to fork, F at most: slot src[f] is copied into slot dst[f] (a dst past the cache: no
    fork), which draws its own first token with seed[f], among the tokens its row of `allowed`
    lets it take where given (a structured-output request's grammar mask, `sampling.mask_tokens`)."""

    src: jax.Array  # [F] int32
    dst: jax.Array  # [F] int32
    seed: jax.Array  # [F] uint32
    allowed: jax.Array | None = None  # [F, ceil(V / 32)] uint32 (None: every token)

    @staticmethod
    def make(size: int, src=(), dst=(), seed=(), allowed=None) -> "Forks":
        """Host arrays of `size` entries, the unused ones aimed past any cache (`allowed`: already
        of `size` rows)."""

        def col(v, dtype, pad):
            out = np.full((size,), pad, dtype)
            out[: len(v)] = v
            return out

        return Forks(
            col(src, np.int32, 0),
            col(dst, np.int32, np.iinfo(np.int32).max),
            col(seed, np.uint32, 0),
            None if allowed is None else np.asarray(allowed, np.uint32),
        )
