"""A persistent weight stream: one launch of one block per SM streams a layer's four weight matrices
(Qwen3-4B shapes, int8) by TMA, with a grid-wide barrier between the matrices as a layer kernel
needs one (attention needs all of Q/K/V, the MLP's norm all of O, down all of the gated product).
Only the compute warpgroup waits at the barriers; the memory warpgroup keeps copying the next
matrix's tiles into its ring, since weights do not depend on the activations. This bounds what a
fused persistent layer kernel could reach, against the kernels XLA launches one after another.

    python scripts/persistent_stream_bench.py          # one launch a layer, one a step, the baselines

Weights are laid out in the order the blocks read them: tiles of TILE_R x 256 bytes, each block's
tiles of a layer contiguous, the units of each matrix split as evenly as the SMs allow (a block
takes 46 or 47 of a layer's 6160 tiles of 64 rows). Settings by environment: TILE_R, STAGES,
LAYERS, ITERS, ROUNDS. JSON goes to $OUT; every figure is printed beside the copy ceiling measured
in the same run.
"""
import json
import os
import statistics
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tma_stream_bench import SHAPES, chained, make_ws, random_layers, timeit, triton_loop  # noqa: E402

TILE_R = int(os.environ.get("TILE_R", 64))
TILE_C = 256
STAGES = int(os.environ.get("STAGES", 8))
L = int(os.environ.get("LAYERS", 36))
OUT = os.environ.get("OUT", "/tmp")


def schedule(n_sm):
    """How each matrix's units are split: (base, rem, off) per matrix, block b taking base tiles, one
    more where (b - off) mod n_sm < rem. The blocks that take one more rotate from matrix to matrix,
    so a block's total differs from another's by at most one."""
    plan, off = [], 0
    for _, N, K, _ in SHAPES:
        base, rem = divmod((N // TILE_R) * (K // TILE_C), n_sm)
        plan.append((base, rem, off))
        off = (off + rem) % n_sm
    return plan


def counts_of(plan, b, n_sm):
    """Tiles block b (an int, or traced in a kernel) takes of each matrix."""
    return [base + jnp.where((b - off) % n_sm < rem, 1, 0) if not isinstance(b, np.ndarray)
            else base + (((b - off) % n_sm) < rem).astype(np.int64) for base, rem, off in plan]


def layout_index(plan, n_sm):
    """Where each stored tile comes from: [n_sm * cmax] indices into a layer's tiles (the four
    matrices' tiles in turn, each in (row tile, K step) order, so a block's run of units stays in
    one row tile as long as it can), padding pointing at one zero tile past the end."""
    counts = np.stack(counts_of(plan, np.arange(n_sm), n_sm))        # [4, n_sm]
    cmax = int(counts.sum(0).max())
    total = int(counts.sum())
    idx = np.full((n_sm, cmax), total, np.int64)
    first = 0
    fill = np.zeros(n_sm, np.int64)
    for p in range(4):
        starts = first + np.concatenate([[0], np.cumsum(counts[p])[:-1]])
        for b in range(n_sm):
            idx[b, fill[b]:fill[b] + counts[p, b]] = starts[b] + np.arange(counts[p, b])
        fill += counts[p]
        first += int(counts[p].sum())
    return idx.reshape(-1), cmax


def layout(ws_layer, index):
    """One layer's matrices as [n_sm * cmax * TILE_R, 256], each block's tiles contiguous."""
    tiles = [ws_layer[name].reshape(N // TILE_R, TILE_R, K // TILE_C, TILE_C).transpose(0, 2, 1, 3)
             .reshape(-1, TILE_R, TILE_C) for name, N, K, _ in SHAPES]
    tiles.append(jnp.zeros((1, TILE_R, TILE_C), jnp.int8))
    return jnp.concatenate(tiles)[index].reshape(-1, TILE_C)


def make_persistent(plan, n_sm, cmax, layers, stages=STAGES):
    """One launch streaming `layers` layers laid out by `layout` (stacked on a leading axis), with a
    grid barrier before each matrix but the launch's first: the compute warpgroup signals a global
    semaphore and waits until every block has, while the memory warpgroup copies on."""
    n_bar = 4 * layers - 1

    def body(w_gmem, dep_gmem, out_gmem):
        # one set of semaphores for the whole grid (scratch semaphores are one set a block), zeroed
        # by the kernel before this one
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((n_bar,)))
        plgpu.griddepcontrol_wait()
        b = lax.axis_index("b")
        cnt = counts_of(plan, b, n_sm)
        st = [sum(cnt[:p], jnp.int32(0)) for p in range(4)]     # first tile of each matrix
        per_layer = st[3] + cnt[3]

        def step(idx, w_smem, acc):
            k = idx[0]
            layer, j = k // per_layer, k % per_layer
            for p in range(4):
                @pl.when((j == st[p]) & ((layer > 0) | (p > 0)))
                def _():
                    g = layer * 4 + p - 1
                    plgpu.semaphore_signal(sem.at[g], 1, memory_scope="gpu")
                    plgpu.semaphore_wait(sem.at[g], n_sm, decrement=False, memory_scope="gpu")
            return acc + w_smem[0, 0].astype(jnp.float32)

        def ctx(eval_pipeline):
            out_gmem[b] = eval_pipeline(jnp.float32(0)) + dep_gmem[0]

        def index(k):
            layer, j = k // per_layer, k % per_layer
            return ((layer * n_sm + b) * cmax + j, 0)

        pipe = plgpu.emit_pipeline_warp_specialized(
            step, grid=(per_layer * layers,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((TILE_R, TILE_C), index)],
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
        pipe(w_gmem)

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((n_sm,), jnp.float32),
                        grid=(n_sm,), grid_names=("b",), num_threads=2, thread_name="wg")


def setup():
    """What both persistent benchmarks start from: the device, the schedule, random weights, the
    ceilings measured in this run and the results record."""
    dev = jax.devices()[0]
    n_sm = int(getattr(dev, "core_count", 132))
    iters = int(os.environ.get("ITERS", 8))
    print(dev.device_kind, jax.__version__, f"{n_sm} SMs", flush=True)
    plan = schedule(n_sm)
    index, cmax = layout_index(plan, n_sm)
    totals = np.stack(counts_of(plan, np.arange(n_sm), n_sm)).sum(0)
    from jaxllm.harness import ceilings
    c = ceilings.measure()
    res = {"device": dev.device_kind, "jax": jax.__version__, "layers": L, "iters": iters, "sms": n_sm,
           "tile": [TILE_R, TILE_C], "ceilings": c.to_json(),
           "bytes_per_layer": sum(N * K for _, N, K, _ in SHAPES),
           "tiles_per_block": [int(totals.min()), int(totals.max())], "rounds": {}}
    return types.SimpleNamespace(n_sm=n_sm, iters=iters, plan=plan, index=index, cmax=cmax,
                                 ws=random_layers(), c=c, res=res)


def main():
    s = setup()
    n_sm, iters, plan, index, cmax, ws, c, res = s.n_sm, s.iters, s.plan, s.index, s.cmax, s.ws, s.c, s.res
    res["stages"] = STAGES
    laid = [layout({n: ws[n][l] for n in ws}, index) for l in range(L)]
    stacked = jnp.stack(laid)                                # [L, rows, 256]
    dep0 = jnp.ones((n_sm,), jnp.float32)
    one = make_persistent(plan, n_sm, cmax, 1)
    whole = make_persistent(plan, n_sm, cmax, L)

    def per_layer_launches(laid, dep):
        for l in range(L):
            dep = one(laid[l], dep)
        return dep

    loop = lambda f: jax.jit(lambda w, dep: lax.fori_loop(0, iters, lambda i, d: f(w, d), dep))
    fns = {"persistent, a launch a layer": (loop(per_layer_launches), (laid, dep0)),
           "persistent, a launch a step": (loop(lambda w, d: whole(w.reshape(-1, TILE_C), d)),
                                           (stacked, dep0))}
    ks = {name: make_ws(N, K, k_, None, False, stages=4, rows=128, cols=256) for name, N, K, k_ in SHAPES}
    fns["separate stream kernels"] = (loop(chained(ks)), (ws, jnp.ones((2560 // 128 * SHAPES[-1][3],))))
    fns["triton matvecs"] = triton_loop(ws, iters)
    run_rounds(fns, res, iters)
    with open(os.path.join(OUT, f"persistent_stream_r{TILE_R}_s{STAGES}.json"), "w") as f:
        json.dump(res, f, indent=1)
    report(res, c)


def run_rounds(fns, res, iters):
    """Time each (fn, args) of fns in turn, ROUNDS times, into res['rounds'] (us a layer)."""
    for name, (f, args) in fns.items():
        out = jax.block_until_ready(f(*args))
        print(name, "compiled; finite:", bool(np.isfinite(np.asarray(out, np.float32)).all()), flush=True)
    for r in range(int(os.environ.get("ROUNDS", 3))):
        for name, (f, args) in fns.items():
            med, _ = timeit(f, *args, reps=10)
            res["rounds"].setdefault(name, []).append(med / iters / L * 1e6)
        print("round", r, {k: round(v[-1], 2) for k, v in res["rounds"].items()}, flush=True)


def report(res, c):
    """The table: each variant's time a layer beside the layer's bytes at the copy ceiling."""
    ideal = res["bytes_per_layer"] / c.bandwidth * 1e6
    print(f"\n{res['device']}, jax {jax.__version__}, copy ceiling {c.bandwidth / 1e9:.0f} GB/s "
          f"({c.bandwidth_method}); ideal {ideal:.2f} us/layer ({res['bytes_per_layer'] / 1e6:.1f} MB)")
    width = max(map(len, res["rounds"])) + 2
    print(f"{'variant':{width}s} {'us/layer, each round':30s} {'mean':>7s} {'of copy':>8s}")
    for name, t in res["rounds"].items():
        m = statistics.mean(t)
        print(f"{name:{width}s} {' '.join(f'{x:6.2f}' for x in t):30s} {m:7.2f} {100 * ideal / m:7.1f}%")


if __name__ == "__main__":
    main()
