"""The bench's measurement (`python -m jaxllm.bench`; its flags, defaults and tables: `bench`): the
model on the device, then each point's decode loop and prefill, timed against the device's own
memory-bandwidth and matmul ceilings.

Each point times the core's decode loop (EOS disabled, so every row runs every step) from a state
whose KV cache is already filled to --ctx, so each step attends over ctx positions. Compile time
is measured apart; the reported step time is the median of --repeats runs.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import ops
from jaxllm.benchmarks import ceilings as ceil
from jaxllm.benchmarks.records import git_commit, note, size_for
from jaxllm.benchmarks.roofline import nbytes, prefill_flops, step_cost
from jaxllm.config.runtime import env
from jaxllm.engine.build import build_engine
from jaxllm.engine.engine import DTYPES
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.slots import Pieces, Slots, State
from jaxllm.engine.speculative import SpecSlots
from jaxllm.errors import RequestError
from jaxllm.kv.options import choose_layout
from jaxllm.kv.paged import PagedCache, static_tables
from jaxllm.model.families import family_for
from jaxllm.model.sharding import layout_for
from jaxllm.weights.random import random_like


@dataclass
class Point:
    batch: int
    ctx: int
    steps: int
    ms_per_step: float | None = None
    tok_s: float | None = None
    compile_s: float | None = None
    step_ms_runs: list = field(default_factory=list)
    weight_bytes_per_step: int = 0
    kv_bytes_per_step: int = 0
    bytes_per_step: int = 0
    roofline_ms: float = 0.0
    roofline_fraction: float | None = None
    flops_per_step: int = 0
    compute_ms: float = 0.0
    ceiling_tok_s: float = 0.0
    ttft_ms: dict = field(default_factory=dict)  # prompt length -> ms (batch rows at once)
    ttft_compile_s: dict = field(default_factory=dict)
    prefill_flops: dict = field(default_factory=dict)  # prompt length -> FLOPs of that prefill
    prefill_mfu: dict = field(default_factory=dict)  # prompt length -> of the measured matmul rate
    speculation: dict | None = None  # verify cycles, drafted, accepted (last run)
    skipped: str | None = None


# -- model ----------------------------------------------------------------------------------------
def load_subject(a):
    """-> (engine, family, description) from --shape (random weights, on device) or --model-dir; the
    engine's KV policy is the run's (--kv-quant, --int8-rings, --rebuild-keys) for ctx + steps."""

    length = a.ctx + a.steps
    eng = build_engine(a.config.replace(max_ctx=length, tp=a.tp))
    subject = {"shape": a.shape} if a.shape else {"model_dir": str(a.model_dir)}
    cfg = eng.cfg
    if a.rebuild_keys and not any(cfg.attn[k].k_eq_v and cfg.attn[k].window is None for k in cfg.kinds_used):
        raise RequestError(
            "--rebuild-keys applies to global layers whose V is their K (Gemma 4's k_eq_v); this model has none"
        )
    return eng, family_for({"model_type": eng.cfg.family}), subject


def device_memory(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


# -- timing ---------------------------------------------------------------------------------------
def median_ms(times: list[float]) -> float:
    return float(np.median(times)) * 1e3


def decode_state(eng, batch: int, ctx: int, steps: int, seed: int, params: SamplingParams) -> State:
    """The core's state as if every slot had just prefilled a prompt of ctx tokens: random KV in
    every block (each row its own, in order), every slot live for `steps` tokens with EOS ignored."""
    plan = eng.pool_plan(batch, ctx + steps)
    shapes = eng.state_shapes(plan)
    pools = random_like(shapes.cache.pools, seed, jax.tree_util.tree_map(lambda s: s.sharding, shapes.cache.pools))
    cache = PagedCache(pools, {n: eng.put_rows(t) for n, t in static_tables(plan.widths, batch).items()})
    last = np.asarray(jax.random.randint(jax.random.key(seed), (batch,), 0, eng.cfg.vocab_size, jnp.int32))
    full = np.full((batch,), 1, np.int32)
    spec = None
    if eng.spec is not None:  # random tokens: n-gram lookup finds what free text would
        history = np.asarray(
            jax.random.randint(jax.random.key(seed + 1), (batch, ctx + steps), 0, eng.cfg.vocab_size, jnp.int32)
        )
        spec = jax.tree_util.tree_map(np.asarray, SpecSlots.empty(batch, ctx + steps)).replace(history=history)
    slots = Slots(
        last=last,
        pos=full * ctx,
        step=full,
        remaining=full * steps,
        active=np.ones(batch, bool),
        ignore_eos=np.ones(batch, bool),
        params=jax.tree_util.tree_map(np.asarray, params),
        spec=spec,
    )
    draft = None
    if shapes.draft_cache is not None:
        draft = random_like(
            shapes.draft_cache, seed + 2, jax.tree_util.tree_map(lambda s: s.sharding, shapes.draft_cache)
        )
    return State(cache, eng.put_rows(slots), draft)


def time_decode(eng, batch, a) -> tuple[float, list[float]]:
    """(compile seconds, per-run seconds) of `steps` decode steps of the core's loop from a cache
    filled to ctx."""
    params = SamplingParams.make(batch, a.temperature, a.top_k, a.top_p, a.seed)
    state = jax.block_until_ready(decode_state(eng, batch, a.ctx, a.steps, a.seed, params))
    steps = eng.layout.put(np.int32(a.steps))
    size = a.steps if eng.spec is None else eng.core_out_size(a.steps)
    t0 = time.perf_counter()
    loop = eng.executable("decode", (state, steps, None), {"max_steps": size, "rows": None})
    compile_s = time.perf_counter() - t0
    runs, spec = [], None
    for i in range(a.warmup + a.repeats):
        if i:
            state = jax.block_until_ready(decode_state(eng, batch, a.ctx, a.steps, a.seed + i, params))
        t0 = time.perf_counter()
        out = loop(eng.call_weights, state, steps, None)
        out[1].block_until_ready()
        if i >= a.warmup:
            runs.append(time.perf_counter() - t0)
        if out[0].slots.spec is not None:  # cycles, drafted, accepted, summed over the rows
            spec = dict(zip(("cycles", "drafted", "accepted"), np.asarray(out[0].slots.spec.stats).sum(0).tolist()))
        del out, state  # freed after the clock stops, as a fresh state is made
    return compile_s, runs, spec


def time_prefill(eng, batch, prompt_len, a) -> tuple[float, float]:
    """(compile seconds, median seconds) from a batch of prompt_len-token prompts, in one forward of
    the core's prefill, to their first tokens."""
    tokens = np.asarray(
        jax.random.randint(jax.random.key(a.seed), (batch, prompt_len), 0, eng.cfg.vocab_size, jnp.int32)
    )
    pieces = eng.put_rows(Pieces.make(tokens, 0, prompt_len, True, np.arange(batch)))

    plan = eng.pool_plan(batch, prompt_len + 1, span=prompt_len)

    def fresh():
        return jax.block_until_ready(eng.new_state(plan))

    t0 = time.perf_counter()
    fn = eng.executable("prefill", (fresh(), pieces, None), {"out": "sample"})
    compile_s = time.perf_counter() - t0
    runs = []
    for i in range(a.warmup + a.repeats):
        state = fresh()
        t0 = time.perf_counter()
        state, first = fn(eng.weights, state, pieces, None)
        first.block_until_ready()
        if i >= a.warmup:
            runs.append(time.perf_counter() - t0)
        del state
    return compile_s, float(np.median(runs))


def kv_itemsizes(cfg, a, dtype) -> dict:
    """Bytes per cached K/V element of each layer kind under the run's KV format (int8 scales are
    not counted): int8 global layers, and sliding ones too with --int8-rings."""
    layout = choose_layout(a.kv_quant, a.ctx + a.steps, a.kv_options)
    full = jnp.dtype(dtype).itemsize
    return {
        kind: 1 if (layout.int8_sliding if cfg.attn[kind].window is not None else layout.int8) else full
        for kind in cfg.kinds_used
    }


def run_point(eng, fam, batch, a, ceilings, mem_limit) -> Point:
    cfg, weights, dtype = eng.cfg, eng.weights, DTYPES[a.dtype]
    shared = a.rebuild_keys
    cost = step_cost(cfg, weights, fam.abstract(cfg), batch, a.ctx, kv_itemsizes(cfg, a, dtype), shared)
    p = Point(
        batch,
        a.ctx,
        a.steps,
        weight_bytes_per_step=cost.weight_bytes,
        kv_bytes_per_step=cost.kv_bytes,
        bytes_per_step=cost.bytes,
        flops_per_step=cost.flops,
    )
    # tensor parallelism splits the bytes and FLOPs of a step over tp devices, each measured alike
    p.roofline_ms = cost.bytes / (ceilings.bandwidth * a.tp) * 1e3
    p.compute_ms = cost.flops / (ceilings.matmul_flops * a.tp) * 1e3
    p.ceiling_tok_s = batch / max(p.roofline_ms, p.compute_ms) * 1e3
    cache_bytes = eng.kv_plan(batch, a.ctx + a.steps).device_bytes
    if mem_limit and nbytes(weights) // a.tp + cache_bytes > 0.9 * mem_limit:
        p.skipped = f"KV cache of {cache_bytes / 2**30:.1f} GiB does not fit next to the weights"
        return p
    try:
        p.compile_s, runs, p.speculation = time_decode(eng, batch, a)
        p.step_ms_runs = [r / a.steps * 1e3 for r in runs]
        p.ms_per_step = median_ms(runs) / a.steps
        p.tok_s = batch / p.ms_per_step * 1e3
        p.roofline_fraction = p.roofline_ms / p.ms_per_step
        for n in a.prompt_lens if a.ttft_every_batch or batch == min(a.batches) else []:
            c, t = time_prefill(eng, batch, n, a)
            p.ttft_compile_s[str(n)], p.ttft_ms[str(n)] = c, t * 1e3
            p.prefill_flops[str(n)] = prefill_flops(cfg, fam.abstract(cfg), batch, n)
            p.prefill_mfu[str(n)] = p.prefill_flops[str(n)] / t / (ceilings.matmul_flops * a.tp)
    except Exception as e:  # out of device memory and the like: note, go on
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        p.skipped = "out of device memory: " + str(e).splitlines()[0][:160]
    return p


# -- reporting ------------------------------------------------------------------------------------
def report(a, eng, subject, ceilings, points) -> dict:
    cfg, weights = eng.cfg, eng.weights
    d = jax.devices()[0]
    return {
        "device": {
            "kind": d.device_kind,
            "platform": d.platform,
            "count": jax.device_count(),
            "memory_bytes": device_memory(d),
        },
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "model": {
            **subject,
            "family": cfg.family,
            "quant": a.quant,
            "dtype": a.dtype,
            "num_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "weight_bytes": nbytes(weights),
        },
        "settings": {
            "ctx": a.ctx,
            "steps": a.steps,
            "warmup": a.warmup,
            "repeats": a.repeats,
            "tp": a.tp,
            "batches": a.batches,
            "prompt_lens": a.prompt_lens,
            "kv_quant": a.kv_quant,
            "int8_rings": a.int8_rings,
            "rebuild_keys": a.rebuild_keys,
            "scan_unroll": eng.runtime.scan_unroll or "auto",
            "compiler_options": eng.ops.compiler_options(),
            "speculative": a.speculative,
            "num_speculative_tokens": a.num_speculative_tokens,
            "draft_shape": a.draft_shape,
            "draft_model_dir": a.draft_model_dir,
            "draft_always": a.draft_always,
            "speculative_max_batch": a.speculative_max_batch,
            "xla_flags": env("XLA_FLAGS", ""),
            "sampling": {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p},
        },
        "ceilings": ceilings.to_json(),
        "kernels": {"mode": eng.runtime.kernels, "backend": eng.ops.name, "selections": ops.selections()},
        "points": [asdict(p) for p in points],
    }


# -- the sweep ------------------------------------------------------------------------------------
def run(a) -> dict:
    """The sweep the checked flags ask for (`bench.check_args`), its progress on stderr as it
    goes; -> the report."""
    if a.tp is not None and a.tp > len(jax.devices()):
        raise RequestError(f"--tp {a.tp}: there are {len(jax.devices())} devices")
    a.layout = layout_for(a.tp)
    a.tp = a.layout.tp
    size_for(a, a.layout.platform)
    if a.int8_rings and not choose_layout(a.kv_quant, a.ctx + a.steps, a.kv_options).int8:
        raise RequestError("--int8-rings needs int8 global layers: add --kv-quant int8")
    note(
        f"on {jax.devices()[0].device_kind}: batches {','.join(map(str, a.batches))} at ctx {a.ctx}, "
        f"{a.steps} decode steps a run, {a.warmup} untimed and {a.repeats} timed runs a point"
    )
    t0 = time.perf_counter()
    eng, fam, subject = load_subject(a)
    note(f"model ready ({a.quant} weights, {a.dtype}) in {time.perf_counter() - t0:.1f} s")
    device = jax.devices()[0]
    note("measuring the device's bandwidth and matmul rate")
    ceilings = ceil.measure(a.probe_mib << 20 if a.probe_mib else None, a.matmul_n, device)
    mem = device_memory(device)
    points = []
    for batch in a.batches:
        note(f"batch {batch}: compiling and timing")
        p = run_point(eng, fam, batch, a, ceilings, mem)
        done = f"{p.ms_per_step:.2f} ms/step, {p.tok_s:.1f} tok/s (compiled in {p.compile_s:.1f} s)"
        note(f"batch {batch}: " + (f"skipped, {p.skipped}" if p.skipped else done))
        points.append(p)
    return report(a, eng, subject, ceilings, points)
