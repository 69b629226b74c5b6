"""What every command-line front end shares: one-line errors, load progress, model flags."""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from contextlib import contextmanager

from jaxllm.config.runtime import env
from jaxllm.errors import JaxllmError


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model-dir", default=None,
                   help="HF model directory, .gguf file or hub id (default: the embedded Gemma 3 270M)")
    p.add_argument("--max-ctx", type=positive_int, default=None,
                   help="KV-cache length (default: the model's maximum, capped at 8192)")
    p.add_argument("--quant", choices=("int8", "none"), default="int8", help="weight format on device")
    p.add_argument("--kv-quant", choices=("auto", "int8", "none"), default="auto",
                   help="KV-cache format: auto = compute dtype up to 32K, int8 above")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree (default: all local devices)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="activation/compute dtype")
    from jaxllm.engine.compilation_cache import add_flag
    from jaxllm.harness import distributed
    distributed.add_args(p)
    add_flag(p)
    add_runtime_args(p)
    add_speculative_args(p)


def add_runtime_args(p: argparse.ArgumentParser):
    """The runtime's choices (`RuntimeConfig`); unset, each falls back to its environment variable."""
    g = p.add_argument_group("runtime")
    g.add_argument("--kernels", choices=("auto", "xla", "pallas"), default=None,
                   help="the Pallas kernels on GPUs (auto), nowhere (xla), or everywhere (pallas; "
                        "interpreted on a CPU) (default: $JAXLLM_KERNELS, else auto)")
    g.add_argument("--layer-scan", choices=("auto", "cond", "period"), default=None,
                   help="how the layer scan reaches sliding and global layers (default: $JAXLLM_LAYER_SCAN, else auto)")


def runtime_from(args):
    """The `RuntimeConfig` the flags and the environment name (the flags win)."""
    from jaxllm.config.runtime import RuntimeConfig
    given = {"kernels": getattr(args, "kernels", None), "layer_scan": getattr(args, "layer_scan", None)}
    return RuntimeConfig.from_env(**{k: v for k, v in given.items() if v is not None})


def add_speculative_args(p: argparse.ArgumentParser):
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative", choices=("ngram", "draft"), default=None,
                   help="draft tokens by n-gram lookup in the sequence itself, or with --draft-model-dir")
    g.add_argument("--num-speculative-tokens", type=positive_int, default=4, help="tokens drafted a cycle")
    g.add_argument("--draft-model-dir", default=None, help="a smaller model sharing the tokenizer")
    add_max_batch_arg(g)


def add_max_batch_arg(g):
    g.add_argument("--speculative-max-batch", type=max_batch, default=4,
                   help="speculate while at most this many rows decode, else decode plainly ('none': any)")


def max_batch(s: str):
    return None if s == "none" else positive_int(s)


def load_engine(args, quiet: bool = False):
    """The engine the flags ask for; `args.load_s` gets the seconds loading took. On a terminal a
    line shows the load's progress, then each compile's."""
    import time

    import jaxllm
    from jaxllm.harness import distributed
    t0 = time.perf_counter()
    if distributed.init_from_args(args) and not distributed.is_main_process():
        sys.stdout = open(os.devnull, "w")     # every process computes; process 0 prints
        quiet = True
    bar = None
    if not quiet and sys.stderr.isatty() or env("JAXLLM_PROGRESS") == "1":
        from tqdm import tqdm
        bar = tqdm(total=0, desc="loading", unit="tensor", file=sys.stderr, leave=False)

    def progress(n, total):
        if bar is not None:
            bar.total = total
            bar.update(n - bar.n)

    caught = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng = jaxllm.load(args.model_dir, max_ctx=args.max_ctx, quant=args.quant, kv_quant=args.kv_quant,
                              tp=args.tp, dtype=args.dtype, progress=progress,
                              speculative=getattr(args, "speculative", None),
                              num_speculative_tokens=getattr(args, "num_speculative_tokens", 4),
                              draft_model_dir=getattr(args, "draft_model_dir", None),
                              speculative_max_batch=getattr(args, "speculative_max_batch", 4),
                              runtime=runtime_from(args), compilation_cache=args.compilation_cache)
    finally:
        if bar is not None:
            bar.close()
        for w in caught:
            sys.stderr.write(f"warning: {w.message}\n")
    args.load_s = time.perf_counter() - t0
    # on stderr, so --json output stays clean; always shown when the int8 long-context layout is used
    if eng.kv_layout.int8 or (not quiet and sys.stderr.isatty()):
        from jaxllm.kv.plan import report
        report(eng.kv_plan(1))
    if not quiet and sys.stderr.isatty():
        eng.on_compile = compile_ticker
    return eng


def compile_ticker(n: int):
    """A line on stderr that counts the seconds while `n` calls compile (the first run of a shape
    can take a while; later runs read JAX's compilation cache); -> the function that clears it."""
    import threading
    import time
    stop, t0 = threading.Event(), time.perf_counter()

    def tick():
        while not stop.wait(0.25):
            sys.stderr.write(f"\rcompiling {n} step{'s' if n > 1 else ''}... {time.perf_counter() - t0:.0f} s")
            sys.stderr.flush()
    thread = threading.Thread(target=tick, daemon=True)
    thread.start()

    def done():
        stop.set()
        thread.join()
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
    return done


@contextmanager
def one_line_errors(prog: str):
    """User errors exit 1 with their message; anything unexpected still gets one line (set
    JAXLLM_DEBUG=1 for the traceback)."""
    try:
        yield
    except JaxllmError as e:
        sys.stderr.write(f"{prog}: error: {e}\n")
        raise SystemExit(1)
    except KeyboardInterrupt:
        raise SystemExit(130)
    except Exception as e:
        if env("JAXLLM_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        sys.stderr.write(f"{prog}: internal error: {type(e).__name__}: {msg} (JAXLLM_DEBUG=1 shows the traceback)\n")
        raise SystemExit(70)
