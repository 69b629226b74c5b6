"""What the KV cache will take, said before it is allocated, and a clear error when it cannot fit."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import jax
import numpy as np

from jaxllm.config.model import ModelConfig
from jaxllm.errors import RequestError
from jaxllm.kv.split import BlockKV, KVLayout, KVOptions, RingKV, cache_shapes

GiB = 1024 ** 3


@dataclass(frozen=True)
class CachePlan:
    layout: KVLayout
    batch: int
    max_ctx: int
    per_token: int        # bytes per position of one row that grow with the context
    fixed: int            # bytes that do not grow (ring buffers, slot positions), all rows
    total: int            # bytes of the whole cache as allocated
    per_device: int | None = None   # bytes on the device that holds the most of it (None: one device)

    @property
    def device_bytes(self) -> int:
        """What one device must find free for its share of the cache."""
        return self.total if self.per_device is None else self.per_device

    def where(self) -> str:
        return "" if self.device_bytes == self.total else f", {self.device_bytes / GiB:.2f} GiB a device"

    def describe(self) -> str:
        ring = f" + {self.fixed / 2**20:.1f} MiB of sliding-window ring buffers" if self.fixed else ""
        return (f"KV cache: {self.layout.name}, {self.per_token:,} bytes/token{ring}; "
                f"{self.total / GiB:.2f} GiB for {self.batch} x {self.max_ctx:,} tokens{self.where()}")


def _nbytes(x) -> int:
    return 0 if x is None else int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def plan_cache(cfg: ModelConfig, layout: KVLayout, opts: KVOptions, batch: int, max_ctx: int, dtype,
               n_layers=None) -> CachePlan:
    shapes = cache_shapes(cfg, layout, opts, batch, max_ctx, dtype, n_layers)
    per_token = fixed = total = 0
    for c in shapes.values():
        leaves = jax.tree_util.tree_leaves(c)
        size = sum(_nbytes(x) for x in leaves)
        total += size
        if isinstance(c, RingKV):
            fixed += size
        else:
            slots = (c.v if isinstance(c, BlockKV) else c["k"]).shape[2]
            per_token += size // (batch * slots)
    return CachePlan(layout, batch, max_ctx, per_token, fixed, total)


def free_memory(device=None) -> int | None:
    """Bytes the device can still allocate: the allocator's limit less what is in use; on a CPU
    without allocator statistics, the host's available memory."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:           # some backends do not implement memory statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if device.platform == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_fits(plan: CachePlan, device=None, free: int | None = None):
    """A clear error where a device cannot hold its share of the cache (the whole cache on one
    device; under a mesh, the largest shard)."""
    free = free_memory(device) if free is None else free
    if free is not None and plan.device_bytes > free:
        raise RequestError(f"the KV cache for {plan.batch} x {plan.max_ctx:,} tokens needs "
                           f"{plan.total / GiB:.2f} GiB ({plan.layout.name}{plan.where()}) but only "
                           f"{free / GiB:.2f} GiB of device memory is free; lower --max-ctx or --batch, "
                           f"or use --kv-quant int8")


def report(plan: CachePlan, file=None):
    print(plan.describe(), file=file or sys.stderr)
