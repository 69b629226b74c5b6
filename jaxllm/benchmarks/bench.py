"""Batch-throughput sweep: the fused on-device decode loop over batch sizes at a fixed context,
measured against the device's own memory-bandwidth and matmul ceilings.

This is its command line: the flags, checked before JAX loads, the points each platform gets by
default, the table, the plot and where results go; `sweep` measures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from jaxllm.benchmarks.records import default_out, int_list, note, subject_name
from jaxllm.benchmarks.serve_bench import main as serve_main
from jaxllm.cli.common import add_sampling_args
from jaxllm.config.engine import RUNTIME, SPECULATION, Parser, add_flags, from_args, settle
from jaxllm.config.kv import KVOptions
from jaxllm.engine.request import check_sampling
from jaxllm.errors import JaxllmError, RequestError
from jaxllm.model.presets import read as read_preset
from jaxllm.weights import locate


# -- command line ---------------------------------------------------------------------------------
def build_parser() -> Parser:
    p = Parser(
        prog="python -m jaxllm.bench",
        description=__doc__.splitlines()[0],
        epilog="python -m jaxllm.bench --serve --help: the serving benchmark",
    )
    src = p.add_mutually_exclusive_group(required=True)
    add_flags(src, ("model_dir", "shape"))
    p.add_argument(
        "--batches", type=int_list, default=None, help="comma-separated batch sizes (default: 1,8,64; 1,8 on a CPU)"
    )
    p.add_argument(
        "--ctx",
        type=int,
        default=None,
        help="KV positions already filled before decoding (default: 1024; 256 on a CPU)",
    )
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed run (default: 64; 16 on a CPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs after compiling")
    p.add_argument("--repeats", type=int, default=3, help="timed runs (the median is reported)")
    p.add_argument(
        "--prompt-lens",
        type=int_list,
        default=[],
        help="prompt lengths whose TTFT to time (a forward of batch such prompts, at the smallest batch)",
    )
    p.add_argument("--ttft-every-batch", action="store_true", help="time --prompt-lens at every batch")
    p.add_argument(
        "--int8-rings", action="store_true", help="with int8 global layers, keep the sliding layers' blocks in int8 too"
    )
    p.add_argument(
        "--rebuild-keys", action="store_true", help="global layers whose V is their K store V alone and rebuild keys"
    )
    add_sampling_args(p)  # --seed draws the random weights too
    add_flags(p, ("out",))
    p.add_argument("--plot", default=None, help="PNG plot path (default: --out with .png)")
    p.add_argument("--probe-mib", type=int, default=None, help="bandwidth probe size (default: by device)")
    p.add_argument("--matmul-n", type=int, default=None, help="matmul probe size n (n x n x n)")
    add_flags(p, ("dtype", "quant", "kv_quant", "tp", "compilation_cache"), "model")
    add_flags(
        p,
        (*SPECULATION, "draft_shape", "draft_always"),
        "speculative decoding (random tokens: what free text finds to draft)",
    )
    add_flags(p, RUNTIME, "runtime")
    return p


def check_args(a) -> None:
    """The flags and the model they name, before JAX loads (the device count and the KV layout are
    checked once JAX is up, in `sweep.run`)."""
    for name in ("ctx", "steps", "repeats"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            raise RequestError(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.warmup < 0:
        raise RequestError(f"--warmup must be >= 0, got {a.warmup}")
    check_sampling(1, a.temperature, a.top_k, a.top_p)
    a.kv_options = KVOptions(int8_rings=bool(a.int8_rings), store_keys=not a.rebuild_keys)
    a.config = from_args(a, kv_options=a.kv_options)
    settle(a, a.config)
    if a.shape:
        read_preset(a.shape)
    else:
        locate(a.model_dir)


# -- reporting ------------------------------------------------------------------------------------


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
    head = (
        f"{rep['model'].get('shape') or rep['model'].get('model_dir')} ({rep['model']['quant']}, "
        f"{rep['model']['dtype']}) on {rep['device']['kind']}, ctx {rep['settings']['ctx']}; "
        f"bandwidth {c['bandwidth_GBps']:.1f} GB/s ({c['bandwidth_method']}), "
        f"bf16 matmul {c['matmul_bf16_TFLOPs']:.2f} TFLOP/s; "
        f"decode kernels: {'Pallas' if rep.get('kernels', {}).get('backend') == 'pallas' else 'XLA'}"
        + sampling_note(rep["settings"].get("sampling"))
        + speculation_note(rep["settings"])
    )
    lens = rep["settings"]["prompt_lens"]
    spec = any(p.get("speculation") for p in rep["points"])
    cols = (
        ["batch", "ms/step", "tok/s", "MB/step", "roofline ms", "HBM frac", "compute ms", "ceiling tok/s", "compile s"]
        + [f"TTFT@{n} ms" for n in lens]
        + [f"MFU@{n}" for n in lens]
        + (["accepted"] if spec else [])
    )
    rows = []
    for p in rep["points"]:
        if p["skipped"]:
            rows.append([str(p["batch"]), "skipped: " + p["skipped"]])
            continue
        rows.append(
            [
                str(p["batch"]),
                f"{p['ms_per_step']:.3f}",
                f"{p['tok_s']:.1f}",
                f"{p['bytes_per_step'] / 1e6:.1f}",
                f"{p['roofline_ms']:.3f}",
                f"{p['roofline_fraction']:.1%}",
                f"{p['compute_ms']:.3f}",
                f"{p['ceiling_tok_s']:.0f}",
                f"{p['compile_s']:.1f}",
            ]
            + [f"{p['ttft_ms'][str(n)]:.1f}" if str(n) in p["ttft_ms"] else "" for n in lens]
            + [f"{p['prefill_mfu'][str(n)]:.1%}" if str(n) in p.get("prefill_mfu", {}) else "" for n in lens]
            + ([accepted(p.get("speculation"))] if spec else [])
        )
    full = [r for r in rows if len(r) == len(cols)]
    width = [max([len(cols[i])] + [len(r[i]) for r in full]) for i in range(len(cols))]

    def fmt(r):
        return (
            "  ".join(x.rjust(w) for x, w in zip(r, width))
            if len(r) == len(cols)
            else f"{r[0].rjust(width[0])}  {r[1]}"
        )

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
    fig.suptitle(
        f"{m.get('shape') or m.get('model_dir')} {m['quant']} on {rep['device']['kind']}, ctx {rep['settings']['ctx']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main -----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--serve" in argv:  # the server under load: its own flags
        return serve_main([x for x in argv if x != "--serve"])
    a = build_parser().parse_args(argv)
    try:
        check_args(a)
        a.out = a.out or str(default_out(a))
        note(f"{subject_name(a)}: loading JAX")
        from jaxllm.benchmarks import sweep

        rep = sweep.run(a)
    except JaxllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rep, indent=2))
    plot_path = a.plot or str(Path(a.out).with_suffix(".png"))
    wrote = [a.out] + ([plot_path] if plot(rep, plot_path) else [])
    print(table(rep), flush=True)
    print(f"wrote {' and '.join(wrote)}", file=sys.stderr)
    return 0
