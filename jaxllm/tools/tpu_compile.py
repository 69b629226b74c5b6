"""Compile the engine core's prefill, a server's mixed prefill chunk and the decode loop for a TPU
slice without having one.

`python -m jaxllm.tools.tpu_compile --shape qwen3-32b --tp 4 --max-ctx 2048 --batch 1`

The TPU compiler (libtpu) builds the real per-device programs from a topology description
(`jax.experimental.topologies`, e.g. v6e:2x2 = 4 chips) and abstract arguments: int8 weights, the KV
pools (blocks for every row's `--max-ctx` positions, `kv.plan.PoolPlan.for_rows`) and the rows' block
tables as `jax.ShapeDtypeStruct`s carrying the engine's NamedShardings, so no array is ever
allocated. The programs are the TPU backend's (`ops.select`): attention is its Pallas kernel, whose
calls the report counts. It reports per-device memory (arguments, temporaries, outputs) and the
bytes one decode step moves, from which the step time at the chip's HBM bandwidth follows: decode is
memory-bound, so that is the roofline a real run is measured against. Needs `pip install
"jax[tpu]"` (libtpu), which also works on machines without a TPU, alongside the CPU backend.
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import Mesh

from jaxllm import ops
from jaxllm.config.engine import Parser, add_flags, from_args, settle
from jaxllm.config.kv import KVOptions
from jaxllm.config.runtime import RuntimeConfig, set_default
from jaxllm.engine import core
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.slots import Pieces, Slots, State
from jaxllm.errors import JaxllmError, ModelError
from jaxllm.kv.options import choose_layout
from jaxllm.kv.paged import PagedCache, kind_specs, make_pools
from jaxllm.kv.plan import PoolPlan
from jaxllm.model.params import map_specs
from jaxllm.model.presets import load_preset
from jaxllm.model.sharding import Layout, check_divisible, scale_shape_axes
from jaxllm.quant import VALUE_DTYPES, QuantArray
from jaxllm.weights.weights import weight_format

# HBM bandwidth per chip, bytes/s, and memory per chip, by topology generation.
CHIPS = {
    "v6e": (1640e9, 32 * 2**30),
    "v5e": (819e9, 16 * 2**30),
    "v5p": (2765e9, 95 * 2**30),
    "v4": (1200e9, 32 * 2**30),
}
GiB = 2**30
PROGRAMS = ("prefill", "prefill_chunk", "decode_loop")
KERNEL_CALL = 'custom_call_target="tpu_custom_call"'  # a Pallas (Mosaic) kernel in a compiled program

# libtpu takes a machine-wide lock file when it loads, which a process that only compiles for a
# described topology does not need: without this, any other JAX process on the machine that
# initialised a TPU client (or failed to find a TPU) blocks this one.
set_default("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def topology_mesh(topology: str, tp: int | None, dp: int = 1) -> Layout:

    try:
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:  # no libtpu, or an unknown topology name
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(
            f'cannot describe TPU topology {topology!r} ({first}); is libtpu installed (pip install "jax[tpu]")?'
        ) from None
    devices = list(topo.devices)
    tp = tp or max(1, len(devices) // dp)
    if tp * dp != len(devices):
        raise ModelError(f"--tp {tp} x --dp {dp} must use all {len(devices)} chips of {topology}")

    return Layout(Mesh(np.asarray(devices, dtype=object).reshape(dp, tp), ("data", "model")))


def abstract_weights(cfg, family, layout: Layout, quant: str, dtype) -> dict:
    """The weights as ShapeDtypeStructs with their shardings (QuantArray for int8 and FP8 ones)."""

    def one(spec):
        fmt = weight_format(spec, quant)
        sh = layout.param_sharding(spec, fmt)
        if not fmt:
            return jax.ShapeDtypeStruct(spec.shape, dtype, sharding=sh)
        return QuantArray(
            jax.ShapeDtypeStruct(spec.shape, VALUE_DTYPES[fmt], sharding=sh.q),
            jax.ShapeDtypeStruct(scale_shape_axes(spec, sh.blockwise)[0], jnp.float32, sharding=sh.scale),
            spec.n_contract,
            sh.blockwise,
        )

    tree = family.abstract(cfg)
    check_divisible(layout, tree)
    return map_specs(one, tree)


def pool_plan(cfg, batch: int, max_ctx: int, span: int, dtype, kv_quant: str = "auto") -> tuple[list, PoolPlan]:
    """The KV pools the engine would allocate for a lockstep batch (`Engine.pool_plan`): every row
    its own blocks for max_ctx positions, sliding kinds their window and the `span` positions a
    call writes past a row's lowest; global layers in int8 above the threshold (`--kv-quant auto`).
    -> (the kinds' specs, the plan)."""
    opts = KVOptions()
    kv_layout = choose_layout(kv_quant, max_ctx, opts)
    specs = kind_specs(cfg, kv_layout, opts)
    plan = PoolPlan.for_rows([specs], kv_layout, opts.block_size, jnp.dtype(dtype).itemsize, batch, max_ctx, span)
    return specs, plan


def abstract_cache(specs, plan: PoolPlan, layout: Layout, kv_dtype) -> PagedCache:
    """The pools and the rows' block tables as sharded shape structs (`Engine.state_shapes`)."""
    pools = jax.eval_shape(lambda: make_pools(specs, plan.blocks, plan.block_size, kv_dtype, KVOptions().read))
    pools = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), pools, layout.cache_shardings(pools)
    )
    return PagedCache(pools, {n: rows(layout, plan.rows, jnp.int32, (w,)) for n, w in plan.widths.items()})


def rows(layout: Layout, batch: int, dtype, extra=()):
    shape = (batch, *extra)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.batch_sharding(shape))


def abstract_state(layout, cache: PagedCache, batch: int) -> State:
    i32 = jnp.int32
    slots = Slots(
        last=rows(layout, batch, i32),
        pos=rows(layout, batch, i32),
        step=rows(layout, batch, i32),
        remaining=rows(layout, batch, i32),
        active=rows(layout, batch, jnp.bool_),
        ignore_eos=rows(layout, batch, jnp.bool_),
        params=abstract_sampling(layout, batch),
    )
    return State(cache, slots)


def abstract_pieces(layout, pieces: int, length: int, slots: bool = False) -> Pieces:
    """A prefill forward's pieces: `pieces` rows of `length` tokens, each of cache row p (the
    lockstep batch's), or with `slots` of any slot at any position (a server's mixed chunk)."""
    shapes = Pieces.shapes(pieces, length, rows=slots)
    return jax.tree_util.tree_map(lambda a: rows(layout, a.shape[0], a.dtype, a.shape[1:]), shapes)


def abstract_sampling(layout, batch: int) -> SamplingParams:
    return SamplingParams(
        rows(layout, batch, jnp.float32),
        rows(layout, batch, jnp.int32),
        rows(layout, batch, jnp.float32),
        rows(layout, batch, jnp.uint32),
        rows(layout, batch, jnp.float32),
    )


def device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    return sum(
        int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize
        for a in jax.tree_util.tree_leaves(tree)
    )


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "temp", "alias", "generated_code")}
    out["total"] = out["argument"] + out["temp"] + out["output"]
    out["peak"] = out["total"] - out["alias"]  # donated inputs are reused by the outputs
    return out


def cost(compiled) -> dict:
    c = compiled.cost_analysis()
    c = c[0] if isinstance(c, (list, tuple)) else c
    return {"flops": float(c.get("flops", 0.0)), "bytes_accessed": float(c.get("bytes accessed", 0.0))}


def compile_shape(
    shape: str,
    tp: int | None = None,
    dp: int = 1,
    max_ctx: int | None = None,
    batch: int = 1,
    prompt_len: int | None = None,
    topology: str = "v6e:2x2",
    quant: str = "int8",
    n_out: int = 128,
    programs=PROGRAMS,
    kv_quant: str = "auto",
    pieces: int = 4,
    chunk: int = 512,
) -> dict:
    """Compile the core's prefill of a batch of prompt_len-token prompts, a server's mixed prefill
    chunk (`pieces` pieces of `chunk` tokens, each of any slot at any position: 4 x 512 is a TPU
    server's default budget of 2048 tokens a forward) and its decode loop of n_out steps (or the
    named `programs`) for the named architecture; per-device memory and cost of each. `tp` None:
    every chip of the topology over `dp`; `max_ctx` None: the model's default (`EngineConfig`)."""
    programs = tuple(programs)
    if not programs or set(programs) - set(PROGRAMS):
        raise ModelError(f"programs must be among {', '.join(PROGRAMS)}")

    cfg, family = load_preset(shape)
    layout = topology_mesh(topology, tp, dp)
    tp, max_ctx = layout.tp, max_ctx or cfg.default_ctx
    dtype = jnp.bfloat16
    prompt_len = prompt_len or max_ctx // 2
    if not 0 < prompt_len < max_ctx:
        raise ModelError(f"--prompt-len must lie in (0, {max_ctx})")
    if not 0 < chunk < max_ctx or pieces < 1:
        raise ModelError(f"--chunk must lie in (0, {max_ctx}) and --pieces be positive")
    backend = ops.select(RuntimeConfig(), layout)  # the TPU backend: its kernels
    weights = abstract_weights(cfg, family, layout, quant, dtype)
    # positions one call writes past a row's lowest, which sliding tables hold beside the window
    span = max([1] + [n for p, n in (("prefill", prompt_len), ("prefill_chunk", chunk)) if p in programs])
    specs, plan = pool_plan(cfg, batch, max_ctx, span, dtype, kv_quant)
    cache = abstract_cache(specs, plan, layout, backend.kv_dtype(dtype))
    state = abstract_state(layout, cache, batch)
    report = {
        "shape": shape,
        "topology": topology,
        "tp": tp,
        "dp": dp,
        "batch": batch,
        "max_ctx": max_ctx,
        "kv_cache": plan.layout.name,
        "prompt_len": prompt_len,
        "pieces": pieces,
        "chunk": chunk,
        "quant": quant,
        "devices": tp * dp,
        "backend": backend.name,
        "kv_pool": {
            "block_size": plan.block_size,
            "tokens": plan.tokens,
            "blocks": dict(plan.blocks),
            "table_widths": dict(plan.widths),
        },
    }
    prefill = jax.jit(
        partial(core.prefill, cfg, ops=backend, dtype=dtype), static_argnames=("out",), donate_argnames=("state",)
    )
    lowering = {
        "prefill": lambda: prefill.lower(weights, state, abstract_pieces(layout, batch, prompt_len), out="sample"),
        "prefill_chunk": lambda: prefill.lower(
            weights, state, abstract_pieces(layout, pieces, chunk, slots=True), out="sample"
        ),
        "decode_loop": lambda: jax.jit(
            partial(core.decode, cfg, ops=backend, dtype=dtype),
            static_argnames=("max_steps", "rows"),
            donate_argnames=("state",),
        ).lower(weights, state, jax.ShapeDtypeStruct((), jnp.int32), max_steps=n_out),
    }
    for name in programs:
        t = time.perf_counter()
        c = lowering[name]().compile()
        report[name] = {
            "memory": memory(c),
            "cost": cost(c),
            "compile_s": time.perf_counter() - t,
            "kernel_calls": c.as_text().count(KERNEL_CALL),
        }

    # A decode step streams every weight and the whole KV cache once per device. (XLA's own "bytes
    # accessed" counts the layer scan's body once, not once per layer, so it is reported beside
    # this, not used for the prediction.)
    per_step = device_bytes(weights) + device_bytes(cache)
    report["weight_bytes_per_device"] = device_bytes(weights)
    report["weight_bytes_total"] = sum(
        int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in jax.tree_util.tree_leaves(weights)
    )
    report["cache_bytes_per_device"] = device_bytes(cache)
    bw, hbm = CHIPS.get(topology.split(":")[0], (None, None))
    report.update(
        bytes_per_step=per_step,
        hbm_bandwidth=bw,
        hbm_per_chip=hbm,
        predicted_step_ms=per_step / bw * 1e3 if bw else None,
        predicted_tok_s=batch * bw / per_step if bw else None,
    )
    return report


def format_report(r: dict) -> str:
    pool = r["kv_pool"]
    blocks = ", ".join(
        f"{n} {b - 1:,} blocks of {w} a row"
        for (n, b), w in zip(sorted(pool["blocks"].items()), (pool["table_widths"][n] for n in sorted(pool["blocks"])))
    )
    lines = [
        f"{r['shape']} on {r['topology']}: tp={r['tp']} dp={r['dp']} batch={r['batch']} "
        f"max_ctx={r['max_ctx']} prompt={r['prompt_len']} chunk={r['pieces']}x{r['chunk']} "
        f"weights={r['quant']} backend={r['backend']}",
        f"KV pool: {r['kv_cache']}, {pool['tokens']:,} tokens in {pool['block_size']}-token blocks ({blocks})",
        f"{'program':<13} {'args GiB':>9} {'temp GiB':>9} {'out GiB':>9} {'alias GiB':>9} "
        f"{'total GiB':>9} {'XLA GB':>9} {'TFLOP':>8} {'compile s':>9} {'kernels':>7}   (per device)",
    ]
    for name in (p for p in PROGRAMS if p in r):
        m, c = r[name]["memory"], r[name]["cost"]
        lines.append(
            f"{name:<13} {m['argument'] / GiB:9.2f} {m['temp'] / GiB:9.2f} {m['output'] / GiB:9.2f} "
            f"{m['alias'] / GiB:9.2f} {m['total'] / GiB:9.2f} {c['bytes_accessed'] / 1e9:9.2f} "
            f"{c['flops'] / 1e12:8.3f} {r[name]['compile_s']:9.1f} {r[name]['kernel_calls']:7d}"
        )
    if r["predicted_step_ms"] is not None:
        lines.append(
            f"decode: {r['bytes_per_step'] / 1e9:.2f} GB per step per device (weights + KV cache) -> "
            f"{r['predicted_step_ms']:.2f} ms/step at {r['hbm_bandwidth'] / 1e9:.0f} GB/s "
            f"({r['predicted_tok_s']:.0f} tok/s for batch {r['batch']})"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog="python -m jaxllm.tools.tpu_compile", description=__doc__.split("\n\n")[0])
    add_flags(p, ("shape", "tp", "dp", "max_ctx", "quant", "kv_quant"))
    p.add_argument("--decode-rows", type=int, default=1, help="rows of the decode step (sequences at --max-ctx)")
    p.add_argument("--prefill-len", type=int, default=None, help="prefill length (default max_ctx/2)")
    p.add_argument("--pieces", type=int, default=4, help="pieces of the mixed prefill chunk")
    p.add_argument("--chunk", type=int, default=512, help="tokens a piece of the mixed prefill chunk")
    p.add_argument("--topology", default="v6e:2x2")
    p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated subset of " + ",".join(PROGRAMS))
    add_flags(p, ("json",))
    args = p.parse_args(argv)
    try:
        if args.shape is None:
            raise ModelError("--shape names the architecture to compile")
        settle(args, from_args(args))
        r = compile_shape(
            args.shape,
            args.tp,
            args.dp,
            args.max_ctx,
            args.decode_rows,
            args.prefill_len,
            args.topology,
            args.quant,
            programs=[x for x in args.programs.split(",") if x],
            kv_quant=args.kv_quant,
            pieces=args.pieces,
            chunk=args.chunk,
        )
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(r) if args.json else format_report(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
