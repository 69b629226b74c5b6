"""Time the prefill-attention kernel against XLA's attention (`ops.xla.attend` over the prompt's keys
and values as one array) on one layer of a paged bf16 pool, over block sizes, for the head shapes
of the presets: Qwen3-4B (head_dim 128), Gemma 3 270M (256, sliding and global) and Gemma 4 31B
(sliding 256, global 512).

    python scripts/prefill_attention_bench.py --out DIR
    python scripts/prefill_attention_bench.py --cases qwen3-4b --lens 2048,8192 --blocks 64x64x4,128x64x8

One prompt of T tokens from position 0 over T + 1 positions in pages of `--page` positions (the
row's blocks shuffled over the pool with `--shuffle`), as the bench's TTFT prefill holds it.
TFLOP/s counts the causal (query, key) pairs within the window (`roofline.causal_pairs`), so masked
work either path does is not counted; each figure is printed beside the bf16 matmul rate measured
in the same run. The error is the largest difference from XLA's output, over the largest
output value.
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

from jaxllm.benchmarks import ceilings as ceil
from jaxllm.benchmarks.roofline import causal_pairs  # noqa: E402
from jaxllm.ops.gpu.prefill import Blocks, choose_blocks, prefill_attention  # noqa: E402
from jaxllm.ops.xla import attend, attention_mask  # noqa: E402

# name: (query heads, KV heads, head_dim, window)
CASES = {
    "qwen3-4b": (32, 8, 128, None),
    "gemma3-270m-sliding": (4, 1, 256, 512),
    "gemma3-270m-global": (4, 1, 256, None),
    "gemma4-31b-sliding": (32, 16, 256, 1024),
    "gemma4-31b-global": (32, 4, 512, None),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--lens", default="2048,8192")
    p.add_argument("--blocks", default="", help="bq x bk x warps variants besides the default, e.g. 64x32x4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--page", type=int, default=32, help="positions a KV block holds (KVOptions.block_size)")
    p.add_argument("--shuffle", action="store_true", help="the prompt's blocks in a random order of the pool")
    p.add_argument("--out", default="out")
    a = p.parse_args()
    dev = jax.devices()[0]
    c = ceil.measure(probe_bytes=64 << 20)
    rate = c.matmul_flops
    print(dev.device_kind, jax.__version__, f"bf16 matmul {rate / 1e12:.1f} TFLOP/s", flush=True)
    extra = [Blocks(*map(int, s.split("x"))) for s in a.blocks.split(",") if s]
    rows = []
    for name in a.cases.split(","):
        H, K, hd, window = CASES[name]
        for T in map(int, a.lens.split(",")):
            P = a.page
            M = -(-(T + 1) // P)
            S = M * P
            key = jax.random.key(T)
            q, k, v = (
                jax.random.normal(kk, shape, jnp.bfloat16)
                for kk, shape in zip(jax.random.split(key, 3), [(1, T, H, hd), (1, S, K, hd), (1, S, K, hd)])
            )
            # the pool: block 0 the null block, the prompt's M blocks after it (in a random order)
            order = np.random.default_rng(T).permutation(M) if a.shuffle else np.arange(M)
            table = jnp.asarray(1 + order, jnp.int32)[None]

            def paged(x):
                blocks = x.reshape(M, P, K, hd)[np.argsort(order)]
                return jnp.concatenate([jnp.zeros((1, P, K, hd), x.dtype), blocks])[None]

            pool = {"k": paged(k), "v": paged(v)}
            pos = jnp.arange(T, dtype=jnp.int32)[None]
            kv_pos = jnp.arange(S, dtype=jnp.int32)[None]
            scale = hd**-0.5
            flops = 4 * H * hd * causal_pairs(T, window)
            xla = jax.jit(lambda q, k, v, pos: attend(q, k, v, attention_mask(pos, kv_pos, window), scale, None))
            ref = xla(q, k, v, pos)
            t = timed(xla, q, k, v, pos, reps=a.reps)
            rows.append(dict(case=name, T=T, path="xla", ms=t * 1e3, tflops=flops / t / 1e12))
            for blk in [choose_blocks(hd, T)] + extra:
                fn = jax.jit(
                    lambda q, pool, table, pos, blk=blk: prefill_attention(
                        q, pool, jnp.int32(0), table, pos, scale=scale, window=window, blocks=blk
                    )
                )
                label = blk.label() + (" (default)" if blk == choose_blocks(hd, T) else "")
                try:
                    o = fn(q, pool, table, pos)
                    err = float(
                        jnp.max(jnp.abs(o.astype(jnp.float32) - ref.astype(jnp.float32)))
                        / jnp.max(jnp.abs(ref.astype(jnp.float32)))
                    )
                    t = timed(fn, q, pool, table, pos, reps=a.reps)
                    rows.append(dict(case=name, T=T, path=label, ms=t * 1e3, tflops=flops / t / 1e12, err=err))
                except Exception as e:  # a block too large to compile: say so, go on
                    rows.append(dict(case=name, T=T, path=label, error=str(e).splitlines()[0][:120]))
            del ref
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "prefill_attention_bench.json"), "w") as f:
        json.dump(
            {
                "device": dev.device_kind,
                "jax": jax.__version__,
                "ceilings": c.to_json(),
                "page": a.page,
                "shuffle": a.shuffle,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"\n{dev.device_kind}, jax {jax.__version__}; bf16 matmul {rate / 1e12:.1f} TFLOP/s measured in this run")
    print(f"{'case':20s} {'T':>6s} {'path':44s} {'ms':>8s} {'TFLOP/s':>8s} {'of matmul':>9s} {'error':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:20s} {r['T']:6d} {r['path']:44s} failed: {r['error']}")
            continue
        print(
            f"{r['case']:20s} {r['T']:6d} {r['path']:44s} {r['ms']:8.3f} {r['tflops']:8.1f} "
            f"{r['tflops'] * 1e12 / rate:9.1%} {r.get('err', 0):9.2e}"
        )


if __name__ == "__main__":
    main()
