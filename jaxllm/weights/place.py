"""Checkpoint tensors -> device shards, one tensor at a time.

A layer-stacked weight is assembled on the devices: its sharded stack is allocated once, then each
layer is read from the (memory-mapped) checkpoint, quantized or cast on the host, and written into
the stack as a sharded layer. The host never holds more than one layer in float32, and in a
multi-process run each process transfers only the shards its own devices hold
(`jax.make_array_from_callback` asks for exactly those).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.quant import quantize_np, quantize_rows_np

ROW_BLOCK = 4096  # rows of an embedding / output head converted at a time


@lru_cache(maxsize=None)
def _zeros(shape, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@lru_cache(maxsize=None)
def _setter(sharding):
    return jax.jit(
        lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0),
        out_shardings=sharding,
        donate_argnums=0,
    )


def layer_sharding(s: NamedSharding) -> NamedSharding:
    return NamedSharding(s.mesh, P(*tuple(s.spec)[1:]))


def from_host(a: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])


def place_stacked(pieces: list[Callable[[], tuple[np.ndarray, ...]]], shapes, dtypes, shardings):
    """Stacks of one or more arrays (values, scales), filled layer by layer.

    `pieces[i]()` returns layer i's host arrays, in the order of shapes/dtypes/shardings."""
    stacks = [_zeros(tuple(s), d, sh)() for s, d, sh in zip(shapes, dtypes, shardings)]
    for i, piece in enumerate(pieces):
        host = piece()
        for j, (a, sh) in enumerate(zip(host, shardings)):
            stacks[j] = _setter(sh)(stacks[j], from_host(a, layer_sharding(sh)), np.int32(i))
        del host
    return stacks


def np_dtype(dtype):

    return ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


def convert_layer(a: np.ndarray, n_contract: int, dtype, int8: bool, n_batch: int = 0) -> tuple[np.ndarray, ...]:
    if int8:
        return quantize_np(a, n_contract, n_batch)
    return (a.astype(np_dtype(dtype)),)


def rows_to_host(raw, transpose: bool, dtype, mode: str | None) -> tuple[np.ndarray, ...]:
    """An embedding [V, D] or output head (stored [V, D], used [D, V]) in its final host format,
    converted ROW_BLOCK checkpoint rows at a time so that no float32 copy of the table exists.

    mode: None (cast), "rows" (per-row int8, scales [V, 1]) or "cols" (int8 with one scale per
    output column of the transposed layout, scales [V])."""
    V, D = raw.shape
    q = np.empty((D, V) if transpose else (V, D), np.int8 if mode else np_dtype(dtype))
    scale = np.empty((V, 1), np.float32) if mode else None
    for r0 in range(0, V, ROW_BLOCK):
        block = np.asarray(raw[r0 : r0 + ROW_BLOCK], np.float32)
        if mode:
            block, scale[r0 : r0 + len(block)] = quantize_rows_np(block)
        if transpose:
            q[:, r0 : r0 + len(block)] = block.T
        else:
            q[r0 : r0 + len(block)] = block
    if not mode:
        return (q,)
    return (q, scale[:, 0] if mode == "cols" else scale)
