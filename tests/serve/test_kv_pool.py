"""A KV pool smaller than the load: 16 clients at once against a pool that holds 4 of their
requests. The newest running requests are preempted and computed again later; every request ends
with what it gets alone (greedy, sampled with a seed, with a frequency penalty), /metrics counts the
preemptions, and no client gets an error."""
import asyncio

import httpx
import numpy as np
import pytest
import tiny

import jaxllm
from jaxllm.engine.memory import KVMemory
from jaxllm.serve.app import ServeOptions, build_app

MAX_LEN = 64
NEW = 40


class Ids:
    chat_template = None
    bos_id = None

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3")
    tiny.make("gemma3", d, seed=4)
    e = jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=MAX_LEN,
                    kv_options=jaxllm.KVOptions(block_size=8, prefill_chunk=32))
    e.tokenizer = Ids()
    return e


def request(i: int, rng) -> dict:
    body = {"prompt": rng.integers(3, 150, 10 + i // 2).tolist(), "max_tokens": NEW, "temperature": 0}
    if i % 3 == 1:
        body.update(temperature=0.8, seed=100 + i)
    elif i % 3 == 2:
        body.update(temperature=0.7, seed=200 + i, frequency_penalty=0.5)
    return body


def alone(eng, body) -> str:
    kw = {k: body[k] for k in ("temperature", "seed", "frequency_penalty") if k in body}
    return eng.generate_ids([body["prompt"]], max_tokens=NEW, **kw)[0].text


def test_a_pool_of_four_requests_serves_sixteen_clients(eng):
    span = 32                                        # the scheduler's: a prompt's piece, or 8 steps of 4
    pool = eng.pool_plan(4, MAX_LEN, span=span)
    app = build_app(eng, ServeOptions(served_name="m", max_model_len=MAX_LEN, max_num_seqs=16,
                                      max_num_batched_tokens=32, max_queue=32, decode_steps=4,
                                      kv_memory=KVMemory(size=pool.total), request_timeout=120))
    sched = app.state.server.scheduler
    assert sched.core.plan.sequences(MAX_LEN) <= 5
    sched.start(warmup=False)
    rng = np.random.default_rng(0)
    bodies = [request(i, rng) for i in range(16)]

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as http:
            rs = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
            return rs, (await http.get("/metrics")).text
    try:
        rs, metrics = asyncio.run(run())
    finally:
        sched.shutdown()
    assert [r.status_code for r in rs] == [200] * 16
    got = [r.json()["choices"][0]["text"] for r in rs]
    want = [alone(eng, b) for b in bodies]
    assert got == want, [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    preempted = sum(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("vllm:num_preemptions_total"))
    assert preempted >= 1 and preempted == sched.seats.preemptions, (preempted, sched.seats.preemptions)
