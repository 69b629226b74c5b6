"""Run in a subprocess with 4 host devices (XLA_FLAGS must be set before jax is imported): the
server (its HTTP app, scheduler and engine core, in process, prefix caching on) against
`Engine.generate` of each request alone, for each KV layout and under tensor parallelism: requests
alone, then 64 concurrent clients; requests sharing prefixes of many lengths (ending inside a
block, longer than the sliding window, the whole prompt); multi-turn conversations, each turn
carrying the ones before; requests for n = 3 answers (the prompt prefilled once, its blocks shared
with the forks) against the requests alone, greedy, and sampled with each answer's seed. Prints one
JSON object: per case, whether every answer matched, the prefix cache's hits (from /metrics, and
the answers' `cached_tokens`) and the pools' sharding."""
import asyncio
import json
import os
import sys

# the suite's XLA flags (tests/conftest.py) come with the environment; 4 host devices on top
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))

import gemma4_refs  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
from tp_models import make  # noqa: E402

import jaxllm  # noqa: E402
from jaxllm.engine.engine import Engine  # noqa: E402
from jaxllm.engine.speculative import Speculation  # noqa: E402
from jaxllm.serve.app import ServeOptions, build_app  # noqa: E402

MAX_LEN = 96
NEW = 12
CLIENTS = 64
BLOCK = 8            # positions a KV block holds: prompts span several, the sliding window (8) one
# (name, checkpoint, kv_quant, int8 rings, tp): compute-dtype KV, int8 global layers (the threshold
# lowered by kv_quant="int8"), int8 sliding layers too, and TP=4 over int8 global layers; a Gemma 4
# E2B-like model, whose shared-KV layers read other layers' blocks, on int8 global layers; a server
# that speculates, on int8 global layers.
CASES = [
    ("full", "gemma3", "none", False, 1),
    ("split-int8", "gemma3", "int8", False, 1),
    ("int8-rings", "gemma3", "int8", True, 1),
    ("split-int8-tp4", "gemma3", "int8", False, 4),
    ("e2b-split-int8", "e2b", "int8", False, 1),
    ("spec-ngram-split-int8", "gemma3", "int8", False, 1),   # the server speculates, the reference not
]
WRITERS = {"gemma3": lambda p: make("gemma3", p), "e2b": lambda p: gemma4_refs.build("e2b").save_pretrained(p)}


def shared_prompts() -> list[list[int]]:
    """Prompts sharing a prefix of 5 (inside the first block), 16 (two whole blocks), 21 (ending
    inside a block) and 40 tokens (five times the sliding window) with a first one, each with a tail
    of its own; and the first one again, whole (every block but its last from the cache)."""
    rng = np.random.default_rng(5)
    base = rng.integers(3, 150, 48).tolist()
    out = [base]
    for k in (5, 16, 21, 40):
        out.append(base[:k] + rng.integers(3, 150, 7).tolist())
    return out + [base]


def prompts(n: int = 12) -> list[list[int]]:
    """Lengths from 3 to 70: inside one prefill piece, and across several (pieces of 32), past the
    sliding window of 8; every other one a short pattern repeated (n-gram drafts find it)."""
    rng = np.random.default_rng(0)
    out = []
    for i, k in enumerate(np.linspace(3, 70, n)):
        k = int(k)
        out.append(rng.integers(3, 150, k).tolist() if i % 2 else (rng.integers(3, 150, 5).tolist() * k)[:k])
    return out


async def ask(http, ids, stream: bool):
    body = {"prompt": ids, "max_tokens": NEW, "temperature": 0, "stream": stream}
    if not stream:
        r = await http.post("/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["choices"][0]["text"]
    text = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


async def answers(http, ids, n: int, seed: int, temperature: float = 0.8) -> list[str]:
    body = {"prompt": ids, "max_tokens": NEW, "temperature": temperature, "seed": seed, "n": n}
    r = await http.post("/v1/completions", json=body)
    r.raise_for_status()
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


async def forks_match(http, ps, want, sampled: bool) -> bool:
    """3 answers of a short prompt and of one prefilled in pieces: greedy, each is `Engine.generate`'s;
    sampled (the one prefilled in pieces), answer i is the request's alone with seed 11 + i (not
    asked of a server that speculates: there a sampled request's tokens depend on the requests
    sharing its decode blocks)."""
    for i in (0, len(ps) - 1):
        if await answers(http, ps[i], 3, 0, temperature=0) != [want[i]] * 3:
            return False
    for ids in (ps[-1],) if sampled else ():
        together = await answers(http, ids, 3, 11)
        alone = [(await answers(http, ids, 1, 11 + i))[0] for i in range(3)]
        if together != alone or len(set(together)) < 2:
            return False
    return True


async def ask_usage(http, ids) -> tuple[str, int]:
    r = await http.post("/v1/completions", json={"prompt": ids, "max_tokens": NEW, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def conversation(http, eng, first: list[int], turns: int, rng) -> tuple[bool, list[int]]:
    """A chat of `turns` turns, each prompt the ones before, their answers and new user tokens:
    -> (whether every answer is `Engine.generate`'s of its whole prompt alone, the cached tokens of
    each turn)."""
    ids, ok, cached = list(first), True, []
    for _ in range(turns):
        text, c = await ask_usage(http, ids)
        ok &= text == alone(eng, ids)
        cached.append(c)
        ids = ids + [int(t) for t in text.split()] + rng.integers(3, 150, 5).tolist()
    return ok, cached


def alone(eng, ids) -> str:
    return eng.generate_ids([ids], max_tokens=NEW)[0].text


async def serve(app, eng, ps, want, sampled: bool):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=600) as http:
        out = {"alone": [await ask(http, p, False) for p in ps] == want}
        many = await asyncio.gather(*(ask(http, ps[i % len(ps)], i % 2 == 1) for i in range(CLIENTS)))
        out["concurrent"] = all(t == want[i % len(ps)] for i, t in enumerate(many))
        out["mismatch"] = [i for i, t in enumerate(many) if t != want[i % len(ps)]]
        sp = shared_prompts()
        got = [await ask_usage(http, p) for p in sp]
        out["shared"] = all(t == alone(eng, p) for (t, _), p in zip(got, sp))
        out["shared_cached"] = [c for _, c in got]
        together = await asyncio.gather(*(ask(http, sp[i % len(sp)], False) for i in range(16)))
        out["shared_concurrent"] = all(t == alone(eng, sp[i % len(sp)]) for i, t in enumerate(together))
        rng = np.random.default_rng(9)
        chats = await asyncio.gather(*(conversation(http, eng, rng.integers(3, 150, 9 + i).tolist(), 3,
                                                    np.random.default_rng(i)) for i in range(3)))
        out["turns"] = all(ok for ok, _ in chats)
        out["turns_cached"] = [c for _, c in chats]
        out["forks"] = await forks_match(http, ps, want, sampled)
        out["forks_shared"] = await forks_match(http, [sp[3], sp[0]], [alone(eng, sp[3]), alone(eng, sp[0])], False)
        metrics = (await http.get("/metrics")).text
        out["metric_hits"] = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                 if line.startswith("vllm:prefix_cache_hits_total"))
    return out


class Ids:
    """A stand-in tokenizer for a checkpoint without one: text is the ids, space-separated."""
    chat_template = None
    bos_id = None

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


REFERENCES = {}   # (checkpoint, kv_quant, int8 rings, tp) -> (engine, its answers)


def reference(tmp, ckpt, kv_quant, rings, tp):
    """The engine of a case's checkpoint and KV settings, and its `Engine.generate` answers to the
    prompts: made once for the cases that share them (a server that speculates is checked against
    the plain engine of its layout)."""
    key = (ckpt, kv_quant, rings, tp)
    if key not in REFERENCES:
        path = os.path.join(tmp, ckpt)
        if not os.path.exists(path):
            WRITERS[ckpt](path)
        eng = jaxllm.load(path, dtype="float32", quant="none", tp=tp, max_ctx=MAX_LEN, kv_quant=kv_quant,
                          kv_options=jaxllm.KVOptions(int8_rings=rings, prefill_chunk=32, block_size=BLOCK))
        eng.tokenizer = Ids()
        REFERENCES[key] = eng, [alone(eng, p) for p in prompts()]
    return REFERENCES[key]


def run_case(tmp, name, ckpt, kv_quant, rings, tp):
    eng, want = reference(tmp, ckpt, kv_quant, rings, tp)
    ps = prompts()
    if name.startswith("spec"):
        eng = Engine(eng.cfg, eng.weights, eng.tokenizer, dtype="float32", max_ctx=MAX_LEN, kv_quant=kv_quant,
                     kv_options=eng.kv_options, layout=eng.layout, speculation=Speculation("ngram", 3))
    app = build_app(eng, ServeOptions(served_name="m", max_model_len=MAX_LEN, max_num_seqs=16,
                                      max_num_batched_tokens=32, max_queue=CLIENTS))
    sched = app.state.server.scheduler
    # every call compiled ahead, as a server starts, where the cache is sharded; elsewhere each call
    # compiles when first needed (the same executables, fewer of them)
    sched.warmup.first_runs = tp > 1      # there, each call also runs once first as on GPUs, under the mesh
    sched.start(warmup=tp > 1)
    try:
        out = asyncio.run(serve(app, REFERENCES[(ckpt, kv_quant, rings, tp)][0], ps, want,
                                sampled=not name.startswith("spec")))
    finally:
        sched.shutdown()
    k = sched.core.state.cache.pools["global"].v
    return {**out, "layout": eng.kv_layout.name, "cache_spec": [str(s) for s in k.sharding.spec],
            "devices": len(k.sharding.device_set), "prefills": sum(r["kind"] == "prefill" for r in sched.record),
            "fixed_blocks": sum(r["kind"] == "decode" and r["fixed"] for r in sched.record),
            "speculation": sched.core.spec_stats()}


def main(tmp):
    out = {}
    for name, *rest in CASES:
        try:
            out[name] = run_case(tmp, name, *rest)
        except Exception as e:
            raise RuntimeError(f"case {name!r} failed") from e
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
