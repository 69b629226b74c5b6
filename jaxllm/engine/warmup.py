"""The server's compiled calls: the shapes a request can wait on, the largest of each kind compiled
before serving and the others on a thread of their own, each run once before a request waits on
it where first runs cost more, and which compiled shape a call takes meanwhile (`Warmup`)."""

from __future__ import annotations

import gc
import logging
import threading
import time

import jax
import numpy as np

from jaxllm.engine.jobs import Job
from jaxllm.engine.request import MAX_LOGPROBS
from jaxllm.engine.shapes import Shapes
from jaxllm.engine.slots import Forks, Pieces

log = logging.getLogger("jaxllm.engine")

# Every prefill, fork and constrained-step call of the server computes the top alternatives of each
# token it samples, whether or not a request asks: one compiled variant of each, compiled before
# the server is ready, instead of a second one compiled on a request's first use (a stall of up to
# 2 s for every running request, Qwen3-4B on one H100). The top 20 of a step's logits come from the
# 20 blocks of 128 with the largest maxima (`sampling.top_k`), after a log-softmax over the
# vocabulary. Decode blocks, which run most tokens, have both variants compiled before ready and
# compute the alternatives only while a request asks: in every step they cost 0.4 ms a token of
# Qwen3-4B at batch 1 (2.7 ms against 2.3, one H100) and up to two fifths of the embedded model's
# throughput. They are read back only for a call that holds a request asking for them. A prefill
# that also scores its prompts' own tokens (a request's `echo` with log-probabilities) is a shape of
# its own, as costly to compile as the plain one: one of them is compiled before serving and the
# others in the background (`Warmup.prefill_shapes`).
LOGPROBS = MAX_LOGPROBS


class Warmup:
    """The scheduler's compiled shapes: which are compiled (`ready`, under the scheduler's `cond`;
    None once all are), compiling in the background (`compiling`), and compiled but not yet run once
    (`unprimed`); the calls of each (`groups`).

    `engine`, `core`: the engine and the scheduler's core; `shapes`: the shapes of its calls;
    `decode_steps`, `out_size`: a decode block's steps and the tokens a call returns a row;
    `mask_words`: a grammar mask's row; `structured`: requests may be constrained, so the calls of
    constrained steps are compiled too; `deterministic`: one decode call whatever runs beside a
    request; `first_runs`: run each compiled call once before a request can wait on it (`prime`;
    None: where the backend's first runs cost more, `first_run_costs`); `freeze_heap`:
    `settle_heap`."""

    def __init__(
        self,
        engine,
        core,
        shapes: Shapes,
        cond: threading.Condition,
        *,
        decode_steps: int,
        out_size: int,
        mask_words: int,
        structured: bool = False,
        deterministic: bool = False,
        first_runs: bool | None = None,
        freeze_heap: bool = False,
    ):
        self.engine, self.core, self.shapes, self.cond = engine, core, shapes, cond
        self.decode_steps, self.out_size, self.mask_words = decode_steps, out_size, mask_words
        self.structured, self.deterministic = structured, deterministic
        self.first_runs = engine.ops.first_run_costs if first_runs is None else first_runs
        self.freeze_heap = freeze_heap
        self.ready: set | None = None  # shapes compiled while the others compile (None: any shape)
        self.compiling = 0  # shapes still compiling in the background
        self.groups: dict = {}  # the calls of each shape (`calls`), once warmed up
        self.unprimed: list = []  # shapes compiled, not yet run once (`prime`)

    def calls(self) -> dict:
        """Every call a request can wait on, by the shape that picks it: {("prefill", P, C) or
        ("score", P, C) (the prefill that also scores its prompts' tokens) or ("decode", rows) or
        ("fixed", rows) or ("fork",): [(name, args, static), ...]}."""
        e = self.engine
        state = self.core.state_shapes()
        lp = {"logprobs": LOGPROBS}
        words = self.mask_words if self.structured else 0

        def pieces(P, C):
            return e.row_shapes(Pieces.shapes(P, C, rows=True, mask_words=words))

        def scored(P, C):  # `launch.prompt_targets`: every token's flat index and target
            return e.row_shapes((np.zeros(P * C, np.int32), np.zeros(P * C, np.int32)))

        groups = {
            (kind, P, C): [("prefill", (state, pieces(P, C), targets), {"out": "sample", **lp})]
            for P, C in self.shapes.prefills()
            for kind, targets in (("prefill", None), ("score", scored(P, C)))
        }
        for n in self.shapes.decodes():
            if self.deterministic:  # one decode call, whatever the requests ask (`Scheduler._launch`)
                masked = (e.row_shapes(np.zeros((n, self.mask_words), np.uint32)),) if self.structured else ()
                groups[("decode", n)] = [
                    (
                        "decode",
                        (state, np.int32(1), e.row_shapes(np.zeros(n, bool)), *masked),
                        {"max_steps": self.out_size, "rows": n, **lp},
                    )
                ]
                continue
            calls = [
                (
                    "decode",
                    (state, np.int32(1), e.row_shapes(np.zeros(n, bool))),
                    {"max_steps": self.out_size, "rows": n, **asked},
                )
                for asked in (lp, {})
            ]
            if self.structured and e.spec is None:  # the two calls of a constrained step
                V = e.cfg.vocab_size
                logits = jax.ShapeDtypeStruct((n, V), np.float32, sharding=e.layout.batch_sharding((n, V)))
                calls.append(("decode_forward", (state,), {"rows": n}))
                calls += [
                    (
                        "decode_sample",
                        (
                            state,
                            logits,
                            e.row_shapes(np.zeros(n, bool)),
                            e.row_shapes(np.zeros((n, self.mask_words), np.uint32)),
                        ),
                        {"rows": n, **lp, **greedy},
                    )
                    for greedy in ({}, {"greedy": True})
                ]
            elif self.structured:  # a speculating server's constrained blocks
                calls += [
                    (
                        "decode",
                        (
                            state,
                            np.int32(1),
                            e.row_shapes(np.zeros(n, bool)),
                            e.row_shapes(np.zeros((n, self.mask_words), np.uint32)),
                        ),
                        {"max_steps": self.out_size, "rows": n, **asked},
                    )
                    for asked in (lp, {})
                ]
            groups[("decode", n)] = calls
            if e.spec is None:  # greedy blocks the device runs without the host (`core.decode`'s `fixed`)
                groups[("fixed", n)] = [
                    (
                        "decode",
                        (state, None, e.row_shapes(np.zeros(n, bool))),
                        {"max_steps": self.decode_steps, "rows": n, **asked, "fixed": True},
                    )
                    for asked in (lp, {})
                ]
        if e.spec is not None:  # the drafting history of a request with a cached prefix
            H = state.slots.spec.history.shape[1]
            groups[("history",)] = [
                (
                    "seed_history",
                    (state, e.row_shapes(np.zeros(1, np.int32)), e.row_shapes(np.zeros((1, H), np.int32))),
                    {},
                )
            ]
        if self.core.num_slots > 1:
            F = self.core.num_slots
            forks = Forks.make(F, allowed=np.zeros((F, words), np.uint32) if words else None)
            copies = {n: (np.zeros(F, np.int32), np.zeros(F, np.int32)) for n in self.core.plan.blocks}
            groups[("fork",)] = [("fork", (state, e.row_shapes(forks), e.row_shapes(copies)), lp)]
        return groups

    def compile(self, background: bool = True) -> float:
        """Compile what a request can wait on before serving: with `background`, the largest shape
        of each kind first (the largest prefill rows of each piece length, the decode blocks over
        every slot, the fork, and the scoring variant of the prefill shape of fewest tokens among
        them), after which any request can be served, on the compiled shapes (a decode block over
        more rows, a prefill forward of those shapes); the others compile on a thread of their own
        while the server serves, each taken up as soon as it is compiled. Without, everything
        before. -> seconds taken before serving."""
        groups = self.calls()
        if self.engine.steps_cache is not None:  # what an earlier process kept: every shape at once
            self.engine.read_back([c for calls in groups.values() for c in calls])
        largest = {k for k in groups if k[0] in ("fork", "history")} | {("decode", self.shapes.decodes()[-1])}
        most = [(self.shapes.row_counts(C)[-1], C) for C in self.shapes.lengths()]
        largest |= {("prefill", P, C) for P, C in most} | {("score", *min(most, key=lambda s: s[0] * s[1]))}
        first = largest | {k for k, calls in groups.items() if all(map(self.engine.compiled, calls))}

        def smallest_first(keys):  # a lone request's decode blocks and prefill first
            return sorted(keys, key=lambda k: (k[0] not in ("decode", "fixed"), k[1:], k[0]))

        rest = smallest_first(k for k in groups if k not in first) if background else []
        with self.cond:
            self.ready = None if not rest else set(first)
        t = self.engine.precompile([c for k in groups if k not in rest for c in groups[k]])
        self.groups = groups
        if self.first_runs:
            # With `background`, the smaller shapes read back from an earlier process's cache run
            # once as the engine thread idles, as those compiled in the background do: a warm start
            # runs 30 calls once in 1.6 s, the Qwen3-4B shape's server on one H100.
            now = [k for k in groups if k not in rest and (not background or k in largest)]
            primed = self.prime(now)
            log.info(
                "ran each of the %d calls compiled before serving once in %.2f s",
                sum(len(groups[k]) for k in now),
                primed,
            )
            t += primed
            self.unprimed = smallest_first(k for k in groups if k not in rest and k not in now)
        if rest:
            self.compiling = len(rest)
            threading.Thread(
                target=self._compile_rest, args=([(k, groups[k]) for k in rest],), name="jaxllm-compile", daemon=True
            ).start()
        return t

    def _compile_rest(self, todo: list):
        """Compile the shapes in `todo` ([(shape, its calls)], the most wanted first) together, each
        taken up as soon as its calls are compiled."""
        t0 = time.perf_counter()

        def taken_up():
            with self.cond:
                if self.ready is None:
                    return
                for key, calls in todo:
                    if key not in self.ready and all(map(self.engine.compiled, calls)):
                        self.ready.add(key)
                        if self.first_runs:
                            self.unprimed.append(key)
                        self.compiling -= 1
                self.cond.notify()  # the engine thread runs them once when idle
                if not self.compiling:  # every shape compiled: any shape from now on, as
                    self.ready = None  # `load()` reports none compiling

        try:
            self.engine.precompile([c for _, calls in todo for c in calls], counted=False, on_compiled=taken_up)
        except Exception:  # the shapes not compiled stay unused
            log.exception("compiling the server's smaller shapes failed; their requests run on larger ones")
            with self.cond:
                self.compiling = 0
            return
        with self.cond:
            self.ready, self.compiling = None, 0
        log.info("the other %d shapes compiled in the background in %.1f s", len(todo), time.perf_counter() - t0)
        if not self.first_runs:  # (else once the engine thread has run them)
            self.settle_heap("every shape compiled")

    def prime(self, keys: list) -> float:
        """Run each call of the shapes `keys` once, on the slot table as it is, with nothing to do:
        prefill rows all padding, forks to no slot, no slot told to stop, so that no live slot changes
        (an idle slot runs at position -1 and writes nothing). A GPU loads a call's kernels and builds
        its command buffers at its first run, 20 to 60 ms a call on one H100 (0.5 s for the 23 calls
        of the Gemma 3 270M shape's server, 0.6 s for Qwen3-4B's), which the first requests would
        otherwise wait on (`first_runs`). The engine thread's, or before it starts. -> seconds taken."""
        t = time.perf_counter()
        core = self.core
        for key in keys:
            for name, args, static in self.groups[key]:
                idle = [self._idle_arg(a) for a in args[1:]]
                if name == "seed_history":  # a slot past the table: nothing written
                    idle[0] = self.engine.put_rows(np.full(1, core.num_slots, np.int32))
                out = self.engine.run(name, core.state, *idle, **static)
                core.state = out if name == "seed_history" else out[0]
        jax.block_until_ready(core.state)
        return time.perf_counter() - t

    def _idle_arg(self, a):
        """A concrete argument, for `prime`, of a warm-up call's shape struct `a`."""
        e, B = self.engine, self.core.num_slots
        words = 0 if getattr(a, "allowed", None) is None else a.allowed.shape[1]
        if isinstance(a, Pieces):
            P, C = a.tokens.shape
            return e.put_rows(
                Pieces.make(
                    np.zeros((P, C), np.int32),
                    rows=np.full(P, B, np.int32),
                    allowed=np.zeros((P, words), np.uint32) if words else None,
                )
            )
        if isinstance(a, Forks):
            F = a.src.shape[0]
            return e.put_rows(Forks.make(F, allowed=np.zeros((F, words), np.uint32) if words else None))
        return jax.tree_util.tree_map(
            lambda x: (
                e.layout.put(np.zeros(x.shape, x.dtype), x.sharding) if isinstance(x, jax.ShapeDtypeStruct) else x
            ),
            a,
        )

    def settle_heap(self, what: str):
        """With `freeze_heap` (a process that serves for its lifetime): collect, then move every
        object alive (the model, the compiled calls, the libraries) out of the garbage collector's
        reach, once the server is warm and again once the shapes compiled in the background are.
        Its full passes then walk only what requests made since, a few milliseconds, where they
        walked the whole heap, which every running request waited on: on one H200, 374 ms for the
        Gemma 3 270M shape's server and 312 ms for Qwen3-4B's, once every few seconds of a 64-client
        load (its TTFT p99 444 and 464 ms against 90 and 237 ms frozen). What is frozen is never
        collected."""
        if not self.freeze_heap:
            return
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        log.info(
            "%s: %d objects moved out of the garbage collector's passes in %.2f s",
            what,
            gc.get_freeze_count(),
            time.perf_counter() - t,
        )

    def prime_next(self) -> bool:
        """Run the next shape compiled in the background once (`prime`; the engine thread's, with no
        slot in use and no request waiting): one at a time, so that a request arriving meanwhile
        waits for one shape's calls at most. -> whether there was one."""
        with self.cond:
            if not self.unprimed:
                return False
            key = self.unprimed.pop(0)
        log.debug("ran the calls of %s, compiled in the background, once in %.3f s", key, self.prime([key]))
        if not self.unprimed and not self.compiling:
            log.info("every shape has run once")
            self.settle_heap("every shape run once")
        return True

    def decode_rows(self, live: int) -> int:
        """The leading slots a decode block covers for `live`: the shape's, or while that shape
        compiles, the next larger compiled one."""
        n = self.shapes.decode_rows(live)
        ready = self.ready
        if ready is None:
            return n
        return next(m for m in self.shapes.decodes() if m >= n and ("decode", m) in ready)

    def fixed(self, rows: int, decoding: list[Job]) -> bool:
        """Whether the next block of `rows` slots can be a fixed one (`core.decode`'s `fixed`):
        every decoding request greedy and its variant compiled (until then, the other one runs)."""
        if self.engine.spec is not None or self.deterministic or any(j.req.temperature != 0 for j in decoding):
            return False
        ready = self.ready
        return ready is None or ("fixed", rows) in ready

    def prefill_shapes(self, scored: list[bool]):
        """Which prefill shapes a forward may take now, for the prompts waiting in order, `scored`
        where their own tokens are scored: any, or while some compile, the compiled ones (the most
        rows of each piece length are compiled before serving); a forward that holds a scored
        prompt takes a compiled scoring shape (one is before serving). -> a predicate of (rows,
        piece length), or None for any."""
        ready = self.ready
        if ready is None:
            return None
        plain = next((i for i, s in enumerate(scored) if s), len(scored))  # prompts before the first scored
        return lambda P, C: ("prefill" if P <= plain else "score", P, C) in ready
