"""Persistent batch-1 matvecs: the weight stream of persistent_stream_bench.py with the arithmetic in,
each matrix taking the one before's output (Q/K/V, O, gate/up, down in turn, 36 Qwen3-4B layers),
in one launch a decode step. Hopper GPUs, jax with Pallas Mosaic GPU.

    python scripts/persistent_matvec_bench.py            # checked, then timed against the baselines
    PROFILE=6 CHECK_ONLY=1 python scripts/persistent_matvec_bench.py   # where a block's time goes

One block per SM. Its memory warpgroup copies its weight tiles (64 rows x 256 bytes, int8) by TMA
into a ring and never waits on the activations. Its compute warpgroup, per matrix:
1. waits at grid barrier A, at which each block arrives once it has added its last products of
   the matrix before;
2. if the block is one that builds a 256-wide input chunk of this matrix, builds it from the
   previous output (silu(gate) * up before down), splits it into two int8 parts with one scale
   (x = s * (p1 + p2 / 254)) and writes them to global memory;
3. waits at grid barrier B, then loads by TMA the chunks its tiles need;
4. runs each tile as an int8 wgmma (the tile is A, the parts are two columns of B), scales the
   int32 products by the chunk's scale, and adds them across the K steps of a row tile;
5. adds each finished row tile into the output with atomic adds.
Outputs are zeroed by the blocks a matrix ahead. Each layer's input chunk is divided by its
largest value, standing in for the input norm that keeps a model's layers in range. A per-matrix
scale 1 / (73.3 sqrt(K)) stands in for the per-channel scales (in a layer kernel, a 256-value load
in step 2).

Variants timed beside it: arriving at A only at the next matrix's first tile; the chunks built by
blocks 0 to KT rather than by blocks that take one tile fewer; a flag a chunk in place of barrier
B; the next tiles prefetched into L2 (AHEAD=12,24); without steps 2 and 3 (barrier A only) and
without 1 to 3; each block reading two tiles over and over (from L2, so the arithmetic's own rate
shows); the weight stream alone; the Triton kernels the model runs. Checked against the same
chain in float32 XLA over CHECK layers. Settings by environment: STAGES, LAYERS, ITERS, ROUNDS,
SKIPS. JSON goes to $OUT; every figure is printed beside the copy ceiling measured in the same run.
"""
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from persistent_stream_bench import (SHAPES, TILE_C, TILE_R, counts_of, layout, make_persistent,  # noqa: E402
                                     report, run_rounds, setup)
from tma_stream_bench import triton_loop  # noqa: E402

STAGES = int(os.environ.get("STAGES", 12))
L = int(os.environ.get("LAYERS", 36))
OUT = os.environ.get("OUT", "/tmp")
NS = [N for _, N, _, _ in SHAPES]
KS = [K for _, _, K, _ in SHAPES]
KT = [K // TILE_C for K in KS]
REGION = [int(x) for x in np.cumsum([0] + NS)]          # each matrix's rows in a layer's output
WIDTH = REGION[-1]
SCALE = [1.0 / (73.3 * np.sqrt(K)) for K in KS]      # unit gain for uniform int8 weights
SW = 128
TR = (plgpu.TilingTransform((8, SW)), plgpu.SwizzleTransform(SW))


def _fence_async_global():
    """Orders this thread's global writes before later TMA (async proxy) reads, and the reverse."""
    @plgpu.inline_mgpu()
    def _(ctx):
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "", has_side_effects=True)
    _()


def unit_base(plan, p, b, n_sm):
    """The first unit of matrix p block b takes (units in (row tile, K step) order)."""
    base, rem, off = plan[p]
    extra_before = jnp.clip(b - off, 0, rem) + jnp.where(off + rem > n_sm, jnp.clip(b, 0, off + rem - n_sm), 0)
    return base * b + extra_before


def reference(ws, x, layers):
    """The chain in float32 XLA, with the kernel's quantization of each input."""
    def parts(v):
        v = v.reshape(-1, TILE_C)
        s = jnp.max(jnp.abs(v), axis=1, keepdims=True) / 127 + 1e-30
        q1 = jnp.round(v / s)
        q2 = jnp.round((v / s - q1) * 254)
        return (s * (q1 + q2 / 254)).reshape(-1)
    hp = jax.lax.Precision.HIGHEST
    outs_prev = None
    for l in range(layers):
        outs = []
        for p, (name, N, K, _) in enumerate(SHAPES):
            if p == 0:
                v = x if l == 0 else outs_prev[3] * SCALE[3]
                v = (v.reshape(-1, TILE_C) / (jnp.max(jnp.abs(v.reshape(-1, TILE_C)), axis=1, keepdims=True)
                                              + 1e-30)).reshape(-1)
            elif p == 3:
                g, u = outs[2][:9728] * SCALE[2], outs[2][9728:] * SCALE[2]
                v = g / (1 + jnp.exp(-g)) * u
            else:
                v = outs[p - 1][:K] * SCALE[p - 1]
            outs.append(jnp.dot(ws[name][l].astype(jnp.float32), parts(v), precision=hp))
        outs_prev = outs
    return outs_prev[3]


def make_matvecs(plan, n_sm, cmax, layers, stages=STAGES, skip="", ahead=0, flags=False, one_tile=False,
                 profile_dir="", balanced=True, early=True):
    """The launch for `layers` layers laid out by `layout`: (weights, x_in [2560, 8]) -> (outputs
    [layers, WIDTH, 8], the parts, their scales). The variants: skip ("prep": barrier A only,
    "boundary": no exchange), ahead (tiles prefetched into L2), flags (a flag a chunk for barrier
    B), one_tile (two tiles read over and over), balanced (chunks built by blocks that take one tile
    fewer), early (arrive at A once the last products are added), profile_dir (Mosaic GPU's
    profiler, events by named scope)."""
    nslots = [min(int(max(c)), kt) for c, kt in zip(
        [counts_of(plan, np.arange(n_sm), n_sm)[p] for p in range(4)], KT)]
    n_g = 4 * layers

    def body(w_gmem, x_in, out_gmem, xp_gmem, xs_gmem, xin, s_smem, bars):
        x_smem, in_smem = xin          # the input chunks are read before the parts are loaded
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR((2 * n_g,)))
        if flags:           # one a chunk: its parts are out (in place of barrier B)
            flag = pl.get_global(plgpu.SemaphoreType.REGULAR((n_g * max(KT),)))
        plgpu.griddepcontrol_wait()
        b = lax.axis_index("b")
        cnt = counts_of(plan, b, n_sm)
        per_layer = sum(cnt, jnp.int32(0))

        def arrive(i):
            plgpu.semaphore_signal(sem.at[i], 1, memory_scope="gpu")

        def wait(i):
            plgpu.semaphore_wait(sem.at[i], n_sm, decrement=False, memory_scope="gpu")

        def barrier(i):
            arrive(i)
            wait(i)

        def zero_region(g_next, p_next):
            """Zero this block's share of matrix p_next's output rows of step g_next."""
            layer = g_next // 4
            for t in range(0, NS[p_next] // 64, n_sm):
                @pl.when(b + t < NS[p_next] // 64)
                def _():
                    out_gmem[layer, pl.ds(REGION[p_next] + (b + t) * 64, 64), :] = plgpu.layout_cast(
                        jnp.zeros((64, 8), jnp.float32), plgpu.Layout.WGMMA)

        def load_chunk(layer, row0, slot):
            plgpu.copy_gmem_to_smem(out_gmem.at[layer, pl.ds(row0, TILE_C), :], in_smem.at[slot], bars.at[slot])
            plgpu.barrier_wait(bars.at[slot])
            a = plgpu.layout_cast(in_smem[slot], plgpu.Layout.WGMMA)
            cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE_C, 8), 1), plgpu.Layout.WGMMA)
            return jnp.sum(jnp.where(cols == 0, a, jnp.where(cols == 1, a * (1 / 254), 0.0)), axis=1)

        def prep(g, p, layer, c):
            """Build input chunk c of matrix p at step g, as int8 parts and a scale."""
            if p == 0:
                def from_prev():
                    return load_chunk(layer - 1, REGION[3] + c * TILE_C, 0) * SCALE[3]

                def from_input():
                    plgpu.copy_gmem_to_smem(x_in.at[pl.ds(c * TILE_C, TILE_C), :], in_smem.at[0], bars.at[0])
                    plgpu.barrier_wait(bars.at[0])
                    a = plgpu.layout_cast(in_smem[0], plgpu.Layout.WGMMA)
                    cols = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE_C, 8), 1), plgpu.Layout.WGMMA)
                    return jnp.sum(jnp.where(cols == 0, a, 0.0), axis=1)
                x = lax.cond(layer > 0, from_prev, from_input)
                x = x / (jnp.max(jnp.abs(x)) + 1e-30)       # stands in for the layer's input norm
            elif p == 3:
                gt = load_chunk(layer, REGION[2] + c * TILE_C, 0) * SCALE[2]
                up = load_chunk(layer, REGION[2] + 9728 + c * TILE_C, 1) * SCALE[2]
                x = gt / (1 + jnp.exp(-gt)) * up
            else:
                x = load_chunk(layer, REGION[p - 1] + c * TILE_C, 0) * SCALE[p - 1]
            s = jnp.max(jnp.abs(x)) / 127 + 1e-30
            q1 = jnp.round(x / s)
            q2 = jnp.round((x / s - q1) * 254)
            xp_gmem[g, c, 0, :] = q1.astype(jnp.int8)
            xp_gmem[g, c, 1, :] = q2.astype(jnp.int8)
            xs_gmem[g, c, 0] = s
            _fence_async_global()
            if flags:
                plgpu.semaphore_signal(flag.at[g * max(KT) + c], 1, memory_scope="gpu")

        def phase_start(g, p, layer):
            """Steps 1 to 3 at a matrix's first tile (named scopes for the profile)."""
            if skip == "boundary":
                return
            with jax.named_scope("A"):
                if early:                                    # A: the previous matrix is complete
                    wait(2 * g)
                else:
                    barrier(2 * g)
            if skip == "prep":
                return
            with jax.named_scope("prep"):
                # chunk c is built by the c-th block past those that take one more tile of the matrix
                _, rem, off = plan[p]
                c = (b - off - rem) % n_sm
                if balanced:
                    @pl.when(c < KT[p])
                    def _():
                        prep(g, p, layer, c)
                else:
                    @pl.when(b < KT[p])
                    def _():
                        prep(g, p, layer, b)
            if not flags:
                with jax.named_scope("B"):
                    barrier(2 * g + 1)                       # B: this matrix's input parts are out
                    _fence_async_global()
            with jax.named_scope("x"):
                kk0 = unit_base(plan, p, b, n_sm) % KT[p]
                for i in range(nslots[p]):
                    c = (kk0 + i) % KT[p]
                    if flags:
                        plgpu.semaphore_wait(flag.at[g * max(KT) + c], 1, decrement=False, memory_scope="gpu")
                        _fence_async_global()
                    plgpu.copy_gmem_to_smem(xp_gmem.at[g, c], x_smem.at[i], bars.at[2 + i])
                    plgpu.copy_gmem_to_smem(xs_gmem.at[g, c], s_smem.at[i], bars.at[2 + 12 + i])

                @pl.when(g + 1 < n_g)
                def _():
                    zero_region(g + 1, (p + 1) % 4)
                for i in range(nslots[p]):
                    plgpu.barrier_wait(bars.at[2 + i])
                    plgpu.barrier_wait(bars.at[2 + 12 + i])

        def index(k):
            if one_tile:                # every step reads one of the block's first two tiles: from L2,
                return (b * cmax + k % 2, 0)    # so the arithmetic's own rate shows
            layer, j = k // per_layer, k % per_layer
            return ((layer * n_sm + b) * cmax + j, 0)

        # where each matrix's units start for this block: first unit, its K step and row tile
        ub = [unit_base(plan, q, b, n_sm) for q in range(4)]
        kk0 = [ub[q] % KT[q] for q in range(4)]
        r0 = [ub[q] // KT[q] for q in range(4)]

        def sel(p, vals):
            return sum(jnp.where(p == q, v, 0) for q, v in enumerate(vals))

        def step(idx, w_smem, carry):
            # counters carried from step to step, so a step divides by nothing
            acc, layer, p, i, kk, row, slot = carry
            if ahead:                   # the tile `ahead` steps on, from HBM into L2
                nxt = idx[0] + ahead

                @pl.when(nxt < per_layer * layers)
                def _():
                    plgpu.async_prefetch(w_gmem.at[pl.ds(index(nxt)[0] * TILE_R, TILE_R), :])
            for q in range(4):
                @pl.when((p == q) & (i == 0))
                def _():
                    phase_start(layer * 4 + q, q, layer)
            kt, count = sel(p, KT), sel(p, cnt)
            with jax.named_scope("unit"):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, 8), jnp.int32))
                def prod(acc_ref):
                    plgpu.wgmma(acc_ref, w_smem, x_smem.at[slot].T)
                    return acc_ref[...]
                acc = acc + prod.astype(jnp.float32) * s_smem[slot, 0]
                end, wrap = i == count - 1, kk == kt - 1
                last = end | wrap

                @pl.when(last)
                def _():
                    plgpu.atomic_add(out_gmem.at[layer, pl.ds(sel(p, REGION[:4]) + row * 64, 64), :], acc)
                acc = acc * jnp.where(last, 0.0, 1.0)
            if early and skip != "boundary":     # arrive at A as soon as the matrix's last tile is added
                @pl.when(end & (layer * 4 + p + 1 < n_g))
                def _():
                    arrive(2 * (layer * 4 + p + 1))
            p2 = jnp.where(end, jnp.where(p == 3, 0, p + 1), p)
            layer2 = jnp.where(end & (p == 3), layer + 1, layer)
            kk2 = jnp.where(end, sel(p2, kk0), jnp.where(wrap, 0, kk + 1))
            row2 = jnp.where(end, sel(p2, r0), jnp.where(wrap, row + 1, row))
            slot2 = jnp.where(end | (slot == kt - 1), 0, slot + 1)
            return acc, layer2, p2, jnp.where(end, 0, i + 1), kk2, row2, slot2

        def ctx(eval_pipeline):
            zero_region(0, 0)
            if early and skip != "boundary":
                arrive(0)
            z = jnp.int32(0)
            eval_pipeline((plgpu.layout_cast(jnp.zeros((64, 8), jnp.float32), plgpu.Layout.WGMMA),
                           z, z, z, kk0[0], r0[0], z))

        pipe = plgpu.emit_pipeline_warp_specialized(
            step, grid=(per_layer * layers,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((TILE_R, TILE_C), index, transforms=TR)],
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
        pipe(w_gmem)

    kt_max = max(KT)
    out_type = (jax.ShapeDtypeStruct((layers, WIDTH, 8), jnp.float32),
                jax.ShapeDtypeStruct((n_g, kt_max, 8, TILE_C), jnp.int8),
                jax.ShapeDtypeStruct((n_g, kt_max, 32), jnp.float32))   # 128-byte rows for TMA
    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                  **(dict(profile_space=140 * layers, profile_dir=profile_dir)
                                     if profile_dir else {}))
    return plgpu.kernel(body, out_type=out_type, grid=(n_sm,), grid_names=("b",), num_threads=2,
                        thread_name="wg", compiler_params=params,
                        scratch_types=dict(xin=plgpu.RefUnion(
                                               plgpu.SMEM((max(nslots), 8, TILE_C), jnp.int8, transforms=TR),
                                               plgpu.SMEM((2, TILE_C, 8), jnp.float32)),
                                           s_smem=plgpu.SMEM((16, 32), jnp.float32),
                                           bars=plgpu.Barrier(num_barriers=2 + 24)))


def profile_summary(path, n_sm, layers):
    """Per matrix, the compute warpgroup's time in each part of a step, averaged over the blocks and
    the middle layers (us): barrier A, preparing a chunk (the blocks that do), barrier B, loading
    the parts, the tiles' arithmetic, and the rest of the matrix's span, which is waiting for tiles."""
    events = json.load(open(path))["traceEvents"]
    by_tid = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    rows = {p: [] for p in range(4)}
    arrivals = {}                        # (step, matrix) -> [(time barrier A was entered, block)]
    for tid, evs in by_tid.items():
        if (tid - 1) % 2:                # the memory warpgroup
            continue
        block = (tid - 1) // 2
        stack, spans = [], []
        for e in evs:
            if e["ph"] == "B":
                stack.append(e)
            elif stack:
                bgn = stack.pop()
                spans.append((bgn["name"], bgn["ts"], e["ts"]))
        spans.sort(key=lambda t: t[1])
        starts = [t[1] for t in spans if t[0] == "A"]
        for n in range(4, min(len(starts) - 1, 4 * (layers - 1))):
            arrivals.setdefault(n, []).append((starts[n], block))
            lo, hi = starts[n], starts[n + 1]
            part = {k: sum(e - b_ for nm, b_, e in spans if nm == k and lo <= b_ < hi)
                    for k in ("A", "prep", "B", "x", "unit")}
            part["span"] = hi - lo
            part["wait"] = part["span"] - sum(part[k] for k in ("A", "prep", "B", "x", "unit"))
            rows[n % 4].append(part)
    names = [n for n, *_ in SHAPES]
    keys = ("A", "prep", "B", "x", "unit", "wait", "span")
    out = {names[p]: {k: float(np.mean([r[k] for r in rows[p]])) for k in keys} for p in range(4) if rows[p]}
    print(f"{'matrix':8s} " + " ".join(f"{k:>7s}" for k in keys))
    for nm, r in out.items():
        print(f"{nm:8s} " + " ".join(f"{r[k]:7.2f}" for k in keys))
    # who reaches barrier A last, and how far the blocks' arrivals spread
    last, spread = {}, {p: [] for p in range(4)}
    for n, arr in arrivals.items():
        arr.sort()
        spread[n % 4].append(arr[-1][0] - arr[len(arr) // 2][0])
        for _, blk in arr[-5:]:
            last[blk] = last.get(blk, 0) + 1
    out["arrival_spread_us"] = {names[p]: float(np.mean(v)) for p, v in spread.items() if v}
    out["last_five_at_A"] = dict(sorted(last.items(), key=lambda kv: -kv[1])[:12])
    print("barrier A, last arrival after the median one (us):", {k: round(v, 2) for k, v in
                                                                out["arrival_spread_us"].items()})
    print("blocks most often among the last five at A (block: times):", out["last_five_at_A"])
    return out


def profile(plan, n_sm, cmax, stacked, x_in, layers):
    import glob
    import tempfile
    d = tempfile.mkdtemp()
    mv = jax.jit(make_matvecs(plan, n_sm, cmax, layers, stages=8, profile_dir=d))   # the events take smem
    jax.block_until_ready(mv(stacked[:layers * n_sm * cmax * TILE_R], x_in))
    return profile_summary(sorted(glob.glob(os.path.join(d, "*trace.json")))[-1], n_sm, layers)


def main():
    s = setup()
    n_sm, iters, plan, index, cmax, ws, c, res = s.n_sm, s.iters, s.plan, s.index, s.cmax, s.ws, s.c, s.res
    res["stages"] = STAGES
    stacked = jnp.stack([layout({n: ws[n][l] for n in ws}, index) for l in range(L)]).reshape(-1, TILE_C)
    x = jax.random.normal(jax.random.key(1), (2560,), jnp.float32)
    x_in = jnp.zeros((2560, 8), jnp.float32).at[:, 0].set(x)
    mv = make_matvecs(plan, n_sm, cmax, L)
    # checked over the first CHECK layers: past a few layers the chain (random weights, silu(gate) * up)
    # amplifies any rounding difference, the reference's own included
    nchk = min(L, int(os.environ.get("CHECK", 4)))
    ref = jax.jit(functools.partial(reference, layers=nchk))(ws, x)
    res["checked_layers"], res["relative_error"] = nchk, {}
    for flags in (False, True):
        got = jax.jit(make_matvecs(plan, n_sm, cmax, nchk, flags=flags))(
            stacked[:nchk * n_sm * cmax * TILE_R], x_in)[0][nchk - 1, REGION[3]:REGION[4]]
        got = got[:, 0] + got[:, 1] / 254
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        res["relative_error"]["flags" if flags else "barriers"] = err
        print(f"matvec chain of {nchk} layers ({'a flag a chunk' if flags else 'barriers'}) against float32 "
              f"XLA: max error {err:.3e} of the largest output", flush=True)
    if os.environ.get("PROFILE"):
        res["profile"] = profile(plan, n_sm, cmax, stacked, x_in, int(os.environ["PROFILE"]))
    if os.environ.get("CHECK_ONLY") == "1":
        with open(os.path.join(OUT, f"persistent_matvec_profile_s{STAGES}.json"), "w") as f:
            json.dump(res, f, indent=1)
        return

    def chain(mv):
        def one(w, x_in):
            o = mv(w, x_in)[0][L - 1, REGION[3]:REGION[4]]
            return x_in.at[:, 0].set(o[:, 0] * SCALE[3])
        return jax.jit(lambda w, x_in: lax.fori_loop(0, iters, lambda i, x: one(w, x), x_in))
    stream = make_persistent(plan, n_sm, cmax, L)
    fns = {"persistent matvecs": (chain(mv), (stacked, x_in))}
    fns["matvecs, arriving at A late"] = (chain(make_matvecs(plan, n_sm, cmax, L, early=False)), (stacked, x_in))
    fns["matvecs, chunks built by blocks 0 to KT"] = (chain(make_matvecs(plan, n_sm, cmax, L, balanced=False)),
                                                    (stacked, x_in))
    fns["matvecs, a flag a chunk"] = (chain(make_matvecs(plan, n_sm, cmax, L, flags=True)), (stacked, x_in))
    for ahead in map(int, filter(None, os.environ.get("AHEAD", "").split(","))):
        fns[f"matvecs, L2 {ahead} ahead"] = (chain(make_matvecs(plan, n_sm, cmax, L, ahead=ahead)),
                                             (stacked, x_in))
    for skip in filter(None, os.environ.get("SKIPS", "prep,boundary").split(",")):
        fns[f"matvecs, no {skip}"] = (chain(make_matvecs(plan, n_sm, cmax, L, skip=skip)), (stacked, x_in))
    for skip in ("", "prep", "boundary"):
        fns[f"two tiles{', no ' + skip if skip else ''}"] = (
            chain(make_matvecs(plan, n_sm, cmax, L, skip=skip, one_tile=True)), (stacked, x_in))
    fns |= {"persistent stream": (jax.jit(lambda w, d: lax.fori_loop(0, iters, lambda i, d: stream(w, d), d)),
                                 (stacked, jnp.ones((n_sm,), jnp.float32)))}
    fns["triton matvecs"] = triton_loop(ws, iters)
    run_rounds(fns, res, iters)
    with open(os.path.join(OUT, f"persistent_matvec_s{STAGES}.json"), "w") as f:
        json.dump(res, f, indent=1)
    report(res, c)


if __name__ == "__main__":
    main()
