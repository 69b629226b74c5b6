"""Offline generation of prompts of mixed lengths through the scheduler's continuous batching: each
prompt is prefilled as itself (no row padded to the longest), a row that ends frees its slot for
the next prompt, and prompts that share a prefix (a system prompt) prefill it once. What
`Engine.generate_ids` runs for prompts of different lengths; equal lengths take the lockstep loop
(`lockstep`)."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np

from jaxllm.engine.jobs import Failed, Finished, Job
from jaxllm.engine.memory import KVMemory
from jaxllm.engine.outputs import GenerateStats, token_logprobs
from jaxllm.engine.request import Request
from jaxllm.engine.sampling import Penalties, SamplingParams, TokenRules
from jaxllm.engine.scheduler import Scheduler
from jaxllm.errors import JaxllmError
from jaxllm.kv.plan import check_fits

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


def lockstep(engine, ids: list[list[int]], asked: Request, n_lp: int) -> list[tuple[list[int], list | None]]:
    """Prompts of one length, every row with blocks of its own, prefilled in chunks and then decoded
    to completion in one on-device loop (row b with seed + b); what it needs is compiled first, so
    `engine.stats` times the run itself. -> each row's (tokens, TokenLogprob list or None)."""
    r = asked
    B, n = len(ids), len(ids[0])
    S = engine.padded_len(n + r.max_tokens)
    check_fits(engine.kv_plan(B, S))
    params = SamplingParams.make(B, r.temperature, r.top_k, r.top_p, r.seed, r.min_p)
    pen = (r.presence_penalty, r.frequency_penalty, r.repetition_penalty)
    core = engine.core(B, S, span=engine.chunking(n)[0])
    compile_s = core.prepare(n, r.max_tokens - 1, n_lp)
    t0 = time.perf_counter()
    first = core.prefill_prompts(
        ids,
        params,
        np.full(B, r.max_tokens, np.int32),
        logprobs=n_lp,
        penalties=Penalties.make(B, *pen),
        rules=TokenRules.make(B, [r.logit_bias] * B, [r.stop_token_ids] * B, r.min_tokens),
    )
    t1 = time.perf_counter()
    core.run_to_completion(r.max_tokens - 1, steps=0, logprobs=n_lp)  # the loop's first run, untimed
    t1, t = time.perf_counter(), t1 - t0
    rest, count, rest_lp = core.run_to_completion(r.max_tokens - 1, logprobs=n_lp)
    t2 = time.perf_counter()
    engine.stats = GenerateStats(
        B, B * n, int(B + count.sum()), t, t2 - t1, int(count.max(initial=0)), compile_s, core.spec_stats()
    )
    if not n_lp:
        return [([int(first[b])] + rest[b, : count[b]].tolist(), None) for b in range(B)]
    first, first_lp = first
    lp = jax.tree_util.tree_map(lambda f, x: np.concatenate([f[:, None], x], axis=1), first_lp, rest_lp)
    outs = []
    for b in range(B):
        new = [int(first[b])] + rest[b, : count[b]].tolist()
        outs.append((new, token_logprobs(lp, b, new, r.logprobs)))
    return outs
