"""The backend: every hot operation the model calls (linear and fused linears, the gated MLP, the
residual add and norm, the decode prologue, attention over a cache, the output head, the
embedding), behind one interface chosen once at the edge.

`XlaOps` (ops/xla.py) is the reference; `ops.cpu` changes what XLA's CPU backend does slowly.
`ops.gpu` holds the Pallas kernels for GPUs with their own weight layout, wrapper types, tile
tables and the Triton-lowering patch;
`ops.tpu` the Pallas (Mosaic) kernels for TPUs, over XLA's operations elsewhere. Each is imported
only when `select` chooses it, so a process loads Pallas only for the backend it runs.
"""

from __future__ import annotations

import logging
import sys

import jax

from jaxllm.config.runtime import RuntimeConfig
from jaxllm.ops.xla import HeadPrep, KeysFromValues, XlaOps, memory_limit

__all__ = ["HeadPrep", "KeysFromValues", "XlaOps", "memory_limit", "select", "uses_kernels"]
log = logging.getLogger("jaxllm.ops")


def _platform(layout) -> str:
    return jax.default_backend() if layout is None else layout.mesh.devices.flat[0].platform


def uses_kernels(runtime: RuntimeConfig, layout=None) -> bool:
    """Whether the GPU's Pallas kernels run for `layout` (None: the default device): one GPU, or a
    tensor-parallel mesh of GPUs with no data-parallel axis, under `kernels="auto"`; always under
    "pallas" (interpreted off a GPU) except on TPUs, which have kernels of their own; never under
    "xla"."""
    if runtime.kernels == "xla":
        return False
    platform = _platform(layout)
    if runtime.kernels == "pallas":
        return platform != "tpu"
    if platform != "gpu":
        return False
    return jax.device_count() == 1 if layout is None else layout.dp == 1


def select(runtime: RuntimeConfig | None = None, layout=None) -> XlaOps:
    """The backend for `layout` under `runtime` (None: the defaults, `RuntimeConfig()`): on TPUs the
    TPU kernels unless `kernels="xla"`, on GPUs the GPU kernels where `uses_kernels`, on one CPU
    device under `kernels="auto"` XLA with the CPU's output head (`ops.cpu`), else XLA."""
    runtime = RuntimeConfig() if runtime is None else runtime
    if runtime.kernels != "xla" and _platform(layout) == "tpu":
        from jaxllm.ops.tpu.backend import TpuOps

        return TpuOps(runtime, layout)
    if uses_kernels(runtime, layout):
        from jaxllm.ops.gpu.backend import PallasOps

        return PallasOps(runtime, layout)
    if runtime.kernels == "auto" and _platform(layout) == "cpu" and (layout is None or layout.mesh.size == 1):
        from jaxllm.ops.cpu import CpuOps

        return CpuOps(runtime, layout)
    return XlaOps(runtime, layout)


def selections() -> list[dict]:
    """Every kernel choice made so far in this process (none where no kernel backend ran)."""

    return [
        s
        for name in ("jaxllm.ops.gpu", "jaxllm.ops.tpu")
        if (m := sys.modules.get(name)) is not None
        for s in m.selections()
    ]
