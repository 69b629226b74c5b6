"""Weights streamed by TMA from Mosaic GPU kernels, against the Triton matvec kernels the model runs,
on the four weight matrices of 36 Qwen3-4B layers (int8, output-major, one array per layer, in the
model's order, each kernel taking what the one before wrote). Hopper GPUs, jax with Pallas Mosaic GPU.

    python scripts/tma_stream_bench.py                  # the stream in PDL variants, one call each
    RR=1 WS=1 python scripts/tma_stream_bench.py        # the variants timed in turn, and traced
    INLOOP=1 MM=1x256x4 MM8=1x256x4x1 python scripts/tma_stream_bench.py   # in a loop, with matvecs
    PERSHAPE=1 PS="qkv:1x256x4x1x1;down:1x256x8x2x1" python scripts/tma_stream_bench.py   # one shape

Streams (`make`; `make_ws` warp-specialized) copy a weight's rows through shared memory and sum them,
with griddepcontrol.wait at entry or once the first copies are issued, with or without
launch_dependents at entry. `make_mm` is a matvec on wgmma, checked against XLA. Settings by
environment: DT, CONFIGS (rows x bytes x stages), VARIANTS, LAYERS, ITERS, ROUNDS, MM and MM8
(compute warpgroups x bytes x stages [x delay]), TRITON=0. JSON goes to $OUT; every figure is
printed beside the copy ceiling measured in the same run.
"""
import functools
import json
import os
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

R, C = int(os.environ.get("TR", 32)), int(os.environ.get("TC", 256))
L = int(os.environ.get("LAYERS", 36))
STAGES = int(os.environ.get("STAGES", 4))
SHAPES = [("qkv", 6144, 2560, 1), ("o", 2560, 4096, 2), ("gate_up", 19456, 2560, 1), ("down", 2560, 9728, 2)]
OUT = os.environ.get("OUT", "/tmp")


DT = jnp.dtype(os.environ.get("DT", "int8"))
WB = DT.itemsize


def _blocks(N, K, ksplit, rows, cols):
    """(columns of a tile, blocks, K range of a block, its steps) for w [N, K bytes] in DT words."""
    K, c = K // WB, cols // WB
    kpb = K // ksplit
    assert N % rows == 0 and kpb % c == 0, (N, K, ksplit)
    return c, (N // rows) * ksplit, kpb, kpb // c


def _enter(b, wait, trigger, ksplit, rows, kpb):
    """The PDL calls at a block's entry; the block's first row and first column."""
    if trigger:
        plgpu.griddepcontrol_launch_dependents()
    if wait == "entry":
        plgpu.griddepcontrol_wait()
    return (b // ksplit) * rows, (b % ksplit) * kpb


def _wait_issued(idx, wait):
    """With wait='issued', the wait at the pipeline's first step, after its first copies."""
    if wait == "issued":
        @pl.when(idx[0] == 0)
        def _():
            plgpu.griddepcontrol_wait()


def make(N, K, ksplit, wait, trigger, stages=STAGES, rows=R, cols=C):
    """A kernel streaming w [N, K] int8: block b takes `rows` rows by K/ksplit columns in (rows, C)
    tiles, sums them, adds dep[0] and writes out[b]. wait: None (no PDL), 'entry' (wait first),
    'issued' (wait once the pipeline's first copies are issued). trigger: launch dependents at entry."""
    c, nblocks, kpb, steps = _blocks(N, K, ksplit, rows, cols)
    lay = plgpu.Layout.WG_STRIDED((rows, c), vec_size=max(1, 64 // (8 * WB)))
    acc_t = jnp.float32 if WB == 1 else DT

    def body(w_gmem, dep_gmem, out_gmem):
        b = lax.axis_index("b")
        r0, k0 = _enter(b, wait, trigger, ksplit, rows, kpb)

        def step(idx, w_smem, acc):
            _wait_issued(idx, wait)
            return acc + plgpu.load(w_smem, layout=lay).astype(acc_t)

        acc0 = plgpu.layout_cast(jnp.zeros((rows, c), acc_t), lay)
        pipe = plgpu.emit_pipeline(step, grid=(steps,),
                                   in_specs=[plgpu.BlockSpec((rows, c), lambda k: (0, k))],
                                   max_concurrent_steps=stages, init_carry=acc0)
        acc = pipe(w_gmem.at[pl.ds(r0, rows), pl.ds(k0, kpb)])
        out_gmem[b] = jnp.sum(acc).astype(jnp.float32) + dep_gmem[0]

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((nblocks,), jnp.float32),
                        grid=(nblocks,), grid_names=("b",))


def make_ws(N, K, ksplit, wait, trigger, stages=STAGES, rows=R, cols=C):
    """The same stream with a memory warpgroup issuing the copies and a compute warpgroup taking a
    scalar of each tile: with wait='issued' only the compute warpgroup waits, so the copies start
    at the kernel's entry."""
    c, nblocks, kpb, steps = _blocks(N, K, ksplit, rows, cols)

    def body(w_gmem, dep_gmem, out_gmem):
        b = lax.axis_index("b")
        r0, k0 = _enter(b, wait, trigger, ksplit, rows, kpb)

        def step(idx, w_smem, carry):
            _wait_issued(idx, wait)
            return carry + w_smem[0, 0].astype(jnp.float32)

        def ctx(eval_pipeline):
            total = eval_pipeline(jnp.float32(0))
            out_gmem[b] = total + dep_gmem[0]

        pipe = plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((rows, c), lambda k: (0, k))],
            wg_axis="wg", num_compute_wgs=1, max_concurrent_steps=stages, compute_context=ctx)
        pipe(w_gmem.at[pl.ds(r0, rows), pl.ds(k0, kpb)])

    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((nblocks,), jnp.float32),
                        grid=(nblocks,), grid_names=("b",), num_threads=2, thread_name="wg")


MAKE = make_ws if os.environ.get("WS") == "1" else make


def triton_stacks(ws):
    """The layers' weights stacked as the model holds them (gate and up apart), with scales."""
    st = {name: jnp.stack(ws[name]) for name, *_ in SHAPES}
    gu = st.pop("gate_up")
    st["gate"], st["up"] = gu[:, :9728], gu[:, 9728:]
    del gu
    return st, {k: jnp.full((L, v.shape[1]), 0.01, jnp.float32) for k, v in st.items()}


def triton_layer(st, sc, x, l):
    """Layer l's four products on the Triton matvec kernels the model runs: x [1, 2560] -> [1, 2560]."""
    from jaxllm.kernels.matmul import stacked_gated, stacked_matmuls
    q = stacked_matmuls(x, [(st["qkv"], sc["qkv"])], l, out_major=True)[0]
    o = stacked_matmuls(q[:, :4096], [(st["o"], sc["o"])], l, out_major=True)[0]
    g = stacked_gated(o, (st["gate"], sc["gate"]), (st["up"], sc["up"]), l, jax.nn.silu, out_major=True)
    return stacked_matmuls(g, [(st["down"], sc["down"])], l, out_major=True)[0] * 1e-3


def chained(ks, *extra):
    """The 36 layers in the model's order on kernels ks (name -> kernel(w, *extra[name], dep)), each
    taking what the one before wrote: a function of (weights by name, dep)."""
    def chain(ws, dep):
        for l in range(L):
            for name, *_ in SHAPES:
                dep = ks[name](ws[name][l], *(e[name] for e in extra), dep)
        return dep
    return chain


def triton_chain(st, sc, x):
    """The 36 layers on the Triton matvec kernels the model runs."""
    for l in range(L):
        x = triton_layer(st, sc, x, l)
    return x


def random_layers(dt=jnp.int8):
    """Random weights of the four matrices, one array a layer: name -> L arrays [N, K bytes / itemsize]."""
    key = jax.random.key(0)
    return {name: [jax.random.randint(jax.random.fold_in(key, 1000 * i + l), (N, K // jnp.dtype(dt).itemsize),
                                      -127, 127, dt) for l in range(L)] for i, (name, N, K, _) in enumerate(SHAPES)}


def triton_loop(ws, iters):
    """The Triton chain in a fori_loop of `iters` steps, as the decode loop runs it: (fn, args)."""
    st, sc = triton_stacks(ws)
    fn = jax.jit(lambda st, sc, x: lax.fori_loop(0, iters, lambda i, x: triton_chain(st, sc, x), x))
    return fn, (st, sc, jnp.ones((1, 2560), jnp.bfloat16))


def timeit(f, *args, reps=15):
    for _ in range(2):
        jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), min(ts)


def main():
    dev = jax.devices()[0]
    print(dev.device_kind, jax.__version__, DT.name, flush=True)
    key = jax.random.key(0)
    ws = {}
    for name, N, K, _ in SHAPES:     # one array per layer: no slicing between kernels
        ws[name] = [jax.random.randint(jax.random.fold_in(key, hash((name, l)) % 2**31), (N, K // WB), -127, 127,
                                       DT) for l in range(L)]
    per_layer_bytes = sum(N * K for _, N, K, _ in SHAPES)
    results = {"device": dev.device_kind, "jax": jax.__version__, "dtype": DT.name,
               "layers": L, "bytes_per_layer": per_layer_bytes, "variants": {}}

    from jaxllm.harness import ceilings
    c = ceilings.measure()
    bw = c.bandwidth
    results["ceilings"] = c.to_json()
    print(f"copy ceiling {bw / 1e9:.0f} GB/s ({c.bandwidth_method})", flush=True)

    variants = {"plain": (None, False), "wait_entry": ("entry", False), "wait_issued": ("issued", False),
                "trigger_wait_entry": ("entry", True), "trigger_wait_issued": ("issued", True)}
    only = os.environ.get("VARIANTS", ",".join(variants)).split(",")
    variants = {k: v for k, v in variants.items() if k in only}
    configs = [tuple(map(int, cf.split("x"))) for cf in os.environ.get("CONFIGS", f"{R}x{C}x{STAGES}").split(",")]
    for rows, cols, stages in configs:
        tag = f"{rows}x{cols}B_s{stages}"
        for vname, (wait, trigger) in variants.items():
            try:
                ks = {name: MAKE(N, K, ks_, wait, trigger, stages=stages, rows=rows, cols=cols)
                      for name, N, K, ks_ in SHAPES}

                chain = jax.jit(chained(ks))
                dep0 = jnp.ones((8,), jnp.float32)
                t0 = time.perf_counter()
                out = jax.block_until_ready(chain(ws, dep0))
                compile_s = time.perf_counter() - t0
                med, best = timeit(chain, ws, dep0)
                us = med / L * 1e6
                gbps = per_layer_bytes * L / med / 1e9
                results["variants"][f"{tag}/{vname}"] = {
                    "us_per_layer": us, "best_us_per_layer": best / L * 1e6, "GBps": gbps,
                    "fraction_of_copy": gbps * 1e9 / bw, "compile_s": compile_s,
                    "finite": bool(np.isfinite(np.asarray(out)).all())}
                print(f"{tag} {vname:22s} {us:7.2f} us/layer  {gbps:6.0f} GB/s  "
                      f"{100 * gbps * 1e9 / bw:5.1f}% of copy", flush=True)
                dump(results)
            except Exception as e:      # report and go on to the next variant
                msg = "".join(traceback.format_exception_only(type(e), e))[-1500:]
                results["variants"][f"{tag}/{vname}"] = {"error": msg}
                print(f"{tag} {vname}: FAILED {msg}", flush=True)

    # the Triton matvec kernels the model runs, on the same shapes, chained the same way
    if os.environ.get("TRITON", "1") == "1" and DT == jnp.int8:
        try:
            st, sc = triton_stacks(ws)
            med, best = timeit(jax.jit(triton_chain), st, sc, jnp.ones((1, 2560), jnp.bfloat16))
            us = med / L * 1e6
            gbps = per_layer_bytes * L / med / 1e9
            results["variants"]["triton_matvec"] = {"us_per_layer": us, "best_us_per_layer": best / L * 1e6,
                                                    "GBps": gbps, "fraction_of_copy": gbps * 1e9 / bw}
            print(f"{'triton_matvec':22s} {us:7.2f} us/layer  {gbps:6.0f} GB/s  "
                  f"{100 * gbps * 1e9 / bw:5.1f}% of copy",
                  flush=True)
        except Exception as e:
            msg = "".join(traceback.format_exception_only(type(e), e))[-1500:]
            results["variants"]["triton_matvec"] = {"error": msg}
            print("triton FAILED", msg, flush=True)

    ideal = per_layer_bytes / bw * 1e6
    print(f"\nideal at the copy ceiling: {ideal:.2f} us/layer ({per_layer_bytes / 1e6:.1f} MB)")
    print(f"{'variant':40s} {'us/layer':>9s} {'GB/s':>7s} {'of copy':>8s}")
    for k, v in results["variants"].items():
        print(f"{k:40s} error" if "error" in v else
              f"{k:40s} {v['us_per_layer']:9.2f} {v['GBps']:7.0f} {100 * v['fraction_of_copy']:7.1f}%")
    dump(results)


def dump(results):
    with open(os.path.join(OUT, f"tma_stream_{DT.name}{'_ws' if MAKE is make_ws else ''}.json"), "w") as f:
        json.dump(results, f, indent=1)




def kernel_events(fn, *args):
    """GPU kernel events (name, start us, duration us) of one call of fn, in start order."""
    import glob
    import gzip
    import re
    import tempfile
    d = tempfile.mkdtemp()
    jax.block_until_ready(fn(*args))
    with jax.profiler.trace(d, create_perfetto_trace=True):
        jax.block_until_ready(fn(*args))
    files = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(files[0]))["traceEvents"] if files else []
    pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
            and re.search(r"/device:GPU:0\b|GPU 0\b|/device:GPU(?!:)", str(e.get("args", {}).get("name", "")))}
    ks = sorted((e["ts"], e["dur"], e["name"]) for e in events
                if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e)
    return ks


def overlap_stats(ks, per_layer):
    """Gaps between consecutive kernels (negative: the next began before this one ended), and the
    mean duration of each kernel of a layer."""
    ks = [k for k in ks if k[1] > 0.5]          # drop tiny copies
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(ks, ks[1:])]
    span = ks[-1][0] + ks[-1][1] - ks[0][0] if ks else 0
    by_pos = [statistics.mean(k[1] for k in ks[i::per_layer]) for i in range(per_layer)] if ks else []
    return {"kernels": len(ks), "span_us": span, "busy_us": sum(k[1] for k in ks),
            "gap_mean_us": statistics.mean(gaps) if gaps else 0, "overlapping": sum(g < 0 for g in gaps),
            "gap_min_us": min(gaps) if gaps else 0, "mean_us_by_position": by_pos,
            "names": sorted({k[2][:40] for k in ks})[:6]}


def roundrobin():
    dev = jax.devices()[0]
    rows, cols, stages = map(int, os.environ.get("CONFIGS", "128x256x4").split(",")[0].split("x"))
    names = os.environ.get("VARIANTS", "plain,wait_entry,wait_issued,trigger_wait_issued").split(",")
    allv = {"plain": (None, False), "wait_entry": ("entry", False), "wait_issued": ("issued", False),
            "trigger_wait_entry": ("entry", True), "trigger_wait_issued": ("issued", True)}
    ws = random_layers(DT)
    per_layer_bytes = sum(N * K for _, N, K, _ in SHAPES)
    from jaxllm.harness import ceilings
    c = ceilings.measure()
    res = {"device": dev.device_kind, "jax": jax.__version__, "dtype": DT.name, "layers": L,
           "config": [rows, cols, stages], "warp_specialized": MAKE is make_ws, "ceilings": c.to_json(),
           "bytes_per_layer": per_layer_bytes, "rounds": {}, "trace": {}}
    chains = {}
    for v in names:
        ks = {name: MAKE(N, K, k_, *allv[v], stages=stages, rows=rows, cols=cols) for name, N, K, k_ in SHAPES}
        chains[v] = jax.jit(chained(ks))
    dep0 = jnp.ones((8,), jnp.float32)
    fns = {v: (f, (ws, dep0)) for v, f in chains.items()}
    if os.environ.get("TRITON", "1") == "1" and DT == jnp.int8:
        st, sc = triton_stacks(ws)
        fns["triton_matvec"] = (jax.jit(triton_chain), (st, sc, jnp.ones((1, 2560), jnp.bfloat16)))
    for f, args in fns.values():
        jax.block_until_ready(f(*args))
    for r in range(int(os.environ.get("ROUNDS", 4))):
        for v, (f, args) in fns.items():
            med, _ = timeit(f, *args, reps=10)
            res["rounds"].setdefault(v, []).append(med / L * 1e6)
        print("round", r, {v: round(t[-1], 2) for v, t in res["rounds"].items()}, flush=True)
    for v, (f, args) in fns.items():
        try:
            st_ = overlap_stats(kernel_events(f, *args), 4 if v != "triton_matvec" else 5)
            res["trace"][v] = st_
            print(v, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in st_.items() if k != "names"},
                  st_["names"], flush=True)
        except Exception as e:
            res["trace"][v] = {"error": str(e)[-500:]}
            print(v, "trace FAILED", str(e)[-500:], flush=True)
    bw = c.bandwidth
    print(f"\n{dev.device_kind}, jax {jax.__version__}, copy ceiling {bw / 1e9:.0f} GB/s; ideal "
          f"{per_layer_bytes / bw * 1e6:.2f} us/layer")
    print(f"{'variant':22s} {'us/layer, each round':40s} {'mean':>7s}")
    for v, t in res["rounds"].items():
        print(f"{v:22s} {' '.join(f'{x:6.2f}' for x in t):40s} {statistics.mean(t):7.2f}")
    name = f"tma_stream_rr_{DT.name}_{rows}x{cols}_s{stages}{'_ws' if MAKE is make_ws else ''}.json"
    with open(os.path.join(OUT, name), "w") as f:
        json.dump(res, f, indent=1)


def make_mm(N, K, ksplit, cols=256, stages=4, cwgs=1, delay=False, int8_x=False):
    """A matvec fed by a warp-specialized TMA pipeline, as wgmma: w [N, K] int8 tiles (K-major) are A,
    x [8, K] (K-major; rows past the first are padding) is B; out: partials [ksplit, N, 8]. bf16 x:
    the int8 tile is widened to bf16 in registers first. int8 x (x split into int8 parts, one a row):
    the tensor cores read both tiles where TMA put them, into int32. `cwgs` compute warpgroups take
    64 rows each; with `delay` a step leaves its wgmma in flight and its tiles are released later."""
    rows = 64 * cwgs
    nblocks = (N // rows) * ksplit
    kpb = K // ksplit
    steps = kpb // cols
    assert N % rows == 0 and kpb % cols == 0, (N, K, ksplit)
    sw = min(128, cols)
    w_tr = (plgpu.TilingTransform((8, sw)), plgpu.SwizzleTransform(sw))
    xsw = sw if int8_x else min(128, cols * 2)
    x_tr = (plgpu.TilingTransform((8, xsw if int8_x else xsw // 2)), plgpu.SwizzleTransform(xsw))
    acc_t = jnp.int32 if int8_x else jnp.float32
    o_tr = (plgpu.TilingTransform((8, 8)), plgpu.SwizzleTransform(32))
    rel = dict(delay_release=1) if delay else {}

    def body(w_gmem, x_gmem, dep_gmem, out_gmem, out_smem):
        b = lax.axis_index("b")
        wg = lax.axis_index("wg") if cwgs > 1 else 0
        r0 = (b // ksplit) * rows
        ks = b % ksplit
        k0 = ks * kpb

        def step(idx, w_smem, x_smem, acc_ref):
            a = w_smem.at[pl.ds(wg * 64, 64)] if cwgs > 1 else w_smem
            plgpu.wgmma(acc_ref, a if int8_x else a[...].astype(jnp.bfloat16), x_smem.T)
            plgpu.wgmma_wait(1 if delay else 0)
            return acc_ref

        def ctx(eval_pipeline):
            @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((64, 8), acc_t))
            def _(acc_ref):
                eval_pipeline(acc_ref)
                plgpu.wgmma_wait(0)
                out_smem.at[wg][...] = acc_ref[...]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[ks, pl.ds(r0 + wg * 64, 64)])
                plgpu.wait_smem_to_gmem(0)

        pipe = plgpu.emit_pipeline_warp_specialized(
            step, grid=(steps,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((rows, cols), lambda k: (0, k), transforms=w_tr, **rel),
                      plgpu.BlockSpec((8, cols), lambda k: (0, k), transforms=x_tr, **rel)],
            wg_axis="wg", num_compute_wgs=cwgs, max_concurrent_steps=stages, compute_context=ctx)
        pipe(w_gmem.at[pl.ds(r0, rows), pl.ds(k0, kpb)], x_gmem.at[:, pl.ds(k0, kpb)])

    params = plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ksplit, N, 8), acc_t),
                        grid=(nblocks,), grid_names=("b",), num_threads=cwgs + 1, thread_name="wg",
                        compiler_params=params,
                        scratch_types=dict(out_smem=plgpu.SMEM((cwgs, 64, 8), acc_t, transforms=o_tr)))


SPLITS = {1: {"qkv": 2, "o": 4, "gate_up": 1, "down": 19}, 2: {"qkv": 5, "o": 8, "gate_up": 1, "down": 19}}


def splits(cwgs, cols):
    """How far each shape's K is split, for blocks of `cwgs` x 64 rows and `cols`-byte tiles."""
    return SPLITS[cwgs] if cols == 256 else {k: v * 2 if k != "down" else 38 for k, v in SPLITS[cwgs].items()}


def inloop():
    """The chains inside a fori_loop of ITERS steps, as the decode loop runs them: Mosaic streams,
    Mosaic wgmma matvecs, the Triton matvecs."""
    dev = jax.devices()[0]
    iters = int(os.environ.get("ITERS", 8))
    key = jax.random.key(0)
    ws = random_layers()
    per_layer_bytes = sum(N * K for _, N, K, _ in SHAPES)
    from jaxllm.harness import ceilings
    c = ceilings.measure()
    bw = c.bandwidth
    res = {"device": dev.device_kind, "jax": jax.__version__, "layers": L, "iters": iters,
           "ceilings": c.to_json(), "bytes_per_layer": per_layer_bytes, "chains": {}}
    fns = {}
    rows, cols, stages = map(int, os.environ.get("CONFIGS", "128x256x4").split(",")[0].split("x"))
    ks = {name: make_ws(N, K, k_, None, False, stages=stages, rows=rows, cols=cols) for name, N, K, k_ in SHAPES}

    stream = jax.jit(lambda ws, dep: lax.fori_loop(0, iters, lambda i, dep: chained(ks)(ws, dep), dep))
    fns["mosaic_stream"] = (stream, (ws, jnp.ones(((2560 // rows) * SHAPES[-1][3],), jnp.float32)))
    xs = {name: jnp.zeros((8, K), jnp.bfloat16).at[0].set(0.01) for name, N, K, _ in SHAPES}
    xq = {name: jax.random.randint(jax.random.fold_in(key, 7 + i), (8, K), -127, 127, jnp.int8)
          for i, (name, N, K, _) in enumerate(SHAPES)}
    matvecs = [("wgmma8", functools.partial(make_mm, int8_x=True), xq, jnp.int32, os.environ.get("MM8", "")),
               ("wgmma", make_mm, xs, jnp.float32, os.environ.get("MM", "1x256x4"))]
    for kind, maker, xin, acc_t, cfgs in matvecs:
        for cfg in filter(None, cfgs.split(",")):
            cw, cols_, stg, *dl = map(int, cfg.split("x"))
            tag = f"{kind}_{64 * cw}rows_{cols_}B_s{stg}{'_delay' if dl and dl[0] else ''}"
            try:
                sp = splits(cw, cols_)
                extra = dict(delay=bool(dl[0])) if dl else {}
                mk = {name: maker(N, K, sp[name], cols=cols_, stages=stg, cwgs=cw, **extra)
                      for name, N, K, _ in SHAPES}

                mm = jax.jit(lambda ws, xin, dep, mk=mk: lax.fori_loop(
                    0, iters, lambda i, dep: chained(mk, xin)(ws, dep), dep))
                dep0 = jnp.zeros((sp["down"], 2560, 8), acc_t)
                out = jax.block_until_ready(mm(ws, xin, dep0))
                ref = jnp.dot(xin["down"].astype(acc_t), ws["down"][L - 1].astype(acc_t).T,
                              precision=jax.lax.Precision.HIGHEST)
                diff = jnp.max(jnp.abs(out.sum(axis=0).T - ref)).astype(jnp.float32)
                err = float(diff / (jnp.max(jnp.abs(ref)).astype(jnp.float32) + 1e-9))
                res["chains"][f"{tag}_error"] = err
                print(tag, "relative error against XLA", err, flush=True)
                fns[tag] = (mm, (ws, xin, dep0))
            except Exception as e:
                msg = "".join(traceback.format_exception_only(type(e), e))[-1200:]
                res["chains"][tag] = {"error": msg}
                print(tag, "FAILED", msg, flush=True)
    fns["triton_matvec"] = triton_loop(ws, iters)
    for f, args in fns.values():
        jax.block_until_ready(f(*args))
    for r in range(3):
        for v, (f, args) in fns.items():
            med, _ = timeit(f, *args, reps=5)
            res["chains"].setdefault(v, []).append(med / (L * iters) * 1e6)
        print("round", r, {v: round(t[-1], 2) for v, t in res["chains"].items() if isinstance(t, list)},
              flush=True)
    res["trace"] = {}
    for v, (f, args) in fns.items():
        try:
            evs = kernel_events(f, *args)
            st_ = overlap_stats(evs, 4)
            res["trace"][v] = st_
            print(v, {k: (round(x, 2) if isinstance(x, float) else x) for k, x in st_.items() if k != "names"},
                  flush=True)
        except Exception as e:
            print(v, "trace FAILED", str(e)[-300:], flush=True)
    print(f"\n{dev.device_kind}, jax {jax.__version__}, copy ceiling {bw / 1e9:.0f} GB/s; ideal "
          f"{per_layer_bytes / bw * 1e6:.2f} us/layer; {iters} loop steps of {L} layers")
    print(f"{'chain':22s} {'wall us/layer, each round':30s} {'mean':>7s} {'kernel span us/layer':>22s}")
    for v, t in res["chains"].items():
        if isinstance(t, list):
            span = res["trace"].get(v, {}).get("span_us", 0) / (L * iters)
            print(f"{v:22s} {' '.join(f'{x:6.2f}' for x in t):30s} {statistics.mean(t):7.2f} {span:22.2f}")
    with open(os.path.join(OUT, "tma_stream_inloop.json"), "w") as f:
        json.dump(res, f, indent=1)


def per_shape():
    """Each weight shape alone: a loop of ITERS steps over its 36 layers' matrices, µs a kernel, for
    the stream, the int8 wgmma matvec in several forms (PS: shape:warpgroups x bytes x stages x
    split x delay, ';'-separated), and the Triton kernel."""
    dev = jax.devices()[0]
    iters = int(os.environ.get("ITERS", 8))
    key = jax.random.key(0)
    from jaxllm.harness import ceilings
    c = ceilings.measure()
    res = {"device": dev.device_kind, "jax": jax.__version__, "layers": L, "iters": iters,
           "ceilings": c.to_json(), "shapes": {}}
    plan = {}
    for item in filter(None, os.environ.get("PS", "").split(";")):
        name, cfg = item.split(":")
        plan.setdefault(name, []).append(tuple(map(int, cfg.split("x"))))

    def looped(kern, args_of):
        @jax.jit
        def f(ws, dep):
            def one(i, dep):
                for l in range(L):
                    dep = kern(*args_of(ws, l), dep)
                return dep
            return lax.fori_loop(0, iters, one, dep)
        return f

    for i, (name, N, K, k_) in enumerate(SHAPES):
        if name not in plan:
            continue
        ws = [jax.random.randint(jax.random.fold_in(key, 1000 * i + l), (N, K), -127, 127, jnp.int8)
              for l in range(L)]
        xq = jax.random.randint(jax.random.fold_in(key, 7 + i), (8, K), -127, 127, jnp.int8)
        out = res["shapes"].setdefault(name, {"N": N, "K": K, "MB": N * K / 1e6,
                                              "copy_us": N * K / c.bandwidth * 1e6})
        runs = {}
        sk = make_ws(N, K, 2 if N == 2560 else 1, None, False, stages=4, rows=128, cols=256)
        runs["stream_128x256B_s4"] = (looped(sk, lambda ws, l: (ws[l],)),
                                      jnp.zeros(((N // 128) * (2 if N == 2560 else 1),), jnp.float32))
        for cw, cols_, stg, split, dl in plan[name]:
            tag = f"wgmma8_{64 * cw}rows_{cols_}B_s{stg}_split{split}{'_delay' if dl else ''}"
            try:
                mk = make_mm(N, K, split, cols=cols_, stages=stg, cwgs=cw, delay=bool(dl), int8_x=True)
                runs[tag] = (looped(lambda w, x, dep, mk=mk: mk(w, x, dep), lambda ws, l: (ws[l], xq)),
                             jnp.zeros((split, N, 8), jnp.int32))
            except Exception as e:
                out[tag] = {"error": "".join(traceback.format_exception_only(type(e), e))[-600:]}
        from jaxllm.kernels.matmul import stacked_gated, stacked_matmuls
        stk = jnp.stack(ws)
        sc = jnp.full((L, N), 0.01, jnp.float32)
        x = jnp.ones((1, K), jnp.bfloat16)
        if name == "gate_up":       # the gated product, unsplit at batch 1: no XLA kernel after it
            g, u, sg = stk[:, :N // 2], stk[:, N // 2:], sc[:, :N // 2]
            tk = lambda l: stacked_gated(x, (g, sg), (u, sg), l, jax.nn.silu, out_major=True)
        else:                       # K-split partials left unsummed, as the model sums them elsewhere
            tk = lambda l: stacked_matmuls(x, [(stk, sc)], l, out_major=True, summed=False)[0]
        dep_t = jnp.zeros((8,), jnp.float32)

        @jax.jit
        def tri(acc):               # every product kept live by one sum a loop step
            def one(i, acc):
                return acc + sum(tk(l).reshape(-1)[:8].astype(jnp.float32) for l in range(L))
            return lax.fori_loop(0, iters, one, acc)
        results = {}
        for tag, (f, dep) in list(runs.items()) + [("triton", (None, dep_t))]:
            try:
                call = (lambda d, f=f: f(ws, d)) if f is not None else tri
                if tag != "triton" and tag.startswith("wgmma8"):
                    o = jax.block_until_ready(call(dep))
                    ref = jnp.dot(xq.astype(jnp.int32), ws[L - 1].astype(jnp.int32).T)
                    if not bool(jnp.array_equal(o.sum(axis=0).T, ref)):
                        raise AssertionError("wgmma8 product differs from XLA's")
                med, _ = timeit(call, dep, reps=5)
                results[tag] = med / (L * iters) * 1e6
            except Exception as e:
                results[tag] = "".join(traceback.format_exception_only(type(e), e))[-400:]
        out.update(results)
        print(f"{name} {N}x{K} ({N * K / 1e6:.1f} MB, {out['copy_us']:.2f} us at the copy ceiling):", flush=True)
        for tag, v in results.items():
            print(f"  {tag:44s} " + (f"{v:7.2f} us" if isinstance(v, float) else f"FAILED {v}"), flush=True)
    with open(os.path.join(OUT, "tma_stream_per_shape.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    if os.environ.get("PERSHAPE") == "1":
        per_shape()
    elif os.environ.get("INLOOP") == "1":
        inloop()
    else:
        roundrobin() if os.environ.get("RR") == "1" else main()
