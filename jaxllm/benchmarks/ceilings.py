"""Measured ceilings of the device the benchmark runs on: memory bandwidth and bf16 matmul rate.

Bandwidth is the best of several ways to stream memory, because each leaves some on the table on
some backend: an elementwise copy (read + write), a read-only reduction, and on GPU a Pallas copy
kernel with large blocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp


@dataclass
class Ceilings:
    bandwidth: float  # bytes/s, the best method's
    bandwidth_method: str
    bandwidth_by_method: dict = field(default_factory=dict)  # name -> bytes/s or an error line
    matmul_flops: float = 0.0  # bf16 FLOP/s
    matmul_shape: tuple = ()
    probe_bytes: int = 0

    def to_json(self) -> dict:
        return {
            "bandwidth_GBps": self.bandwidth / 1e9,
            "bandwidth_method": self.bandwidth_method,
            "bandwidth_by_method_GBps": {
                k: (v / 1e9 if isinstance(v, float) else v) for k, v in self.bandwidth_by_method.items()
            },
            "bandwidth_probe_bytes": self.probe_bytes,
            "matmul_bf16_TFLOPs": self.matmul_flops / 1e12,
            "matmul_shape": list(self.matmul_shape),
        }


def best_time(fn, *args, repeats: int = 5) -> float:
    """Fastest of `repeats` runs after one warm-up (which also compiles)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def default_probe_bytes(device) -> int:
    if device.platform == "cpu":
        return 256 << 20
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit", 16 << 30)
    return int(min(4 << 30, limit // 8))


PALLAS_BLOCK_ROWS = 8  # 32 KiB blocks: larger ones ran at a third of the speed on H100


def _copy(x, c):
    return x + c


def _read(x):
    return jnp.sum(x, dtype=jnp.float32)


def pallas_copy(x, block_rows: int = PALLAS_BLOCK_ROWS):
    """Blockwise copy through a Pallas kernel (GPU): [rows, 1024] float32, block_rows rows a block."""
    from jax.experimental import pallas as pl

    rows, cols = x.shape
    block = (block_rows, cols)

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(rows // block_rows,),
        in_specs=[pl.BlockSpec(block, lambda i: (i, 0))],
        out_specs=pl.BlockSpec(block, lambda i: (i, 0)),
    )(x)


def measure_bandwidth(nbytes: int, device=None, repeats: int = 5) -> tuple[str, float, dict, int]:
    """(best method, bytes/s, {method: bytes/s or the error that stopped it}, probe array bytes)."""
    device = device or jax.devices()[0]
    cols = 1024
    rows = max(256, (nbytes // 4 // cols) // 256 * 256)
    x = jax.device_put(jnp.ones((rows, cols), jnp.float32), device)
    n = rows * cols * 4
    results: dict = {}
    methods = [("copy", jax.jit(_copy), (x, jnp.float32(1)), 2 * n), ("read_reduce", jax.jit(_read), (x,), n)]
    if device.platform == "gpu":
        methods.append(("pallas_copy", jax.jit(pallas_copy), (x,), 2 * n))
    for name, fn, args, moved in methods:
        try:
            results[name] = moved / best_time(fn, *args, repeats=repeats)
        except Exception as e:  # a method the backend cannot run is reported, not fatal
            results[name] = f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    del x
    speeds = {k: v for k, v in results.items() if isinstance(v, float)}
    best = max(speeds, key=speeds.get)
    return best, speeds[best], results, n


def measure_matmul(n: int, device=None, repeats: int = 5) -> float:
    """bf16 [n, n] @ [n, n] with float32 accumulation -> FLOP/s."""
    device = device or jax.devices()[0]
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(k1, (n, n), jnp.bfloat16), device)
    b = jax.device_put(jax.random.normal(k2, (n, n), jnp.bfloat16), device)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    return 2 * n**3 / best_time(f, a, b, repeats=repeats)


def measure(probe_bytes: int | None = None, matmul_n: int | None = None, device=None) -> Ceilings:
    device = device or jax.devices()[0]
    probe_bytes = probe_bytes or default_probe_bytes(device)
    matmul_n = matmul_n or (1024 if device.platform == "cpu" else 8192)
    method, bw, by, n = measure_bandwidth(probe_bytes, device)
    return Ceilings(bw, method, by, measure_matmul(matmul_n, device), (matmul_n, matmul_n, matmul_n), n)
