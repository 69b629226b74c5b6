"""`--deterministic`: a request's answer, greedy or sampled with its seed, is the same among 64
concurrent clients as alone, in bfloat16 with int8 weights (the defaults, where batch shapes and
chunk boundaries change the arithmetic: without the flag some answers differ, which is why it
exists; what it costs is measured by the serving bench's --deterministic, not here).

The model is a tiny random Gemma 3 (sliding and global layers) served in this process, its text
the token ids, so that 64 clients' prompts of up to 1,500 tokens and each request's lone run cost
seconds, not the quarter of an hour the embedded model takes on two CPU cores."""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import tiny
import tiny_chat

import jaxllm

CLIENTS = 64
PROMPTS = 24
MAX_TOKENS = 8
MAX_LEN = 2048
VOCAB = 512


class Ids:
    """The text of token ids: the ids, space-separated (the tiny model has no tokenizer)."""
    chat_template = None
    bos_id = None

    def decode(self, ids, skip_special: bool = True):
        return "".join(f" {i}" for i in ids)


def prompts() -> list[list[int]]:
    """24 distinct prompts of 10 to 1,500 token ids (BOS first), no two sharing a prefix past it."""
    rng = random.Random(7)
    lengths = [10 + round(i * (1500 - 10) / (PROMPTS - 1)) for i in range(PROMPTS)]
    rng.shuffle(lengths)
    return [[2] + [rng.randrange(3, VOCAB) for _ in range(n - 1)] for n in lengths]


def requests() -> list[dict]:
    """Client k's request: prompt k % 24, greedy for the first half of the clients, sampled with a
    seed of its own for the second."""
    ps = prompts()
    out = []
    for k in range(CLIENTS):
        body = {"prompt": [ps[k % PROMPTS]], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        if k >= CLIENTS // 2:
            body.update(temperature=0.9, top_p=0.95, seed=1000 + k)
        out.append(body)
    return out


async def send(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], r.json()["usage"]["completion_tokens"]


async def run_mode(url: str) -> dict:
    """The load at once (64 clients), then each distinct request alone. -> their answers."""
    reqs = requests()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=CLIENTS)) as c:
        await send(c, reqs[0])                     # the first request's compiles before the load
        loaded = await asyncio.gather(*(send(c, b) for b in reqs))
        alone = {}
        for b in reqs:                             # each distinct request once, one after another
            key = repr(b)
            if key not in alone:
                alone[key] = await send(c, b)
    return {"loaded": [a for a, _ in loaded], "alone": [alone[repr(b)][0] for b in reqs]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = tmp_path_factory.mktemp("deterministic_gemma3")
    tiny.make("gemma3", path, vocab_size=VOCAB, hidden_size=128, intermediate_size=256, sliding_window=64,
              max_position_embeddings=MAX_LEN)
    engine = jaxllm.load(str(path), quant="int8", dtype="bfloat16", max_ctx=MAX_LEN)
    engine.tokenizer = Ids()
    server = tiny_chat.LiveServer(engine, max_model_len=MAX_LEN, max_num_seqs=16, max_queue=CLIENTS,
                                  deterministic=True)
    try:
        return asyncio.run(run_mode(server.url))
    finally:
        server.stop()


def test_answers_under_load_equal_answers_alone(results):
    differ = [k for k, (a, b) in enumerate(zip(results["loaded"], results["alone"])) if a != b]
    assert not differ, differ
    assert len(set(results["loaded"])) > PROMPTS    # the sampled half differs by seed: a real load
