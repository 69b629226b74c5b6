"""Time the decode-attention kernel on each kind of cache the engine keeps, over block sizes and
warp counts: full-length bf16, int8 linear (global layers of the split cache), ring slots (bf16 or
int8 sliding layers) and keys rebuilt from stored values (Gemma 4's k_eq_v global layers). With
`--widen` and `--prefetch`, also the ways of widening int8 and the kernel's loads a block ahead
(by default each is the engine's own choice, shown as "default").

    python scripts/attention_bench.py --batch 64 --ctx 2048 --out DIR
    python scripts/attention_bench.py --batch 64 --widen convert,magic,bits --prefetch --blocks 32 --warps 8

Caches hold positions as a real one does (rings written up to ctx - 1), so the kernel reads every
slot a query can see. Times are medians of 20 calls on one layer of a 3-layer stack; GB/s counts
the K/V bytes (and scales) of that layer.
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

from jaxllm.ops.gpu.attention import Cache, KeysFromValues, decode_attention  # noqa: E402
from jaxllm.ops.gpu.widen import WAYS  # noqa: E402

L = 3


def case(name, B, S, H, K, hd, ctx, key):
    """(arrays, KeysFromValues or None, window) of one cache kind."""
    int8 = "int8" in name
    shape = (L, B, S, K, hd)
    kv = jax.random.randint(key, shape, -127, 128, jnp.int32).astype(jnp.int8 if int8 else jnp.bfloat16)
    scale = jnp.full(shape[:-1], 0.01, jnp.float32) if int8 else None
    arrs = {"k": kv, "v": kv, "k_scale": scale, "v_scale": scale}
    keys, window = None, None
    if name.startswith("ring"):
        held = (ctx - 1) - ((ctx - 1 - jnp.arange(S, dtype=jnp.int32)) % S)
        arrs["slot_pos"] = jnp.broadcast_to(held, (L, B, S))
        window = S
    if name.startswith("keys"):
        inv = (1.0 / 1e6 ** (np.arange(0, hd, 2) / hd)).astype(np.float32)
        inv[hd // 8:] = 0.0                                   # partial rotary, as Gemma 4's global layers
        keys = KeysFromValues(inv, jnp.ones((hd,), jnp.bfloat16), 1e-6, 0.0)
        arrs.update(k=None, k_scale=None)
    return {k: v for k, v in arrs.items() if v is not None}, keys, window


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--blocks", default="16,32,64")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--widen", default="", help="ways of widening int8 K/V to time besides the default "
                   "(convert, magic, bits; comma-separated; `kernels.widen`), with the default block and warps")
    p.add_argument("--prefetch", action="store_true", help="time each way both with and without the kernel's "
                   "own one-block-ahead loads (default block and warps)")
    p.add_argument("--out", default="attention_bench")
    a = p.parse_args()
    if any(w not in WAYS for w in a.widen.split(",") if w):
        sys.exit(f"--widen: each of {a.widen!r} must be one of {', '.join(WAYS)}")
    key = jax.random.key(0)
    # name, query heads, KV heads, head_dim, slots: Gemma 4 31B's layers on one GPU, and Qwen3-4B's
    cases = [("ring bf16", 32, 16, 256, 1024), ("ring int8", 32, 16, 256, 1024),
             ("linear int8", 32, 4, 512, a.ctx), ("keys from int8 values", 32, 4, 512, a.ctx),
             ("linear bf16", 32, 8, 128, a.ctx)]
    pos = jnp.full((a.batch,), a.ctx - 1, jnp.int32)
    rows = []
    for name, H, K, hd, S in cases:
        arrs, keys, window = case(name, a.batch, S, H, K, hd, a.ctx, key)
        q = jax.random.normal(key, (a.batch, H, hd), jnp.bfloat16)
        nbytes = sum(x[0].size * x.dtype.itemsize for x in arrs.values())
        ways = [None] + ([w for w in a.widen.split(",") if w] if "int8" in name else [])
        configs = ([(None, None, w, pf) for w in ways for pf in ((False, True) if a.prefetch else (None,))]
                   + [(int(b), int(w), None, None) for b in a.blocks.split(",") for w in a.warps.split(",")])
        for bs, warps, way, pf in configs:
            fn = jax.jit(lambda q, arrs, pos, bs=bs, warps=warps, way=way, pf=pf: decode_attention(
                q, Cache(**{"k": None, **arrs}, keys=keys), jnp.int32(1), pos, scale=0.05, window=window,
                block=bs, warps=warps, widen=way, prefetch=pf))
            try:
                t = timed(fn, q, arrs, pos)
            except Exception as e:                 # a tiling the compiler rejects
                print(f"{name:24s} block={bs} warps={warps} widen={way} prefetch={pf}: {type(e).__name__}",
                      flush=True)
                continue
            rows.append({"cache": name, "block": bs, "warps": warps, "widen": way, "prefetch": pf, "us": t * 1e6,
                         "GBps": nbytes / t / 1e9})
            print(f"{name:24s} block={str(bs or 'default'):7s} warps={str(warps or 'default'):7s} "
                  f"widen={way or 'default':7s} prefetch={'default' if pf is None else pf!s:7s}"
                  f"{t * 1e6:9.1f} us {nbytes / t / 1e9:7.0f} GB/s", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention_bench.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": a.batch,
                   "ctx": a.ctx, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
