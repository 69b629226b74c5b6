"""The server's Prometheus metrics (`GET /metrics`), named as vLLM names its `vllm:` ones.

Each server keeps them in a registry of its own, so that several servers in one process (tests,
an embedding application) count apart. The scheduler reports tokens as its output thread reads
them back (`Observer`); the HTTP handlers report how each request ended; the gauges are read from
the scheduler when scraped.
"""

from __future__ import annotations

import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxllm.engine.jobs import Job, Observer

CONTENT_TYPE = CONTENT_TYPE_LATEST
SUCCESS = ("stop", "length", "tool_calls")
FAILURE = ("abort", "timeout", "error")  # the client left; the request timed out; a 5xx ended it
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class Metrics(Observer):
    def __init__(self, scheduler, model_name: str):
        self.scheduler = scheduler
        self.registry = reg = CollectorRegistry()
        name = {"model_name": model_name}
        m = ["model_name"]

        def counter(metric, doc, labels=()):
            return Counter(metric, doc, [*m, *labels], registry=reg)

        def histogram(metric, doc, buckets):
            return Histogram(metric, doc, m, buckets=buckets, registry=reg).labels(**name)

        def gauge(metric, doc, fn):
            Gauge(metric, doc, m, registry=reg).labels(**name).set_function(fn)

        success = counter("jaxllm:request_success", "Requests that finished, by finish reason", ["finished_reason"])
        failure = counter(
            "jaxllm:request_failure",
            "Requests ended early: the client left (abort), the request timed out, or an error ended it",
            ["reason"],
        )
        self.success = {r: success.labels(**name, finished_reason=r) for r in SUCCESS}
        self.failure = {r: failure.labels(**name, reason=r) for r in FAILURE}
        self.prompt_tokens = counter("jaxllm:prompt_tokens", "Prompt tokens prefilled").labels(**name)
        self.generation_tokens = counter("jaxllm:generation_tokens", "Tokens generated").labels(**name)
        self.ttft = histogram(
            "jaxllm:time_to_first_token_seconds", "From arrival to the first token, queueing included", TTFT_BUCKETS
        )
        self.itl = histogram(
            "jaxllm:inter_token_latency_seconds",
            "Between a request's successive arrivals of tokens (a decode block brings several at once)",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "jaxllm:request_time_per_output_token_seconds",
            "A finished request's time after its first token, per later token",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "jaxllm:e2e_request_latency_seconds", "From arrival to the last token of a finished request", E2E_BUCKETS
        )
        gauge(
            "jaxllm:slot_usage_perc",
            "Fraction of the slots (--max-num-seqs) in use",
            lambda: scheduler.load()["running"] / scheduler.core.num_slots,
        )
        # The load a router reads to pick a replica (the Gateway API Inference Extension reads vLLM's
        # names), under vLLM's names and ours.
        blocks = scheduler.core.blocks
        both = ("jaxllm", "vllm")
        for p in both:
            gauge(f"{p}:num_requests_running", "Requests holding a slot", lambda: scheduler.load()["running"])
            gauge(f"{p}:num_requests_waiting", "Requests queued for a slot", lambda: scheduler.load()["waiting"])
            gauge(f"{p}:kv_cache_usage_perc", "Fraction of the KV blocks held by requests", blocks.usage)
        self.prefix_queries = [
            counter(f"{p}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(**name)
            for p in both
        ]
        self.prefix_hits = [
            counter(f"{p}:prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**name) for p in both
        ]
        self.preemptions = [
            counter(f"{p}:num_preemptions", "Running requests preempted for KV blocks (computed again later)").labels(
                **name
            )
            for p in both
        ]
        # Where the scheduler's two threads spend their time (`Scheduler` names the parts): with the
        # wall time, what keeps the device waiting (the engine thread's time outside device calls).
        self.thread_seconds = counter(
            "jaxllm:scheduler_thread_seconds",
            "Seconds the scheduler's engine and output threads spent on each part of their work",
            ["thread", "part"],
        )
        self.core_calls = counter("jaxllm:scheduler_calls", "Calls of the engine core launched, by kind", ["kind"])
        self.model_name = model_name
        self.spec_counters = None
        if scheduler.engine.spec is not None:
            self.spec_counters = {
                "cycles": counter("jaxllm:spec_decode_num_drafts", "Speculative verify cycles").labels(**name),
                "drafted": counter("jaxllm:spec_decode_num_draft_tokens", "Tokens drafted").labels(**name),
                "accepted": counter("jaxllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted").labels(**name),
            }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # -- from the scheduler's threads ------------------------------------------------------------
    def tokens(self, job: Job, n: int, now: float):
        if job.first_token_at is None:
            if job.parent is None:  # a request's first answer: its prompt was prefilled once
                self.ttft.observe(now - job.arrived)
                self.prompt_tokens.inc(len(job.req.prompt_ids))
        else:
            self.itl.observe(now - job.last_token_at)
        self.generation_tokens.inc(n)

    def prefix(self, queries: int, hits: int):
        for q, h in zip(self.prefix_queries, self.prefix_hits):
            q.inc(queries)
            h.inc(hits)

    def preempted(self):
        for c in self.preemptions:
            c.inc()

    def busy(self, thread: str, part: str, seconds: float):
        self.thread_seconds.labels(model_name=self.model_name, thread=thread, part=part).inc(seconds)

    def calls(self, kind: str):
        self.core_calls.labels(model_name=self.model_name, kind=kind).inc()

    def spec(self, stats: dict):
        if self.spec_counters is not None:
            for k, c in self.spec_counters.items():
                c.inc(stats[k])

    # -- from the request handlers ---------------------------------------------------------------
    def finished(self, job: Job, reason: str):
        end = job.last_token_at if job.last_token_at is not None else time.monotonic()
        self.success[reason].inc()
        self.e2e.observe(end - job.arrived)
        if job.first_token_at is not None and job.n_tokens > 1:
            self.tpot.observe((job.last_token_at - job.first_token_at) / (job.n_tokens - 1))

    def failed(self, reason: str):
        self.failure[reason].inc()
