"""Which code runs the decode-time hot spots: Pallas kernels on GPUs, XLA everywhere else.

`JAXLLM_KERNELS` picks: `auto` (the default) uses the Pallas kernels on GPUs (one, or a
tensor-parallel mesh, where they run per device on its shards) and XLA otherwise (TPU, CPU); `xla`
forces the pure-XLA path everywhere (the reference, and a fallback a user can choose); `pallas`
forces the kernels, in Pallas interpret mode on a CPU (how the tests check them).
Every choice is logged once per shape on the `jaxllm.kernels` logger and kept in `selections()`,
so a run can say what it ran; a shape a kernel does not take goes to XLA, logged the same way.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os

import jax
from jax.experimental import pallas as pl

from jaxllm.errors import ModelError
from jaxllm.ops.gpu import offsets

offsets.install()

MODES = ("auto", "xla", "pallas")
log = logging.getLogger("jaxllm.kernels")
_layout: contextvars.ContextVar = contextvars.ContextVar("kernel_layout", default=None)
_seen: dict[tuple, str] = {}


def mode() -> str:
    m = os.environ.get("JAXLLM_KERNELS", "auto").strip().lower() or "auto"
    if m not in MODES:
        raise ModelError(f"JAXLLM_KERNELS must be one of {', '.join(MODES)}, got {m!r}")
    return m


@contextlib.contextmanager
def use_layout(layout):
    """Declare the `sharding.Layout` whose mesh the computations traced inside run on: with a
    tensor-parallel mesh the kernels run per device inside `shard_map`, on each device's shards."""
    tok = _layout.set(layout)
    try:
        yield
    finally:
        _layout.reset(tok)


def current_layout():
    """The declared layout, or None (then the computation is taken to be on one device)."""
    return _layout.get()


def platform() -> str:
    """The platform what is traced now runs on: the declared layout's devices', else the default
    backend's."""
    lay = _layout.get()
    return jax.default_backend() if lay is None else lay.mesh.devices.flat[0].platform


def enabled() -> bool:
    """Whether the Pallas kernels are used for what is traced now: one GPU, or a tensor-parallel
    mesh of GPUs (no data-parallel axis) declared with `use_layout`."""
    m = mode()
    if m != "auto":
        return m == "pallas"
    lay = _layout.get()
    if platform() != "gpu":
        return False
    return jax.device_count() == 1 if lay is None else lay.dp == 1


def device_kind() -> str:
    """The kind of device what is traced now runs on (e.g. "NVIDIA H200"), for tiles tuned per GPU."""
    lay = _layout.get()
    return (jax.devices()[0] if lay is None else lay.mesh.devices.flat[0]).device_kind


def interpret() -> bool:
    """Pallas runs compiled (Triton) on a GPU and interpreted anywhere else."""
    return jax.default_backend() != "gpu"


def pallas_call(kernel, **kw):
    """`pl.pallas_call`, compiled on a GPU and interpreted anywhere else; compiled, its operands
    are first checked against what the lowering's offsets can address (`offsets`)."""
    call = pl.pallas_call(kernel, interpret=interpret(), **kw)

    def run(*args):
        if not interpret():
            offsets.check(*args)
        return call(*args)
    return run


def note(kernel: str, shape: tuple, choice: str) -> None:
    key = (kernel, tuple(shape))
    if _seen.get(key) != choice:
        _seen[key] = choice
        log.info("%s %s -> %s", kernel, "x".join(map(str, shape)), choice)


def selections() -> list[dict]:
    """Every kernel choice made so far in this process: kernel, shape, and what ran it."""
    return [{"kernel": k, "shape": list(s), "choice": c} for (k, s), c in _seen.items()]
