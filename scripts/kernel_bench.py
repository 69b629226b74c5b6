"""Time the decode kernels against the XLA formulation they replace, on the layer shapes of a
preset, with the weights stacked as the model holds them (so nothing stays in L2 between layers).

    python scripts/kernel_bench.py --shape qwen3-4b --rows 1,8,64 --ctx 2048 --out DIR
    python scripts/kernel_bench.py --shape gemma4-31b --tp 4 --rows 1 --layouts out --out DIR

With `--tp N` the shapes are one device's shards under N-way tensor parallelism (Q/K/V and gate/up
split along their outputs, O and down along their inputs, attention over 1/N of the heads), so the
tiles of a tensor-parallel run can be tuned on a single GPU.

For each matmul it reports GB/s of weight bytes moved (int8 weights plus scales) next to the
device's measured bandwidth, for each tile configuration tried, with the weights input-major and
output-major (`--layouts`), and for XLA (slice, widen, dot), with the cost of the bare layer loop
subtracted, and each kernel's largest error against a float32 product. Then decode attention over
a paged bf16 pool of ctx positions a row (pages of 32, each row's blocks in order), the kernel
against XLA's blockwise attention over the same blocks (`kv.paged.LayerKV.attend`).

With `--tune` it fills the tile table (`jaxllm/ops/gpu/matmul_tiles.py`) for the GPU at hand
instead: for each shape class the `--rows` of the preset's matmuls fall in (Q/K/V in one launch,
O, down, the gated gate/up), it times the table's entry and its neighbours (`candidates` there)
inside the same kernels, moves to the fastest and tries its neighbours again (`--tune-passes`),
and prints each class's fastest entry in the table's own format, with its time beside the
table's, for a new GPU kind's table (`TABLES`):

    python scripts/kernel_bench.py --tune --shape qwen3-4b --rows 1,8,32,64,128,256 --layouts out
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.benchmarks import ceilings as ceil
from jaxllm.kv.paged import KVPool, LayerKV, static_tables  # noqa: E402
from jaxllm.model.presets import load_preset  # noqa: E402
from jaxllm.ops.gpu.attention import decode_attention  # noqa: E402
from jaxllm.ops.gpu.matmul import (  # noqa: E402
    choose_tiles,
    stacked_gated,
    stacked_matmul,
    stacked_matmuls,
    table_entry,
    tiles_of,
)
from jaxllm.ops.gpu.matmul_tiles import candidates, shape_class, table_for  # noqa: E402
from jaxllm.ops.gpu.widen import WAYS  # noqa: E402
from jaxllm.ops.xla import XlaOps  # noqa: E402


def timed(fn, *args, reps=100):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def over_layers(step, L):
    """Run step(layer) for every layer in one compiled loop, as the layer scan does (the loop's own
    cost is timed apart with a trivial step and subtracted)."""

    def run(*args):
        def body(carry, l):
            return carry + step(l, *args).astype(jnp.float32).sum(), None

        return jax.lax.scan(body, jnp.float32(0), jnp.arange(L))[0]

    return jax.jit(run)


def _one_layer(gated, x, w, w2, s, layer, t):
    """One layer's product by a kernel with tiles t, or by XLA in float32 when t is None."""
    if t is None:
        xf, dq = x.astype(jnp.float32), lambda a: a[layer].astype(jnp.float32) * s[layer]
        if gated:
            return jax.nn.silu(xf @ dq(w)) * (xf @ dq(w2))
        return xf @ dq(w)
    if gated:
        return stacked_gated(x, (w, s), (w2, s), layer, jax.nn.silu, t, t.out_major).astype(jnp.float32)
    return stacked_matmul(x, w, s, layer, t, t.out_major).astype(jnp.float32)


def matmul_cases(cfg, tp: int = 1):
    """(K, N) of each matmul of the first layer kind, as one of `tp` devices holds it."""
    a = cfg.attn[cfg.layer_kinds[0]]
    D, F = cfg.hidden_size, cfg.intermediate_size
    n_kv = 1 if a.k_eq_v else 2
    return {
        "qkv": (D, (a.num_heads + n_kv * a.num_kv_heads) * a.head_dim // tp),
        "o": (a.num_heads * a.head_dim // tp, D),
        "down": (F // tp, D),
        "gate_up": (D, F // tp),
    }


def variants(M, K, N, gated, out_major, quick, psum_after=False, widen=(), weights_first=False):
    """The automatic tiles and, unless quick, other shapes around them (each with its own
    automatic K split): at M=1 wide column blocks over shallow steps input-major, a few output
    channels over long contiguous steps output-major, as the accumulator allows. Above one row,
    the automatic tiles again for each other way of widening int8 in `widen` (`kernels.widen`)."""
    auto = choose_tiles(M, K, N, gated, out_major=out_major, psum_after=psum_after)
    out = {("auto out-major" if out_major else "auto"): auto}
    for way in widen:
        if M > 1 and way != auto.widen:
            t = dataclasses.replace(auto, widen=way)
            out[t.label()] = t
    if weights_first and M > 1 and out_major:
        bms = sorted({auto.bm, min(128, max(16, 1 << (M - 1).bit_length()))})
        for bm in bms:
            for bn, bk, warps in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 64, 8), (128, 128, 8), (256, 64, 8)):
                t = dataclasses.replace(
                    choose_tiles(M, K, N, gated, bn=bn, bk=bk, warps=warps, out_major=True, psum_after=psum_after),
                    bm=bm,
                    weights_first=True,
                )
                stages = 3
                while stages > 1 and stages * bk * (bm * 2 + (2 if gated else 1) * bn) > 200 * 1024:
                    stages -= 1
                t = dataclasses.replace(t, stages=stages)
                out[t.label()] = t
    if quick:
        return out
    if M == 1 and out_major:
        shapes = [(bn, bk) for bn in (4, 8, 16, 32) for bk in (128, 256, 512, 1024) if 1024 <= bn * bk <= 8192]
    elif M == 1:
        shapes = [(bn, bk) for bn in (64, 128, 256, 512) for bk in (16, 32, 64, 128) if bn * bk <= 16384]
    else:
        shapes = [(bn, bk) for bn in (64, 128) for bk in (64, 128)]
    for bn, bk in shapes:
        for warps in (4, 8):
            t = choose_tiles(M, K, N, gated, bn=bn, bk=bk, warps=warps, out_major=out_major, psum_after=psum_after)
            out[t.label()] = t
    return out


def tune_cases(cfg, tp: int = 1):
    """name -> (K, output widths, gated, row-parallel) of each matmul launch of the first layer
    kind, as one of `tp` devices holds it and the model launches it (Q, K and V in one)."""
    a = cfg.attn[cfg.layer_kinds[0]]
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = a.num_heads * a.head_dim // tp, a.num_kv_heads * a.head_dim // tp
    return {
        "qkv": (D, (q, kv) if a.k_eq_v else (q, kv, kv), False, False),
        "o": (q, (D,), False, tp > 1),
        "down": (F // tp, (D,), False, tp > 1),
        "gate_up": (D, (F // tp,), True, False),
    }


class Launch(NamedTuple):
    matmul: str  # a `tune_cases` name
    M: int
    K: int
    Ns: tuple  # the widths of its outputs
    gated: bool
    psum: bool  # a row-parallel shard (under --tp)
    out_major: bool


def _looped(e, c: Launch, L: int):
    """The compiled loop over the layers of launch c with the tiles of table entry e."""
    t = tiles_of(e, c.M, c.K, sum(c.Ns), c.gated, out_major=c.out_major, outputs=len(c.Ns), psum_after=c.psum)
    if c.gated:
        return over_layers(
            lambda l, x, w, s: stacked_gated(x, (w[0], s[0]), (w[1], s[1]), l, jax.nn.silu, t, t.out_major), L
        )
    return over_layers(
        lambda l, x, w, s: jnp.stack(
            [y.astype(jnp.float32).sum() for y in stacked_matmuls(x, list(zip(w, s)), l, t, t.out_major)]
        ),
        L,
    )


def tune(a, cfg, layouts) -> dict:
    """Time the entries around the table's for each class the launches fall in; print each class's
    fastest in the table's format and return what was timed (see the module's docstring)."""
    kind = jax.devices()[0].device_kind
    table = table_for(kind)
    L, key = cfg.num_layers, jax.random.key(0)
    classes = {}
    for om in layouts:
        for name, (K, Ns, gated, psum) in tune_cases(cfg, a.tp).items():
            for M in [int(r) for r in a.rows.split(",")]:
                if not a.cases or name in a.cases.split(","):
                    c = Launch(name, M, K, Ns, gated, psum, om)
                    classes.setdefault(shape_class(table, M, om, gated), []).append(c)
    operands, loop_s = {}, {}

    def seconds(c: Launch, e) -> float:
        """A launch's time over the layers with entry e's tiles, the bare loop's subtracted."""
        if c not in operands:
            shapes = [(L, N, c.K) if c.out_major else (L, c.K, N) for N in c.Ns * (2 if c.gated else 1)]
            w = tuple(jax.random.randint(key, sh, -127, 128, jnp.int8) for sh in shapes)
            s = tuple(jnp.full((L, N), 0.01, jnp.float32) for N in c.Ns * (2 if c.gated else 1))
            operands[c] = (jax.random.normal(key, (c.M, c.K), jnp.bfloat16), w, s)
            bare = over_layers(lambda l, x, w, s: x[:1, :1], L)
            loop_s[c] = min(timed(bare, *operands[c], reps=a.reps) for _ in range(a.rounds))
        f = _looped(e, c, L)
        return min(timed(f, *operands[c], reps=a.reps) for _ in range(a.rounds)) - loop_s[c]

    def layer_us(launches, pick):
        """µs a layer of the launches, each with the entry pick(launch), or the error that stopped it."""
        try:
            return sum(seconds(c, pick(c)) for c in launches) / L * 1e6
        except Exception as err:  # a tile shape Triton refuses: note it, go on
            return str(err).splitlines()[0][:120]

    print(f"# {kind}, jax {jax.__version__}, {a.shape} (tp {a.tp}): µs a layer of each class's launches", flush=True)
    out = []
    for cls, launches in classes.items():
        table_us = layer_us(launches, lambda c: table_entry(c.M, sum(c.Ns), c.out_major, c.gated))
        first = launches[0]
        best = dataclasses.replace(table_entry(first.M, sum(first.Ns), first.out_major, first.gated), cover=0)
        tried = {}
        for _ in range(a.tune_passes):
            todo = [e for e in candidates(best, max(c.M for c in launches), first.out_major) if e not in tried]
            tried.update({e: layer_us(launches, lambda c, e=e: e) for e in todo[: a.tune_candidates]})
            timed_ok = {e: t for e, t in tried.items() if isinstance(t, float)}
            if not timed_ok or min(timed_ok, key=timed_ok.get) == best:
                break
            best = min(timed_ok, key=timed_ok.get)
        what = "+".join(dict.fromkeys(c.matmul for c in launches))
        rows = ",".join(map(str, dict.fromkeys(c.M for c in launches)))
        if isinstance(tried.get(best), float):
            table = f"{table_us:.1f} with the table's" if isinstance(table_us, float) else f"the table's: {table_us}"
            print(
                f"    {cls!r}: {best!r},  # {what}, M={rows}: {tried[best]:.1f} µs a layer against {table}",
                flush=True,
            )
        out.append(
            {
                "class": list(cls),
                "launches": [[c.matmul, c.M] for c in launches],
                "table_us": table_us,
                "best": repr(best) if isinstance(tried.get(best), float) else None,
                "tried_us": {repr(e): t for e, t in tried.items()},
            }
        )
    return {"device": kind, "jax": jax.__version__, "shape": a.shape, "tp": a.tp, "classes": out}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--out", default="kernel_bench")
    p.add_argument("--tp", type=int, default=1, help="time one device's shards of an N-way tensor-parallel layer")
    p.add_argument("--quick", action="store_true", help="only the automatic tiles and XLA")
    p.add_argument("--rounds", type=int, default=3, help="times each variant is timed, in turn with the others")
    p.add_argument("--reps", type=int, default=30, help="calls timed per round (their median is the round's time)")
    p.add_argument("--tune-rows", type=int, default=8, help="try tile variants up to this many rows")
    p.add_argument("--cases", default="", help="matmuls to time, comma-separated (default: all)")
    p.add_argument(
        "--widen",
        default="",
        help="ways of widening int8 to time beside the automatic tiles' "
        "(convert, magic, bits; comma-separated), above one row",
    )
    p.add_argument(
        "--weights-first",
        action="store_true",
        help="above one row, also time output-major tiles whose dot takes the weights as its left operand",
    )
    p.add_argument(
        "--layouts",
        default="in,out",
        help="weight layouts to time: in (input-major [L, K, N]), out (output-major [L, N, K])",
    )
    p.add_argument("--tune", action="store_true", help="fill the tile table for this GPU kind (see above) instead")
    p.add_argument("--tune-passes", type=int, default=3, help="times --tune moves to the fastest and tries around it")
    p.add_argument("--tune-candidates", type=int, default=100, help="entries --tune times at most in a pass")
    a = p.parse_args()
    layouts = [{"in": False, "out": True}[x] for x in a.layouts.split(",")]
    ways = [w for w in a.widen.split(",") if w]
    if any(w not in WAYS for w in ways):
        sys.exit(f"--widen: each of {a.widen!r} must be one of {', '.join(WAYS)}")
    os.makedirs(a.out, exist_ok=True)
    cfg, _ = load_preset(a.shape)
    L = cfg.num_layers
    a_spec = cfg.attn[cfg.layer_kinds[0]]
    if a.tp < 1 or any(n % a.tp for n in (a_spec.num_heads, a_spec.num_kv_heads, cfg.intermediate_size)):
        sys.exit(
            f"--tp {a.tp}: does not divide the heads ({a_spec.num_heads} query, {a_spec.num_kv_heads} "
            f"key/value) and the MLP width ({cfg.intermediate_size}) of {a.shape}"
        )
    if a.tune:
        json.dump(tune(a, cfg, layouts), open(os.path.join(a.out, "kernel_tune.json"), "w"), indent=1)
        return
    bw = ceil.measure_bandwidth(ceil.default_probe_bytes(jax.devices()[0]))
    print(f"bandwidth {bw[1] / 1e9:.0f} GB/s ({bw[0]})", flush=True)
    key = jax.random.key(0)
    rows = []
    for name, (K, N) in matmul_cases(cfg, a.tp).items():
        if a.cases and name not in a.cases.split(","):
            continue
        gated = name == "gate_up"
        w = jax.random.randint(key, (L, K, N), -127, 128, jnp.int8)
        w2 = jax.random.randint(key, (L, K, N), -127, 128, jnp.int8) if gated else None
        s = jnp.ones((L, N), jnp.float32) * 0.01
        nbytes = L * (K * N + 4 * N) * (2 if gated else 1)
        swap = jax.jit(lambda a: None if a is None else jnp.swapaxes(a, 1, 2))
        stacks = {False: (w, w2), True: (swap(w), swap(w2))} if True in layouts else {False: (w, w2)}
        for M in [int(r) for r in a.rows.split(",")]:
            x = jax.random.normal(key, (M, K), jnp.bfloat16)
            if gated:
                xla = over_layers(
                    lambda l, x, w, w2, s: (
                        jax.nn.silu(x @ w[l].astype(x.dtype) * s[l]) * (x @ w2[l].astype(x.dtype) * s[l])
                    ),
                    L,
                )
            else:
                xla = over_layers(lambda l, x, w, w2, s: (x @ w[l].astype(x.dtype)) * s[l], L)
            fns = {"base": (over_layers(lambda l, x, w, w2, s: x[:1, :1], L), (w, w2)), "xla": (xla, (w, w2))}
            quick = a.quick or M > a.tune_rows
            layer = L // 2
            ref = np.asarray(_one_layer(gated, x, w, w2, s, layer, None))
            errs, res = {}, {}
            vs = {}
            for om in layouts:
                # under --tp, O and down are row-parallel shards: "auto" is what the model picks there
                row_par = a.tp > 1 and name in ("o", "down")
                vs.update(
                    {
                        k: (t, stacks[om])
                        for k, t in variants(M, K, N, gated, om, quick, row_par, ways, a.weights_first).items()
                    }
                )
            for label, (t, (wl, w2l)) in vs.items():
                if gated:
                    f = over_layers(
                        lambda l, x, w, w2, s, t=t: stacked_gated(x, (w, s), (w2, s), l, jax.nn.silu, t, t.out_major), L
                    )
                else:
                    f = over_layers(lambda l, x, w, w2, s, t=t: stacked_matmul(x, w, s, l, t, t.out_major), L)
                try:
                    got = np.asarray(_one_layer(gated, x, wl, w2l, s, layer, t))
                    errs[label] = float(np.max(np.abs(got - ref)) / (np.max(np.abs(ref)) + 1e-30))
                    jax.block_until_ready(f(x, wl, w2l, s))
                    fns[label] = (f, (wl, w2l))
                except Exception as e:  # a tile shape Triton refuses: note it, go on
                    res[label] = str(e).splitlines()[0][:120]
            # Every variant once a round, in turn, and the best round of each: a clock or memory
            # state that drifts over the run then weighs on all of them alike, not on the first.
            best_t = {}
            for _ in range(a.rounds):
                for label, (f, (wl, w2l)) in fns.items():
                    t = timed(f, x, wl, w2l, s, reps=a.reps)
                    best_t[label] = min(best_t.get(label, t), t)
            base = best_t.pop("base")
            res.update({label: t - base for label, t in best_t.items()})
            ok = {k: v for k, v in res.items() if isinstance(v, float)}
            best = min((k for k in ok if k != "xla"), key=ok.get, default=None)
            row = {
                "matmul": name,
                "M": M,
                "K": K,
                "N": N,
                "bytes": nbytes,
                "xla_GBps": nbytes / ok["xla"] / 1e9,
                "auto_GBps": nbytes / ok["auto"] / 1e9 if "auto" in ok else None,
                "auto_out_major_GBps": (nbytes / ok["auto out-major"] / 1e9 if "auto out-major" in ok else None),
                "best": best,
                "best_GBps": nbytes / ok[best] / 1e9 if best else None,
                "all_s": res,
                "max_rel_err": errs,
            }
            rows.append(row)
            print(
                f"{name:8s} M={M:3d} K={K:5d} N={N:5d}  xla {row['xla_GBps']:7.0f}  auto "
                f"{row['auto_GBps'] or 0:7.0f}  auto out-major {row['auto_out_major_GBps'] or 0:7.0f}  "
                f"best {row['best_GBps'] or 0:7.0f} GB/s  ({best})",
                flush=True,
            )
    H, Kh, hd = a_spec.num_heads // a.tp, a_spec.num_kv_heads // a.tp, a_spec.head_dim
    P = 32  # KVOptions.block_size
    att = []
    for B in [int(r) for r in a.rows.split(",")]:
        S = a.ctx
        M = -(-S // P)
        table = jnp.asarray(static_tables({"global": M}, B)["global"])  # each row its own blocks
        k = jax.random.normal(key, (L, B * M + 1, P, Kh, hd), jnp.bfloat16)
        v = jax.random.normal(key, (L, B * M + 1, P, Kh, hd), jnp.bfloat16)
        q = jax.random.normal(key, (B, H, hd), jnp.bfloat16)
        pos = jnp.full((B,), S - 1, jnp.int32)
        nbytes = 2 * B * S * Kh * hd * 2 * L
        kern = over_layers(lambda l, q, k, v, pos: decode_attention(q, {"k": k, "v": v}, l, table, pos, scale=0.1), L)
        xla = over_layers(
            lambda l, q, k, v, pos: LayerKV(KVPool(k, v), l, table).attend(
                q[:, None], pos[:, None], XlaOps(), scale=0.1, softcap=None, window=None
            ),
            L,
        )
        got = {}
        for path, f in (("pallas", kern), ("xla", xla)):
            try:
                got[path] = nbytes / timed(f, q, k, v, pos) / 1e9
            except jax.errors.JaxRuntimeError as e:  # e.g. XLA's buffers not fitting: note it, go on
                got[path] = str(e).splitlines()[0][:120]
        att.append({"B": B, "S": S, "bytes": nbytes, **{f"{p}_GBps": g for p, g in got.items()}})
        shown = [f"{p} {g:7.0f}" if isinstance(g, float) else f"{p} ({g})" for p, g in got.items()]
        print(f"attention B={B:3d} S={S}  " + "  ".join(shown) + " GB/s", flush=True)
        del k, v
    json.dump(
        {
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
            "bandwidth_GBps": bw[1] / 1e9,
            "shape": a.shape,
            "tp": a.tp,
            "matmuls": rows,
            "attention": att,
        },
        open(os.path.join(a.out, "kernel_bench.json"), "w"),
        indent=1,
    )


if __name__ == "__main__":
    main()
