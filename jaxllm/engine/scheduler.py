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
import functools
import logging
import threading
import time

import jax

from jaxllm.engine.jobs import ARRIVAL_GAP, ARRIVAL_WAIT, RETURN_GAP, RETURN_WAIT, Failed, Job, Observer, QueueFull
from jaxllm.engine.launch import Launcher
from jaxllm.engine.memory import KVMemory, Seats, deterministic_memory
from jaxllm.engine.results import ResultReader
from jaxllm.engine.shapes import Shapes
from jaxllm.engine.warmup import Warmup
from jaxllm.errors import ModelError

log = logging.getLogger("jaxllm.engine")


# -- the scheduler --------------------------------------------------------------------------------
class Scheduler:
    """Requests in (`submit`), events out, over one engine core. Its parts: `seats` (`Seats`: the
    queue, the slots and their KV blocks), `launcher` (`Launcher`: the device calls), `results`
    (`ResultReader`: the output thread's work) and `warmup` (`Warmup`: the compiled shapes); the
    scheduler runs the engine thread's loop over them and the two threads' lives."""

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
        self.cond = threading.Condition()  # the handlers', the engine thread's and the output thread's
        self.stopping = False  # no new requests
        self.failure: str | None = None  # why the engine or output thread stopped on its own
        self.progress_at = time.monotonic()  # when the engine thread last finished a piece of work
        self.deadline = None  # running requests end with a 503 past this (monotonic)
        self.done = False
        self.ended: collections.deque[Job] = collections.deque()  # finished by the output thread
        self.last_submit = 0.0
        self.last_end = 0.0  # when the output thread last ended a request
        self.returning = 0  # completed requests whose clients have not sent again (`_gather_arrivals`)
        self.wait_for = None  # the results of the call before a fixed block just launched
        # What the device ran, in order: {"kind": "prefill", "pieces": [(job, start, length), ...]},
        # {"kind": "fork", "forks": [(job, its slot, the slot it forks), ...]} or {"kind": "decode",
        # "steps": n, "rows": r, "fixed": bool, "tokens": {job: count}} (filled when read back).
        self.record: collections.deque[dict] = collections.deque(maxlen=record)
        # Speculation counts reported so far; the core's are read (one device read) when the engine
        # goes idle after decoding, so that a busy server never waits on the device for them.
        self.spec_reported = {"cycles": 0, "drafted": 0, "accepted": 0}
        self.spec_read = 0  # slots given back when they were last read

        mask_words = -(-engine.cfg.vocab_size // 32)  # a grammar mask's row: one bit a token
        self.results = ResultReader(
            engine.layout.get,
            engine.cfg.eos_ids,
            decode_steps,
            self.cond,
            on_end=self._ended,
            on_failure=functools.partial(self._stopped, "output"),
        )
        self.launcher = Launcher(
            engine,
            self.core,
            self.results,
            self.record,
            mask_words=mask_words,
            structured=structured,
            out_size=self.out_size,
        )
        self.seats = Seats(
            self.core,
            self.cond,
            await_results=self._await_results,
            preempted=self._preempted,
            seed_history=None if engine.spec is None else self.launcher.seed_history,
        )
        self.warmup = Warmup(
            engine,
            self.core,
            self.shapes,
            self.cond,
            decode_steps=decode_steps,
            out_size=self.out_size,
            mask_words=mask_words,
            structured=structured,
            deterministic=deterministic,
            first_runs=first_runs,
            freeze_heap=freeze_heap,
        )
        self.observer = Observer()
        self.thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self.output = threading.Thread(target=self.results.run, name="jaxllm-output", daemon=True)

    @property
    def observer(self) -> Observer:
        """What the scheduler's threads report to (the server's metrics)."""
        return self._observer

    @observer.setter
    def observer(self, observer: Observer):
        self._observer = self.results.observer = self.launcher.observer = observer

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
                    self.launcher.reset()
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
        self.launcher.ahead = None  # a forward launched ahead no longer matches the slot table
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
        seats, launcher = self.seats, self.launcher
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
            if self._split_steps() and launcher.ahead is None and not seats.prefilling:
                launcher.forward(self.warmup.decode_rows(max(j.slot for j in decoding) + 1))
            self._await_results()
            self._free_ended()
            decoding = seats.to_decode()
            constrained = any(j.matcher is not None for j in decoding)
        if not decoding:
            return prefilled or constrained
        n = 1 if seats.prefilling or constrained else self.decode_steps
        rows = self.warmup.decode_rows(max(j.slot for j in decoding) + 1)
        if constrained and launcher.ahead is not None and launcher.ahead[1] == launcher.launched:
            rows = max(rows, launcher.ahead[0])  # the forward launched ahead covers these rows
        stop = seats.to_stop[:rows].copy()
        seats.to_stop[:rows] = False
        if constrained and self._split_steps():
            launcher.sample(rows, stop, seats.slots, decoding, then_forward=not seats.prefilling)
            return True
        self.wait_for = launcher.decode(
            n,
            rows,
            stop,
            seats.slots,
            decoding,
            fixed=n == self.decode_steps and not constrained and self.warmup.fixed(rows, decoding),
            # a deterministic server passes masks with every block where requests may be constrained
            # (all ones for the others): one decode call whoever runs beside a request
            masked=constrained or (self.deterministic and self.structured),
            asked=self.deterministic or any(j.req.logprobs is not None for j in decoding),
        )
        return True

    def _split_steps(self) -> bool:
        """Whether a constrained step runs as two calls (`Launcher.sample`): not with speculation,
        nor on a deterministic server, whose every step is the one decode call."""
        return self.engine.spec is None and not self.deterministic

    def _preempted(self):
        """`Seats` preempted a running request."""
        self.observer.preempted()
        self.launcher.ahead = None  # a forward launched ahead no longer matches the slots

    def _await_results(self):
        """Wait until the output thread has read back every call launched so far."""
        with self.cond, self.observer.timed("engine", "output"):
            while self.results.read < self.launcher.launched and not self.done:
                self.cond.wait(1.0)

    def _launch_prefill(self):
        """A prefill forward over the next pieces of the prompts waiting for it (their KV blocks
        taken first), in the shape that does the most for its cost; the prompts it ends start
        decoding, and their requests' other answers fork them."""
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
            ready = [j for j in ready if j.prefill_scores == ready[0].prefill_scores]
        if not ready:
            return
        P, C, lengths = self.shapes.choose(
            [len(j.prompt) - j.prefilled for j in ready], self.warmup.prefill_shapes([j.prefill_scores for j in ready])
        )
        jobs = ready[: len(lengths)]
        finals = self.launcher.prefill(jobs, lengths, P, C)
        seats.prefilling = [j for j in seats.prefilling if j.prefilled < len(j.prompt)]
        started = [j for j, f in zip(jobs, finals) if f]
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
        self.launcher.fork(children, copies)
        for c in children:
            self.seats.start(c)

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
