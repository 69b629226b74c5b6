"""The engine core: one KV cache of `slots` rows and a table of those slots, and the two calls that
advance them on the device. Offline generation, logits, perplexity, the bench and the server all
drive this.

- `prefill` runs one forward over pieces of prompts: P rows of at most C tokens, row p a piece of
  the prompt of slot rows[p] starting at position start[p]. Several requests' pieces go in one
  forward, and a long prompt goes in several. A row whose piece ends its prompt samples the
  request's first token and makes its slot live. It can return the pieces' logits or the NLL of
  given targets instead (`Engine.logits`, perplexity).
- `decode` runs up to n steps of every live slot in one `lax.while_loop`: each step feeds every
  slot its last token at its own position, samples with the slot's own parameters, and stops a slot
  at EOS or at its token limit; the loop ends early once no slot is live. Idle slots run at
  position -1, which writes nothing. The cache is read in place: nothing is sliced or copied around
  the loop.

A slot draws its k-th token with `fold_in(seed, k)`, so a request samples the same tokens whatever
else shares the cache and however its steps are split into calls.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig
from .model import forward, logits_from_hidden
from .sampling import SamplingParams, sample

LOGIT_ELEMENTS = 1 << 26        # float32 logits made at once when scoring, at most (256 MiB)


@struct.dataclass
class Slots:
    """The slot table, one entry per cache row [B]."""
    last: jax.Array            # the token to feed next
    pos: jax.Array             # its position
    step: jax.Array            # tokens sampled so far (the sampling step of the next one)
    remaining: jax.Array       # tokens the slot may still sample
    active: jax.Array          # the slot holds a request that is still generating
    ignore_eos: jax.Array      # EOS does not end this slot (benchmarks ask for exact lengths)
    params: SamplingParams

    @staticmethod
    def empty(batch: int) -> "Slots":
        def zeros(dtype=jnp.int32):        # distinct buffers: the whole state is donated
            return jnp.zeros((batch,), dtype)
        params = jax.tree_util.tree_map(jnp.array, SamplingParams.make(batch))
        return Slots(zeros(), zeros(), zeros(), zeros(), zeros(bool), zeros(bool), params)


@struct.dataclass
class State:
    cache: dict
    slots: Slots


@struct.dataclass
class Pieces:
    """One prefill forward: P rows of C tokens. Row p holds length[p] tokens of a prompt, at
    positions start[p] onwards, for cache row rows[p] (None: row p is cache row p; a row past the
    cache is padding). `final` rows end their prompt: their slot gets the sampling parameters, the
    token limit `max_new` and `ignore_eos`, samples its first token and goes live."""
    tokens: jax.Array          # [P, C] int32
    start: jax.Array           # [P] int32
    length: jax.Array          # [P] int32
    final: jax.Array           # [P] bool
    max_new: jax.Array         # [P] int32
    ignore_eos: jax.Array      # [P] bool
    params: SamplingParams     # [P]
    rows: jax.Array | None = None

    @staticmethod
    def make(tokens, start=None, length=None, final=None, rows=None, params: SamplingParams | None = None,
             max_new=None, ignore_eos=None) -> "Pieces":
        """Host arrays -> Pieces (numpy leaves; the engine puts them on the mesh)."""
        P = len(tokens)

        def col(v, dtype, default):
            return np.full((P,), default, dtype) if v is None else np.broadcast_to(np.asarray(v, dtype), (P,)).copy()
        params = params or SamplingParams.make(P)
        return Pieces(np.asarray(tokens, np.int32), col(start, np.int32, 0), col(length, np.int32, 0),
                      col(final, bool, False), col(max_new, np.int32, 1), col(ignore_eos, bool, False),
                      jax.tree_util.tree_map(np.asarray, params),
                      None if rows is None else np.asarray(rows, np.int32))

    @staticmethod
    def shapes(P: int, C: int, rows: bool = True) -> "Pieces":
        """Pieces of P rows of C tokens as shape structs (to compile for them ahead)."""
        host = Pieces.make(np.zeros((P, C), np.int32), rows=np.zeros(P, np.int32) if rows else None)
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), host)

    def positions(self) -> jax.Array:
        """[P, C]: each token's position, -1 past the row's length (padding, never written)."""
        C = self.tokens.shape[1]
        t = jnp.arange(C, dtype=jnp.int32)[None, :]
        return jnp.where(t < self.length[:, None], self.start[:, None] + t, -1)


def is_eos(tok: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.any(tok[:, None] == jnp.asarray(eos_ids, jnp.int32)[None, :], axis=-1)


# -- prefill ---------------------------------------------------------------------------------------
def prefill(cfg: ModelConfig, weights, state: State, pieces: Pieces, targets=None, *, out: str = "sample",
            dtype=jnp.bfloat16):
    """One forward over `pieces`, writing their K/V into the cache.

    out="sample": final rows start their slots -> (state, first tokens [P]);
    out="logits": -> (state, float32 logits [P, C, V]); the slot table is left as it is;
    out="nll": -> (state, NLL [N]) of targets (flat token index [N] into the P x C tokens, target
    id [N]; a negative target scores 0), the logits made a few rows at a time.
    """
    h, cache = forward(cfg, weights, pieces.tokens, pieces.positions(), state.cache, dtype, rows=pieces.rows)
    state = state.replace(cache=cache)
    if out == "logits":
        return state, logits_from_hidden(cfg, weights, h)
    if out == "nll":
        return state, _nll(cfg, weights, h, *targets)
    P, C = pieces.tokens.shape
    last = jnp.clip(pieces.length - 1, 0, C - 1)
    h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
    first = sample(logits_from_hidden(cfg, weights, h_last), pieces.params, jnp.zeros((P,), jnp.int32))
    live = pieces.final & (pieces.ignore_eos | ~is_eos(first, cfg.eos_ids)) & (pieces.max_new > 1)
    rows = jnp.arange(P, dtype=jnp.int32) if pieces.rows is None else pieces.rows

    def put(a, v):
        return a.at[rows].set(v, mode="drop")
    sl = state.slots
    one = jnp.ones((P,), jnp.int32)
    slots = Slots(last=put(sl.last, first), pos=put(sl.pos, pieces.start + pieces.length), step=put(sl.step, one),
                  remaining=put(sl.remaining, pieces.max_new - 1), active=put(sl.active, live),
                  ignore_eos=put(sl.ignore_eos, pieces.ignore_eos),
                  params=jax.tree_util.tree_map(put, sl.params, pieces.params))
    return state.replace(slots=slots), first


def _nll(cfg: ModelConfig, weights, h, where, target):
    """NLL of target [N] given the hidden states at flat positions where [N] of h [P, C, D]; only
    scored positions pay for the vocabulary projection."""
    flat = h.reshape(-1, h.shape[-1])
    n = where.shape[0]
    rows = _divisor_at_most(n, max(1, LOGIT_ELEMENTS // cfg.vocab_size))

    def chunk(args):
        w, t = args
        logits = logits_from_hidden(cfg, weights, flat[w])                  # [rows, V] float32
        picked = jnp.take_along_axis(logits, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        return jnp.where(t >= 0, jax.nn.logsumexp(logits, axis=-1) - picked, 0.0)
    return jax.lax.map(chunk, (where.reshape(n // rows, rows), target.reshape(n // rows, rows))).reshape(n)


def _divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


# -- decode ----------------------------------------------------------------------------------------
def decode_step(cfg: ModelConfig, weights, state: State, dtype=jnp.bfloat16):
    """One token for every live slot -> (state, sampled tokens [B], live [B])."""
    sl = state.slots
    live = sl.active
    pos = jnp.where(live, sl.pos, -1)
    h, cache = forward(cfg, weights, sl.last[:, None], pos[:, None], state.cache, dtype)
    tok = sample(logits_from_hidden(cfg, weights, h[:, 0]), sl.params, sl.step)
    inc = live.astype(jnp.int32)
    remaining = sl.remaining - inc
    active = live & (sl.ignore_eos | ~is_eos(tok, cfg.eos_ids)) & (remaining > 0)
    slots = sl.replace(last=jnp.where(live, tok, sl.last), pos=sl.pos + inc, step=sl.step + inc,
                       remaining=remaining, active=active)
    return State(cache, slots), tok, live


def decode(cfg: ModelConfig, weights, state: State, n_steps, stop=None, *, max_steps: int,
           rows: int | None = None, dtype=jnp.bfloat16):
    """Up to n_steps (at most max_steps) decode steps of the first `rows` slots (all for None; the
    others must not be live), ending once none is live. `stop` [rows]: slots to end first (a
    request cancelled or stopped by the host).

    -> (state, tokens [rows, max_steps], count [rows]): slot b sampled tokens[b, :count[b]]."""
    full = state.slots
    B = full.last.shape[0] if rows is None else rows
    slots = jax.tree_util.tree_map(lambda a: a[:B], full)
    if stop is not None:
        slots = slots.replace(active=slots.active & ~stop)
    out = jnp.zeros((B, max_steps), jnp.int32)

    def cond(c):
        i, s, _, _ = c
        return (i < jnp.minimum(n_steps, max_steps)) & jnp.any(s.slots.active)

    def body(c):
        i, s, out, count = c
        s, tok, live = decode_step(cfg, weights, s, dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(live, tok, 0)[:, None], i, axis=1)
        return i + 1, s, out, count + live.astype(jnp.int32)

    init = (jnp.int32(0), State(state.cache, slots), out, jnp.zeros((B,), jnp.int32))
    _, s, out, count = jax.lax.while_loop(cond, body, init)
    if B < full.last.shape[0]:
        slots = jax.tree_util.tree_map(lambda a, v: a.at[:B].set(v), full, s.slots)
        s = s.replace(slots=slots)
    return s, out, count


# -- the host side ---------------------------------------------------------------------------------
def bucket(n: int, lo: int = 16) -> int:
    """Next power of two >= n: lengths come in few shapes, so few compiles."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class EngineCore:
    """A KV cache of `num_slots` rows of `max_len` positions and its slot table, on an engine's mesh
    (`Engine.core`), and the calls that advance them. The server keeps one for its lifetime;
    offline generation, logits and perplexity make one sized to the work."""

    def __init__(self, engine, num_slots: int, max_len: int):
        self.engine = engine
        self.num_slots, self.max_len = num_slots, max_len
        self.state = engine.new_state(num_slots, max_len)

    def reset(self):
        """A fresh state (also after a failed call left the donated one unusable)."""
        self.state = self.engine.new_state(self.num_slots, self.max_len)

    # -- device calls (results stay on the device until read) -------------------------------------
    def prefill(self, pieces: Pieces, out: str = "sample", targets=None):
        e = self.engine
        self.state, res = e.run("prefill", self.state, e.put_rows(pieces),
                                None if targets is None else e.put_rows(targets), out=out)
        return res

    def decode(self, n_steps: int, max_steps: int, stop=None, rows: int | None = None):
        """-> (tokens [rows, max_steps], count [rows]) on the device; see `core.decode`."""
        e = self.engine
        stop = None if stop is None else e.put_rows(np.asarray(stop, bool))
        self.state, toks, count = e.run("decode", self.state, np.int32(n_steps), stop, max_steps=max_steps,
                                        rows=rows)
        return toks, count

    # -- lockstep batches: every row a prompt, prefilled in chunks ----------------------------------
    def prepare(self, longest: int, n_steps: int) -> float:
        """Compile what `prefill_prompts` of prompts up to `longest` tokens and `run_to_completion(
        n_steps)` call, if not compiled yet. -> seconds it took."""
        e, B = self.engine, self.num_slots
        C, _ = e.chunking(longest)
        state = e.state_shapes(B, self.max_len)
        calls = [("prefill", (state, e.row_shapes(Pieces.shapes(B, C, rows=True)), None), {"out": "sample"})]
        if n_steps >= 1:
            calls.append(("decode", (state, np.int32(1), None), {"max_steps": bucket(n_steps, 1), "rows": None}))
        return e.precompile(calls)

    def _chunks(self, tokens: np.ndarray, lens: np.ndarray, chunk: int):
        """(start, tokens [B, chunk], lengths [B]) of each chunk of right-padded rows."""
        for s in range(0, tokens.shape[1], chunk):
            yield s, tokens[:, s:s + chunk], np.clip(lens - s, 0, chunk).astype(np.int32)

    def prefill_prompts(self, ids: list[list[int]], params: SamplingParams, max_new, ignore_eos=None) -> np.ndarray:
        """Prompt b into slot b, every slot at once, in chunks; -> each row's first token."""
        from .engine import pad_rows
        B = len(ids)
        lens = np.asarray([len(x) for x in ids], np.int32)
        C, T = self.engine.chunking(int(lens.max()))
        tokens = pad_rows(ids, T, self.engine.cfg.pad_id)
        firsts, finals = [], []
        for s, tok, length in self._chunks(tokens, lens, C):
            final = (length > 0) & (lens - s <= C)
            rows = np.where(length > 0, np.arange(B), B).astype(np.int32)     # done rows: padding
            firsts.append(self.prefill(Pieces.make(tok, s, length, final, rows, params, max_new, ignore_eos)))
            finals.append(final)
        firsts = np.stack([self.engine.layout.get(f) for f in firsts])
        return firsts[np.argmax(np.stack(finals), axis=0), np.arange(B)]

    def run_to_completion(self, n_steps: int, steps: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Decode every live slot until it is done or has n_steps more tokens, in one loop (of
        `steps` steps where given: 0 runs the compiled loop once without a step, so that its first
        run's costs stay out of a timed one)."""
        if n_steps < 1:
            return np.zeros((self.num_slots, 0), np.int32), np.zeros((self.num_slots,), np.int32)
        toks, count = self.decode(n_steps if steps is None else steps, bucket(n_steps, 1), rows=None)
        get = self.engine.layout.get
        return get(toks), get(count)

    def logits(self, tokens: np.ndarray, lens: np.ndarray, chunk: int) -> np.ndarray:
        """Causal logits [B, T, V] of right-padded rows tokens [B, T] (T whole chunks), row b in
        cache row b, chunk by chunk through the cache."""
        out = []
        for s, tok, length in self._chunks(tokens, np.asarray(lens, np.int32), chunk):
            out.append(self.engine.layout.get(self.prefill(Pieces.make(tok, s, length), out="logits")))
        return np.concatenate(out, axis=1)

    def step_logits(self, tokens, positions) -> np.ndarray:
        """The forward a decode step runs (the decode kernels where they are on), for checks: one
        token per cache row at its position -> float32 logits [B, V]."""
        t = np.asarray(tokens, np.int32).reshape(-1, 1)
        out = self.prefill(Pieces.make(t, np.asarray(positions, np.int32), 1), out="logits")
        return self.engine.layout.get(out)[:, 0]
