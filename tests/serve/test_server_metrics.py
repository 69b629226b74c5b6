"""`GET /metrics`: Prometheus text whose counters match the requests made (requests by finish
reason, prompt and generated tokens, the latency histograms' counts, the gauges back at zero),
speculative decoding's counters equal to what `Engine.generate` drafts for the same prompts, and
requests that ended early (the client left, the deadline passed, the device failed) counted by
reason, and the scheduler's calls by kind. Each server here is in this process, with a registry of its
own."""
from __future__ import annotations

import asyncio
import time

import httpx
import logprob_refs
import pytest
import tiny_chat
from prometheus_client.parser import text_string_to_metric_families

import jaxllm
from jaxllm.engine.engine import Engine
from jaxllm.engine.speculative import Speculation

MAX_LEN = 256
PROMPTS = [[5, 6, 7, 8, 9] * 6 + [5, 6], [40, 41, 42] * 9 + [40], [100, 120, 140, 100, 120, 140, 100, 120] * 3]


def scrape(url: str) -> dict:
    """{(sample name, labels without model_name): value} of a /metrics page."""
    r = httpx.get(url + "/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            assert s.labels.pop("model_name") == "m"
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    d = tiny_chat.make_qwen3(tmp_path_factory.mktemp("qwen3_metrics"), seed=3)
    base = jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=MAX_LEN)
    return Engine(base.cfg, base.weights, base.tokenizer, dtype="float32", max_ctx=MAX_LEN,
                  speculation=Speculation("ngram", 4))


def test_counters_match_the_requests(spec_engine):
    spec = {"cycles": 0, "drafted": 0, "accepted": 0}
    for p in PROMPTS:                    # what the engine drafts for each prompt alone
        spec_engine.generate_ids([p], max_tokens=24)
        for k in spec:
            spec[k] += spec_engine.stats.spec[k]
    server = tiny_chat.LiveServer(spec_engine, max_model_len=MAX_LEN, max_num_seqs=4)
    try:
        client = server.client()
        before = scrape(server.url)
        assert before[("jaxllm:request_success_total", (("finished_reason", "stop"),))] == 0
        usages = []
        for i, p in enumerate(PROMPTS):          # one at a time, as generate ran them
            if i == 1:
                chunks = list(client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
                usages.append(chunks[-1].usage)
            else:
                usages.append(client.completions.create(model="m", prompt=p, max_tokens=24, temperature=0).usage)
        t0 = time.time()                         # the engine thread reports speculation once idle
        while (m := scrape(server.url))[("jaxllm:spec_decode_num_drafts_total", ())] < spec["cycles"] \
                and time.time() - t0 < 30:
            time.sleep(0.1)
        ran = [r["kind"] for r in server.scheduler.record]
    finally:
        server.stop()
    finished = sum(m[("jaxllm:request_success_total", (("finished_reason", r),))] for r in ("stop", "length", "tool_calls"))
    assert finished == 3
    assert m[("jaxllm:prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages) == sum(map(len, PROMPTS))
    assert m[("jaxllm:generation_tokens_total", ())] == sum(u.completion_tokens for u in usages)
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert m[(f"jaxllm:{h}_count", ())] == 3
        assert m[(f"jaxllm:{h}_bucket", (("le", "+Inf"),))] == 3
    assert m[("jaxllm:inter_token_latency_seconds_count", ())] >= 3
    for g in ("num_requests_running", "num_requests_waiting", "slot_usage_perc", "kv_cache_usage_perc"):
        assert m[(f"jaxllm:{g}", ())] == 0, g
    assert all(m[("jaxllm:request_failure_total", (("reason", r),))] == 0 for r in ("abort", "timeout", "error"))
    for kind in ("prefill", "decode"):          # the calls the scheduler launched, and their time
        assert m[("jaxllm:scheduler_calls_total", (("kind", kind),))] == ran.count(kind) > 0
        assert m[("jaxllm:scheduler_thread_seconds_total", (("part", kind), ("thread", "engine")))] > 0
    got = {k: m[(f"jaxllm:spec_decode_num_{n}_total", ())] for k, n in
           (("cycles", "drafts"), ("drafted", "draft_tokens"), ("accepted", "accepted_tokens"))}
    print(f"\nspeculation: server {got}, Engine.generate {spec}")
    assert got == spec and spec["accepted"] > 0


def test_logprobs_with_speculation_and_prompts_in_pieces(spec_engine):
    """Log-probabilities of tokens from verified drafts, and an echo's prompt scored across the
    several forwards that prefill it (pieces of 16 tokens here), equal log_softmax of the logits."""
    server = tiny_chat.LiveServer(spec_engine, max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=16)
    accepted = 0
    try:
        client = server.client()
        for p in PROMPTS:
            ref = spec_engine.generate_ids([p], max_tokens=16)[0]
            accepted += spec_engine.stats.spec["accepted"]
            kw = {"model": "m", "prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 3, "echo": True}
            r = client.completions.create(**kw).model_dump()["choices"][0]
            logprob_refs.check_completion(spec_engine, r["logprobs"], p + ref.token_ids, 0, 3)
            chunks = [c.model_dump() for c in client.completions.create(stream=True, **kw)]
            assert logprob_refs.joined(chunks, "completion") == r["logprobs"]
    finally:
        server.stop()
    assert accepted > 0           # the same drafts as generate's were verified in the server
    assert any(start > 0 for rec in server.scheduler.record if rec["kind"] == "prefill" for _, start, _ in rec["pieces"])


def test_gauges_while_requests_run_and_early_ends_by_reason(tmp_path_factory):
    """A slow scripted device: 4 requests hold slots and KV positions while one waits; a client
    that leaves (streaming or not), a deadline and a failing device are counted apart."""
    d = tiny_chat.make_qwen3(tmp_path_factory.mktemp("qwen3_slow"))
    eng = jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=MAX_LEN)
    fail = {"now": False}

    def reply(ids):
        if fail["now"]:
            raise RuntimeError("the device failed")
        return [7] * 200
    server = tiny_chat.LiveServer(tiny_chat.ScriptedEngine(eng, reply, step_s=0.02), max_model_len=MAX_LEN,
                                  max_num_seqs=4, request_timeout=3.0, decode_steps=1)
    url = server.url
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 150, "ignore_eos": True}
    try:
        async def load():
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                tasks = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(5)]
                await asyncio.sleep(1.0)
                m = scrape(url)
                for t in tasks:
                    t.cancel()                   # five clients leave
                await asyncio.gather(*tasks, return_exceptions=True)
                return m
        m = asyncio.run(load())
        assert (m[("jaxllm:num_requests_running", ())], m[("jaxllm:num_requests_waiting", ())]) == (4, 1)
        assert m[("jaxllm:slot_usage_perc", ())] == 1.0
        assert 4 * 5 / (4 * MAX_LEN) < m[("jaxllm:kv_cache_usage_perc", ())] < 4 * 154 / (4 * MAX_LEN)

        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            next(r.iter_lines())                 # a streaming client that leaves after its first chunk
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 504              # the 3 s deadline
        fail["now"] = True
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        t0 = time.time()
        while (m := scrape(url))[("jaxllm:request_failure_total", (("reason", "abort"),))] < 6 and time.time() - t0 < 30:
            time.sleep(0.1)
    finally:
        server.stop()
    assert m[("jaxllm:request_failure_total", (("reason", "abort"),))] == 6
    assert m[("jaxllm:request_failure_total", (("reason", "timeout"),))] == 1
    assert m[("jaxllm:request_failure_total", (("reason", "error"),))] == 1
    assert sum(v for (k, _), v in m.items() if k == "jaxllm:request_success_total") == 0
