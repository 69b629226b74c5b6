"""The serving bench's clients: streaming connections that keep a level's clients busy (their
requests one after another, or a conversation's turns), what the server's /metrics says of its
threads, speculation and preemptions, and the figures of a level (`Level`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Level:
    concurrency: int
    requests: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    output_tok_s: float = 0.0
    ttft_ms: dict = field(default_factory=dict)  # p50, p99, max
    tpot_ms: dict = field(default_factory=dict)  # (end - first token) / (tokens - 1), per request
    itl_ms: dict = field(default_factory=dict)  # gaps between streamed chunks
    failed: int = 0
    fused_tok_s: float | None = None
    ratio: float | None = None
    bound: float | None = None  # the ratio with no host time: the loop's steps and one prefill a round,
    # the prompts in the server's pieces (`piece_len`)
    bound_packed: float | None = None  # the same with the prompts packed to their length
    speculation: dict | None = None  # verify cycles, drafted, accepted over the level (from /metrics)
    long_prompt: dict | None = None  # --long-prompt: its TTFT, and the others' chunk gaps during its prefill
    # --logprobs / --json-fraction: the same requests without them (output_tok_s, duration_s,
    # output_tokens, failed) and this level's tok/s as a fraction of theirs ("of_plain")
    plain: dict | None = None
    # The fraction of the level's wall time each scheduler thread spent on each part of its work
    # ("other": the engine thread's own scheduling), from the server's /metrics.
    threads: dict | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of them, served by the prefix cache (the answers' usage)
    hit_rate: float | None = None
    preemptions: int = 0  # running requests the server preempted for KV blocks (from /metrics)
    turns: list | None = None  # --turns: per turn, {"ttft_ms", "hit_rate", "prompt_tokens"}


# -- the clients -------------------------------------------------------------------------------------
class Connection:
    """One keep-alive HTTP/1.1 connection that streams SSE answers: a few lines of asyncio, so that
    the client's own cost per event stays far below the server's (a general HTTP client spent more
    time parsing 64 streams than the server did producing them)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: dict):
        """Yield the JSON object of each `data:` event of the answer, then return."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status = int((await self.reader.readline()).split()[1])
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        if status != 200:
            n = int(headers.get("content-length", 0))
            raise RuntimeError(f"HTTP {status}: {(await self.reader.readexactly(n))[:200]!r}")
        buf = b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            buf += chunk[:-2]
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if ev.startswith(b"data: {"):
                    yield json.loads(ev[6:])

    def close(self):
        if self.writer is not None:
            self.writer.close()


async def one_request(
    conn: Connection,
    ids: list[int],
    max_tokens: int,
    logprobs: int | None = None,
    json_object: bool = False,
    on_first=None,
) -> dict:
    """One streamed completion -> its chunks' arrival times from `start` (the clock at sending),
    TTFT, tokens; or {"error": ...}. `on_first()` is called when its first text arrives."""
    body = {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": not json_object,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"logprobs": logprobs} if logprobs is not None else {}),
        **({"response_format": {"type": "json_object"}} if json_object else {}),
    }
    t0 = time.perf_counter()
    chunks, n, cached, err, text = [], 0, 0, None, []
    try:
        async for d in conn.post_stream("/v1/completions", body):
            if "error" in d:
                err = d["error"]["message"]
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
                cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if any(c.get("text") for c in d.get("choices", [])):
                chunks.append(time.perf_counter() - t0)
                text += [c["text"] for c in d["choices"]]
                if len(chunks) == 1 and on_first is not None:
                    on_first()
    except (RuntimeError, OSError, ValueError) as e:
        conn.close()
        conn.writer = None
        return {"error": str(e)}
    if err or not chunks:
        return {"error": err or "no tokens streamed"}
    return {
        "start": t0,
        "ttft": chunks[0],
        "end": chunks[-1],
        "chunks": chunks,
        "tokens": n,
        "prompt": len(ids),
        "cached": cached,
        "text": "".join(text),
    }


THREAD_METRIC, CALLS_METRIC = "jaxllm:scheduler_thread_seconds", "jaxllm:scheduler_calls"
PREEMPTIONS = "jaxllm:num_preemptions"
SPEC_METRICS = {
    "jaxllm:spec_decode_num_drafts": "cycles",
    "jaxllm:spec_decode_num_draft_tokens": "drafted",
    "jaxllm:spec_decode_num_accepted_tokens": "accepted",
}


def server_counts(url: str) -> tuple[dict | None, dict]:
    """The server's speculation counters (verify cycles, drafted, accepted; None where it does not
    speculate) and its scheduler threads' seconds by (thread, part), with its preemptions so far
    under ("preemptions", "")."""

    spec, threads = {}, {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == PREEMPTIONS:
            threads["preemptions", ""] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name in SPEC_METRICS:
            spec[SPEC_METRICS[fam.name]] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
        elif fam.name == THREAD_METRIC:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    threads[s.labels["thread"], s.labels["part"]] = s.value
        elif fam.name == CALLS_METRIC:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    threads["calls", s.labels["kind"]] = s.value
    return spec or None, threads


def thread_shares(before: dict, after: dict, wall: float) -> dict:
    """{thread: {part: fraction of wall}} between two readings (and {"calls": {kind: count}}); the
    engine thread's time outside every counted part is its "other" (its own scheduling)."""
    out: dict = {}
    for (thread, part), v in after.items():
        if thread == "preemptions":
            continue
        d = v - before.get((thread, part), 0.0)
        out.setdefault(thread, {})[part] = int(d) if thread == "calls" else round(d / wall, 4)
    if "engine" in out:
        out["engine"]["other"] = round(max(0.0, 1 - sum(out["engine"].values())), 4)
    return out


def thread_summary(shares: dict | None) -> str:
    if not shares:
        return ""

    def part(t, p, v):
        return f"{p} {v}" if t == "calls" else f"{p} {v:.0%}"

    return "; ".join(
        f"{t}{'' if t == 'calls' else ' thread'} "
        + ", ".join(part(t, p, v) for p, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        for t, parts in sorted(shares.items())
    )


def spec_summary(d: dict | None) -> str:
    if not d or not d["drafted"]:
        return "-"
    return f"{d['accepted'] / d['drafted']:.0%}, {(d['accepted'] + d['cycles']) / d['cycles']:.2f}/cycle"


def pct(xs, scale=1e3) -> dict:
    if not xs:
        return {}
    xs = np.asarray(xs) * scale
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99)), "max": float(xs.max())}


@dataclass
class Load:
    """The requests of a level, in the order the clients send them (client i sends rounds i * R to
    (i + 1) * R - 1). With `turns`, each round is a conversation's next turn: its prompt is the
    conversation so far followed by the round's own tokens."""

    prompts: list
    outs: list  # max_tokens of each
    constrained: list  # each asks for a JSON object
    logprobs: int | None
    long_prompt: int | None
    turns: bool = False

    @staticmethod
    def draw(c: int, a, rng) -> "Load":
        n = c * a.rounds
        shared = rng.integers(0, a.vocab, a.shared_prefix).tolist()
        prompts = [
            (shared if a.turns == 1 or i % a.rounds == 0 else [])
            + rng.integers(0, a.vocab, rng.integers(a.prompt_len[0], a.prompt_len[1] + 1)).tolist()
            for i in range(n)
        ]
        outs = rng.integers(a.output_len[0], a.output_len[1] + 1, n).tolist()
        constrained = [int((i + 1) * a.json_fraction) > int(i * a.json_fraction) for i in range(n)]
        return Load(prompts, outs, constrained, a.logprobs, a.long_prompt, a.turns > 1)

    def plain(self, tokens: list) -> "Load":
        """The same prompts without log-probabilities or constraints, each asking for `tokens` of
        its own (EOS ignored)."""
        return Load(self.prompts, tokens, [False] * len(self.prompts), None, None, self.turns)


async def run_level(url: str, c: int, a, load: Load, rng) -> tuple[Level, list]:
    """-> (the level's figures, each request's completion tokens in load order, None where it failed)."""

    u = urlparse(url)
    conns = [Connection(u.hostname, u.port or 80) for _ in range(c)]
    prompts, outs, constrained = load.prompts, load.outs, load.constrained
    await one_request(conns[0], prompts[0][:8], 4, load.logprobs, any(constrained))  # awake, its calls compiled
    before, threads_before = server_counts(url)

    streaming = asyncio.Event()
    firsts = [0]

    def first():
        firsts[0] += 1
        if firsts[0] == c:
            streaming.set()

    async def client(i):
        out, history = [], []
        for j in range(i * a.rounds, (i + 1) * a.rounds):
            ids = history + prompts[j] if load.turns else prompts[j]
            r = await one_request(
                conns[i], ids, outs[j], load.logprobs, constrained[j], first if j == i * a.rounds else None
            )
            out.append(r)
            if load.turns and "error" not in r:  # the answer's text is its token ids
                history = ids + [int(t) for t in r["text"].split()]
        return out

    async def long_one():
        await streaming.wait()
        conn = Connection(u.hostname, u.port or 80)
        try:
            return await one_request(conn, rng.integers(0, a.vocab, load.long_prompt).tolist(), a.long_output)
        finally:
            conn.close()

    t0 = time.perf_counter()
    long_task = asyncio.ensure_future(long_one()) if load.long_prompt else None
    results = [r for rs in await asyncio.gather(*(client(i) for i in range(c))) for r in rs]
    duration = time.perf_counter() - t0
    long_result = await long_task if long_task is not None else None
    for conn in conns:
        conn.close()
    ok = [r for r in results if "error" not in r]
    lv = Level(c, len(results), sum(r["tokens"] for r in ok), duration, failed=len(results) - len(ok))
    lv.output_tok_s = lv.output_tokens / duration
    lv.ttft_ms = pct([r["ttft"] for r in ok])
    lv.tpot_ms = pct([(r["end"] - r["ttft"]) / max(r["tokens"] - 1, 1) for r in ok])
    lv.itl_ms = pct([b - x for r in ok for x, b in zip(r["chunks"], r["chunks"][1:])])
    if long_result is not None:
        lv.long_prompt = long_prompt_summary(load.long_prompt, long_result, ok)
    lv.prompt_tokens, lv.cached_tokens = sum(r["prompt"] for r in ok), sum(r["cached"] for r in ok)
    lv.hit_rate = lv.cached_tokens / max(lv.prompt_tokens, 1)
    if load.turns:
        lv.turns = [
            turn_summary([r for j, r in enumerate(results) if j % a.rounds == t and "error" not in r])
            for t in range(a.rounds)
        ]
    if before is not None:
        await asyncio.sleep(0.2)  # the server reads its speculation counts once it is idle
    spec, threads = server_counts(url)
    if before is not None:
        lv.speculation = {k: v - before[k] for k, v in spec.items()}
    lv.threads = thread_shares(threads_before, threads, duration) or None
    lv.preemptions = int(threads.get(("preemptions", ""), 0) - threads_before.get(("preemptions", ""), 0))
    return lv, [None if "error" in r else r["tokens"] for r in results]


def turn_summary(rs: list[dict]) -> dict:
    """One turn of the level's conversations: its TTFT and the share of its prompts served by the
    prefix cache."""
    prompt = sum(r["prompt"] for r in rs)
    return {
        "ttft_ms": pct([r["ttft"] for r in rs]),
        "prompt_tokens": prompt,
        "hit_rate": sum(r["cached"] for r in rs) / max(prompt, 1),
    }


def long_prompt_summary(n: int, long: dict, others: list[dict]) -> dict:
    """The long request's TTFT, and the gaps between the other streams' chunks that overlap its
    prefill (from its sending to its first token) against those that do not."""
    if "error" in long:
        return {"prompt_tokens": n, "error": long["error"]}
    w0, w1 = long["start"], long["start"] + long["ttft"]
    during, outside = [], []
    for r in others:
        at = [r["start"] + x for x in r["chunks"]]
        for x, b in zip(at, at[1:]):
            (during if x < w1 and b > w0 else outside).append(b - x)
    return {
        "prompt_tokens": n,
        "ttft_ms": long["ttft"] * 1e3,
        "tokens": long["tokens"],
        "itl_during_ms": pct(during),
        "itl_outside_ms": pct(outside),
        "gaps_during": len(during),
    }
