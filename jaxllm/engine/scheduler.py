"""The scheduler: one thread owns the device and the engine core (admits queued requests into free
slots, prefills their prompts in chunks, decodes the live slots in blocks), another reads each
call's tokens back and turns them into the requests' text.

Request handlers (asyncio) hand a `Job` to `Scheduler.submit` and read `Event`s back from it; no
thread here blocks on a client, and a client never touches the device.

Each round the engine thread launches at most one prefill forward (pieces of the waiting prompts,
at most `max_num_batched_tokens` tokens, several requests' pieces in one forward, in the shape that
does the most for its cost: `Shapes.choose`) and then a decode
block over the live slots, so a new request waits for no running one to finish, and between two
tokens of a running request at most one prefill forward runs. When the device has nothing left to
run, the first prefill waits a few milliseconds for requests that arrive together, so that they
share one forward (`_gather_arrivals`). While prompts wait for their prefill
the blocks are one step long, so that prefills follow one another closely; otherwise `decode_steps`
long. A block of `decode_steps` whose requests are all greedy is a fixed one (`core.decode`'s
`fixed`): nothing in it waits for the host, so its call returns at once and the engine thread plans
the next call while the device runs it, once the device has run the call before it (a wait without
the GIL), knowing of the requests the calls in flight end only those they take to their token limit
(`Job.launched`). A GPU runs the other blocks deciding each step on the host, so their call returns
once the device has run them. The output thread detokenizes a block while the device runs the
next; at most two calls wait for it.

Structured output: a constrained request's `grammar.Matcher` takes each of its tokens as the output
thread reads them. While a constrained request decodes, the blocks are one step long, each in two
calls: the step's forward, launched as soon as the previous step's sampling is (it needs nothing
from the host), and its sampling, launched once the output thread has read every call back and the
engine thread has written each constrained slot's allowed tokens into a bitmask (unconstrained rows
all ones). The device runs the forward while the host advances the grammars. The output thread
has each grammar take its token at once, but holds every row's tokens back and turns them into text
and events a block's worth at a time (or as soon as the answer may end), so that a one-token step
costs the host little more than the grammars' work. (With speculative decoding a step is one call,
its masks written before it.) A prefill piece that ends a constrained prompt gets its row too, for
the first token.

A request for n answers takes n slots at once. Its prompt is prefilled into the first; right after
the forward that ends it, `EngineCore.fork` copies that slot into the others, each drawing its own
first token with its own seed, and from there each answer is a job of its own.

Each thread counts its time by part (`Observer.busy`; the server's
`jaxllm:scheduler_thread_seconds`): the engine thread's time inside the core's calls ("prefill",
"decode", "fork", "forward", "sample"; on GPUs a decode block's call, unless fixed, returns once
the device has run it, and a call that samples once the device reaches its sampling) apart from
compiling a shape no warmup compiled ("compile"), waiting for the device before planning past a
fixed block ("device"), for the output thread ("output") and for work ("idle"),
the rest being its own scheduling; the output thread's time waiting for a call to be launched
("idle"), for the device to finish it ("device"), and turning its results into events
("processing").
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
import time

import jax
import numpy as np

from jaxllm.engine.grammar import masks
from jaxllm.engine.jobs import ARRIVAL_GAP, ARRIVAL_WAIT, RETURN_GAP, RETURN_WAIT, Failed, Job, Observer, QueueFull
from jaxllm.engine.memory import KVMemory, Seats, deterministic_memory
from jaxllm.engine.results import Launched, ResultReader
from jaxllm.engine.sampling import Penalties, SamplingParams, TokenRules
from jaxllm.engine.shapes import Shapes
from jaxllm.engine.slots import Forks, Pieces
from jaxllm.engine.warmup import LOGPROBS, Warmup
from jaxllm.errors import ModelError

log = logging.getLogger("jaxllm.engine")


# -- the scheduler --------------------------------------------------------------------------------
class Scheduler:
    def __init__(
        self,
        engine,
        max_num_seqs: int,
        max_model_len: int,
        max_queue: int,
        decode_steps: int = 8,
        max_num_batched_tokens: int | None = None,
        record: int = 10_000,
        structured: bool = False,
        first_runs: bool | None = None,
        freeze_heap: bool = False,
        kv_memory: KVMemory | None = None,
        deterministic: bool = False,
    ):
        """`max_num_batched_tokens`: prompt tokens a prefill forward takes (None: the backend's,
        `XlaOps.prefill_tokens`). `structured`: requests may be constrained (a grammar engine serves
        them), so the calls of constrained steps are compiled before ready too. `first_runs`: run
        each compiled call once before a request can wait on it (`Warmup.prime`; None: where the
        backend's first runs cost more, `first_run_costs`). `freeze_heap`: `Warmup.settle_heap`.
        `kv_memory`: the size of the KV pool and whether it caches prefixes. `deterministic`: a
        request's answer is the same whatever runs beside it (`deterministic_memory`)."""
        self.engine = engine
        self.text_tokenizer = engine.tokenizer  # what turns the requests' tokens into text
        self.structured = structured
        if max_num_batched_tokens is None:
            max_num_batched_tokens = engine.ops.prefill_tokens
        if deterministic and engine.spec is not None:
            raise ModelError("deterministic serving does not speculate: its drafts depend on the load")
        self.deterministic = deterministic
        self.shapes = Shapes(
            max_num_batched_tokens,
            max_num_seqs,
            min(max_num_batched_tokens, engine.kv_options.prefill_chunk, max_model_len),
            deterministic=deterministic,
        )
        self.decode_steps = decode_steps  # steps (speculative cycles) a decode block
        tokens = decode_steps * (1 if engine.spec is None else engine.spec.k + 1)
        self.out_size = engine.core_out_size(tokens)
        # A call writes at most a piece of a prompt, or a decode block, past its rows' lowest
        # positions; the output thread's reading may lag three calls behind the engine thread's.
        span = max(self.shapes.max_piece, 8 * tokens)
        kv_memory = kv_memory or KVMemory()
        if deterministic:
            kv_memory = deterministic_memory(kv_memory)
        budget = engine.kv_budget(max_num_seqs, max_model_len, span, kv_memory, max_num_batched_tokens, 8 * tokens)
        self.core = engine.core(
            max_num_seqs,
            max_model_len,
            budget=budget,
            span=span,
            prefix_caching=kv_memory.prefix_caching,
            steady=8 * tokens,
        )
        plan = self.core.plan
        if plan.sequences(max_model_len) < 1:
            raise ModelError(
                f"the KV pool holds {plan.tokens:,} tokens, fewer than one sequence of --max-model-len "
                f"{max_model_len:,}: give it more memory (--kv-cache-memory, --gpu-memory-utilization) "
                f"or lower --max-model-len"
            )
        if deterministic and plan.sequences(max_model_len) < max_num_seqs:
            raise ModelError(
                f"deterministic serving needs a KV pool of every slot at --max-model-len (no request "
                f"is preempted): {plan.sequences(max_model_len)} of {max_num_seqs} fit"
            )
        log.info("%s", plan.describe())
        self.max_queue = max_queue
        self.last_submit = 0.0
        self.last_end = 0.0  # when the output thread last ended a request
        self.returning = 0  # completed requests whose clients have not sent again (`_gather_arrivals`)
        self.ended: collections.deque[Job] = collections.deque()  # finished by the output thread
        self.cond = threading.Condition()
        self.stopping = False  # no new requests
        self.failure: str | None = None  # why the engine or output thread stopped on its own
        self.progress_at = time.monotonic()  # when the engine thread last finished a piece of work
        self.deadline = None  # running requests end with a 503 past this (monotonic)
        self.done = False
        self.results = ResultReader(
            engine.layout.get,
            engine.cfg.eos_ids,
            decode_steps,
            self.cond,
            on_end=self._ended,
            on_failure=functools.partial(self._stopped, "output"),
        )
        self.observer = Observer()
        self.launched = 0  # calls launched
        self.mask_words = -(-engine.cfg.vocab_size // 32)  # a grammar mask's row: one bit a token
        self.ahead = None  # (rows, calls launched then, logits): a one-step block's forward, launched ahead
        self.last_result = None  # what the last call launched returns (on the device)
        self.wait_for = None  # the results of the call before a fixed block just launched
        self.thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self.output = threading.Thread(target=self.results.run, name="jaxllm-output", daemon=True)
        self.warmup = Warmup(
            engine,
            self.core,
            self.shapes,
            self.cond,
            decode_steps=decode_steps,
            out_size=self.out_size,
            mask_words=self.mask_words,
            structured=structured,
            deterministic=deterministic,
            first_runs=first_runs,
            freeze_heap=freeze_heap,
        )
        # What the device ran, in order: {"kind": "prefill", "pieces": [(job, start, length), ...]},
        # {"kind": "fork", "forks": [(job, its slot, the slot it forks), ...]} or {"kind": "decode",
        # "steps": n, "rows": r, "fixed": bool, "tokens": {job: count}} (filled when read back).
        self.record: collections.deque[dict] = collections.deque(maxlen=record)
        # Speculation counts reported so far; the core's are read (one device read) when the engine
        # goes idle after decoding, so that a busy server never waits on the device for them.
        self.spec_reported = {"cycles": 0, "drafted": 0, "accepted": 0}
        self.spec_read = 0  # slots given back when they were last read
        self.seats = Seats(
            self.core,
            self.cond,
            await_results=self._await_results,
            preempted=self._preempted,
            seed_history=None if engine.spec is None else self._seed_history,
        )

    @property
    def observer(self) -> Observer:
        """What the scheduler's threads report to (the server's metrics)."""
        return self._observer

    @observer.setter
    def observer(self, observer: Observer):
        self._observer = self.results.observer = observer

    # -- called from request handlers ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull(self.failure or "the server is shutting down")
            seats = self.seats
            if len(seats.waiting) >= self.max_queue:  # clients that left give their place back
                seats.waiting = collections.deque(j for j in seats.waiting if not j.cancelled.is_set())
            if len(seats.waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            seats.waiting.append(job)
            self.last_submit = time.monotonic()
            self.returning = max(0, self.returning - 1)
            self.cond.notify()

    def load(self) -> dict:
        b, seats = self.core.blocks, self.seats
        with self.cond:
            return {
                "running": sum(j is not None for j in seats.slots),
                "waiting": len(seats.waiting),
                "slots": len(seats.slots),
                "finished": self.results.finished,
                "generated_tokens": self.results.generated,
                "compiling": self.warmup.compiling,
                "warming": len(self.warmup.unprimed),
                "kv_usage": round(b.usage(), 4),
                "preemptions": seats.preemptions,
                "prefix_queries": b.queries,
                "prefix_hits": b.hits,
            }

    def health(self, stall: float) -> str | None:
        """Why the engine cannot serve (None: it can): a thread that stopped on its own, or work
        waiting while neither thread has finished anything for `stall` seconds."""
        if self.failure is not None:
            return self.failure
        started = self.thread.ident is not None
        if started and not self.done and not (self.thread.is_alive() and self.output.is_alive()):
            return "the engine thread is not running"
        with self.cond:
            work = bool(self.seats.waiting) or self.seats.busy()
        idle = time.monotonic() - max(self.progress_at, self.results.progress_at)
        if started and work and idle > stall:
            return f"the engine has made no progress for {idle:.0f} s with requests waiting"
        return None

    def _stopped(self, thread: str, error: BaseException | None):
        """A thread's loop ended without a shutdown: nothing more will run, so every request, the
        waiting ones included, ends now with a 503 and new ones are refused with the reason."""
        if self.done:
            return
        why = f"the engine's {thread} thread stopped" + (f" ({type(error).__name__}: {error})" if error else "")
        log.error("%s; the server cannot generate any more", why)
        with self.cond:
            self.failure = self.failure or why
            self.stopping = True
            waiting = list(self.seats.waiting)
            self.seats.waiting.clear()
        for job in waiting + [j for j in self.seats.slots if j is not None]:
            for c in job.choices if job.parent is None else [job]:
                c.end(Failed(503, why))

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, warmup: bool = True):
        if warmup:
            t = self.warmup.compile()
            n, compiling = len(self.warmup.groups), self.warmup.compiling  # prefill, decode, fork shapes
            log.info(
                "compiled %d of %d shapes of calls in %.1f s%s",
                n - compiling,
                n,
                t,
                f"; the {compiling} others compile in the background, their requests running on larger shapes meanwhile"
                if compiling
                else "",
            )
        self.warmup.settle_heap("warm")
        self.thread.start()
        self.output.start()

    def drain(self, timeout: float):
        """Stop taking requests: queued ones end with a 503 now, running ones may finish for `timeout`
        seconds, then end with a 503 too."""
        with self.cond:
            self.stopping = True
            deadline = time.monotonic() + timeout
            self.deadline = deadline if self.deadline is None else min(self.deadline, deadline)
            waiting = list(self.seats.waiting)
            self.seats.waiting.clear()
            self.cond.notify()
        for job in waiting:
            for c in job.choices:
                c.end(Failed(503, "the server is shutting down"))
        # The engine thread ends the running ones at the deadline between two device calls; this
        # timer ends them then whatever call it is inside (their slots are freed when it returns).
        timer = threading.Timer(timeout, self._end_running, ("the server is shutting down",))
        timer.daemon = True
        timer.start()

    def _end_running(self, why: str):
        for job in [j for j in self.seats.slots if j is not None]:
            job.end(Failed(503, why))

    def shutdown(self, timeout: float = 10.0):
        """End everything now (running requests get a 503) and stop the threads."""
        self.drain(0.0)
        with self.cond:
            self.done = True
            self.cond.notify()
        self.thread.join(timeout)
        self.output.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self):
        error = None
        try:
            while True:
                self.progress_at = time.monotonic()
                with self.cond:
                    while not (
                        self.done
                        or self.seats.waiting
                        or self.ended
                        or self.seats.busy()
                        or self.deadline
                        or self.warmup.unprimed
                    ):
                        with self.observer.timed("engine", "idle"):
                            self.cond.wait()
                    if self.done:
                        break
                    past = self.deadline is not None and time.monotonic() >= self.deadline
                self._free_ended()
                if past:
                    self._fail_running(503, "the server is shutting down")
                    with self.cond, self.observer.timed("engine", "idle"):
                        self.cond.wait(0.05)
                    continue
                try:
                    if self.wait_for is not None:  # a fixed block was launched: plan the next call
                        wait, self.wait_for = self.wait_for, None  # once the device has run the one before it
                        with self.observer.timed("engine", "device"):
                            jax.block_until_ready(wait)
                    self._reap()
                    if self._spec_unread() and not self.seats.busy():  # idle: report what the slots drafted
                        self._read_spec()
                    if self._prime_idle():
                        continue
                    if self._gather_arrivals():
                        self._free_ended()  # the slots of requests that ended meanwhile
                    if not self.stopping:
                        self.seats.admit(self.text_tokenizer)
                    if not self._launch():  # nothing to run (draining, or only waiting on results)
                        with self.cond, self.observer.timed("engine", "idle"):
                            self.cond.wait(0.05)
                except Exception:  # a device failure: fail the batch, keep serving
                    log.exception("engine step failed")
                    self._fail_running(500, "internal error while generating; see the server log")
                    self.core.reset()
                    self.ahead = self.last_result = None
                    self.spec_reported = dict.fromkeys(self.spec_reported, 0)  # a fresh core counts afresh
        except BaseException as e:  # a bug outside one step: the thread cannot go on
            error = e
            log.exception("the engine thread failed")
        finally:
            self._stopped("engine", error)
            self._fail_running(503, "the server is shutting down")
            self.results.close()

    def _prime_idle(self) -> bool:
        """With no slot in use and no request waiting, run the next shape compiled in the background
        once (`Warmup.prime_next`). -> whether it did."""
        with self.cond:
            if not self.warmup.unprimed or self.seats.waiting or self.seats.busy():
                return False
        self.ahead = None  # a forward launched ahead no longer matches the slot table
        return self.warmup.prime_next()

    def _gather_arrivals(self) -> bool:
        """While the device has nothing left to run (no prompt waits for its prefill, and the calls
        launched take every decoding request to its end), let a burst of requests arrive before the
        first prefill: clients that send together (a batch job, the round of a benchmark, clients
        whose answers ended in one block) then share one forward instead of each waiting for the
        forwards of the ones that came a millisecond earlier. Waits while answers of that last
        block are still being read back, and while requests or ends keep coming ARRIVAL_GAP apart,
        up to ARRIVAL_WAIT in all; while clients whose answers ended have not all sent again
        (`returning`), while their requests keep coming RETURN_GAP apart, up to RETURN_WAIT: a
        round of closed-loop clients reaches the server over milliseconds to tens of them (each
        request costs the event loop and the parse thread about half a millisecond), with pauses
        longer than ARRIVAL_GAP, at which 16 such clients' round often took two forwards. Clients
        that do not come back cost the next burst RETURN_GAP once. -> whether it waited."""
        seats = self.seats
        if seats.prefilling or not seats.waiting or seats.to_decode():
            return False
        start = time.monotonic()
        with self.cond, self.observer.timed("engine", "idle"):
            while len(seats.waiting) < len(seats.slots) and not self.done and not self.stopping:
                now = time.monotonic()
                gap, wait = (RETURN_GAP, RETURN_WAIT) if self.returning else (ARRIVAL_GAP, ARRIVAL_WAIT)
                until = start + wait
                if not any(j is not None and not j.done for j in seats.slots):  # all answers read back
                    until = min(max(self.last_submit, self.last_end) + gap, until)
                if until <= now:
                    self.returning = 0  # those not back by now are not coming soon
                    break
                self.cond.wait(until - now)
        return True

    def _launch(self) -> bool:
        """Launch one prefill forward where prompts wait, then a decode block where slots are live."""
        seats = self.seats
        prefilled = bool(seats.prefilling)
        if prefilled:
            self._launch_prefill()
        decoding = seats.to_decode()
        if decoding:  # blocks for a block's worth of tokens a row
            decoding = seats.decode_blocks(
                decoding, self.decode_steps * (1 if self.engine.spec is None else self.engine.spec.k + 1)
            )
        constrained = any(j.matcher is not None for j in decoding)
        if constrained:  # their matchers must have taken their last tokens
            if self._split_steps() and self.ahead is None and not seats.prefilling:
                self._launch_forward(self.warmup.decode_rows(max(j.slot for j in decoding) + 1))
            self._await_results()
            self._free_ended()
            decoding = seats.to_decode()
            constrained = any(j.matcher is not None for j in decoding)
        if not decoding:
            return prefilled or constrained
        n = 1 if seats.prefilling or constrained else self.decode_steps
        rows = self.warmup.decode_rows(max(j.slot for j in decoding) + 1)
        if constrained and self.ahead is not None and self.ahead[1] == self.launched:
            rows = max(rows, self.ahead[0])  # the forward launched ahead covers these rows
        stop = seats.to_stop[:rows].copy()
        seats.to_stop[:rows] = False
        if constrained and self._split_steps():
            return self._launch_sampling(rows, stop, decoding)
        # a deterministic server passes masks with every block where requests may be constrained
        # (all ones for the others): one decode call whoever runs beside a request
        allowed = (
            masks([j.matcher if j in decoding else None for j in seats.slots[:rows]], self.mask_words)
            if constrained or (self.deterministic and self.structured)
            else None
        )
        asked = self.deterministic or any(j.req.logprobs is not None for j in decoding)
        fixed = n == self.decode_steps and not constrained and self.warmup.fixed(rows, decoding)
        before = self.last_result
        with self._device_call("decode"):
            toks = self.core.decode(
                None if fixed else n,
                n if fixed else self.out_size,
                stop,
                rows,
                logprobs=LOGPROBS if asked else 0,
                allowed=allowed,
            )
        self._put_decode(toks, n, rows, fixed=fixed)
        self.wait_for = before if fixed else None
        return True

    def _split_steps(self) -> bool:
        """Whether a constrained step runs as two calls (`_launch_sampling`): not with speculation,
        nor on a deterministic server, whose every step is the one decode call."""
        return self.engine.spec is None and not self.deterministic

    @contextlib.contextmanager
    def _device_call(self, kind: str):
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

    def _launch_forward(self, rows: int):
        """Launch the forward of the next one-step block now, while the host still reads the
        last one back and advances the grammars: the sampling call that follows takes its logits
        (`_launch_sampling`), unless another call changes the slots first."""
        with self._device_call("forward"):
            self.ahead = (rows, self.launched, self.core.decode_forward(rows))

    def _launch_sampling(self, rows: int, stop, decoding: list[Job]) -> bool:
        """A step while a constrained request decodes, in two calls: the forward (launched ahead
        when it could be) and the sampling, which takes the grammars' masks of the step."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[:2] != (rows, self.launched):
            self._launch_forward(rows)
            ahead, self.ahead = self.ahead, None
        allowed = masks([j.matcher if j in decoding else None for j in self.seats.slots[:rows]], self.mask_words)
        greedy = all(j.req.temperature == 0 for j in decoding)
        with self._device_call("sample"):
            toks = self.core.decode_sample(ahead[2], stop, rows, logprobs=LOGPROBS, allowed=allowed, greedy=greedy)
        self._put_decode(toks, 1, rows, hold=True)
        if not self.seats.prefilling:
            self._launch_forward(rows)
        return True

    def _put_decode(self, toks, steps: int, rows: int, hold: bool = False, fixed: bool = False):
        rec = {"kind": "decode", "steps": steps, "rows": rows, "fixed": fixed, "tokens": {}}
        self.record.append(rec)
        jobs = [j if j is not None and j.started else None for j in self.seats.slots[:rows]]
        for j in jobs:  # a live row samples one token a step (a speculative cycle: at least one)
            if j is not None:
                j.launched += steps
        self._put(Launched("decode", toks, jobs, record=rec, hold=hold))

    def _preempted(self):
        """`Seats` preempted a running request."""
        self.observer.preempted()
        self.ahead = None  # a forward launched ahead no longer matches the slots

    def _seed_history(self, job: Job):
        """A speculating request that takes a cached prefix: its drafting history reads the prompt."""
        with self._device_call("history"):
            self.core.seed_history(job.slot, job.prompt)

    def _put(self, call: Launched):
        self.launched += 1
        self.last_result = call.result
        with self.observer.timed("engine", "output"):  # the output thread two calls behind
            self.results.put(call)

    def _await_results(self):
        """Wait until the output thread has read back every call launched so far."""
        with self.cond, self.observer.timed("engine", "output"):
            while self.results.read < self.launched and not self.done:
                self.cond.wait(1.0)

    def _launch_prefill(self):
        seats = self.seats
        held = seats.held_back()
        for job in [j for j in seats.prefilling if j not in held]:
            if not job.sent and seats.refresh(job):  # its first lookup in the prefix cache
                self.observer.prefix(len(job.prompt), job.start_at)
            hi = job.prefilled + min(len(job.prompt) - job.prefilled, self.shapes.max_piece)
            if not seats.take_blocks(job, job.prefilled, hi):  # blocks for its next piece at most
                seats.unseat(job)
        ready = [j for j in seats.prefilling if j not in held]
        if ready and self.deterministic:  # a forward scores every prompt it holds or none
            ready = [j for j in ready if self._scored(j) == self._scored(ready[0])]
        if not ready:
            return
        P, C, lengths = self.shapes.choose(
            [len(j.prompt) - j.prefilled for j in ready], self.warmup.prefill_shapes([self._scored(j) for j in ready])
        )
        jobs = ready[: len(lengths)]
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
        scored = [(int(s), int(n)) if self._scored(j) else None for j, s, n in zip(jobs, start, length)]
        targets = self._prompt_targets(jobs, scored, P, C) if any(scored) else None
        masked = [j.matcher if f else None for j, f in zip(jobs, final)]
        # A server that constrains passes masks with every prefill (all ones for the free rows): one
        # compiled variant of each prefill shape, compiled before ready, whichever requests come.
        allowed = masks(masked + [None] * (P - len(jobs)), self.mask_words) if self.structured else None
        with self._device_call("prefill"):
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
        seats.prefilling = [j for j in seats.prefilling if j.prefilled < len(j.prompt)]
        self.record.append(
            {"kind": "prefill", "pieces": [(j.id, int(s), int(n)) for j, s, n in zip(jobs, start, length)]}
        )
        self._put(Launched("prefill", drawn, jobs, finals=list(final[: len(jobs)]), scored=scored))
        started = [j for j, f in zip(jobs, final) if f]
        for job in started:
            seats.start(job)
        self._launch_forks([c for j in started if not j.resumed for c in j.children])

    def _launch_forks(self, children: list[Job]):
        """Fork each child's parent slot (which has just ended its prompt) into the child's: the
        prompt's full KV blocks shared, its partial last one copied. A child with no block for
        that prefills the prompt as a request of its own."""
        copies = {}
        for c in list(children):
            got = self.seats.fork_blocks(c)
            if got is None:
                children.remove(c)
                self.seats.unseat(c)
                continue
            for n, pairs in got.items():
                copies.setdefault(n, []).extend(pairs)
        if not children:
            return
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
        with self._device_call("fork"):
            first = self.core.fork(forks, copies, logprobs=LOGPROBS)
        for c in children:
            c.prefilled = len(c.req.prompt_ids)
            self.seats.start(c)
        self.record.append({"kind": "fork", "forks": [(c.id, c.slot, c.parent.slot) for c in children]})
        self._put(Launched("fork", first, children))

    @staticmethod
    def _scored(job: Job) -> bool:
        """Whether `job`'s prefill scores its prompt's tokens (a preempted answer's were already)."""
        return job.req.scores_prompt and not job.resumed

    @staticmethod
    def _prompt_targets(jobs, scored, P: int, C: int):
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

    def _spec_unread(self) -> bool:
        """Whether slots were given back since the slots' speculation counts were last read."""
        return self.engine.spec is not None and self.seats.freed > self.spec_read

    def _read_spec(self):
        stats = self.core.spec_stats()
        self.spec_read = self.seats.freed
        if stats is not None:
            self.observer.spec({k: v - self.spec_reported[k] for k, v in stats.items()})
            self.spec_reported = stats

    def _ended(self, job: Job, complete: bool = False):
        """The output thread sent `job`'s last events: its slot is given back at the engine thread's
        next turn. `complete`: the request's last answer ended, so its client may send again."""
        with self.cond:
            self.ended.append(job)
            self.last_end = time.monotonic()
            self.returning += complete
            self.cond.notify()

    def _free_ended(self):
        while True:
            with self.cond:
                if not self.ended:
                    return
                job = self.ended.popleft()
            self.seats.free(job)

    def _reap(self):
        """Free the slots of requests whose client went away or timed out."""
        for job in [j for j in self.seats.slots if j is not None and j.cancelled.is_set()]:
            job.end(None)
            self.seats.free(job)

    def _fail_running(self, status: int, message: str):
        for job in [j for j in self.seats.slots if j is not None]:
            job.end(Failed(status, message))
            self.seats.free(job)
