"""`TpuOps`: the backend interface (`ops.xla.XlaOps`) with the TPU's ragged paged attention kernel
(`attention.py`) where it takes the shapes, and XLA (the parent class) for everything else: the
matmuls, norms and RoPE are XLA's own fusions on a TPU.

On a mesh the kernel runs per device inside `shard_map`: each device's query heads over the KV
heads it holds (KV heads split over "model" like the query heads, or one KV head on every device),
its rows where the batch is split over "data". The pool's arrays reach the kernel in the order the
device keeps them in memory (`device_order`), so the kernel reads them in place: handed a view in
another order, XLA would copy the whole pool around every call.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout
from jax.sharding import PartitionSpec as P

from jaxllm.config.axes import cache_leaf_axes
from jaxllm.ops.tpu import note
from jaxllm.ops.tpu.attention import Pages, paged_attention
from jaxllm.ops.xla import XlaOps

KERNEL = "paged attention"
# A pool's [layers, blocks, block, heads, hd] in memory: a block's positions major and its heads
# minor, or (heads fewer than a tile's rows of the dtype) the reverse -> whether heads come first.
KV_ORDERS = {(0, 1, 2, 3, 4): False, (0, 1, 3, 2, 4): True}
DTYPES = (jnp.bfloat16, jnp.float32, jnp.int8)


def device_order(shape, dtype, device) -> tuple[int, ...]:
    """The dimensions of an array of `shape` as `device` lays it out by default, major to minor."""
    try:
        pjrt = device.client.get_default_layout(jnp.dtype(dtype), tuple(shape), device)
    except Exception:  # a client that does not say: row-major, as the CPU's
        return tuple(range(len(shape)))
    return tuple(Layout.from_pjrt_layout(pjrt).major_to_minor)


def shard_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    return tuple(d // (mesh.shape[a] if a else 1) for d, a in zip(shape, tuple(spec) + (None,) * len(shape)))


def unsupported(q, pool) -> str | None:
    """Why the kernel does not take these operands (None: it does)."""
    if pool.keys_from_values:
        return "keys rebuilt from values"
    if q.shape[-1] % 128:
        return f"head_dim {q.shape[-1]} not a multiple of 128"
    if pool.v.dtype not in DTYPES or q.dtype not in DTYPES[:2]:
        return f"{q.dtype} queries over a {pool.v.dtype} pool"
    if q.shape[2] % pool.v.shape[3]:
        return "query heads not a multiple of KV heads"
    return None


@dataclasses.dataclass(frozen=True)
class TpuOps(XlaOps):
    """`interpret`: run the kernel in Pallas's TPU interpreter (`pltpu.InterpretParams()`), which
    simulates its DMAs and semaphores on a CPU: how the tests check it."""

    interpret: object = False
    name = "tpu"

    def kv_dtype(self, dtype):
        """The kernel reads pools of the compute dtype itself (in the interpreter too)."""
        return dtype

    def paged_attention(self, q, layer_kv, positions, *, scale, softcap, window, keys=None):
        pool = layer_kv.pool
        B, T, H, hd = q.shape
        desc = (B, T, H, pool.v.shape[3], hd, str(pool.v.dtype) + (" values alone" if pool.keys_from_values else ""))
        why = unsupported(q, pool)
        if why is not None:
            note(KERNEL, desc, f"xla ({why})")
            return None
        arrays = layer_kv.arrays()
        names = tuple(arrays)
        layout = self.layout

        def run(q, idx, table, pos, *arrs, heads_major):
            a = dict(zip(names, arrs))
            order = (lambda x: jnp.swapaxes(x, 2, 3)) if heads_major else (lambda x: x)
            pages = Pages(order(a["k"]), order(a["v"]), a.get("k_scale"), a.get("v_scale"), heads_major)
            return paged_attention(
                q, pages, idx, table, pos, scale=scale, softcap=softcap, window=window, interpret=self.interpret
            )

        if layout is None:
            device, local = jax.devices()[0], pool.v.shape
        else:
            qspec = layout.spec(q.shape, ("batch", "seq", "q_heads", "head_dim"))
            specs = {n: layout.spec(a.shape, cache_leaf_axes(a.ndim)) for n, a in arrays.items()}
            if (qspec[2] is None) != (specs["v"][3] is None) and pool.v.shape[3] != 1:
                note(KERNEL, desc, "xla (query and KV heads split differently)")
                return None
            device, local = layout.mesh.devices.flat[0], shard_shape(pool.v.shape, specs["v"], layout.mesh)
        heads_major = KV_ORDERS.get(device_order(local, pool.v.dtype, device))
        if heads_major is None:
            note(KERNEL, desc, "xla (the pool's layout in memory)")
            return None
        note(KERNEL, desc, "kernel")
        body = functools.partial(run, heads_major=heads_major)
        args = (q, layer_kv.idx, layer_kv.table, positions, *arrays.values())
        if layout is None:
            return body(*args)
        # under a mesh of one device too: Mosaic learns the device it compiles for from the mesh
        rows = P(qspec[0], None)
        return jax.shard_map(
            body,
            mesh=layout.mesh,
            in_specs=(qspec, P(), rows, rows) + tuple(specs[n] for n in names),
            out_specs=qspec,
            check_vma=False,
        )(*args)
