"""The CPU backend: XLA's operations, except the output head over int8 weights.

XLA's CPU backend does not fold an int8 weight's widening into the dot that reads it: it writes the
widened weight out first, and inside the decode loop it hoists that widening out of the loop, so
every step reads the head (262144 x 640 for Gemma) in float32, four times its int8 bytes, and the
head was half of a decode step of the embedded model. Here the head goes over the vocabulary in
pieces whose widened copy stays in cache, each widened inside the step. On one 2-core CPU that
measured 18 ms a step against 47 for the head of a [1, 640] state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops.xla import XlaOps
from jaxllm.quant import QuantArray

HEAD_PIECE = 4096  # vocabulary rows widened at a time (of 640: 10 MiB in float32)


class CpuOps(XlaOps):
    name = "cpu"

    def output_head(self, h, table, tied: bool):
        if not isinstance(table, QuantArray) or (table.shape[0] if tied else table.shape[-1]) % HEAD_PIECE:
            return super().output_head(h, table, tied)
        return head_in_pieces(h, table, tied)


def head_in_pieces(h: jax.Array, table: QuantArray, tied: bool) -> jax.Array:
    """float32 logits [..., V] of h [..., D] against an int8 table ([V, D] tied, [D, V] untied),
    HEAD_PIECE vocabulary entries at a time."""
    q = table.q if tied else table.q.T  # [V, D]
    V, D = q.shape
    pieces = q.reshape(V // HEAD_PIECE, HEAD_PIECE, D)
    out = jax.lax.map(
        lambda w: jnp.einsum("...d,vd->...v", h, w.astype(h.dtype), preferred_element_type=jnp.float32), pieces
    )  # [n, ..., P]
    out = jnp.moveaxis(out, 0, -2).reshape(*h.shape[:-1], V)
    return out * (table.scale[:, 0] if tied else table.scale)
