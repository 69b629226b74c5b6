"""Time the top-k / top-p cut-off both ways `jaxllm.sampling.filtered` can find it -- a sort of the
vocabulary, or bisection on the values' order -- and a greedy argmax, for vocabularies of Qwen3
(151,936) and Gemma (262,144) at several batch sizes; beside each, the time to read the logits once
at the copy bandwidth measured in the same run. Then a whole draw, timed per step inside a compiled
loop as the decode loop runs it: `jaxllm.sampling.sample` (rejection for top-p) against finding
the cut-off first and drawing from the filtered logits.

    python scripts/sampling_bench.py --batches 1,8,64 --out results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from kernel_bench import timed  # noqa: E402  (this directory is on the path of a script run from it)

from jaxllm.benchmarks.ceilings import measure_bandwidth  # noqa: E402
from jaxllm.benchmarks.records import git_commit  # noqa: E402
from jaxllm.engine.sampling import SamplingParams, _row_keys, filtered, sample  # noqa: E402

CASES = {"top-k 50, top-p 0.95": dict(top_k=50, top_p=0.95), "top-p 0.95": dict(top_p=0.95)}
DRAW_CASES = {"top-p 0.95": dict(top_p=0.95), "top-p 0.5": dict(top_p=0.5), **CASES}
STEPS = 20


def cut_then_draw(logits, p, step):
    """The draw as it was: the cut-off by sort or bisection, then one categorical draw, behind a
    branch that skips both when no row samples."""
    return jax.lax.cond(
        jnp.any(p.temperature > 0),
        lambda: jax.vmap(jax.random.categorical)(_row_keys(p, step), filtered(logits, p)),
        lambda: jnp.argmax(logits, -1),
    ).astype(jnp.int32)


def per_step(draw, reps):
    """Seconds a step of `draw` takes inside a compiled loop of STEPS steps, each on logits that
    differ slightly, so nothing is hoisted out of the loop."""

    def run(x, p):
        def body(i, acc):
            return acc + jnp.sum(draw(x * (1 + i.astype(jnp.float32) * 1e-7), p, i))

        return jax.lax.fori_loop(0, STEPS, body, jnp.int32(0))

    return lambda x, p: timed(jax.jit(run), x, p, reps=reps) / STEPS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocabs", default="151936,262144")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", help="JSON file to write")
    a = ap.parse_args(argv)
    _, bandwidth, _, _ = measure_bandwidth(1 << 30)
    dev = jax.devices()[0]
    rows = []
    for V in map(int, a.vocabs.split(",")):
        for B in map(int, a.batches.split(",")):
            logits = jax.random.normal(jax.random.key(0), (B, V)) * 3
            greedy = timed(jax.jit(lambda x: jnp.argmax(x, -1)), logits, reps=a.reps)
            for case, kw in CASES.items():
                p = SamplingParams.make(B, 0.9, seed=1, **kw)
                ms = {
                    by: 1e3 * timed(jax.jit(partial(filtered, by=by)), logits, p, reps=a.reps)
                    for by in ("sort", "bisection")
                }
                rows.append(
                    dict(
                        vocab=V,
                        batch=B,
                        case=case,
                        sort_ms=ms["sort"],
                        bisection_ms=ms["bisection"],
                        argmax_ms=1e3 * greedy,
                        read_once_ms=1e3 * B * V * 4 / bandwidth,
                    )
                )
                print(rows[-1], flush=True)
    draws = []
    for V in map(int, a.vocabs.split(",")):
        for B in map(int, a.batches.split(",")):
            logits = jax.random.normal(jax.random.key(0), (B, V)) * 3
            for case, kw in DRAW_CASES.items():
                p = SamplingParams.make(B, 0.9, seed=1, **kw)
                ms = {
                    name: 1e3 * per_step(fn, a.reps)(logits, p)
                    for name, fn in (
                        ("greedy", lambda x, p, i: jnp.argmax(x, -1)),
                        ("cut_then_draw", cut_then_draw),
                        ("sample", sample),
                    )
                }
                draws.append(
                    dict(
                        vocab=V,
                        batch=B,
                        case=case,
                        **{f"{k}_ms": v for k, v in ms.items()},
                        read_once_ms=1e3 * B * V * 4 / bandwidth,
                    )
                )
                print(draws[-1], flush=True)
    rep = dict(
        device=dev.device_kind,
        jax=jax.__version__,
        git_commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        bandwidth_gbs=bandwidth / 1e9,
        rows=rows,
        draws=draws,
    )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rep, f, indent=1)
    print(f"{dev.device_kind}, jax {jax.__version__}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"{'vocab':>7} {'batch':>5}  {'case':22} {'sort ms':>8} {'bisect ms':>9} {'argmax ms':>9} {'read once':>9}")
    for r in rows:
        print(
            f"{r['vocab']:>7} {r['batch']:>5}  {r['case']:22} {r['sort_ms']:8.3f} {r['bisection_ms']:9.3f} "
            f"{r['argmax_ms']:9.3f} {r['read_once_ms']:9.4f}"
        )
    print(
        f"\nA draw, ms a step in a compiled loop\n{'vocab':>7} {'batch':>5}  {'case':22} {'greedy':>8} "
        f"{'cut, draw':>9} {'sample':>8} {'read once':>9}"
    )
    for r in draws:
        print(
            f"{r['vocab']:>7} {r['batch']:>5}  {r['case']:22} {r['greedy_ms']:8.3f} {r['cut_then_draw_ms']:9.3f} "
            f"{r['sample_ms']:8.3f} {r['read_once_ms']:9.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
