"""Offline generation of prompts of mixed lengths through the scheduler's continuous batching: each
prompt is prefilled as itself (no row padded to the longest), a row that ends frees its slot for
the next prompt, and prompts that share a prefix (a system prompt) prefill it once. What
`Engine.generate_ids` runs for prompts of different lengths; equal lengths take the lockstep loop."""

from __future__ import annotations

import threading
import time

from jaxllm.engine.jobs import Failed, Finished, Job
from jaxllm.engine.memory import KVMemory
from jaxllm.engine.request import Request
from jaxllm.engine.scheduler import Scheduler
from jaxllm.errors import JaxllmError

MAX_SLOTS = 256  # prompts decoding at once, at most (the others queue for a slot)


class _NoText:
    """The text stream's tokenizer for a model without one: the engine decodes the ids itself."""

    def decode(self, ids) -> str:
        return ""


def run(engine, ids: list[list[int]], requests: list[Request]) -> tuple[list[Job], dict | None]:
    """Every request (prompt ids[i]) to its end -> their jobs (`out_ids`: its tokens; `logprobs`:
    each token's TokenLogprob, where asked), in order, and the speculation of their slots (None
    without). A pool with room for every slot at its longest: none is preempted."""
    rows = min(len(ids), MAX_SLOTS)
    # the pools' and the calls' shapes follow the longest sequence's bucket, not its length
    longest = engine.padded_len(max(len(p) + r.max_tokens for p, r in zip(ids, requests)))
    sched = Scheduler(engine, rows, longest, max_queue=len(ids), kv_memory=KVMemory(every_slot=True))
    if engine.tokenizer is None:
        sched.text_tokenizer = _NoText()
    ended = threading.Semaphore(0)
    events: list = [None] * len(ids)

    def emit(i):
        def put(ev):
            if isinstance(ev, (Finished, Failed)):
                events[i] = ev
                ended.release()

        return put

    jobs = [Job(r, emit(i)) for i, r in enumerate(requests)]
    sched.start(warmup=False)
    try:
        for job in jobs:
            sched.submit(job)
        for _ in jobs:
            ended.acquire()
    finally:
        sched.shutdown()
    failed = next((ev for ev in events if isinstance(ev, Failed)), None)
    if failed is not None:
        raise JaxllmError(failed.message)
    return jobs, sched.core.spec_stats()


def generate(engine, ids: list[list[int]], requests: list[Request]):
    """`run` -> (each request's (tokens, TokenLogprob list), (mean seconds to the first token,
    seconds after the first of them, compile seconds, speculation)), compiling shapes as they come."""
    c0, t0 = engine.compile_s, time.perf_counter()
    jobs, spec = run(engine, ids, requests)
    end, compile_s = time.perf_counter(), engine.compile_s - c0
    firsts = [j.first_token_at for j in jobs if j.first_token_at is not None]
    ttft = sum(f - j.arrived for f, j in zip(firsts, jobs)) / max(len(firsts), 1)
    decode = end - t0 - (min(firsts) - min(j.arrived for j in jobs) if firsts else 0.0)
    return [(j.out_ids, j.logprobs) for j in jobs], (ttft, decode, compile_s, spec)
