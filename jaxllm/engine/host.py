"""The engine core's host side: `EngineCore` holds the KV pools, the slots' block tables and the
slot table on an engine's mesh and advances them through the core's compiled calls (`core.prefill`,
`core.decode`, `core.fork`); `Engine.generate`, `Engine.logits`, perplexity and the scheduler each
drive one."""

from __future__ import annotations

import jax
import numpy as np

from jaxllm.engine.blocks import BlockManager
from jaxllm.engine.sampling import LogProbs, Penalties, SamplingParams, TokenRules
from jaxllm.engine.slots import Forks, Pieces


def bucket(n: int, lo: int = 16) -> int:
    """Next power of two >= n: lengths come in few shapes, so few compiles."""
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


class EngineCore:
    """KV pools for `num_slots` rows of up to `max_len` positions, the rows' block tables and the
    slot table, on an engine's mesh (`Engine.core`), and the calls that advance them. Offline
    generation, logits and perplexity make one sized to the work, each row with its own blocks for
    its whole run; the scheduler keeps one with a pool of `budget` bytes for its lifetime, whose
    blocks its `BlockManager` hands the rows as they need them (`prefix_caching`: and reuses
    cached prefixes)."""

    def __init__(
        self,
        engine,
        num_slots: int,
        max_len: int,
        budget: int | None = None,
        span: int | None = None,
        prefix_caching: bool = False,
        steady: int | None = None,
    ):
        self.engine = engine
        self.num_slots, self.max_len = num_slots, max_len
        if span is None:  # a piece of a prompt at most, as long as a prefill takes
            span = min(max_len, engine.kv_options.prefill_chunk)
        self.plan = engine.pool_plan(num_slots, max_len, budget, span, steady)
        self.blocks = None if budget is None else BlockManager(self.plan, num_slots, prefix_caching)
        self.reset()

    def reset(self):
        """A fresh state (also after a failed call left the donated one unusable): every block free."""
        if self.blocks is not None:
            self.blocks.reset()
        self.uploaded = None if self.blocks is None else self.blocks.version
        self.state = self.engine.new_state(self.plan, None if self.blocks is None else self.blocks.tables)

    def _tables(self):
        """The state with the block tables the host holds now (put on the device when they changed)."""
        b = self.blocks
        if b is not None and b.version != self.uploaded:
            e = self.engine
            # copies: a CPU device may keep using the host buffer it was given, which the host changes
            tables = {n: e.put_rows(t.copy()) for n, t in b.tables.items()}
            self.state = self.state.replace(cache=self.state.cache.replace(tables=tables))
            self.uploaded = b.version
        return self.state

    def state_shapes(self):
        return self.engine.state_shapes(self.plan)

    # -- device calls (results stay on the device until read) -------------------------------------
    def prefill(self, pieces: Pieces, out: str = "sample", targets=None, logprobs: int = 0):
        assert pieces.tokens.shape[1] <= self.plan.span, "a piece longer than the pools' span"
        e = self.engine
        static = {"out": out, **({"logprobs": logprobs} if logprobs else {})}
        self.state, res = e.run(
            "prefill", self._tables(), e.put_rows(pieces), None if targets is None else e.put_rows(targets), **static
        )
        return res

    def fork(self, forks: Forks, copies: dict | None = None, logprobs: int = 0):
        """-> the forked slots' first tokens [F] (with `logprobs`, and their LogProbs) on the device;
        see `core.fork`. `copies` {kind: [(src block, dst block)]}: the blocks to copy."""
        e = self.engine
        F = len(forks.src)
        pad = {n: [(0, np.iinfo(np.int32).max)] * F for n in self.plan.blocks}
        for n, pairs in (copies or {}).items():
            pad[n] = (pairs + pad[n])[:F]
        arrays = {
            n: (np.asarray([s for s, _ in p], np.int32), np.asarray([d for _, d in p], np.int32))
            for n, p in pad.items()
        }
        static = {"logprobs": logprobs} if logprobs else {}
        self.state, res = e.run("fork", self._tables(), e.put_rows(forks), e.put_rows(arrays), **static)
        return res

    def seed_history(self, row: int, tokens: list[int]):
        """Slot `row`'s drafting history holds `tokens` (see `core.seed_history`)."""
        e = self.engine
        hist = np.zeros((1, self.state.slots.spec.history.shape[1]), np.int32)
        n = min(len(tokens), hist.shape[1])
        hist[0, :n] = tokens[:n]
        self.state = e.run("seed_history", self._tables(), e.put_rows(np.asarray([row], np.int32)), e.put_rows(hist))

    def decode(
        self, n_steps: int | None, max_steps: int, stop=None, rows: int | None = None, logprobs: int = 0, allowed=None
    ):
        """-> (tokens [rows, max_steps], count [rows], LogProbs or None) on the device; see
        `core.decode`. A call with `allowed` is a variant of its own, compiled on first use.
        n_steps None: a fixed block of max_steps greedy steps (`core.decode`'s `fixed`)."""
        e = self.engine
        stop = None if stop is None else e.put_rows(np.asarray(stop, bool))
        static = {
            "max_steps": max_steps,
            "rows": rows,
            **({"logprobs": logprobs} if logprobs else {}),
            **({"fixed": True} if n_steps is None else {}),
        }
        masks = () if allowed is None else (e.put_rows(np.asarray(allowed, np.uint32)),)
        n = None if n_steps is None else np.int32(n_steps)
        self.state, toks, count, lp = e.run("decode", self._tables(), n, stop, *masks, **static)
        return toks, count, lp

    def decode_forward(self, rows: int | None = None):
        """The forward of a one-step decode block, apart from its sampling (`decode_sample`): ->
        the logits [rows, V] on the device, for `decode_sample`."""
        e = self.engine
        self.state, logits = e.run("decode_forward", self._tables(), rows=rows)
        return logits

    def decode_sample(
        self, logits, stop=None, rows: int | None = None, logprobs: int = 0, allowed=None, greedy: bool = False
    ):
        """The sampling of the one-step block whose forward gave `logits`: -> as `decode` for one
        step (`greedy`: every live slot's temperature is 0; see `core.decode_sample`)."""
        e = self.engine
        stop = None if stop is None else e.put_rows(np.asarray(stop, bool))
        masks = None if allowed is None else e.put_rows(np.asarray(allowed, np.uint32))
        static = {"rows": rows, **({"logprobs": logprobs} if logprobs else {}), **({"greedy": True} if greedy else {})}
        self.state, toks, count, lp = e.run("decode_sample", self._tables(), logits, stop, masks, **static)
        return toks, count, lp

        # -- lockstep batches: every row a prompt, prefilled in chunks ----------------------------------

    def prepare(self, longest: int, n_steps: int, logprobs: int = 0) -> float:
        """Compile what `prefill_prompts` of prompts up to `longest` tokens and `run_to_completion(
        n_steps)` call, if not compiled yet. -> seconds it took."""
        e, B = self.engine, self.num_slots
        C, _ = e.chunking(longest)
        state = self.state_shapes()
        lp = {"logprobs": logprobs} if logprobs else {}
        calls = [("prefill", (state, e.row_shapes(Pieces.shapes(B, C, rows=True)), None), {"out": "sample", **lp})]
        if n_steps >= 1:
            calls.append(
                ("decode", (state, np.int32(1), None), {"max_steps": self.out_size(n_steps), "rows": None, **lp})
            )
        return e.precompile(calls)

    def out_size(self, n_tokens: int) -> int:
        """A lockstep run's decode buffer for up to n_tokens tokens a row (room for a last
        speculative cycle's tokens past them): a power of two of at least 16, so that short runs
        share one program (the loop runs as many steps as asked, whatever its buffer)."""
        return self.engine.core_out_size(n_tokens, 16)

    def _chunks(self, tokens: np.ndarray, lens: np.ndarray, chunk: int):
        """(start, tokens [B, chunk], lengths [B]) of each chunk of right-padded rows."""
        for s in range(0, tokens.shape[1], chunk):
            yield s, tokens[:, s : s + chunk], np.clip(lens - s, 0, chunk).astype(np.int32)

    def prefill_prompts(
        self,
        ids: list[list[int]],
        params: SamplingParams,
        max_new,
        ignore_eos=None,
        logprobs: int = 0,
        penalties: Penalties | None = None,
        rules: TokenRules | None = None,
    ):
        """Prompt b into slot b, every slot at once, in chunks; -> each row's first token [B] (and
        with `logprobs` their LogProbs [B], host arrays)."""
        B = len(ids)
        lens = np.asarray([len(x) for x in ids], np.int32)
        C, T = self.engine.chunking(int(lens.max()))
        tokens = pad_rows(ids, T, self.engine.cfg.pad_id)
        firsts, finals = [], []
        for s, tok, length in self._chunks(tokens, lens, C):
            final = (length > 0) & (lens - s <= C)
            rows = np.where(length > 0, np.arange(B), B).astype(np.int32)  # done rows: padding
            firsts.append(
                self.prefill(
                    Pieces.make(tok, s, length, final, rows, params, max_new, ignore_eos, penalties, rules),
                    logprobs=logprobs,
                )
            )
            finals.append(final)
        which = np.argmax(np.stack(finals), axis=0), np.arange(B)
        firsts = jax.tree_util.tree_map(lambda *a: np.stack([self.engine.layout.get(x) for x in a])[which], *firsts)
        return firsts

    def run_to_completion(self, n_steps: int, steps: int | None = None, logprobs: int = 0):
        """Decode every live slot until it is done or has n_steps more tokens, in one loop (of
        `steps` steps where given: 0 runs the compiled loop once without a step, so that its first
        run's costs stay out of a timed one). -> host (tokens [B, S], count [B], LogProbs [B, S]
        with `logprobs`, else None)."""
        if n_steps < 1:
            B = self.num_slots
            return (
                np.zeros((B, 0), np.int32),
                np.zeros((B,), np.int32),
                jax.tree_util.tree_map(np.asarray, LogProbs.zeros((B, 0), logprobs)) if logprobs else None,
            )
        toks, count, lp = self.decode(
            n_steps if steps is None else steps, self.out_size(n_steps), rows=None, logprobs=logprobs
        )
        return jax.tree_util.tree_map(self.engine.layout.get, (toks, count, lp))

    def logits(self, tokens: np.ndarray, lens: np.ndarray, chunk: int) -> np.ndarray:
        """Causal logits [B, T, V] of right-padded rows tokens [B, T] (T whole chunks), row b in
        cache row b, chunk by chunk through the cache."""
        out = []
        for s, tok, length in self._chunks(tokens, np.asarray(lens, np.int32), chunk):
            out.append(self.engine.layout.get(self.prefill(Pieces.make(tok, s, length), out="logits")))
        return np.concatenate(out, axis=1)

    def spec_stats(self, rows=None) -> dict | None:
        """Speculation since the core was made, summed over the slots (or `rows`): verify cycles,
        tokens drafted, drafts accepted; None without speculation."""
        spec = self.state.slots.spec
        if spec is None:
            return None
        st = self.engine.layout.get(spec.stats)
        st = st if rows is None else st[np.asarray(rows)]
        return dict(zip(("cycles", "drafted", "accepted"), (int(x) for x in st.sum(axis=0))))

    def step_logits(self, tokens, positions) -> np.ndarray:
        """The forward a decode step runs (the decode kernels where they are on), for checks: one
        token per cache row at its position -> float32 logits [B, V]."""
        t = np.asarray(tokens, np.int32).reshape(-1, 1)
        out = self.prefill(Pieces.make(t, np.asarray(positions, np.int32), 1), out="logits")
        return self.engine.layout.get(out)[:, 0]


def pad_rows(ids, length: int, pad_id: int) -> np.ndarray:
    out = np.full((len(ids), length), pad_id, np.int32)
    for b, x in enumerate(ids):
        out[b, : len(x)] = x
    return out
