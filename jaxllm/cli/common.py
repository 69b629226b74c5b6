"""What every command-line front end shares: one-line errors, load progress, the engine's flags."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from contextlib import contextmanager

from tqdm import tqdm

import jaxllm
from jaxllm.cli import distributed
from jaxllm.config.engine import MODEL, RUNTIME, SPECULATION, add_flags, from_args, settle
from jaxllm.config.runtime import env
from jaxllm.errors import JaxllmError, warnings_as_lines

ENGINE = (*MODEL, "compilation_cache")  # the engine flags every command line that loads a model takes


def add_engine_args(p: argparse.ArgumentParser, speculation: bool = True) -> None:
    """The model, runtime and (optionally) speculation flags (`config.engine.FLAGS`) and the multi-host ones."""

    add_flags(p, ENGINE, "model")
    if speculation:
        add_flags(p, SPECULATION, "speculative decoding")
    add_flags(p, RUNTIME, "runtime")
    distributed.add_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """How the front ends that generate sample (`jaxllm.infer`, the bench's decode loop)."""
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    g.add_argument("--top-p", type=float, default=None, help="keep the most likely tokens holding this mass")
    add_flags(g, ("seed",))


def load_engine(args, quiet: bool = False):
    """The engine the flags ask for; `args.load_s` gets the seconds loading took. On a terminal a
    line shows the load's progress, then each compile's."""

    t0 = time.perf_counter()
    if distributed.init_from_args(args) and not distributed.is_main_process():
        sys.stdout = open(os.devnull, "w")  # every process computes; process 0 prints
        quiet = True
    bar = None
    if not quiet and sys.stderr.isatty() or env("JAXLLM_PROGRESS") == "1":
        bar = tqdm(total=0, desc="loading", unit="tensor", file=sys.stderr, leave=False)

    def progress(n, total):
        if bar is not None:
            bar.total = total
            bar.update(n - bar.n)

    try:
        with warnings_as_lines():
            config = from_args(args)
            settle(args, config)
            eng = jaxllm.load(config=config, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    args.load_s = time.perf_counter() - t0
    # on stderr, so --json output stays clean; always shown when the int8 long-context layout is used
    if eng.kv_layout.int8 or (not quiet and sys.stderr.isatty()):
        from jaxllm.kv.plan import report  # JAX, loaded once the flags are checked

        report(eng.kv_plan(1))
    if not quiet and sys.stderr.isatty():
        eng.on_compile = compile_ticker
    return eng


def compile_ticker(n: int):
    """A line on stderr that counts the seconds while `n` calls compile (the first run of a shape
    can take a while; later runs read JAX's compilation cache); -> the function that clears it."""

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
