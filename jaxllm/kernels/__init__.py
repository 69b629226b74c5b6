"""Which code runs the decode-time hot spots: Pallas kernels on GPUs, XLA everywhere else.

`JAXLLM_KERNELS` picks: `auto` (the default) uses the Pallas kernels when the computation runs on one
GPU and XLA otherwise (TPU, CPU, and tensor-parallel meshes, whose sharded operands the kernels do
not partition); `xla` forces the pure-XLA path everywhere (the reference, and a fallback a user can
choose); `pallas` forces the kernels, in Pallas interpret mode on a CPU (how the tests check them).
Every choice is logged once per shape on the `jaxllm.kernels` logger and kept in `selections()`,
so a run can say what it ran; a shape a kernel does not take goes to XLA, logged the same way.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import jax

from ..errors import ModelError

MODES = ("auto", "xla", "pallas")
log = logging.getLogger("jaxllm.kernels")
_devices_in_use: contextvars.ContextVar[int | None] = contextvars.ContextVar("devices_in_use", default=None)
_seen: dict[tuple, str] = {}


def mode() -> str:
    m = os.environ.get("JAXLLM_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ModelError(f"JAXLLM_KERNELS must be one of {', '.join(MODES)}, got {m!r}")
    return m


@contextlib.contextmanager
def devices_in_use(n: int):
    """Declare how many devices the computations traced inside shard their operands over."""
    tok = _devices_in_use.set(int(n))
    try:
        yield
    finally:
        _devices_in_use.reset(tok)


def enabled() -> bool:
    """Whether the Pallas kernels are used for what is traced now."""
    m = mode()
    if m != "auto":
        return m == "pallas"
    n = _devices_in_use.get()
    n = jax.device_count() if n is None else n
    return jax.default_backend() == "gpu" and n == 1


def interpret() -> bool:
    """Pallas runs compiled (Triton) on a GPU and interpreted anywhere else."""
    return jax.default_backend() != "gpu"


def note(kernel: str, shape: tuple, choice: str) -> None:
    key = (kernel, tuple(shape))
    if _seen.get(key) != choice:
        _seen[key] = choice
        log.info("%s %s -> %s", kernel, "x".join(map(str, shape)), choice)


def selections() -> list[dict]:
    """Every kernel choice made so far in this process: kernel, shape, and what ran it."""
    return [{"kernel": k, "shape": list(s), "choice": c} for (k, s), c in _seen.items()]
