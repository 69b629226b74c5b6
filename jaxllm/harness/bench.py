"""Batch-throughput sweep: the fused on-device decode loop over batch sizes at a fixed context,
measured against the device's own memory-bandwidth and matmul ceilings.

Each point times `generate.decode_loop` (EOS disabled, so every row runs every step) from a state
whose KV cache is already filled to --ctx, so each step attends over ctx positions. Compile time
is measured apart; the reported step time is the median of --repeats runs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import ops
from jaxllm.config.runtime import env
from jaxllm.engine.engine import DTYPES, check_sampling
from jaxllm.engine.sampling import SamplingParams
from jaxllm.engine.sharding import layout_for
from jaxllm.engine.slots import Pieces, Slots, State
from jaxllm.engine.speculative import SpecSlots
from jaxllm.errors import JaxllmError, RequestError
from jaxllm.harness import ceilings as ceil
from jaxllm.harness.roofline import nbytes, prefill_flops, step_cost
from jaxllm.harness.synthetic import random_engine
from jaxllm.kv.options import KVOptions, choose_layout
from jaxllm.kv.paged import PagedCache, static_tables
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
    ttft_ms: dict = field(default_factory=dict)          # prompt length -> ms (batch rows at once)
    ttft_compile_s: dict = field(default_factory=dict)
    prefill_flops: dict = field(default_factory=dict)    # prompt length -> FLOPs of that prefill
    prefill_mfu: dict = field(default_factory=dict)      # prompt length -> of the measured matmul rate
    speculation: dict | None = None                      # verify cycles, drafted, accepted (last run)
    skipped: str | None = None


# -- command line ---------------------------------------------------------------------------------
def int_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"values must be positive, got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxllm.bench", description=__doc__.splitlines()[0],
                                epilog="python -m jaxllm.bench --serve --help: the serving benchmark")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-dir", help="HF model directory or .gguf file (real weights)")
    src.add_argument("--shape", help="preset architecture name (random weights) or a config.json path")
    p.add_argument("--batches", type=int_list, default=[1, 8, 64], help="comma-separated batch sizes")
    p.add_argument("--ctx", type=int, default=1024, help="KV positions already filled before decoding")
    p.add_argument("--steps", type=int, default=64, help="decode steps per timed run")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
    p.add_argument("--prompt-lens", type=int_list, default=[],
                   help="prompt lengths whose TTFT to time (a forward of batch such prompts, at the smallest batch)")
    p.add_argument("--ttft-every-batch", action="store_true", help="time --prompt-lens at every batch")
    p.add_argument("--quant", choices=("int8", "none"), default="int8")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices on the model axis)")
    p.add_argument("--kv-quant", choices=("auto", "int8", "none"), default="auto",
                   help="KV-cache format, as in jaxllm.infer (auto: int8 global layers above 32K)")
    p.add_argument("--int8-rings", action="store_true",
                   help="with int8 global layers, keep the sliding layers' blocks in int8 too")
    p.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="speculative decoding in the loop (random tokens: what free text finds to draft)")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--draft-shape", default=None,
                   help="the draft model's shape (random weights), for --speculative draft")
    p.add_argument("--draft-model-dir", default=None, help="or a real draft model, for --speculative draft")
    from jaxllm.harness.cli import add_max_batch_arg
    add_max_batch_arg(p)
    p.add_argument("--draft-always", action="store_true",
                   help="rows draft every cycle however little they accept (the cost of a cycle); "
                        "by default rows whose drafts fail stop drafting, as in serving")
    p.add_argument("--rebuild-keys", action="store_true",
                   help="global layers whose V is their K store V alone and rebuild keys")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="decode sampling: 0 is greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--out", default="bench-results/bench.json", help="JSON results path (its folder is made)")
    p.add_argument("--plot", default=None, help="PNG plot path (default: --out with .png)")
    p.add_argument("--probe-mib", type=int, default=None, help="bandwidth probe size (default: by device)")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul probe size n (n x n x n)")
    from jaxllm.engine.compilation_cache import add_flag
    from jaxllm.harness.cli import add_runtime_args
    add_flag(p)
    add_runtime_args(p)
    return p


def check_args(a) -> None:
    if a.tp < 1 or a.tp > len(jax.devices()):
        raise RequestError(f"--tp {a.tp}: there are {len(jax.devices())} devices")
    for name in ("ctx", "steps", "repeats"):
        if getattr(a, name) < 1:
            raise RequestError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        raise RequestError(f"--warmup must be >= 0, got {a.warmup}")
    check_sampling(1, a.temperature, a.top_k, a.top_p)
    from jaxllm.engine.speculative import check_args as check_speculative
    if a.draft_shape and a.draft_model_dir:
        raise RequestError("a draft model is --draft-shape or --draft-model-dir, not both")
    check_speculative(a.speculative, a.num_speculative_tokens, a.draft_shape or a.draft_model_dir)
    if a.draft_always and not (a.speculative and a.shape):
        raise RequestError("--draft-always measures a cycle of --speculative on a random --shape")
    a.kv_options = KVOptions(int8_rings=a.int8_rings, store_keys=not a.rebuild_keys)
    layout = choose_layout(a.kv_quant, a.ctx + a.steps, a.kv_options)
    if a.int8_rings and not layout.int8:
        raise RequestError("--int8-rings needs int8 global layers: add --kv-quant int8")


# -- model ----------------------------------------------------------------------------------------
def load_subject(a):
    """-> (engine, family, description) from --shape (random weights, on device) or --model-dir; the
    engine's KV policy is the run's (--kv-quant, --int8-rings, --rebuild-keys) for ctx + steps."""
    from jaxllm.harness.cli import runtime_from
    from jaxllm.model.families import family_for
    length = a.ctx + a.steps
    if a.shape:
        eng = random_engine(a.shape, dtype=a.dtype, quant=a.quant, max_ctx=length, layout=a.layout,
                            kv_quant=a.kv_quant, kv_options=a.kv_options, seed=a.seed, speculative=a.speculative,
                            num_speculative_tokens=a.num_speculative_tokens, draft_shape=a.draft_shape,
                            draft_model_dir=a.draft_model_dir, draft_always=a.draft_always,
                            speculative_max_batch=a.speculative_max_batch, runtime=runtime_from(a))
        subject = {"shape": a.shape}
    else:
        import jaxllm
        eng = jaxllm.load(a.model_dir, quant=a.quant, dtype=a.dtype, max_ctx=length, tp=a.tp, kv_quant=a.kv_quant,
                          kv_options=a.kv_options, speculative=a.speculative,
                          num_speculative_tokens=a.num_speculative_tokens, draft_model_dir=a.draft_model_dir,
                          speculative_max_batch=a.speculative_max_batch, runtime=runtime_from(a))
        subject = {"model_dir": str(a.model_dir)}
    cfg = eng.cfg
    if a.rebuild_keys and not any(cfg.attn[k].k_eq_v and cfg.attn[k].window is None for k in cfg.kinds_used):
        raise RequestError("--rebuild-keys applies to global layers whose V is their K (Gemma 4's k_eq_v); "
                           "this model has none")
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
    if eng.spec is not None:         # random tokens: n-gram lookup finds what free text would
        history = np.asarray(jax.random.randint(jax.random.key(seed + 1), (batch, ctx + steps), 0,
                                                eng.cfg.vocab_size, jnp.int32))
        spec = jax.tree_util.tree_map(np.asarray, SpecSlots.empty(batch, ctx + steps)).replace(history=history)
    slots = Slots(last=last, pos=full * ctx, step=full, remaining=full * steps,
                       active=np.ones(batch, bool), ignore_eos=np.ones(batch, bool),
                       params=jax.tree_util.tree_map(np.asarray, params), spec=spec)
    draft = None
    if shapes.draft_cache is not None:
        draft = random_like(shapes.draft_cache, seed + 2,
                            jax.tree_util.tree_map(lambda s: s.sharding, shapes.draft_cache))
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
        if out[0].slots.spec is not None:       # cycles, drafted, accepted, summed over the rows
            spec = dict(zip(("cycles", "drafted", "accepted"), np.asarray(out[0].slots.spec.stats).sum(0).tolist()))
        del out, state                 # freed after the clock stops, as a fresh state is made
    return compile_s, runs, spec


def time_prefill(eng, batch, prompt_len, a) -> tuple[float, float]:
    """(compile seconds, median seconds) from a batch of prompt_len-token prompts, in one forward of
    the core's prefill, to their first tokens."""
    tokens = np.asarray(jax.random.randint(jax.random.key(a.seed), (batch, prompt_len), 0, eng.cfg.vocab_size,
                                           jnp.int32))
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
    return {kind: 1 if (layout.int8_sliding if cfg.attn[kind].window is not None else layout.int8) else full
            for kind in cfg.kinds_used}


def run_point(eng, fam, batch, a, ceilings, mem_limit) -> Point:
    cfg, weights, dtype = eng.cfg, eng.weights, DTYPES[a.dtype]
    shared = a.rebuild_keys
    cost = step_cost(cfg, weights, fam.abstract(cfg), batch, a.ctx, kv_itemsizes(cfg, a, dtype), shared)
    p = Point(batch, a.ctx, a.steps, weight_bytes_per_step=cost.weight_bytes, kv_bytes_per_step=cost.kv_bytes,
              bytes_per_step=cost.bytes, flops_per_step=cost.flops)
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
        for n in (a.prompt_lens if a.ttft_every_batch or batch == min(a.batches) else []):
            c, t = time_prefill(eng, batch, n, a)
            p.ttft_compile_s[str(n)], p.ttft_ms[str(n)] = c, t * 1e3
            p.prefill_flops[str(n)] = prefill_flops(cfg, fam.abstract(cfg), batch, n)
            p.prefill_mfu[str(n)] = p.prefill_flops[str(n)] / t / (ceilings.matmul_flops * a.tp)
    except Exception as e:                            # out of device memory and the like: note, go on
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        p.skipped = "out of device memory: " + str(e).splitlines()[0][:160]
    return p


# -- reporting ------------------------------------------------------------------------------------
def git_commit() -> str:
    if env("JAXLLM_COMMIT"):           # a copy of the tree without its .git
        return env("JAXLLM_COMMIT")
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def report(a, eng, subject, ceilings, points) -> dict:
    cfg, weights = eng.cfg, eng.weights
    d = jax.devices()[0]
    return {
        "device": {"kind": d.device_kind, "platform": d.platform, "count": jax.device_count(),
                   "memory_bytes": device_memory(d)},
        "jax_version": jax.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "model": {**subject, "family": cfg.family, "quant": a.quant, "dtype": a.dtype,
                  "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                  "weight_bytes": nbytes(weights)},
        "settings": {"ctx": a.ctx, "steps": a.steps, "warmup": a.warmup, "repeats": a.repeats, "tp": a.tp,
                     "batches": a.batches, "prompt_lens": a.prompt_lens, "kv_quant": a.kv_quant,
                     "int8_rings": a.int8_rings, "rebuild_keys": a.rebuild_keys,
                     "scan_unroll": eng.runtime.scan_unroll or "auto",
                     "compiler_options": eng.ops.compiler_options(),
                     "speculative": a.speculative, "num_speculative_tokens": a.num_speculative_tokens,
                     "draft_shape": a.draft_shape, "draft_model_dir": a.draft_model_dir,
                     "draft_always": a.draft_always, "speculative_max_batch": a.speculative_max_batch,
                     "xla_flags": env("XLA_FLAGS", ""),
                     "sampling": {"temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p}},
        "ceilings": ceilings.to_json(),
        "kernels": {"mode": eng.runtime.kernels, "backend": eng.ops.name, "selections": ops.selections()},
        "points": [asdict(p) for p in points],
    }


def speculation_note(s) -> str:
    if not s.get("speculative"):
        return ""
    source = s.get("draft_shape") or s.get("draft_model_dir")
    draft = f" from {source}" if source else ""
    return f"; speculative {s['speculative']}{draft}, {s['num_speculative_tokens']} tokens a cycle"


def sampling_note(s) -> str:
    if not s or not s["temperature"]:
        return "; greedy"
    cut = "".join(f", {k} {s[k]}" for k in ("top_k", "top_p") if s[k] is not None)
    return f"; sampled at temperature {s['temperature']}{cut}"


def table(rep: dict) -> str:
    c = rep["ceilings"]
    head = (f"{rep['model'].get('shape') or rep['model'].get('model_dir')} ({rep['model']['quant']}, "
            f"{rep['model']['dtype']}) on {rep['device']['kind']}, ctx {rep['settings']['ctx']}; "
            f"bandwidth {c['bandwidth_GBps']:.1f} GB/s ({c['bandwidth_method']}), "
            f"bf16 matmul {c['matmul_bf16_TFLOPs']:.2f} TFLOP/s; "
            f"decode kernels: {'Pallas' if rep.get('kernels', {}).get('backend') == 'pallas' else 'XLA'}"
            + sampling_note(rep["settings"].get("sampling")) + speculation_note(rep["settings"]))
    lens = rep["settings"]["prompt_lens"]
    spec = any(p.get("speculation") for p in rep["points"])
    cols = ["batch", "ms/step", "tok/s", "MB/step", "roofline ms", "HBM frac", "compute ms", "ceiling tok/s",
            "compile s"] + [f"TTFT@{n} ms" for n in lens] + [f"MFU@{n}" for n in lens] + (["accepted"] if spec else [])
    rows = []
    for p in rep["points"]:
        if p["skipped"]:
            rows.append([str(p["batch"]), "skipped: " + p["skipped"]])
            continue
        rows.append([str(p["batch"]), f"{p['ms_per_step']:.3f}", f"{p['tok_s']:.1f}",
                     f"{p['bytes_per_step'] / 1e6:.1f}",
                     f"{p['roofline_ms']:.3f}", f"{p['roofline_fraction']:.1%}", f"{p['compute_ms']:.3f}",
                     f"{p['ceiling_tok_s']:.0f}", f"{p['compile_s']:.1f}"]
                    + [f"{p['ttft_ms'][str(n)]:.1f}" if str(n) in p['ttft_ms'] else "" for n in lens]
                    + [f"{p['prefill_mfu'][str(n)]:.1%}" if str(n) in p.get('prefill_mfu', {}) else ""
                       for n in lens]
                    + ([accepted(p.get("speculation"))] if spec else []))
    full = [r for r in rows if len(r) == len(cols)]
    width = [max([len(cols[i])] + [len(r[i]) for r in full]) for i in range(len(cols))]
    def fmt(r):
        return "  ".join(x.rjust(w) for x, w in zip(r, width)) if len(r) == len(cols) else \
            f"{r[0].rjust(width[0])}  {r[1]}"
    return "\n".join([head, fmt(cols), *map(fmt, rows)])


def accepted(s) -> str:
    """Drafts accepted, and tokens a verify cycle."""
    if not s or not s["drafted"]:
        return "no drafts"
    return f"{s['accepted'] / s['drafted']:.0%}, {(s['accepted'] + s['cycles']) / s['cycles']:.2f}/cycle"


def plot(rep: dict, path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [p for p in rep["points"] if not p["skipped"]]
    if not pts:
        print("no point was measured: no plot written", file=sys.stderr)
        return False
    b = [p["batch"] for p in pts]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.plot(b, [p["tok_s"] for p in pts], "o-", label="measured")
    ax1.plot(b, [p["ceiling_tok_s"] for p in pts], "--", label="roofline ceiling")
    ax1.set(xscale="log", yscale="log", xlabel="batch", ylabel="decode tok/s", title="throughput")
    for ax in (ax1, ax2):
        ax.set_xticks(b, [str(x) for x in b])
        ax.minorticks_off()
    ax1.legend()
    ax2.plot(b, [100 * p["roofline_fraction"] for p in pts], "o-")
    ax2.set(xscale="log", xlabel="batch", ylabel="% of HBM roofline", title="bytes/step over measured bandwidth")
    ax2.set_ylim(bottom=0)
    m = rep["model"]
    fig.suptitle(f"{m.get('shape') or m.get('model_dir')} {m['quant']} on {rep['device']['kind']}, "
                 f"ctx {rep['settings']['ctx']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--serve" in argv:                  # the server under load: its own flags
        from jaxllm.harness.serve_bench import main as serve_main
        return serve_main([x for x in argv if x != "--serve"])
    a = build_parser().parse_args(argv)
    from jaxllm.engine.compilation_cache import enable
    a.cache = enable(a.compilation_cache)
    try:
        check_args(a)
        return sweep(a)
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def progress(items):
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="bench", unit="point", file=sys.stderr)


def sweep(a) -> int:
    a.layout = layout_for(a.tp)
    eng, fam, subject = load_subject(a)
    from jaxllm.engine.compilation_cache import executables_folder
    eng.steps_cache = executables_folder(getattr(a, "cache", None))
    device = jax.devices()[0]
    ceilings = ceil.measure(a.probe_mib << 20 if a.probe_mib else None, a.matmul_n, device)
    mem = device_memory(device)
    points = []
    for batch in progress(a.batches):
        points.append(run_point(eng, fam, batch, a, ceilings, mem))
    rep = report(a, eng, subject, ceilings, points)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rep, indent=2))
    plot_path = a.plot or str(Path(a.out).with_suffix(".png"))
    wrote = [a.out] + ([plot_path] if plot(rep, plot_path) else [])
    print(f"wrote {' and '.join(wrote)}", file=sys.stderr)
    print(table(rep), flush=True)
    return 0
