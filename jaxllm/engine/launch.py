"""The engine thread's device calls (`Launcher`): a prefill forward over pieces of the waiting
prompts, the fork of a prompt's slot into its request's other answers, a decode block, and the two
calls of a constrained step (its forward, launched ahead, and its sampling, with the grammars'
masks). Each call is built from the jobs it serves, launched on the engine core, timed as the
engine thread's part of that kind (apart from any compiling it had to do), recorded, and handed
to the output thread; the scheduler decides which calls run, over which jobs and rows.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time

import numpy as np

from jaxllm.engine.grammar import masks
from jaxllm.engine.jobs import Job, Observer
from jaxllm.engine.results import Launched, ResultReader
from jaxllm.engine.sampling import Penalties, SamplingParams, TokenRules
from jaxllm.engine.slots import Forks, Pieces
from jaxllm.engine.warmup import LOGPROBS

log = logging.getLogger("jaxllm.engine")


class Launcher:
    """The calls the engine thread launches on the scheduler's core.

    `engine`, `core`: the engine and the scheduler's core; `results`: the output thread's reader,
    which each call is handed to; `record`: the scheduler's record of what the device ran, which
    each call joins; `mask_words`: a grammar mask's row; `structured`: requests may be constrained,
    so every prefill and fork passes masks (one compiled variant of each, whichever requests come);
    `out_size`: the tokens a decode call returns a row.

    `launched`: the calls launched so far; `ahead`: a one-step block's forward launched ahead
    (its rows, `launched` then, its logits), or None; `last_result`: what the last call returns."""

    def __init__(
        self,
        engine,
        core,
        results: ResultReader,
        record: collections.deque,
        *,
        mask_words: int,
        structured: bool,
        out_size: int,
    ):
        self.engine, self.core, self.results, self.record = engine, core, results, record
        self.mask_words, self.structured, self.out_size = mask_words, structured, out_size
        self.observer = Observer()  # the scheduler's
        self.launched = 0
        self.ahead = None
        self.last_result = None

    def reset(self):
        """A fresh core: nothing launched ahead, nothing to wait for."""
        self.ahead = self.last_result = None

    @contextlib.contextmanager
    def device_call(self, kind: str):
        """Time a call of the engine core as the engine thread's `kind` ("prefill", "decode", ...),
        apart from any compiling it had to do first (a shape no warmup compiled: logged, and counted
        as "compile")."""
        e = self.engine
        t, c = time.perf_counter(), e.compile_s
        try:
            yield
        finally:
            compiled = e.compile_s - c
            self.observer.busy("engine", kind, time.perf_counter() - t - compiled)
            self.observer.calls(kind)
            if compiled:
                self.observer.busy("engine", "compile", compiled)
                log.info("compiled a %s call for a new shape in %.2f s", kind, compiled)

    def seed_history(self, job: Job):
        """A speculating request that takes a cached prefix: its drafting history reads the prompt."""
        with self.device_call("history"):
            self.core.seed_history(job.slot, job.prompt)

    # -- prompts -----------------------------------------------------------------------------------
    def prefill(self, jobs: list[Job], lengths: list[int], P: int, C: int) -> list[bool]:
        """One prefill forward of shape (P pieces, C tokens each): the next `lengths[i]` tokens of
        each of `jobs`' prompts (their blocks taken), the rest padding. Each job's prompt advances
        (`prefilled`), its full blocks join the prefix cache. -> whether each piece ends its prompt
        (its first token drawn)."""
        B = self.core.num_slots
        tokens = np.full((P, C), self.engine.cfg.pad_id, np.int32)
        start, length, rows = np.zeros(P, np.int32), np.zeros(P, np.int32), np.full(P, B, np.int32)
        final, max_new, ignore = np.zeros(P, bool), np.ones(P, np.int32), np.zeros(P, bool)
        temp, top_k, top_p, seed = (
            np.zeros(P, np.float32),
            np.zeros(P, np.int32),
            np.ones(P, np.float32),
            np.zeros(P, np.uint32),
        )
        min_p = np.zeros(P, np.float32)
        first, step0, out_start = np.zeros(P, bool), np.zeros(P, np.int32), np.full(P, np.iinfo(np.int32).max, np.int32)
        for i, (job, n) in enumerate(zip(jobs, lengths)):
            r, prompt = job.req, job.prompt
            tokens[i, :n] = prompt[job.prefilled : job.prefilled + n]
            start[i], length[i], rows[i] = job.prefilled, n, job.slot
            first[i] = job.prefilled == job.start_at
            job.prefilled += n
            final[i] = job.prefilled == len(prompt)
            max_new[i], ignore[i] = max(r.max_tokens - job.resumed, 1), r.ignore_eos
            step0[i], out_start[i] = job.resumed, len(r.prompt_ids)
            temp[i], top_k[i], seed[i] = r.temperature, r.top_k or 0, r.choice_seed(job.index)
            top_p[i], min_p[i] = 1.0 if r.top_p is None else r.top_p, r.min_p
            self.core.blocks.commit(job.slot, prompt, job.prefilled)
        params = SamplingParams(temp, top_k, top_p, seed, min_p)
        pen = Penalties(
            *(
                np.asarray([getattr(j.req, k) for j in jobs] + [d] * (P - len(jobs)), np.float32)
                for k, d in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0))
            )
        )
        rules = TokenRules.make(
            P,
            [j.req.logit_bias for j in jobs],
            [j.req.stop_token_ids for j in jobs],
            [j.req.min_tokens for j in jobs] + [0] * (P - len(jobs)),
        )
        scored = [(int(s), int(n)) if j.prefill_scores else None for j, s, n in zip(jobs, start, length)]
        targets = prompt_targets(jobs, scored, P, C) if any(scored) else None
        masked = [j.matcher if f else None for j, f in zip(jobs, final)]
        # A server that constrains passes masks with every prefill (all ones for the free rows): one
        # compiled variant of each prefill shape, compiled before ready, whichever requests come.
        allowed = masks(masked + [None] * (P - len(jobs)), self.mask_words) if self.structured else None
        with self.device_call("prefill"):
            drawn = self.core.prefill(
                Pieces.make(
                    tokens,
                    start,
                    length,
                    final,
                    rows,
                    params,
                    max_new,
                    ignore,
                    pen,
                    rules,
                    allowed,
                    first,
                    step0,
                    out_start,
                ),
                targets=targets,
                logprobs=LOGPROBS,
            )
        self.record.append(
            {"kind": "prefill", "pieces": [(j.id, int(s), int(n)) for j, s, n in zip(jobs, start, length)]}
        )
        finals = list(final[: len(jobs)])
        self._put(Launched("prefill", drawn, jobs, finals=finals, scored=scored))
        return finals

    def fork(self, children: list[Job], copies: dict):
        """Fork each child's parent slot (which has just ended its prompt) into the child's, each
        drawing its own first token; `copies` {kind: [(src block, dst block)]}: the partial last
        blocks copied (the full ones are shared)."""
        F = self.core.num_slots
        allowed = (
            masks([c.matcher for c in children] + [None] * (F - len(children)), self.mask_words)
            if self.structured
            else None
        )  # a constrained answer's first token too
        forks = Forks.make(
            F,
            [c.parent.slot for c in children],
            [c.slot for c in children],
            [c.req.choice_seed(c.index) for c in children],
            allowed,
        )
        with self.device_call("fork"):
            first = self.core.fork(forks, copies, logprobs=LOGPROBS)
        for c in children:
            c.prefilled = len(c.req.prompt_ids)
        self.record.append({"kind": "fork", "forks": [(c.id, c.slot, c.parent.slot) for c in children]})
        self._put(Launched("fork", first, children))

    # -- decoding ----------------------------------------------------------------------------------
    def decode(self, steps: int, rows: int, stop, slots: list, decoding: list[Job], *, fixed, masked, asked):
        """A decode block of `steps` over the leading `rows` of `slots` (each slot's job), `stop`:
        the rows to end first; `decoding`: the jobs that decode. `fixed`: a block the device runs
        without the host (`core.decode`'s); `masked`: with the grammars' masks (all ones for free
        rows); `asked`: computing the tokens' log-probabilities. -> the results of the call before
        a fixed block, which the engine thread waits for before planning past it (else None)."""
        allowed = (
            masks([j.matcher if j in decoding else None for j in slots[:rows]], self.mask_words) if masked else None
        )
        before = self.last_result
        with self.device_call("decode"):
            toks = self.core.decode(
                None if fixed else steps,
                steps if fixed else self.out_size,
                stop,
                rows,
                logprobs=LOGPROBS if asked else 0,
                allowed=allowed,
            )
        self._put_decode(toks, steps, rows, slots, fixed=fixed)
        return before if fixed else None

    def forward(self, rows: int):
        """Launch the forward of the next one-step block now, while the host still reads the
        last one back and advances the grammars: the sampling call that follows takes its logits
        (`sample`), unless another call changes the slots first."""
        with self.device_call("forward"):
            self.ahead = (rows, self.launched, self.core.decode_forward(rows))

    def sample(self, rows: int, stop, slots: list, decoding: list[Job], then_forward: bool):
        """A step while a constrained request decodes, in two calls: the forward (launched ahead
        when it could be) and the sampling, which takes the grammars' masks of the step.
        `then_forward`: launch the next step's forward right after."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[:2] != (rows, self.launched):
            self.forward(rows)
            ahead, self.ahead = self.ahead, None
        allowed = masks([j.matcher if j in decoding else None for j in slots[:rows]], self.mask_words)
        greedy = all(j.req.temperature == 0 for j in decoding)
        with self.device_call("sample"):
            toks = self.core.decode_sample(ahead[2], stop, rows, logprobs=LOGPROBS, allowed=allowed, greedy=greedy)
        self._put_decode(toks, 1, rows, slots, hold=True)
        if then_forward:
            self.forward(rows)

    def _put_decode(self, toks, steps: int, rows: int, slots: list, hold: bool = False, fixed: bool = False):
        rec = {"kind": "decode", "steps": steps, "rows": rows, "fixed": fixed, "tokens": {}}
        self.record.append(rec)
        jobs = [j if j is not None and j.started else None for j in slots[:rows]]
        for j in jobs:  # a live row samples one token a step (a speculative cycle: at least one)
            if j is not None:
                j.launched += steps
        self._put(Launched("decode", toks, jobs, record=rec, hold=hold))

    def _put(self, call: Launched):
        self.launched += 1
        self.last_result = call.result
        with self.observer.timed("engine", "output"):  # the output thread two calls behind
            self.results.put(call)


def prompt_targets(jobs: list[Job], scored: list, P: int, C: int):
    """Every token of the forward scored against the prompt's next token (-1 where there is
    none to score: other requests' pieces, padding, a prompt's last token, whose next token is
    the first sampled one) -> (flat index [P * C], target [P * C])."""
    target = np.full((P, C), -1, np.int32)
    for i, (job, sc) in enumerate(zip(jobs, scored)):
        if sc is not None:
            s, n = sc
            nxt = job.req.prompt_ids[s + 1 : s + n + 1]
            target[i, : len(nxt)] = nxt
    return np.arange(P * C, dtype=np.int32), target.reshape(-1)
