"""What reading the layer index costs the batch-1 matmul kernels: the four weight matrices of 36
Qwen3-4B layers (int8, output-major) on the Triton kernels the model runs, in a loop of ITERS decode
steps, with the weights as the model holds them (stacks [L, N, K], the kernel loading the layer's
index before its first weight tile) against one array per layer (the index always 0, loaded, or
compiled into the kernel). µs a layer beside the copy ceiling of the same run; JSON to $OUT.

    python scripts/layer_index_bench.py
"""
import json
import os
import statistics

import jax
import jax.numpy as jnp
from jax import lax

from jaxllm.harness import ceilings
from jaxllm.kernels import matmul as mm
from tma_stream_bench import timeit         # this folder: two warm-up calls, then the median

L = int(os.environ.get("LAYERS", 36))
ITERS = int(os.environ.get("ITERS", 8))
SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate": (9728, 2560), "up": (9728, 2560), "down": (2560, 9728)}


class _Zero:
    """Stands for the layer-index ref: index 0, known when the kernel is compiled."""
    def __getitem__(self, i):
        return jnp.int32(0)


def _static(kernel):
    return lambda layer_ref, *refs, **kw: kernel(_Zero(), *refs, **kw)


def layer(w, s, x, i):
    """One layer's products on the model's kernels: w, s map a name to (weights, scales) with
    layer i inside them."""
    q = mm.stacked_matmuls(x, [(w["qkv"], s["qkv"])], i, out_major=True)[0]
    o = mm.stacked_matmuls(q[:, :SHAPES["o"][1]], [(w["o"], s["o"])], i, out_major=True, summed=False)[0]
    g = mm.stacked_gated(o.sum(axis=0).astype(x.dtype) if o.ndim == 3 else o, (w["gate"], s["gate"]),
                         (w["up"], s["up"]), i, jax.nn.silu, out_major=True)
    d = mm.stacked_matmuls(g, [(w["down"], s["down"])], i, out_major=True, summed=False)[0]
    return (d.sum(axis=0) if d.ndim == 3 else d).astype(x.dtype)


def main():
    key = jax.random.key(0)
    per = {n: [jax.random.randint(jax.random.fold_in(key, 100 * i + l), (1, N, K), -127, 127, jnp.int8)
               for l in range(L)] for i, (n, (N, K)) in enumerate(SHAPES.items())}
    scales = {n: [jnp.full((1, N), 1 / (127 * K ** 0.5), jnp.float32) for _ in range(L)]   # outputs stay O(1)
              for n, (N, K) in SHAPES.items()}
    stacks = {n: jnp.concatenate(v) for n, v in per.items()}
    stack_sc = {n: jnp.concatenate(v) for n, v in scales.items()}
    x0 = jnp.ones((1, SHAPES["qkv"][1]), jnp.bfloat16)
    c = ceilings.measure()
    per_layer_bytes = sum(N * K for N, K in SHAPES.values())

    @jax.jit
    def on_stacks(w, s, x):
        return lax.fori_loop(0, ITERS, lambda _, x: _chain(lambda i: (w, s, i), x), x)

    def arrays(w, s, x):
        return lax.fori_loop(0, ITERS, lambda _, x: _chain(lambda i: ({n: v[i] for n, v in w.items()},
                                                                      {n: v[i] for n, v in s.items()}, 0), x), x)
    on_arrays = jax.jit(arrays)

    def _chain(args_of, x):
        for i in range(L):
            w, s, idx = args_of(i)
            x = layer(w, s, x, idx)
        return x

    fns = {"stacks, index loaded": (on_stacks, (stacks, stack_sc, x0)),
           "one array a layer, index loaded": (on_arrays, (per, scales, x0))}
    kern, gated = mm._matmul_kernel, mm._gated_kernel
    mm._matmul_kernel, mm._gated_kernel = _static(kern), _static(gated)
    try:
        static = jax.jit(lambda w, s, x: arrays(w, s, x)).lower(per, scales, x0).compile()
    finally:
        mm._matmul_kernel, mm._gated_kernel = kern, gated
    fns["one array a layer, index compiled in"] = (static, (per, scales, x0))
    outs = {k: jax.block_until_ready(f(*a)) for k, (f, a) in fns.items()}
    ref = next(iter(outs.values()))
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": L, "iters": ITERS,
           "ceilings": c.to_json(), "bytes_per_layer": per_layer_bytes, "passes": {},
           "same_output": {k: bool(jnp.array_equal(v, ref, equal_nan=True)) for k, v in outs.items()}}
    for p in range(3):
        for k, (f, a) in fns.items():
            res["passes"].setdefault(k, []).append(timeit(f, *a, reps=5)[0] / (L * ITERS) * 1e6)
        print("pass", p, {k: round(v[-1], 2) for k, v in res["passes"].items()}, flush=True)
    print(f"\n{res['device']}, jax {jax.__version__}, copy ceiling {c.bandwidth / 1e9:.0f} GB/s: "
          f"{per_layer_bytes / c.bandwidth * 1e6:.2f} us a layer for its {per_layer_bytes / 1e6:.1f} MB")
    for k, v in res["passes"].items():
        print(f"{k:40s} {' '.join(f'{t:6.2f}' for t in v)}   mean {statistics.mean(v):6.2f} us a layer"
              f"   ({'the same output' if res['same_output'][k] else 'OUTPUT DIFFERS'})")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "layer_index_bench.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
