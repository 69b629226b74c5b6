"""The engine thread: owns the device, admits queued requests into free slots, decodes all slots.

Request handlers (asyncio) hand a `Job` to `Scheduler.submit` and read `Event`s back from it; the
thread never blocks on a client, and a client never touches the device.
"""
from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

from ..batching import SlotBatch
from .detok import TextStream
from .protocol import GenRequest

log = logging.getLogger("jaxllm.serve")


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    finish_reason: str           # "stop" | "length"
    completion_tokens: int


@dataclass
class Failed:
    status: int
    message: str
    type: str = "server_error"


@dataclass
class Job:
    req: GenRequest
    emit: Callable[[object], None]          # thread-safe: delivers an event to the request's handler
    cancelled: threading.Event = field(default_factory=threading.Event)
    text: TextStream | None = None
    n_tokens: int = 0

    def cancel(self):
        self.cancelled.set()


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(self, engine, max_num_seqs: int, max_model_len: int, max_queue: int, decode_steps: int = 4):
        self.engine = engine
        self.eos = set(engine.cfg.eos_ids)
        self.batch = SlotBatch.for_engine(engine, max_num_seqs, max_model_len, decode_steps)
        self.slots: list[Job | None] = [None] * max_num_seqs
        self.max_queue = max_queue
        self.waiting: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="jaxllm-engine", daemon=True)
        self.finished = 0              # requests completed
        self.generated = 0             # tokens sampled for requests (a freed slot stops adding)

    # -- called from request handlers ------------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:      # clients that left give their place back
                self.waiting = collections.deque(j for j in self.waiting if not j.cancelled.is_set())
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            self.waiting.append(job)
            self.cond.notify()

    def load(self) -> dict:
        with self.cond:
            return {"running": sum(j is not None for j in self.slots), "waiting": len(self.waiting),
                    "slots": len(self.slots), "finished": self.finished, "generated_tokens": self.generated}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, warmup: bool = True):
        if warmup:
            self.batch.warmup()
        self.thread.start()

    def shutdown(self, timeout: float = 10.0):
        """Stop taking work; requests still queued or running end with a 503 error event."""
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self):
        pending = None        # the decode block launched last round, read back after the next launch
        while True:
            with self.cond:
                while not self.stopping and not self.waiting and not self._busy() and pending is None:
                    self.cond.wait()
                if self.stopping:
                    break
            try:
                self._admit()
                self._reap()
                launched = (self.batch.dispatch(), list(self.slots)) if self._busy() else None
                if pending is not None:
                    self._take_block(*pending)
                pending = launched
            except Exception:                      # a device failure: fail the batch, keep serving
                log.exception("engine step failed")
                pending = None
                self._fail_running(500, "internal error while generating; see the server log")
                self.batch.reset()
        self._fail_running(503, "the server is shutting down")
        with self.cond:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for job in waiting:
            job.emit(Failed(503, "the server is shutting down"))

    def _busy(self) -> bool:
        return any(j is not None for j in self.slots)

    def _admit(self):
        """Prefill queued requests into free slots, one at a time, before the next decode block."""
        for b in range(len(self.slots)):
            if self.slots[b] is not None:
                continue
            job = self._next_waiting()
            if job is None:
                return
            r = job.req
            job.text = TextStream(self.engine.tokenizer, r.stop)
            self.slots[b] = job
            tok = self.batch.prefill(b, r.prompt_ids, r.max_tokens, r.temperature, r.top_k, r.top_p, r.seed,
                                     r.ignore_eos)
            self._take(b, tok)

    def _next_waiting(self) -> Job | None:
        with self.cond:
            while self.waiting:
                job = self.waiting.popleft()
                if not job.cancelled.is_set():
                    return job
        return None

    def _take_block(self, block, jobs: list):
        """Hand a block's tokens to the requests that held the slots when it was launched; a slot
        freed (and maybe refilled) since then ignores the rest of that block."""
        toks, emitted = self.batch.collect(block)
        for b, job in enumerate(jobs):
            for k in range(toks.shape[1]):
                if job is not None and emitted[b, k] and self.slots[b] is job:
                    self._take(b, int(toks[b, k]))

    def _take(self, b: int, tok: int):
        """Fold one sampled token into slot b's request and finish it when it is done."""
        job = self.slots[b]
        job.n_tokens += 1
        self.generated += 1
        if tok in self.eos and not job.req.ignore_eos:
            return self._finish(b, "stop")
        delta = job.text.push(tok)
        if delta:
            job.emit(Delta(delta))
        if job.text.stopped:
            return self._finish(b, "stop")
        if job.n_tokens >= job.req.max_tokens:
            self._finish(b, "length")

    def _finish(self, b: int, reason: str):
        job = self.slots[b]
        rest = job.text.finish()           # held-back text is final now (empty after a stop string)
        if job.text.stopped:
            reason = "stop"
        if rest:
            job.emit(Delta(rest))
        job.emit(Finished(reason, job.n_tokens))
        self.finished += 1
        self._free(b)

    def _free(self, b: int):
        self.slots[b] = None
        self.batch.release(b)

    def _reap(self):
        """Free the slots of requests whose client went away or timed out."""
        for b, job in enumerate(self.slots):
            if job is not None and job.cancelled.is_set():
                self._free(b)

    def _fail_running(self, status: int, message: str):
        jobs = [j for j in self.slots if j is not None]
        self.slots = [None] * len(self.slots)
        for job in jobs:
            job.emit(Failed(status, message))
