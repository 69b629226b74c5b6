"""Compiling several XLA programs at once: each is traced and lowered in turn (Python, which holds
the GIL) and compiled on a thread of its own meanwhile (XLA compiles without the GIL), so n programs
take the lowering of all of them plus about one compile, not n compiles."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable


def _pool(n: int, threads: int | None) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads or max(1, min(n, os.cpu_count() or 2)))


def map_threads(fn: Callable, items: Iterable, threads: int | None = None) -> list:
    """[fn(item) for item in items], each on a thread: for work that runs without the GIL (reading
    compiled programs back onto the devices)."""
    items = list(items)
    if not items:
        return []
    with _pool(len(items), threads) as pool:
        return list(pool.map(fn, items))


def compile_all(items: Iterable, lower: Callable, compile: Callable | None = None, threads: int | None = None) -> list:
    """[compile(item, lower(item)) for item in items] (default: the lowered program's own
    `compile()`), each compile started as soon as its program is lowered."""
    items = list(items)
    if not items:
        return []
    compile = compile or (lambda item, lowered: lowered.compile())
    with _pool(len(items), threads) as pool:
        futures = [pool.submit(compile, item, lower(item)) for item in items]
        return [f.result() for f in futures]
