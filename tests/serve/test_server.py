"""The OpenAI-compatible server, tested as a live process on 127.0.0.1 with the official client.

Every exactness check runs float32 with unquantized weights, so the server's greedy tokens (slot
batching, other compile shapes) must equal `Engine.generate` on the same prompts.
"""
from __future__ import annotations

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import logprob_refs
import numpy as np
import pytest
import xla_env

import jaxllm

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key-123"
MAX_LEN = 512                  # positions per slot on the server
SLOTS = 16
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a small engine that served many requests at once.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation , . ; : ! ? ( ) [ ] { } - + = / \\ ' \"",
    "Unicode: café, naïve, 東京, Привет, emoji 🙂🚀, ümlaut, façade.",
    "Hello world! How are you today? Tell me a story about batching and caches.",
]


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir():
    """The one place that names the model: every server and reference engine below uses it.
    None: the embedded default (the real Gemma 3 270M), as a user gets it with no --model-dir."""
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir, log_path: Path, *args, access_log: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**xla_env.full_speed(), "PYTHONPATH": str(ROOT)}      # it decodes the real model
        env.setdefault("JAX_PLATFORMS", "cpu")
        model = ["--model-dir", model_dir] if model_dir else []
        cmd = [sys.executable, "-m", "jaxllm.serve", *model, "--port", str(self.port), "--quant", "none",
               "--dtype", "float32", *([] if access_log else ["--disable-uvicorn-access-log"]), *args]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout=300.0):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        pytest.fail(f"server not ready after {timeout} s:\n{self.output()[-3000:]}")

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=10).json()

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def terminate(self, timeout=60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


@pytest.fixture(scope="module")
def process(model_dir, tmp_path_factory):
    """The server process, started while the reference engine compiles. Its 16 slots and queue of
    24 are what the last test (SIGTERM with 16 running and 24 waiting) needs; the drain window is
    long enough for those 16 streams to finish on a loaded CI machine."""
    p = ServerProcess(model_dir, tmp_path_factory.mktemp("server_logs") / "main.log", "--max-num-seqs", str(SLOTS),
                      "--max-queue", "24", "--max-model-len", str(MAX_LEN), "--api-key", API_KEY,
                      "--max-request-bytes", "200000", "--body-timeout", "2", "--shutdown-timeout", "240")
    yield p
    p.terminate()


@pytest.fixture(scope="module")
def engine(model_dir):
    return jaxllm.load(model_dir, max_ctx=MAX_LEN, quant="none", dtype="float32")


@pytest.fixture(scope="module")
def server(process, engine):
    main = process.wait_ready()
    yield main
    assert "Traceback" not in main.output(), main.output()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def headers(key=API_KEY):
    return {"Authorization": f"Bearer {key}"}


# -- 1. the openai client, parity with Engine.generate ----------------------------------------------
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about café 東京"}]
PROMPT = "Once upon a time there was"


def test_chat_and_completion_match_engine(engine, client, model_name):
    ref_chat = engine.generate([CHAT], max_tokens=24)[0]
    ref_text = engine.generate([PROMPT], max_tokens=24, chat=False)[0]

    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == ref_chat.text
    assert r.choices[0].finish_reason == ref_chat.finish_reason
    assert r.usage.prompt_tokens == len(ref_chat.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == ref_text.text
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 24)

    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == ref_chat.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref_chat.finish_reason
    assert chunks[-1].usage.prompt_tokens == len(ref_chat.prompt_token_ids)

    pieces = [c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)]
    assert "".join(pieces) == ref_text.text


def test_stop_strings_match_engine(engine, client, model_name):
    full = engine.generate([PROMPT], max_tokens=24, chat=False)[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]          # a string the greedy text surely contains
    ref = engine.generate([PROMPT], max_tokens=24, chat=False, stop=[stop, "never-there"])[0]
    assert ref.finish_reason == "stop" and stop not in ref.text

    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop, "never-there"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    pieces = [c.choices[0].text for c in client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)]
    assert "".join(pieces) == ref.text
    assert all(stop not in "".join(pieces[:i + 1]) for i in range(len(pieces)))


def test_seeded_sampling_matches_engine(engine, client, model_name):
    kw = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234)
    ref = engine.generate([PROMPT], chat=False, top_k=50, **kw)[0]
    a = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"top_k": 50}, **kw)
    b = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"top_k": 50}, stream=True, **kw)
    assert a.choices[0].text == ref.text
    assert "".join(c.choices[0].text for c in b) == ref.text
    other = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0.9, seed=99)
    assert other.usage.completion_tokens >= 1


def test_logprobs_match_the_logits(engine, client, model_name):
    """Completions' `logprobs` N and chat's `logprobs` + `top_logprobs` are log_softmax of the
    model's logits at each token's position with the N most likely tokens, streamed or not; a stop
    string keeps the tokens that cover the text before it, as `Engine.generate` does."""
    ref = engine.generate([PROMPT], max_tokens=12, chat=False)[0]
    seq = ref.prompt_token_ids + ref.token_ids
    kw = {"model": model_name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    r = client.completions.create(**kw).model_dump()["choices"][0]
    assert r["text"] == ref.text
    logprob_refs.check_completion(engine, r["logprobs"], seq, len(ref.prompt_token_ids), 3)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **kw)]
    assert logprob_refs.joined(chunks, "completion") == r["logprobs"]

    stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    cut = engine.generate([PROMPT], max_tokens=12, chat=False, stop=[stop], logprobs=3)[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) < len(ref.token_ids)
    r = client.completions.create(stop=stop, **kw).model_dump()["choices"][0]
    assert r["text"] == cut.text
    logprob_refs.check_completion(engine, r["logprobs"], ref.prompt_token_ids + cut.token_ids,
                                  len(ref.prompt_token_ids), 3)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, stop=stop, **kw)]
    assert logprob_refs.joined(chunks, "completion") == r["logprobs"]

    ref = engine.generate([CHAT], max_tokens=12)[0]
    seq, n_prompt = ref.prompt_token_ids + ref.token_ids, len(ref.prompt_token_ids)
    kw = {"model": model_name, "messages": CHAT, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**kw).model_dump()["choices"][0]
    assert r["message"]["content"] == ref.text
    logprob_refs.check_chat(engine, r["logprobs"]["content"], seq, n_prompt, 2)
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **kw)]
    assert logprob_refs.joined(chunks, "chat") == r["logprobs"]["content"]
    r = client.chat.completions.create(**{**kw, "top_logprobs": None}).model_dump()["choices"][0]
    assert [c["top_logprobs"] for c in r["logprobs"]["content"]] == [[]] * len(ref.token_ids)
    assert client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None}).choices[0].logprobs is None


def test_echo_scores_the_prompt(engine, client, model_name):
    """`echo` with `logprobs` returns the prompt's tokens scored (the first has none) before the
    answer's: what lm-evaluation-harness's loglikelihood requests send (token ids, max_tokens 1,
    logprobs 1), and with max_tokens 0 the prompt alone; streamed, the prompt comes first."""
    ids = engine.tokenizer.encode(PROMPT)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    c = r.model_dump()["choices"][0]
    assert (c["text"], c["finish_reason"], r.usage.completion_tokens) == (PROMPT, "length", 0)
    logprob_refs.check_completion(engine, c["logprobs"], ids, 0, 2)

    ref = engine.generate([PROMPT], max_tokens=1, chat=False)[0]
    r = client.completions.create(model=model_name, prompt=[ids], max_tokens=1, echo=True, logprobs=1,
                                  temperature=0, seed=1234).model_dump()["choices"][0]
    assert r["text"] == engine.tokenizer.decode(ids) + ref.text
    logprob_refs.check_completion(engine, r["logprobs"], ids + ref.token_ids, 0, 1)

    kw = {"model": model_name, "prompt": CORPUS[4], "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0}
    ids = engine.tokenizer.encode(CORPUS[4])
    ref = engine.generate_ids([ids], max_tokens=3)[0]
    r = client.completions.create(**kw).model_dump()["choices"][0]
    assert r["text"] == CORPUS[4] + ref.text
    logprob_refs.check_completion(engine, r["logprobs"], ids + ref.token_ids, 0, 2)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, **kw)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["text"]
    assert logprob_refs.joined(chunks, "completion") == r["logprobs"]
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, echo=True, temperature=0)
    assert plain.choices[0].text == PROMPT + engine.generate([PROMPT], max_tokens=2, chat=False)[0].text
    assert plain.choices[0].logprobs is None


def test_logprobs_beside_requests_without(server):
    """A request with log-probabilities decodes in the same blocks as requests without them: every
    answer is what it is alone."""
    specs = SPECS[:4]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2, "echo": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=300) as http:
            async def with_logprobs():
                r = await http.post("/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["choices"][0]
            alone = [await one_request(http, s) for s in specs] + [await with_logprobs()]
            together = await asyncio.gather(*(one_request(http, s) for s in specs), with_logprobs())
            return alone, together
    alone, together = asyncio.run(run())
    assert together[:-1] == alone[:-1]
    assert together[-1]["text"] == alone[-1]["text"]
    a, b = together[-1]["logprobs"], alone[-1]["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    np.testing.assert_allclose(a["token_logprobs"][1:], b["token_logprobs"][1:], atol=logprob_refs.ATOL)


def test_penalties_match_engine(engine, client, model_name):
    """presence_penalty, frequency_penalty and repetition_penalty (vLLM's) give what
    `Engine.generate` gives with them (whose tokens tests/test_decode.py checks against numpy),
    alone and in the same decode blocks as requests without penalties."""
    from concurrent.futures import ThreadPoolExecutor
    kw = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "repetition_penalty": 1.5}
    ref = engine.generate([PROMPT], max_tokens=20, chat=False, **kw)[0]
    plain = engine.generate([PROMPT], max_tokens=20, chat=False)[0]
    assert ref.text != plain.text

    def ask(penalized: bool):
        extra = {"presence_penalty": 1.2, "frequency_penalty": 0.8, "extra_body": {"repetition_penalty": 1.5}}
        return client.completions.create(model=model_name, prompt=PROMPT, max_tokens=20, temperature=0,
                                         **(extra if penalized else {})).choices[0].text
    assert ask(True) == ref.text
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, [False, True, False, True]))
    assert got == [plain.text, ref.text] * 2
    ref = engine.generate([CHAT], max_tokens=16, frequency_penalty=1.0)[0]
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=16, temperature=0,
                                       frequency_penalty=1.0)
    assert r.choices[0].message.content == ref.text


def test_n_answers_are_the_requests_with_their_seeds(client, model_name):
    """`n` answers of one prompt (prefilled once, its slot forked): answer i is what the request
    alone samples with seed + i, streamed or not, completions and chat, with its own
    log-probabilities; the usage counts the prompt once and every answer's tokens."""
    kw = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0.8, seed=77)
    r = client.completions.create(n=4, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(**{**kw, "seed": 77 + i}) for i in range(4)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert len({c.text for c in r.choices}) == 4
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    lp = client.completions.create(n=2, echo=True, logprobs=1, **kw).model_dump()["choices"]
    for i, c in enumerate(lp):
        one = client.completions.create(echo=True, logprobs=1, **{**kw, "seed": 77 + i}).model_dump()["choices"][0]
        assert c["text"] == one["text"] == PROMPT + r.choices[i].text
        assert c["logprobs"]["tokens"] == one["logprobs"]["tokens"]
        np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:], one["logprobs"]["token_logprobs"][1:],
                                   atol=logprob_refs.ATOL)

    chat = dict(model=model_name, messages=CHAT, max_tokens=8, temperature=0.8, seed=5, n=2)
    whole = client.chat.completions.create(**chat)
    texts = {}
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        if chunk.usage:
            assert chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert [texts[i] for i in range(2)] == [c.message.content for c in whole.choices]
    assert whole.choices[0].message.content != whole.choices[1].message.content


def greedy_reference(engine, ids, n, bias=None, min_tokens=0, stops=()):
    """numpy: greedy tokens from `Engine.logits` of the prompt and the tokens so far, with
    logit_bias added, and EOS and the stop ids at -inf for the first min_tokens; an ending EOS or
    stop id is the last token."""
    out, ends = [], set(engine.cfg.eos_ids) | set(stops)
    for k in range(n):
        logits = engine.logits(np.asarray([ids + out], np.int32))[0, -1]
        for t, b in (bias or {}).items():
            logits[t] += np.float32(b)
        if k < min_tokens:
            logits[sorted(ends)] = -np.inf
        out.append(int(np.argmax(logits)))
        if out[-1] in ends:
            break
    return out


def test_logit_bias_and_min_tokens_match_a_numpy_reference(engine, client, model_name):
    """Greedy answers with `logit_bias` (a bias that overturns the argmax at one step, a ban, a
    bias of 100) and with `min_tokens` (EOS made the argmax by a bias, then kept back; a stop id
    kept back) are the argmax of `Engine.logits` treated so in numpy at every step."""
    ids = engine.tokenizer.encode(PROMPT)
    base = engine.generate_ids([ids], max_tokens=8)[0].token_ids
    logits = engine.logits(np.asarray([ids + base], np.int32))[0, len(ids) + 1]
    runner_up = int(np.argsort(logits)[-2])
    cases = [{"logit_bias": {runner_up: float(logits.max() - logits[runner_up]) + 1.0, base[5]: -100}},
             {"logit_bias": {106: 100}}, {"logit_bias": {106: 100}, "min_tokens": 3},
             {"stop_token_ids": [base[1]], "min_tokens": 4}]
    for extra in cases:
        bias = extra.get("logit_bias", {})
        r = client.completions.create(model=model_name, prompt=ids, max_tokens=8, temperature=0,
                                      extra_body={**extra, "logit_bias": {str(t): b for t, b in bias.items()}})
        want = greedy_reference(engine, ids, 8, bias, extra.get("min_tokens", 0), extra.get("stop_token_ids", ()))
        ended = want[-1] in set(engine.cfg.eos_ids) | set(extra.get("stop_token_ids", ()))
        c = r.choices[0]
        assert (c.text, c.finish_reason) == (engine.tokenizer.decode(want[:-1] if ended else want),
                                             "stop" if ended else "length"), extra
        assert r.usage.completion_tokens == len(want) and want != base
        assert len(want) > extra.get("min_tokens", 0)
    assert want[:4] != base[:4]                      # the stop id (base[1]) kept back
    big = {engine.tokenizer.encode(" banana")[0]: 100}
    r = client.completions.create(model=model_name, prompt=ids, max_tokens=5, temperature=0,
                                  logit_bias={str(t): b for t, b in big.items()})
    assert r.choices[0].text == engine.tokenizer.decode(list(big) * 5)


def test_vllm_extras_match_references(engine, client, model_name):
    """vLLM's extra parameters against references: `min_p` (every sampled token inside the min-p
    set numpy finds on `Engine.logits` at temperature 1; min_p 1 is the greedy answer; the same
    tokens as `Engine.generate` with min_p), `skip_special_tokens` (the text of a forced special
    token as the tokenizer decodes it, kept or left out), `include_stop_str_in_output`,
    `ignore_eos` (an EOS made the argmax, ignored), `truncate_prompt_tokens` (the prompt's last k
    tokens) and `prompt_logprobs` (log_softmax of the logits at each prompt position)."""
    ids = engine.tokenizer.encode(PROMPT)
    kw = dict(model=model_name, prompt=ids, max_tokens=10, seed=7)
    for min_p in (0.05, 0.3):
        r = client.completions.create(temperature=1.0, extra_body={"min_p": min_p}, **kw)
        got = engine.tokenizer.encode(r.choices[0].text)
        ref = engine.generate_ids([ids], max_tokens=10, temperature=1.0, seed=7, min_p=min_p)[0]
        assert r.choices[0].text == ref.text
        x = logprob_refs.log_softmax(engine, ids + ref.token_ids)
        for k, t in enumerate(ref.token_ids):
            row = x[len(ids) - 1 + k]
            assert row[t] >= row.max() + np.log(min_p) - 1e-4, (min_p, k)
        assert got                                   # it samples real text
    greedy = engine.generate_ids([ids], max_tokens=10)[0]
    r = client.completions.create(temperature=1.0, extra_body={"min_p": 1.0}, **kw)
    assert r.choices[0].text == greedy.text

    special = engine.tokenizer.tok.token_to_id("<start_of_turn>")
    forced = {"logit_bias": {str(special): 100}, "max_tokens": 3, "temperature": 0}
    kept = client.completions.create(**{**kw, **forced, "extra_body": {"skip_special_tokens": False}})
    plain = client.completions.create(**{**kw, **forced})
    assert kept.choices[0].text == engine.tokenizer.decode([special] * 3, skip_special=False) == "<start_of_turn>" * 3
    assert plain.choices[0].text == "" and plain.usage.completion_tokens == 3

    stop = greedy.text[len(greedy.text) // 2:len(greedy.text) // 2 + 3]
    cut = greedy.text[:greedy.text.index(stop) + len(stop)]
    for stream in (False, True):
        r = client.completions.create(temperature=0, stop=stop, stream=stream,
                                      extra_body={"include_stop_str_in_output": True}, **kw)
        text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
        assert text == cut

    eos = engine.cfg.eos_ids[0]
    bias = {str(eos): 100}
    ended = client.completions.create(temperature=0, logit_bias=bias, **kw)
    assert (ended.choices[0].text, ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("", "stop", 1)
    r = client.completions.create(temperature=0, logit_bias=bias, extra_body={"ignore_eos": True}, **kw)
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", 10)
    want = greedy_reference(engine, ids, 10, {eos: 100})
    assert want == [eos] and r.choices[0].text == engine.tokenizer.decode([eos] * 10)

    r = client.completions.create(temperature=0, extra_body={"truncate_prompt_tokens": 3}, **kw)
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == engine.generate_ids([ids[-3:]], max_tokens=10)[0].text

    for stream in (False, True):
        r = client.completions.create(temperature=0, max_tokens=2, stream=stream, model=model_name, prompt=ids,
                                      extra_body={"prompt_logprobs": 2})
        c = [x.model_dump() for x in r] if stream else [r.model_dump()]
        scored = [x["choices"][0]["prompt_logprobs"] for x in c if x["choices"] and "prompt_logprobs" in x["choices"][0]]
        assert len(scored) == 1
        logprob_refs.check_prompt_logprobs(engine, scored[0], ids, 2)
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 1}).model_dump()
    logprob_refs.check_prompt_logprobs(engine, chat["prompt_logprobs"], engine.encode_prompt(CHAT, True), 1)


def test_stop_token_ids_end_the_answer(engine, client, model_name):
    """`stop_token_ids` end the answer at the first of them the greedy answer meets, as EOS does:
    finish reason "stop", the token counted but not in the text, streamed or not; with `logprobs`
    the ending token is listed last (what a loglikelihood request scores when the next token ends
    the answer)."""
    ids = engine.tokenizer.encode(PROMPT)
    base = engine.generate_ids([ids], max_tokens=12)[0].token_ids
    first = min(base.index(base[6]), base.index(base[9]))
    kw = dict(model=model_name, prompt=ids, max_tokens=12, temperature=0, extra_body={"stop_token_ids": [base[9], base[6]]})
    r = client.completions.create(**kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (engine.tokenizer.decode(base[:first]), "stop")
    assert r.usage.completion_tokens == first + 1
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"
    lp = client.completions.create(logprobs=2, **kw).model_dump()["choices"][0]["logprobs"]
    logprob_refs.check_completion(engine, lp, ids + base[:first + 1], len(ids), 2)
    chunks = [c.model_dump() for c in client.completions.create(stream=True, logprobs=2, **kw)]
    assert logprob_refs.joined(chunks, "completion") == lp


def test_text_stream_never_splits_a_character(engine):
    from jaxllm.engine.detok import TextStream
    text = "Unicode: café, 東京 🙂🚀 Привет"
    ids = engine.tokenizer.encode(text)
    assert len(ids) > len(text.split())            # multi-byte characters span several tokens here
    ts = TextStream(engine.tokenizer)
    deltas = [ts.push(t) for t in ids] + [ts.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)

    rng = random.Random(0)                          # random ids: invalid byte runs, stops anywhere
    for _ in range(300):
        rand = [rng.randrange(engine.cfg.vocab_size) for _ in range(rng.randrange(1, 24))]
        stop = [engine.tokenizer.decode(rand[2:4]) or "x", "ab"]
        ts = TextStream(engine.tokenizer, stop)
        deltas = []
        for t in rand:
            deltas.append(ts.push(t))
            if ts.stopped:
                break
        # as a server streams: generation stops at the first token after which any stop string
        # appears in the text so far (a short stop can complete before a longer, earlier one)
        want = engine.tokenizer.decode(rand)
        for n in range(1, len(rand) + 1):
            so_far = engine.tokenizer.decode(rand[:n])
            hits = [i for i in (so_far.find(s) for s in stop) if i >= 0]
            if hits:
                want = so_far[:min(hits)]
                break
        assert "".join(deltas) + ts.finish() == want

    ts = TextStream(engine.tokenizer, stop=["東京 🙂"])
    deltas = [ts.push(t) for t in ids]
    assert ts.stopped and "".join(deltas) == "Unicode: café, "
    assert not any("東" in d for d in deltas)      # the stop string's start was held back, never sent


def test_slots_joining_mid_decode_match_engine(engine):
    """The engine core without HTTP: requests join while others decode, one prompt in pieces over
    several prefills, greedy and sampled rows mix, a slot is reused after its request ended, and
    every request's tokens equal Engine.generate_ids for it."""
    from jaxllm.engine.sampling import SamplingParams
    from jaxllm.engine.slots import Pieces
    prompts = [engine.tokenizer.encode(p) for p in ("Hello world", "Once upon a time there was a", "café 東京")]
    # (ids, temperature, seed): row r of a generate call with seed 3 samples with seed 3 + r
    jobs = [(p, 0.0, 3) for p in prompts[:2]] + [(p, 0.8, 3 + r) for r, p in enumerate(prompts[1:])]
    refs = {0.0: engine.generate_ids(prompts[:2], max_tokens=12),
            0.8: engine.generate_ids(prompts[1:], max_tokens=12, temperature=0.8, top_k=20, seed=3)}
    expected = [refs[0.0][0], refs[0.0][1], refs[0.8][0], refs[0.8][1]]
    core = engine.core(3, 64)
    out, slot_of, waiting = {}, {}, list(range(len(jobs)))
    while waiting or slot_of:
        free = [b for b in range(3) if b not in slot_of.values()]
        if waiting and free:                             # one joins per block, its prompt in pieces of 4
            j, b = waiting.pop(0), free[0]
            ids, temp, seed = jobs[j]
            params = SamplingParams.make(1, temp, 20, None, seed)
            for s in range(0, len(ids), 4):
                n = min(4, len(ids) - s)
                tok = np.zeros((1, 4), np.int32)
                tok[0, :n] = ids[s:s + n]
                first = core.prefill(Pieces.make(tok, s, n, s + n == len(ids), [b], params, 12))
            out[j], slot_of[j] = [int(np.asarray(first)[0])], b
        toks, count, _ = (np.asarray(x) for x in core.decode(3, 3))
        for j, b in list(slot_of.items()):
            out[j] += toks[b, :count[b]].tolist()
            if len(out[j]) >= 12 or out[j][-1] in engine.cfg.eos_ids:
                del slot_of[j]
    for j, ref in enumerate(expected):
        got = out[j][:-1] if out[j][-1] in engine.cfg.eos_ids else out[j]
        assert got == ref.token_ids, (j, got, ref.token_ids)


# -- 2. load: many clients, mixed lengths, streaming and not -------------------------------------
SPECS = [  # (endpoint, prompt or messages, max_tokens, stream)
    ("completions", "Hello world", 4, False),
    ("chat", [{"role": "user", "content": "Hi"}], 14, True),
    ("completions", "The quick brown fox jumps over the lazy dog. " * 4, 10, True),
    ("chat", [{"role": "user", "content": "Tell me a story about batching and caches."}], 6, False),
    ("completions", "Numbers 0 1 2 3", 18, False),
    ("chat", [{"role": "user", "content": "Привет 🙂"}], 3, True),
    ("completions", "Unicode: café, naïve", 8, True),
    ("chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], 12, False),
]

async def one_request(http: httpx.AsyncClient, spec) -> tuple[str, str, int]:
    """-> (text, finish_reason, completion_tokens), via SSE or a plain response."""
    kind, prompt, max_tokens, stream = spec
    body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"], path = prompt, "/v1/chat/completions"
    else:
        body["prompt"], path = prompt, "/v1/completions"
    if not stream:
        r = await http.post(path, json=body)
        r.raise_for_status()
        d = r.json()
        c = d["choices"][0]
        return (c["text"] if kind != "chat" else c["message"]["content"], c["finish_reason"],
                d["usage"]["completion_tokens"])
    body["stream_options"] = {"include_usage": True}
    text, finish, n = [], None, None
    async with http.stream("POST", path, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            for c in d["choices"]:
                text.append(c["text"] if kind != "chat" else c["delta"].get("content") or "")
                finish = c["finish_reason"] or finish
    return "".join(text), finish, n


CLIENTS = SLOTS + 2     # each sends 2 requests, one after another: more clients than slots, so some queue
PER_CLIENT = 2


def test_concurrent_load_matches_requests_run_alone(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=300) as http:
            alone = [await one_request(http, s) for s in SPECS]
            jobs = [(c, j, (c * PER_CLIENT + j) % len(SPECS)) for c in range(CLIENTS) for j in range(PER_CLIENT)]

            async def client_loop(c):
                return [(i, await one_request(http, SPECS[i])) for cc, _, i in jobs if cc == c]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(client_loop(c) for c in range(CLIENTS)))
            return alone, results, time.perf_counter() - t0

    alone, results, dt = asyncio.run(run())
    flat = [x for r in results for x in r]
    assert len(flat) == PER_CLIENT * CLIENTS
    for i, got in flat:
        assert got == alone[i], (SPECS[i], got, alone[i])
    n_tok = sum(got[2] for _, got in flat)
    print(f"\nload: {len(flat)} requests from {CLIENTS} clients in {dt:.2f} s: {len(flat) / dt:.1f} req/s, "
          f"{n_tok / dt:.0f} tok/s")
    assert server.health()["running"] == 0


# -- 3. malformed and hostile requests --------------------------------------------------------------
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 200
BAD = [  # (id, path, raw body or JSON, headers, status, words the message must contain)
    ("bad_json", "/v1/completions", b'{"prompt": "x",', None, 400, "not valid JSON"),
    ("empty_body", "/v1/completions", b"", None, 400, "empty"),
    ("not_object", "/v1/completions", [1, 2], None, 400, "JSON object"),
    ("prompt_type", "/v1/completions", {"prompt": 12}, None, 400, "'prompt'"),
    ("max_tokens_type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, None, 400, "'max_tokens'"),
    ("max_tokens_negative", "/v1/completions", {"prompt": "x", "max_tokens": -3}, None, 400, ">= 1"),
    ("max_tokens_huge", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 9}, None, 400, str(MAX_LEN)),
    ("prompt_too_long", "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, None, 400, "context length"),
    ("temperature_negative", "/v1/completions", {"prompt": "x", "temperature": -0.5}, None, 400, "'temperature'"),
    ("top_p_over_one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, None, 400, "'top_p'"),
    ("top_k_type", "/v1/completions", {"prompt": "x", "top_k": "ten"}, None, 400, "'top_k'"),
    ("seed_float", "/v1/completions", {"prompt": "x", "seed": 1.5}, None, 400, "'seed'"),
    ("stop_type", "/v1/completions", {"prompt": "x", "stop": [1, 2]}, None, 400, "'stop'"),
    ("n_over_slots", "/v1/completions", {"prompt": "x", "n": SLOTS + 1}, None, 400,
     f"'n' = {SLOTS + 1} answers need {SLOTS + 1} slots, but this server has {SLOTS}"),
    ("n_zero", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, None, 400, "'n'"),
    ("logit_bias_key", "/v1/completions", {"prompt": "x", "logit_bias": {"a5": 1}}, None, 400, "'logit_bias' keys"),
    ("logit_bias_vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"262144": 1}}, None, 400,
     "'logit_bias' token 262144 is outside the vocabulary"),
    ("logit_bias_value", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, None, 400,
     "'logit_bias' values must be numbers in [-100, 100]"),
    ("logit_bias_type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "logit_bias": [5]}, None, 400, "'logit_bias' must be an object"),
    ("logit_bias_size", "/v1/completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, None, 400,
     "'logit_bias' takes at most 300"),
    ("min_tokens_over_max", "/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, None, 400,
     "'min_tokens' (5) must not be more than max_tokens (4)"),
    ("min_tokens_negative", "/v1/completions", {"prompt": "x", "min_tokens": -1}, None, 400, "'min_tokens'"),
    ("stop_token_ids_type", "/v1/completions", {"prompt": "x", "stop_token_ids": 5}, None, 400, "'stop_token_ids'"),
    ("stop_token_ids_vocab", "/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, None, 400,
     "'stop_token_ids' must lie in"),
    ("stop_token_ids_size", "/v1/completions", {"prompt": "x", "stop_token_ids": list(range(17))}, None, 400,
     "at most 16"),
    ("unknown_field", "/v1/completions", {"prompt": "x", "max_token": 5}, None, 400, "max_token"),
    ("token_out_of_range", "/v1/completions", {"prompt": [1, 10 ** 6]}, None, 400, "token ids"),
    ("stream_options_alone", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     None, 400, "stream_options"),
    ("unknown_model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, None, 404, "gpt-9"),
    ("empty_messages", "/v1/chat/completions", {"messages": []}, None, 400, "non-empty"),
    ("bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400, "role"),
    ("content_type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None, 400, "content"),
    ("missing_key", "/v1/completions", {"prompt": "x"}, {}, 401, "API key"),
    ("wrong_key", "/v1/completions", {"prompt": "x"}, headers("nope"), 401, "API key"),
    ("oversized_body", "/v1/completions", {"prompt": "y" * 300_000}, None, 413, "limit"),
    ("no_route", "/v1/embeddings", {"input": "x"}, None, 404, "no route"),
    ("lone_surrogate", "/v1/completions", b'{"prompt": "a\\ud800b"}', None, 400, "surrogate"),
    ("deep_nesting", "/v1/completions", b"[" * 50_000 + b"]" * 50_000, None, 400, "nested"),
    ("temperature_nan", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, 400, "'temperature'"),
    ("stop_too_long", "/v1/completions", {"prompt": "x", "stop": "z" * 600}, None, 400, "at most"),
    ("logprobs_over_20", "/v1/completions", {"prompt": "x", "logprobs": 21}, None, 400, "'logprobs'"),
    ("logprobs_bool", "/v1/completions", {"prompt": "x", "logprobs": True}, None, 400, "'logprobs'"),
    ("chat_logprobs_int", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2},
     None, 400, "'logprobs'"),
    ("top_logprobs_alone", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2}, None, 400, "'top_logprobs' needs"),
    ("top_logprobs_over_20", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                      "logprobs": True, "top_logprobs": 21}, None, 400, "'top_logprobs'"),
    ("max_tokens_zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, None, 400, "'max_tokens'"),
    ("echo_type", "/v1/completions", {"prompt": "x", "echo": 1}, None, 400, "'echo'"),
    ("chat_echo", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, None, 400,
     "unknown field 'echo'"),
    # OpenAI and vLLM fields this server does not implement: refused by name (docs/server.md lists them)
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, None, 400, "'suffix'"),
    ("best_of", "/v1/completions", {"prompt": "x", "best_of": 3}, None, 400, "'best_of'"),
    ("presence_penalty_range", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, None, 400,
     "'presence_penalty' must be in [-2, 2]"),
    ("frequency_penalty_type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                         "frequency_penalty": "1"}, None, 400, "'frequency_penalty'"),
    ("repetition_penalty_zero", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, None, 400,
     "'repetition_penalty' must be > 0"),
    ("response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "response_format": {"type": "xml"}}, None, 400, "'response_format'"),
    ("guided_json", "/v1/completions", {"prompt": "x", "guided_json": "[1, 2"}, None, 400, "'guided_json'"),
    ("functions", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, None, 400,
     "'functions'"),
    # Gemma 3 has no tool-call format and no thinking: tools, tool messages and enable_thinking are refused
    ("tools_without_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}]}, None, 400, "'tools' is not supported"),
    ("tool_message_without_format", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a", "content": "y"}]}, None, 400,
     "no tool-call format"),
    ("enable_thinking_without_thinking", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                                  "chat_template_kwargs": {"enable_thinking": True}},
     None, 400, "enable_thinking"),
    ("min_p_range", "/v1/completions", {"prompt": "x", "min_p": 1.5}, None, 400, "'min_p' must be in [0, 1]"),
    ("truncate_zero", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, None, 400,
     "'truncate_prompt_tokens'"),
    ("prompt_logprobs_range", "/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, None, 400,
     "'prompt_logprobs' must be an integer from 0 to 20"),
    ("seed_past_uint64", "/v1/completions", {"prompt": "x", "seed": 2 ** 64}, None, 400, "'seed' must be <="),
    ("seed_far_past_uint64", "/v1/completions", {"prompt": "x", "seed": 2 ** 80}, None, 400, "'seed' must be <="),
    ("user_object", "/v1/completions", {"prompt": "x", "user": {"id": 1}}, None, 400, "'user' must be a string"),
    ("logit_bias_long_key", "/v1/completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, None, 400,
     "'logit_bias' keys must be token ids"),
    ("audio_output", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "audio": {"voice": "alloy", "format": "wav"}}, None, 400, "'audio'"),
    ("modalities_audio", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "modalities": ["text", "audio"]}, None, 400, "'modalities'"),
    ("reasoning_effort_value", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                        "reasoning_effort": "extreme"}, None, 400,
     "'reasoning_effort' must be one of"),
    ("metadata_type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                               "metadata": {"k": 5}}, None, 400, "'metadata'"),
    ("store_type", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "store": "yes"},
     None, 400, "'store' must be true or false"),
    ("tokenize_both", "/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None, 400,
     "one of 'prompt'"),
    ("tokenize_key", "/tokenize", {"prompt": "x"}, {}, 401, "API key"),
    ("detokenize_range", "/detokenize", {"tokens": [0, 10 ** 7]}, None, 400, "must lie in"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_gets_4xx_and_server_keeps_serving(server, case):
    _, path, body, hdrs, status, words = case
    h = headers() if hdrs is None else hdrs
    if isinstance(body, bytes):
        r = httpx.post(server.url + path, content=body, headers={"Content-Type": "application/json", **h}, timeout=60)
    else:
        r = httpx.post(server.url + path, json=body, headers=h, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words in err["message"], err["message"]
    load = server.health()        # still serving, and the refused request left nothing behind
    assert load["status"] == "ok" and load["running"] == 0 and load["waiting"] == 0, load


def test_extreme_but_valid_values_are_served(server):
    """Valid extremes are served; this also generates after every bad request above was refused."""
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0.5, "top_k": 10 ** 12, "seed": -5,
            "top_p": 1, "stop": [], "n": 1, "user": "u", "presence_penalty": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=headers(), timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_tokenize_matches_the_generation_routes(engine, client, model_name, server):
    """/tokenize counts what /v1/completions and /v1/chat/completions count; /detokenize inverts it;
    /v1/models tells the context length."""
    def post(path, body):
        r = httpx.post(server.url + path, json=body, headers=headers(), timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    t = post("/tokenize", {"prompt": PROMPT})
    assert t["tokens"] == engine.tokenizer.encode(PROMPT) and t["max_model_len"] == MAX_LEN
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0)
    assert t["count"] == r.usage.prompt_tokens
    assert post("/detokenize", {"tokens": t["tokens"]})["prompt"] == engine.tokenizer.decode(t["tokens"], False)
    t = post("/tokenize", {"messages": CHAT, "model": model_name})
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, temperature=0)
    assert t["count"] == r.usage.prompt_tokens and t["tokens"] == engine.encode_prompt(CHAT, chat=True)
    assert [(m.id, m.max_model_len) for m in client.models.list().data] == [(model_name, MAX_LEN)]


def test_metrics_count_the_requests(client, model_name, server):
    """/metrics (no key needed, like /health): after 3 completions the request counter is 3 up and
    the token counters are up by the usage the responses reported."""
    from prometheus_client.parser import text_string_to_metric_families

    def counters():
        r = httpx.get(server.url + "/metrics", timeout=30)
        assert r.status_code == 200
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for smp in fam.samples:
                if smp.name.endswith(("_total", "_count")):
                    out[smp.name] = out.get(smp.name, 0) + smp.value
        return out
    before = counters()
    usages = [client.completions.create(model=model_name, prompt=p, max_tokens=n, temperature=0).usage
              for p, n in ((PROMPT, 4), ("Hello world", 7), (CORPUS[3], 2))]
    after = counters()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["jaxllm:request_success_total"] == 3
    assert delta["jaxllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["jaxllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert delta["jaxllm:time_to_first_token_seconds_count"] == 3 == delta["jaxllm:e2e_request_latency_seconds_count"]
    assert delta["jaxllm:request_failure_total"] == 0


def test_wrong_method_and_open_health(server):
    r = httpx.get(server.url + "/v1/completions", headers=headers(), timeout=30)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200     # no key needed
    assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 401


# -- 4. disconnects free their slots ----------------------------------------------------------------
def test_disconnect_mid_stream_frees_slot(server):
    body = {"prompt": "Hello world", "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=headers(), timeout=120) as http:
            before = server.health()["generated_tokens"]

            async def start_and_leave():
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            return              # leaving the block closes the connection
            await asyncio.gather(*(start_and_leave() for _ in range(8)))
            t0 = time.time()
            while (h := server.health())["running"] and time.time() - t0 < 60:
                await asyncio.sleep(0.05)
            assert h["running"] == 0
            # the 8 abandoned requests stopped early instead of running their 500 tokens each
            print(f"\n8 abandoned streams generated {h['generated_tokens'] - before} tokens in all")
            assert h["generated_tokens"] - before < 8 * 250
            short = {"prompt": "Hi", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            rs = await asyncio.gather(*(http.post("/v1/completions", json=short) for _ in range(8)))
            assert [r.status_code for r in rs] == [200] * 8
            assert all(r.json()["usage"]["completion_tokens"] == 6 for r in rs)
    asyncio.run(run())


# -- per-request timeout (in process: a limit far below what the request needs) --------------------
def test_request_timeout(engine):
    from starlette.testclient import TestClient

    from jaxllm.serve.app import ServeOptions, build_app
    opts = ServeOptions(served_name="m", max_model_len=64, max_num_seqs=2, request_timeout=0.001, warmup=False)
    with TestClient(build_app(engine, opts)) as tc:
        body = {"prompt": "Hi", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        r = tc.post("/v1/completions", json=body)
        assert r.status_code == 504 and "did not finish" in r.json()["error"]["message"]
        with tc.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: ")]
        assert "did not finish" in lines[-2] and lines[-1] == "data: [DONE]"
        t0 = time.time()
        while tc.get("/health").json()["running"] and time.time() - t0 < 30:
            time.sleep(0.05)
        assert tc.get("/health").json()["running"] == 0


# -- 5. a stalled body -> 408 -------------------------------------------------------------------------
def test_stalled_body_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:200]
    assert "stalled" in json.loads(body)["error"]["message"]


# -- 6. queue full -> 429; SIGTERM: running requests finish, queued ones get a 503, exit 0 -----------
def test_sigterm_finishes_running_and_503s_the_queue(server):
    """The last test of this file: the server ends here."""
    running = {"prompt": "Hello world", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    queued = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}

    async def request(http, body, stream):
        if not stream:
            r = await http.post("/v1/completions", json=body)
            return r.status_code, r.json()
        async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        return r.status_code, lines

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=600, headers=headers(),
                                     limits=httpx.Limits(max_connections=64)) as http:
            first = [asyncio.create_task(request(http, running, i % 2 == 0)) for i in range(SLOTS)]
            t0 = time.time()
            while server.health()["running"] < SLOTS and time.time() - t0 < 120:
                await asyncio.sleep(0.02)
            rest = [asyncio.create_task(request(http, queued, i % 2 == 0)) for i in range(24)]
            while server.health()["waiting"] < 24 and time.time() - t0 < 120:
                await asyncio.sleep(0.02)
            assert server.health()["running"] == SLOTS
            r = await http.post("/v1/completions", json=queued)
            assert r.status_code == 429 and r.headers.get("retry-after")
            assert r.json()["error"]["type"] == "rate_limit_error"
            server.proc.send_signal(signal.SIGTERM)
            t1 = time.time()
            return await asyncio.gather(*first), await asyncio.gather(*rest), t1

    done, refused, t_sigterm = asyncio.run(run())
    for i, (status, got) in enumerate(done):             # every running request completes
        assert status == 200
        if i % 2:
            assert got["choices"][0]["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 60
        else:
            finals = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
            assert finals[-1]["choices"][0]["finish_reason"] == "length" and got[-1] == "data: [DONE]"
    for i, (status, got) in enumerate(refused):          # every queued one gets an OpenAI 503
        if i % 2:
            assert status == 503 and got["error"]["type"] == "server_error", got
            assert set(got["error"]) == {"message", "type", "param", "code"}
        else:
            err = json.loads(got[-2][6:])
            assert got[-1] == "data: [DONE]" and "shutting down" in err["error"]["message"], got
    assert server.proc.wait(240) == 0
    print(f"\nexit {time.time() - t_sigterm:.1f} s after SIGTERM")
    assert "Traceback" not in server.output()
