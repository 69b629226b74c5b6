"""A request as the scheduler holds it (`Job`), and the events it sends back to the handler."""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from jaxllm.engine.detok import TextStream
from jaxllm.engine.request import Request


@dataclass
class Delta:
    text: str
    logprobs: list | None = None  # TokenLogprob of each token the text accounts for (when asked)


@dataclass
class Prompt:
    """The prompt was read, sent to a request that echoes it (its answer starts with it) or scores it:
    its tokens' TokenLogprob (the first without a value) where scored."""

    logprobs: list | None = None


@dataclass
class Finished:
    finish_reason: str  # "stop" | "length"
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache


@dataclass
class Failed:
    status: int
    message: str
    type: str = "server_error"


_ids = itertools.count(1)
ARRIVAL_GAP = 0.002  # seconds between arrivals that still count as one burst
ARRIVAL_WAIT = 0.020  # the longest a burst holds the first prefill back
# Clients whose answers just ended and that have not sent again (a benchmark's, a batch job's or an
# agent's workers send their next request as each answer ends): the first prefill waits for them
# while they keep coming RETURN_GAP apart, up to RETURN_WAIT in all.
RETURN_GAP = 0.010
RETURN_WAIT = 0.060


@dataclass(eq=False)
class Job:
    """One answer of a request: the request's first (index 0), whose prompt is prefilled, holds the
    others' as `children`, which fork its slot."""

    req: Request
    emit: Callable[[object], None]  # thread-safe: delivers an event to the request's handler
    cancelled: threading.Event = field(default_factory=threading.Event)
    text: TextStream | None = None
    n_tokens: int = 0
    slot: int = -1
    prefilled: int = 0  # prompt tokens the device has (cached or sent so far; a fork: all)
    started: bool = False  # its first token is being drawn: its slot may decode
    launched: int = 0  # tokens the calls launched so far sample for it, unless it ends first
    done: bool = False  # its last event went out
    index: int = 0  # which of the request's answers
    parent: Job | None = None  # a child: the job whose slot it forks
    children: list = field(default_factory=list)
    answers_done: int = 0  # the parent: answers of the request that ended
    id: int = field(default_factory=lambda: next(_ids))
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None  # when its first tokens were read back
    last_token_at: float | None = None
    logprobs: list = field(default_factory=list)  # TokenLogprob of each token taken
    logprobs_sent: int = 0  # how many of them went out
    prompt_logprobs: list = field(default_factory=list)  # an echo's, as its prefill reads them
    matcher: object | None = None  # structured output: its `grammar.Matcher`, freed with the slot
    out_ids: list = field(default_factory=list)  # every token sampled for it, as the output thread reads them
    resumed: int = 0  # of them, those prefilled again after a preemption
    cached: int | None = None  # prompt tokens its first admission found in the prefix cache
    admitted: int = 0  # when it took its slot (an order: the newest are preempted first)
    start_at: int = 0  # where its prefill starts: past the cached prefix it took
    sent: bool = False  # its prefill's first piece was launched
    hashes: list = field(default_factory=list)  # its prompt's full blocks' chained hashes (`blocks.block_hashes`)
    held: list = field(default_factory=list)  # tokens read back, their text not out yet
    held_lp: list = field(default_factory=list)  # their host LogProbs pieces
    ending: threading.Lock = field(default_factory=threading.Lock, repr=False)  # its last events go out once

    def cancel(self):
        self.cancelled.set()

    def end(self, event, text: str = "", logprobs: list | None = None) -> bool:
        """Send its last events (`event` after a last delta of `text` and `logprobs`; no event for
        None), once, whichever thread gets there first. -> whether this call sent them."""
        with self.ending:
            if self.done:
                return False
            self.done = True
        if text or logprobs:
            self.emit(Delta(text, logprobs))
        if event is not None:
            self.emit(event)
        return True

    @property
    def prompt(self) -> list[int]:
        """What its slot prefills: the request's prompt, and after a preemption the tokens it had
        sampled."""
        return self.req.prompt_ids + self.out_ids[: self.resumed] if self.resumed else self.req.prompt_ids

    @property
    def prefill_scores(self) -> bool:
        """Whether its prefill scores its prompt's tokens (a preempted answer's were already)."""
        return self.req.scores_prompt and not self.resumed

    @property
    def choices(self) -> list[Job]:
        return [self] + self.children

    @staticmethod
    def for_request(req: Request, emit: Callable[[int, object], None], matcher=None) -> Job:
        """The jobs of a request's `req.n` answers (the first, holding the others); emit(i, event)
        delivers answer i's events. Cancelling one cancels them all. `matcher`: a constrained
        request's (each answer follows a copy of its own)."""
        job = Job(req, functools.partial(emit, 0), matcher=matcher)
        job.children = [
            Job(
                req,
                functools.partial(emit, i),
                cancelled=job.cancelled,
                index=i,
                parent=job,
                matcher=None if matcher is None else matcher.copy(),
            )
            for i in range(1, req.n)
        ]
        return job


class Observer:
    """What the scheduler reports as it runs (the server's metrics); by default nothing is kept."""

    def tokens(self, job: Job, n: int, now: float):
        """`n` more tokens of `job` were read back at `now` (before its timestamps are updated)."""

    def spec(self, stats: dict):
        """Speculation of requests that ended: {"cycles", "drafted", "accepted"} added up."""

    def busy(self, thread: str, part: str, seconds: float):
        """The scheduler's `thread` ("engine" or "output") spent `seconds` on `part` of its work."""

    @contextlib.contextmanager
    def timed(self, thread: str, part: str):
        """Count the time of the block as `thread`'s on `part` (`busy`)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.busy(thread, part, time.perf_counter() - t)

    def calls(self, kind: str):
        """The engine thread launched a call of the core of this kind."""

    def prefix(self, queries: int, hits: int):
        """A request's prompt of `queries` tokens found `hits` of them in the prefix cache."""

    def preempted(self):
        """A running request was preempted for KV blocks (it will be computed again)."""


class QueueFull(Exception):
    pass
