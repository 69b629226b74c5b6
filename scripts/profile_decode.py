"""Where the time of one decode step goes: trace a few fused-loop steps of a shape preset with random
weights and sum the device kernels by kind (matmul, attention/softmax, fusions, copies, collectives),
next to the wall time per step, so the gaps between kernels show too. With --prefill N, the same
for the prefill of --batch prompts of N tokens (the bench's TTFT), once.

    python scripts/profile_decode.py --shape qwen3-4b --batch 1 --ctx 2048 --steps 32 --out DIR
    python scripts/profile_decode.py --shape qwen3-4b --prefill 2048 --out DIR
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxllm.benchmarks.bench import build_parser  # noqa: E402
from jaxllm.benchmarks.sweep import decode_state, load_subject  # noqa: E402
from jaxllm.engine.sampling import SamplingParams  # noqa: E402
from jaxllm.engine.slots import Pieces
from jaxllm.kv.options import KVOptions  # noqa: E402
from jaxllm.model.sharding import layout_for  # noqa: E402

KINDS = [
    ("matmul", r"gemm|cutlass|cublas|dot|matmul|xmma|sm90"),
    ("collective", r"nccl|all_reduce|all-reduce|allreduce|all_gather"),
    ("copy/dus", r"copy|memcpy|memset|dynamic.update|dynamic_update"),
    ("reduce/softmax", r"reduce|softmax"),
    ("other fusion", r"fusion|loop|input|kernel"),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, pat in KINDS:
        if re.search(pat, low):
            return kind
    return "other"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3-4b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--quant", default="int8")
    p.add_argument("--out", default="profile")
    p.add_argument("--top", type=int, default=25, help="kernels listed by total time")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the first GPU is traced)")
    p.add_argument("--kv-quant", default="none", choices=("none", "int8"))
    p.add_argument("--int8-rings", action="store_true", help="with --kv-quant int8, int8 sliding rings too")
    p.add_argument("--rebuild-keys", action="store_true", help="with --kv-quant int8, k_eq_v layers store V alone")
    p.add_argument("--hlo", help="also write the compiled step's (or prefill's) HLO text here, to look up fusions")
    p.add_argument("--prefill", type=int, default=0, help="profile a prefill of this many tokens a prompt instead")
    a = p.parse_args()
    for k, v in vars(build_parser().parse_args(["--shape", a.shape])).items():  # the bench's other defaults
        if not hasattr(a, k):
            setattr(a, k, v)
    a.layout, a.dtype, a.seed, a.model_dir = layout_for(a.tp), "bfloat16", 0, None
    a.kv_options = KVOptions(int8_rings=a.int8_rings, store_keys=not a.rebuild_keys)
    eng, _, _ = load_subject(a)
    cfg, weights = eng.cfg, eng.weights
    params = SamplingParams.make(a.batch)
    # The state is donated, as the engine does (else the loop's output cache is a second copy of
    # it), so each run gets a fresh one.

    def state():
        return jax.block_until_ready(decode_state(eng, a.batch, a.ctx, a.steps, 0, params))

    if a.prefill:  # one prefill of the whole batch, a fresh cache each time
        n = a.prefill
        tokens = np.asarray(jax.random.randint(jax.random.key(0), (a.batch, n), 0, cfg.vocab_size, jnp.int32))
        pieces = eng.put_rows(Pieces.make(tokens, 0, n, True, np.arange(a.batch)))
        plan = eng.pool_plan(a.batch, n + 1, span=n)
        fn = eng.executable("prefill", (eng.new_state(plan), pieces, None), {"out": "sample"})

        def run():
            s = jax.block_until_ready(eng.new_state(plan))
            return lambda: fn(weights, s, pieces, None)[1].block_until_ready()

        a.steps, what = 1, f"prefill of {n} tokens"
    else:
        loop = eng.executable("decode", (state(), np.int32(a.steps), None), {"max_steps": a.steps, "rows": None})

        def run():
            s = state()
            return lambda: loop(weights, s, np.int32(a.steps), None)[1].block_until_ready()

        what = f"ctx={a.ctx}"
    run()()
    unroll = eng.ops.scan_unroll(cfg.num_layers, a.batch, a.prefill or 1)  # as the step was traced
    if a.hlo:
        with open(a.hlo, "w") as f:
            f.write((fn if a.prefill else loop).as_text())
    go = run()
    t0 = time.perf_counter()
    go()
    wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
    os.makedirs(a.out, exist_ok=True)
    go = run()
    with jax.profiler.trace(a.out, create_perfetto_trace=True):
        go()
    files = glob.glob(os.path.join(a.out, "**", "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(files[0]))["traceEvents"] if files else []
    gpu_pids = {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and re.search(r"/device:GPU:0\b|GPU 0\b|/device:GPU(?!:)", str(e.get("args", {}).get("name", "")))
    }
    if not gpu_pids:  # older trace naming: every GPU stream
        gpu_pids = {
            e["pid"]
            for e in events
            if e.get("ph") == "M"
            and e.get("name") == "process_name"
            and re.search(r"/device:GPU|GPU|stream", str(e.get("args", {}).get("name", "")))
        }
    by_kind, by_name, count, n_kernels = defaultdict(float), defaultdict(float), defaultdict(int), 0
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids and "dur" in e:
            by_kind[kind_of(e["name"])] += e["dur"]
            by_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
            n_kernels += 1
    total = sum(by_kind.values()) / 1e3 / a.steps
    print(
        f"{a.shape} B={a.batch} {what} {a.quant} scan_unroll={unroll}: "
        f"wall {wall_ms:.3f} ms/step, device kernels {total:.3f} ms/step "
        f"({n_kernels / a.steps:.0f} kernels/step), gaps {wall_ms - total:.3f} ms/step"
    )
    for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {k:16s} {v / 1e3 / a.steps:8.3f} ms/step")
    print("  top kernels:")
    for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[: a.top]:
        print(
            f"    {v / 1e3 / a.steps:8.3f} ms  {count[k] / a.steps:6.1f}x/step  "
            f"{v / max(count[k], 1):7.1f} us each  {k[:70]}"
        )


if __name__ == "__main__":
    main()
