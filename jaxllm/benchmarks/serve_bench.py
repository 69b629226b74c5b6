"""`python -m jaxllm.bench --serve`: the OpenAI server under load, beside the fused decode loop.

It starts `python -m jaxllm.serve` (or targets a running server with --url), and at each
concurrency C keeps C streaming clients busy, each sending --rounds requests of --prompt-len token
ids and --output-len new tokens one after another (EOS ignored, so every answer has that length).
Reported per concurrency: output tok/s (all completion tokens over the wall time from the first
request sent to the last answer read, as vLLM's serving benchmark counts it), time to first token
and time per output token (p50, p99), inter-chunk latency, and beside them the fused on-device loop
(`python -m jaxllm.bench`) at batch C and the mean context of a request's decode steps, measured in
the same run, with the ratio of the two. The loop counts decode steps alone, while a server also
prefills every prompt; so beside the ratio is its bound, the ratio a server reaches with no host
time at all: each round of C answers one forward of C prompts (timed in the same run) and then the
mean output length less one of the loop's steps. The server prefills a prompt in a piece of one of
its lengths (128, 512, 2048, ... tokens: `Shapes`), so the bound times the prompts at the piece that
holds the mean prompt; the JSON's `bound_packed` times them at their own length. The time the server
took to report ready is recorded too.

With --logprobs or --json-fraction, each level runs on the same server once untimed, once timed as
asked, then as the same requests (the same prompts, each asking for exactly the tokens its answer
had) without log-probabilities or constraints, so that their cost is the ratio of two loads that
generate the same tokens (JSON answers end where their object does, at lengths of their own).

Loads that reuse what the server computed: --shared-prefix N puts the same N tokens (a system
prompt) before every prompt of a level; --turns T makes each client hold a conversation of T turns,
each request the conversation so far (the earlier prompts and answers) and --prompt-len new tokens.
Each level reports the share of prompt tokens the prefix cache served (the answers' `usage`), and
with --turns the TTFT and that share turn by turn; the fused loop is taken at the mean context of
a decode step, the prefix and the earlier turns included.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np

from jaxllm.benchmarks.records import default_out, git_commit, int_list
from jaxllm.benchmarks.serve_clients import Load, run_level, spec_summary, thread_summary
from jaxllm.config.engine import SPECULATION, add_flags, from_args, settle, to_flags
from jaxllm.engine.shapes import Shapes
from jaxllm.errors import JaxllmError
from jaxllm.model.presets import load_preset
from jaxllm.serve.__main__ import add_scheduler_args, scheduler_flags


def length_range(s: str) -> tuple[int, int]:
    try:
        lo, _, hi = s.partition(":")
        r = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LO:HI, got {s!r}") from None
    if not 1 <= r[0] <= r[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {s!r}")
    return r


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxllm.bench --serve", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    add_flags(src, ("shape", "model_dir"))
    src.add_argument("--url", help="a running server to load instead (no fused-loop reference)")
    p.add_argument("--concurrency", type=int_list, default=[1, 16, 64], help="comma-separated client counts")
    p.add_argument(
        "--prompt-len",
        type=length_range,
        default=(100, 100),
        help="prompt tokens: N, or LO:HI for lengths drawn uniformly",
    )
    p.add_argument("--output-len", type=length_range, default=(128, 128), help="new tokens: N, or LO:HI")
    p.add_argument("--rounds", type=int, default=4, help="requests each client sends, one after another")
    p.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn below this (default: the model's)")
    p.add_argument(
        "--logprobs", type=int, default=None, help="every request asks for this many top log-probabilities a token"
    )
    p.add_argument(
        "--json-fraction",
        type=float,
        default=0.0,
        help="this fraction of the requests asks for a JSON object (response_format json_object)",
    )
    p.add_argument(
        "--long-prompt",
        type=int,
        default=None,
        metavar="N",
        help="once every client is streaming, one more request with an N-token prompt (and "
        "--long-output new tokens): its TTFT and the other streams' gaps while it prefills",
    )
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="N token ids every prompt of a level starts with (a system prompt)",
    )
    p.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="T",
        help="each client holds a conversation of T requests, each carrying the earlier ones and "
        "their answers (needs a server whose text is its token ids: --shape without --tokenizer)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip the fused-loop figures")
    add_flags(p, ("seed", "out"))
    add_flags(
        p,
        SERVED,
        "the server's model (passed to it; --max-model-len by default: prompt + output, rounded up)",
        first={"max_ctx": "--max-model-len"},
    )
    add_scheduler_args(p, defaults=False)  # passed on; --max-num-seqs by default the largest concurrency
    add_flags(p, SPECULATION, "speculative decoding (the server's; the fused-loop reference stays plain decoding)")
    return p


# -- the server --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def source_args(a) -> list[str]:
    return ["--shape", a.shape] if a.shape else ["--model-dir", a.model_dir] if a.model_dir else []


SERVED = ("tokenizer", "dtype", "quant", "kv_quant", "max_ctx", "tp", "block_size", "compilation_cache")


def server_args(a) -> list[str]:
    config = a.config.replace(max_ctx=a.max_ctx)
    return (
        source_args(a)
        + to_flags(config, (*SERVED, *SPECULATION))
        + scheduler_flags(a)
        + ["--max-queue", str(4 * a.max_num_seqs), "--disable-uvicorn-access-log", "--log-level", "info"]
    )


class Server:
    """`python -m jaxllm.serve` in a process of its own, its log in a file."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxllm.serve", "--port", str(self.port), *args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 1800) -> float:

        while time.monotonic() - self.t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - self.t0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise SystemExit(f"the server was not ready after {timeout} s; see {self.log.name}")

    def wait_compiled(self, timeout: float = 1800) -> float:
        """Seconds from start until the shapes the server compiles in the background after ready
        are all compiled and have run once (the timed loads run on every shape, as a server long
        up does)."""

        while time.monotonic() - self.t0 < timeout:
            h = httpx.get(self.url + "/health", timeout=10).json()
            if h.get("compiling", 0) == 0 and h.get("warming", 0) == 0:
                return time.monotonic() - self.t0
            time.sleep(0.1)
        raise SystemExit(f"the server's shapes were not all compiled after {timeout} s; see {self.log.name}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


# -- the fused-loop reference ------------------------------------------------------------------------
def fused_reference(a, ctx: int) -> tuple[dict, dict]:
    """The fused decode loop at each concurrency as batch, from `python -m jaxllm.bench` (its whole
    report goes into this one's)."""
    src = source_args(a) or ["--shape", "gemma3-270m"]  # the embedded model's architecture
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fused_loop.json"
        cmd = [
            sys.executable,
            "-m",
            "jaxllm.bench",
            *src,
            "--batches",
            ",".join(map(str, a.concurrency)),
            "--ctx",
            str(ctx),
            "--steps",
            str(a.output_len[1]),
            "--quant",
            a.quant,
            "--kv-quant",
            a.kv_quant,
            "--prompt-lens",
            ",".join(map(str, sorted({mean_len(a.prompt_len), piece_len(a)}))),
            "--ttft-every-batch",
            "--out",
            str(path),
        ] + (["--tp", str(a.tp)] if a.tp else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"the fused-loop bench failed:\n{r.stderr[-2000:]}")
        rep = json.loads(path.read_text())
    return {p["batch"]: p for p in rep["points"]}, rep


def mean_len(r: tuple[int, int]) -> int:
    return round(sum(r) / 2)


def piece_len(a) -> int:
    """The prompt tokens the server's prefill pieces take for a prompt of the mean length: the
    shortest piece that holds it, or pieces of the longest."""
    n = mean_len(a.prompt_len)
    lengths = Shapes(budget=0, slots=1, max_piece=a.max_ctx, deterministic=a.deterministic).lengths()
    return next((c for c in lengths if c >= n), -(-n // lengths[-1]) * lengths[-1])


def bound(point: dict, prompt_len: int, output_len: int) -> float | None:
    """The ratio to the fused loop a server of this load reaches with no host time (see the module's
    docstring), from the loop's point at the level's batch; None without its prefill timed."""
    prefill_ms = point.get("ttft_ms", {}).get(str(prompt_len))
    if prefill_ms is None or not point.get("ms_per_step"):
        return None
    step = point["ms_per_step"]
    return output_len * step / (prefill_ms + (output_len - 1) * step)


def table(rep: dict) -> str:
    s = rep["settings"]
    ready = "" if rep.get("ready_s") is None else f"; server ready {rep['ready_s']:.1f} s after start"
    if rep.get("compiled_s") is not None:
        ready += f", every shape compiled {rep['compiled_s']:.1f} s after start"

    def span(r):
        return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"

    reuse = (
        (f" after a shared prefix of {s['shared_prefix']}" if s.get("shared_prefix") else "")
        + (f", conversations of {s['turns']} turns" if s.get("turns", 1) > 1 else "")
        + (", deterministic" if s.get("deterministic") else "")
    )
    head = (
        f"serving {rep['subject']} on {rep.get('device', '?')}: prompts of {span(s['prompt_len'])} tokens{reuse}, "
        f"{span(s['output_len'])} new, {s['rounds']} requests a client; fused loop at ctx {s['fused_ctx']}{ready}"
    )
    spec = any(lv.get("speculation") for lv in rep["levels"])
    cols = [
        "clients",
        "requests",
        "tok/s",
        "fused tok/s",
        "ratio",
        "bound",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p50",
        "ITL p99",
        "cached",
        "preempted",
        "failed",
    ] + (["accepted"] if spec else [])
    rows = []
    for lv in rep["levels"]:

        def f(d, k):
            return f"{d[k]:.1f}" if d.get(k) is not None else "-"

        rows.append(
            [
                str(lv["concurrency"]),
                str(lv["requests"]),
                f"{lv['output_tok_s']:.1f}",
                "-" if lv["fused_tok_s"] is None else f"{lv['fused_tok_s']:.1f}",
                "-" if lv["ratio"] is None else f"{lv['ratio']:.2f}",
                "-" if lv.get("bound") is None else f"{lv['bound']:.2f}",
                f(lv["ttft_ms"], "p50"),
                f(lv["ttft_ms"], "p99"),
                f(lv["tpot_ms"], "p50"),
                f(lv["tpot_ms"], "p99"),
                f(lv["itl_ms"], "p50"),
                f(lv["itl_ms"], "p99"),
                "-" if lv.get("hit_rate") is None else f"{lv['hit_rate']:.0%}",
                str(lv.get("preemptions", 0)),
                str(lv["failed"]),
            ]
            + ([spec_summary(lv.get("speculation"))] if spec else [])
        )
    width = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    fmt = lambda r: "  ".join(x.rjust(w) for x, w in zip(r, width))  # noqa: E731
    lines = (
        [head]
        + ([f"the server's KV pool: {rep['kv_pool']}"] if rep.get("kv_pool") else [])
        + [fmt(cols) + "   (ms)", *map(fmt, rows)]
    )
    for lv in rep["levels"]:
        if lv.get("turns"):
            lines.append(
                f"{lv['concurrency']} clients, turn by turn (TTFT p50 ms, prompt tokens from the cache): "
                + ", ".join(f"{t['ttft_ms'].get('p50', 0):.0f} {t['hit_rate']:.0%}" for t in lv["turns"])
            )
        if lv.get("threads"):
            lines.append(f"{lv['concurrency']} clients, time of the wall: {thread_summary(lv['threads'])}")
        pl = lv.get("plain")
        if pl:
            lines.append(
                f"{lv['concurrency']} clients, the same requests without log-probabilities or constraints: "
                f"{pl['output_tok_s']:.1f} tok/s ({pl['output_tokens']} tokens, {pl['failed']} failed); "
                f"this load is {pl['of_plain']:.2f} of it"
            )
        lp = lv.get("long_prompt")
        if lp and "error" in lp:
            lines.append(f"{lv['concurrency']} clients + one {lp['prompt_tokens']}-token prompt: {lp['error']}")
        elif lp:
            d, o = lp["itl_during_ms"], lp["itl_outside_ms"]
            lines.append(
                f"{lv['concurrency']} clients + one {lp['prompt_tokens']}-token prompt: its TTFT "
                f"{lp['ttft_ms']:.0f} ms; the others' chunk gaps during its prefill p50 {d.get('p50', 0):.1f} "
                f"p99 {d.get('p99', 0):.1f} max {d.get('max', 0):.1f} ms ({lp['gaps_during']} gaps), "
                f"otherwise p50 {o.get('p50', 0):.1f} p99 {o.get('p99', 0):.1f} ms"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.concurrency) < 1 or a.output_len[0] < 2 or a.rounds < 1:
        raise SystemExit("--concurrency and --rounds must be >= 1 and --output-len >= 2")
    if not 0 <= a.json_fraction <= 1:
        raise SystemExit(f"--json-fraction must be in [0, 1], got {a.json_fraction}")
    try:
        a.config = from_args(a)
    except JaxllmError as e:
        raise SystemExit(f"error: {e}") from None
    settle(a, a.config)
    a.max_num_seqs = a.max_num_seqs or max(a.concurrency) + (a.long_prompt is not None)
    if a.long_prompt is not None and (a.long_prompt < 1 or a.long_output < 1):
        raise SystemExit("--long-prompt and --long-output must be >= 1")
    if a.shared_prefix < 0 or a.turns < 1:
        raise SystemExit("--shared-prefix must be >= 0 and --turns >= 1")
    if a.turns > 1:
        if not a.url and not (a.shape and not a.tokenizer):
            raise SystemExit("--turns needs a server whose text is its token ids: --shape without --tokenizer")
        a.rounds = a.turns  # a client's requests are its conversation's turns
    turn = a.prompt_len[1] + a.output_len[1]
    longest = max(a.shared_prefix + a.turns * turn, (a.long_prompt or 0) + a.long_output)
    a.max_ctx = a.max_ctx or -(-longest // 64) * 64
    if a.vocab is None:
        if a.url:
            a.vocab = 1000
        elif a.shape:
            a.vocab = load_preset(a.shape)[0].vocab_size
        else:
            a.vocab = 1000  # ids every vocabulary holds
    out = Path(a.out) if a.out else default_out(a, "serve-")
    out.parent.mkdir(parents=True, exist_ok=True)
    # a request's mean decode context: its prompt (after the shared prefix, or the earlier turns)
    # and half its answer
    ctx = (sum(a.prompt_len) + sum(a.output_len) // 2) // 2 + a.shared_prefix
    ctx += (a.turns - 1) * (mean_len(a.prompt_len) + mean_len(a.output_len)) // 2
    ref, ref_rep = ({}, None) if a.url or a.no_reference else fused_reference(a, ctx)
    server = None
    ready = compiled = pool = None
    if not a.url:
        server = Server(server_args(a), out.with_suffix(".server.log"))
        ready = server.wait_ready()
        compiled = server.wait_compiled()
        print(f"server ready in {ready:.1f} s, every shape compiled in {compiled:.1f} s", file=sys.stderr)
        server.log.flush()
        pool = next(
            (line.split("KV pool: ", 1)[1].strip() for line in open(server.log.name) if "KV pool: " in line), None
        )
    url = a.url or server.url
    rng = np.random.default_rng(a.seed)
    levels = []
    try:
        for c in a.concurrency:
            load = Load.draw(c, a, rng)
            twin = a.logprobs is not None or a.json_fraction > 0
            if twin:  # the first run of a load on a fresh server is slower; the pair compared is not
                asyncio.run(run_level(url, c, a, load, rng))
            lv, tokens = asyncio.run(run_level(url, c, a, load, rng))
            if twin:
                plain, _ = asyncio.run(
                    run_level(
                        url,
                        c,
                        a,
                        load.plain([max(t, 1) if t is not None else o for t, o in zip(tokens, load.outs)]),
                        rng,
                    )
                )
                lv.plain = {
                    "output_tok_s": plain.output_tok_s,
                    "duration_s": plain.duration_s,
                    "output_tokens": plain.output_tokens,
                    "failed": plain.failed,
                    "of_plain": lv.output_tok_s / plain.output_tok_s if plain.output_tok_s else None,
                }
            if c in ref and ref[c].get("tok_s"):
                lv.fused_tok_s = ref[c]["tok_s"]
                lv.ratio = lv.output_tok_s / lv.fused_tok_s
                lv.bound = bound(ref[c], piece_len(a), mean_len(a.output_len))
                lv.bound_packed = bound(ref[c], mean_len(a.prompt_len), mean_len(a.output_len))
            levels.append(lv)
            print(f"concurrency {c}: {lv.output_tok_s:.1f} tok/s", file=sys.stderr)
    finally:
        if server is not None:
            server.stop()
    rep = {
        "subject": a.shape or a.model_dir or a.url or "the embedded model",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "ready_s": ready,
        "compiled_s": compiled,
        "kv_pool": pool,
        "settings": {
            k: getattr(a, k)
            for k in (
                "prompt_len",
                "output_len",
                "rounds",
                "max_num_seqs",
                "max_num_batched_tokens",
                "decode_steps",
                "tp",
                "quant",
                "kv_quant",
                "concurrency",
                "speculative",
                "num_speculative_tokens",
                "draft_model_dir",
                "logprobs",
                "json_fraction",
                "long_prompt",
                "long_output",
                "shared_prefix",
                "turns",
                "deterministic",
            )
        }
        | {"max_model_len": a.max_ctx, "fused_ctx": ctx, "prefill_piece": piece_len(a)},
        "levels": [asdict(x) for x in levels],
    }
    if ref_rep is not None:
        rep.update(device=ref_rep["device"]["kind"], jax_version=ref_rep["jax_version"], fused_loop=ref_rep)
    out.write_text(json.dumps(rep, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    print(table(rep), flush=True)
    return 0
