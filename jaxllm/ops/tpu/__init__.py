"""The TPU backend: Pallas kernels (Mosaic) behind `TpuOps` (backend.py), which `ops.select`
chooses on TPUs. Importing the backend loads Pallas; nothing outside this package does.

Every choice the backend makes (the kernel, or XLA for a shape the kernel does not take, and why)
is logged once per shape on the `jaxllm.kernels` logger and kept in `selections()`, so a run can
say what it ran.
"""

from __future__ import annotations

import logging

log = logging.getLogger("jaxllm.kernels")
_seen: dict[tuple, str] = {}


def note(kernel: str, shape: tuple, choice: str) -> None:
    key = (kernel, tuple(shape))
    if _seen.get(key) != choice:
        _seen[key] = choice
        log.info("%s %s -> %s", kernel, "x".join(map(str, shape)), choice)


def selections() -> list[dict]:
    """Every kernel choice made so far in this process: kernel, shape, and what ran it."""
    return [{"kernel": k, "shape": list(s), "choice": c} for (k, s), c in _seen.items()]
