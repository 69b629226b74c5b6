"""int8 values widened to float inside a kernel, exactly, in one of three ways.

Every int8 weight or KV element a kernel reads is widened once before it is multiplied. Hopper's
int-to-float conversion runs at a quarter of the ALU rate, so where the loop is otherwise bound by
memory the conversion can set its pace. The three ways give the same values bit for bit:

- `convert`: the conversion instruction (`astype`).
- `magic`: the integer is added to the bits of 1.5 * 2**23, whose float spacing is 1, and that
  float subtracted: two full-rate operations to float32, then rounded to the operand's type
  (exact: an int8 is a bf16 and an f16).
- `bits`: straight to bf16. The low seven bits go under the exponent of 128 (spacing 1), the sign
  bit under the same exponent, where it reads 128 more: (128 + (x & 127)) - (128 + (x & 128)) is
  x. Two bitwise operations and one bf16 subtraction.

The batch-1 matmul always uses `magic` (measured: Qwen3-4B batch 1 on one H100 gained from it over
`convert`), and so does the decode attention where it widens int8 values to float32 to rebuild
keys from them (measured on one H200). Elsewhere `RuntimeConfig.int8_widen` (JAXLLM_INT8_WIDEN)
picks, `convert` by default
(as bf16 dot operands `magic` and `bits` measured slower); setting it applies everywhere but the
batch-1 matmul, so that each way can be timed inside the whole decode step.
`scripts/attention_bench.py --widen` and `scripts/kernel_bench.py --widen` time them kernel by
kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxllm.ops.gpu import widen_setting

WAYS = ("convert", "magic", "bits")
MAGIC = 0x4B400000  # the bits of 1.5 * 2**23: adding an int8 to them gives that float plus it
BF16_128 = 0x4300  # the bits of bf16 128.0, whose spacing is 1


def default(fallback: str = "convert") -> str:
    """The way the runtime configuration names (`RuntimeConfig.int8_widen`), or `fallback`."""
    return widen_setting() or fallback


def widen(x, dtype, way: str):
    """x as `dtype`; an int8 x widened `way` (other dtypes are simply cast)."""
    if x.dtype != jnp.int8 or way == "convert":
        return x.astype(dtype)
    if way == "bits" and jnp.dtype(dtype) == jnp.bfloat16:
        v = x.astype(jnp.int16)  # sign-extended: bit 7 is the int8's sign bit
        hi = jax.lax.bitcast_convert_type((v & 0x7F) | BF16_128, jnp.bfloat16)
        lo = jax.lax.bitcast_convert_type((v & 0x80) | BF16_128, jnp.bfloat16)
        return hi - lo
    f = jax.lax.bitcast_convert_type(x.astype(jnp.int32) + MAGIC, jnp.float32) - jnp.float32(1.5 * 2**23)
    return f if jnp.dtype(dtype) == jnp.float32 else f.astype(dtype)
