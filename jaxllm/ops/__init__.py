"""The backend: every hot operation the model calls (linear and fused linears, the gated MLP, the
residual add and norm, the decode prologue, attention over a cache, the output head, the
embedding), behind one interface chosen once at the edge.

`XlaOps` (ops/xla.py) is the reference and the TPU/CPU path. `ops.gpu` holds the Pallas kernels
for GPUs with their own weight layout, wrapper types, tile tables and the Triton-lowering patch; it
is imported only when `select` chooses it, so a CPU or TPU process never loads Pallas.
"""
from __future__ import annotations

import logging

import jax

from jaxllm.config.runtime import RuntimeConfig
from jaxllm.ops.xla import HeadPrep, KeysFromValues, XlaOps, memory_limit

__all__ = ["HeadPrep", "KeysFromValues", "XlaOps", "memory_limit", "select", "uses_kernels"]
log = logging.getLogger("jaxllm.ops")


def uses_kernels(runtime: RuntimeConfig, layout=None) -> bool:
    """Whether the Pallas kernels run for `layout` (None: the default device): one GPU, or a
    tensor-parallel mesh of GPUs with no data-parallel axis, under `kernels="auto"`; always under
    "pallas"; never under "xla"."""
    if runtime.kernels != "auto":
        return runtime.kernels == "pallas"
    platform = jax.default_backend() if layout is None else layout.mesh.devices.flat[0].platform
    if platform != "gpu":
        return False
    return jax.device_count() == 1 if layout is None else layout.dp == 1


def select(runtime: RuntimeConfig | None = None, layout=None) -> XlaOps:
    """The backend for `layout` under `runtime` (None: `RuntimeConfig.from_env()`)."""
    runtime = RuntimeConfig.from_env() if runtime is None else runtime
    if uses_kernels(runtime, layout):
        from jaxllm.ops.gpu.backend import PallasOps
        return PallasOps(runtime, layout)
    return XlaOps(runtime, layout)


def selections() -> list[dict]:
    """Every GPU kernel choice made so far in this process (none where the GPU backend never ran)."""
    import sys
    gpu = sys.modules.get("jaxllm.ops.gpu")
    return [] if gpu is None else gpu.selections()
