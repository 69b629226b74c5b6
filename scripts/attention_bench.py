"""Time the decode-attention kernel over a paged KV pool (`kv.paged`) on each kind of pool the engine
keeps, at a batch and context: bf16 (Qwen3-4B's layers, Gemma 4 31B's sliding ones), int8 (Gemma 4's
global layers, its sliding ones with int8 rings) and keys rebuilt from int8 values (Gemma 4's
k_eq_v global layers stored as values alone). With `--shuffle` every case is timed twice, its rows'
blocks in order (each row's blocks one contiguous run, as a fresh pool hands them out) and
shuffled over the whole pool (as a pool that has served for a while holds them); `--pages`,
`--blocks`, `--warps`, `--widen` and `--prefetch` add variants of the page size and the kernel's
own choices (by default each is the kernel's, shown as "default").

    python scripts/attention_bench.py --batch 64 --ctx 32768 --shuffle --out DIR
    python scripts/attention_bench.py --batch 1 --ctx 32768 --pages 16,32,64 --blocks 32,64 --warps 4,8

Every row at position ctx - 1, so the kernel reads every position a query sees (a sliding kind its
window). Times are medians of 100 calls on one layer of a 2-layer pool; GB/s counts the K/V bytes
(and scales) of the positions each row sees in that layer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from kernel_bench import timed  # noqa: E402  (this directory is on the path of a script run from it)

from jaxllm.kv.paged import table_width  # noqa: E402
from jaxllm.ops.gpu.attention import decode_attention  # noqa: E402
from jaxllm.ops.gpu.widen import WAYS  # noqa: E402
from jaxllm.ops.xla import KeysFromValues  # noqa: E402

L = 2
# name: query heads, KV heads, head_dim, window, int8, keys from values
CASES = {
    "qwen3-4b bf16": (32, 8, 128, None, False, False),
    "gemma4-31b sliding bf16": (32, 16, 256, 1024, False, False),
    "gemma4-31b sliding int8": (32, 16, 256, 1024, True, False),
    "gemma4-31b global int8": (32, 4, 512, None, True, False),
    "gemma4-31b keys from int8 values": (32, 4, 512, None, True, True),
}


def make_pool(B, ctx, P, K, hd, window, int8, from_values, key):
    """(pool arrays, M): every row's blocks for ctx positions (a sliding kind's ring of its window),
    filled by tiling one random block (what is read, not its values, sets the time)."""
    M = table_width(window, P, ctx, 1)
    N = B * M + 1
    dtype = jnp.int8 if int8 else jnp.bfloat16

    @jax.jit
    def fill(key):
        one = jax.random.randint(key, (1, 1, P, K, hd), -127, 128, jnp.int32).astype(dtype)
        a = jnp.broadcast_to(one, (L, N, P, K, hd)) + jnp.zeros((), dtype)
        s = jnp.full((L, N, P, K), 0.01, jnp.float32) if int8 else None
        return a, s

    v, vs = fill(key)
    pool = {"v": v, "v_scale": vs}
    if not from_values:
        pool.update(k=fill(jax.random.fold_in(key, 1))[0], k_scale=vs)
    return {n: a for n, a in pool.items() if a is not None}, M


def make_table(B, M, shuffle, seed=0):
    """[B, M]: row b's blocks 1 + b*M .. in order, or all the pool's blocks shuffled over the rows."""
    blocks = 1 + np.arange(B * M, dtype=np.int32)
    if shuffle:
        blocks = np.random.default_rng(seed).permutation(blocks)
    return jnp.asarray(blocks.reshape(B, M))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    p.add_argument(
        "--shuffle", action="store_true", help="time each case over shuffled blocks as well as contiguous ones"
    )
    p.add_argument("--pages", default="64", help="positions a KV block holds (KVOptions.block_size), comma-separated")
    p.add_argument("--blocks", default="", help="tiles of positions to time besides the default, comma-separated")
    p.add_argument("--warps", default="", help="warps a program to time besides the default, comma-separated")
    p.add_argument(
        "--widen",
        default="",
        help="ways of widening int8 K/V to time besides the default "
        "(convert, magic, bits; comma-separated; `kernels.widen`), with the default tile and warps",
    )
    p.add_argument(
        "--prefetch",
        action="store_true",
        help="time the default both with and without the kernel's own one-tile-ahead loads",
    )
    p.add_argument("--out", default="attention_bench")
    a = p.parse_args()
    ways = [w for w in a.widen.split(",") if w]
    if any(w not in WAYS for w in ways):
        sys.exit(f"--widen: each of {a.widen!r} must be one of {', '.join(WAYS)}")
    key = jax.random.key(0)
    B = a.batch
    pos = jnp.full((B,), a.ctx - 1, jnp.int32)
    rows = []
    print(f"{jax.devices()[0].device_kind}, batch {B}, ctx {a.ctx}", flush=True)
    print(
        f"{'case':34s} {'blocks':10s} {'page':>4s} {'tile':>7s} {'warps':>7s} {'widen':>7s} {'prefetch':>8s}"
        f" {'us':>9s} {'GB/s':>7s}",
        flush=True,
    )
    for name in a.cases.split(","):
        H, K, hd, window, int8, from_values = CASES[name]
        q = jax.random.normal(key, (B, H, hd), jnp.bfloat16)
        keys = None
        if from_values:
            inv = (1.0 / 1e6 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
            inv[hd // 8 :] = 0.0  # partial rotary, as Gemma 4's global layers
            keys = KeysFromValues(inv, jnp.ones((hd,), jnp.bfloat16), 1e-6, 0.0)
        seen = min(a.ctx, window or a.ctx)
        nbytes = B * seen * K * ((hd + 4) if int8 else 2 * hd) * (1 if from_values else 2)
        configs = (
            [
                (None, None, w, pf)
                for w in [None] + (ways if int8 else [])
                for pf in ((False, True) if a.prefetch else (None,))
            ]
            + [(int(b), None, None, None) for b in a.blocks.split(",") if b]
            + [(None, int(w), None, None) for w in a.warps.split(",") if w]
        )
        for P in map(int, a.pages.split(",")):
            pool, M = make_pool(B, a.ctx, P, K, hd, window, int8, from_values, key)
            for shuffle in (False, True) if a.shuffle else (False,):
                table = make_table(B, M, shuffle)
                for bs, warps, way, pf in configs:
                    fn = jax.jit(
                        lambda q, pool, table, pos, bs=bs, warps=warps, way=way, pf=pf: decode_attention(
                            q,
                            pool,
                            jnp.int32(1),
                            table,
                            pos,
                            scale=0.05,
                            window=window,
                            keys=keys,
                            block=bs,
                            warps=warps,
                            widen=way,
                            prefetch=pf,
                        )
                    )
                    label = dict(
                        case=name,
                        blocks="shuffled" if shuffle else "contiguous",
                        page=P,
                        block=bs,
                        warps=warps,
                        widen=way,
                        prefetch=pf,
                    )
                    try:
                        t = timed(fn, q, pool, table, pos)
                    except Exception as e:  # a tiling the compiler rejects: say so, go on
                        rows.append({**label, "error": str(e).splitlines()[0][:120]})
                        print(
                            f"{name:34s} {label['blocks']:10s} {P:4d} block={bs} warps={warps}: {type(e).__name__}",
                            flush=True,
                        )
                        continue
                    rows.append({**label, "us": t * 1e6, "GBps": nbytes / t / 1e9})
                    print(
                        f"{name:34s} {label['blocks']:10s} {P:4d} {str(bs or 'default'):>7s} "
                        f"{str(warps or 'default'):>7s} {way or 'default':>7s} "
                        f"{'default' if pf is None else str(pf):>8s} {t * 1e6:9.1f} {nbytes / t / 1e9:7.0f}",
                        flush=True,
                    )
            del pool
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention_bench.json"), "w") as f:
        json.dump(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": B, "ctx": a.ctx, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
