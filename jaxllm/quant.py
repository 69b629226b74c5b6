"""Quantized weights as a pytree the matmul helpers understand: int8 with one scale per output
channel, or values with one scale per block (FP8 checkpoints' float8_e4m3fn, kept as stored)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm import pytree

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FP8_BLOCK = 128  # consecutive entries of a weight's flattened input, and output, dims under one FP8 scale
VALUE_DTYPES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}  # a weight format's values (`weights.weight_format`)


@pytree.dataclass
class QuantArray:
    """Quantized values and float32 scales. Per channel (int8): symmetric values and a scale over
    the weight's output (non-contracted) dims, applied to the product. `blockwise`: a scale of q's
    rank, each entry the scale of a box of q.shape[i] // scale.shape[i] entries along each dim; the
    boxes also divide the contracted dims, so the scales apply to the values before the product."""

    q: jax.Array  # int8 or float8_e4m3fn, the weight's shape
    scale: jax.Array  # float32: q.shape without the contracted dims, or (blockwise) of q's rank
    n_contract: int = pytree.static(1)
    blockwise: bool = pytree.static(False)

    @property
    def shape(self):
        return self.q.shape

    @property
    def dtype(self):
        return self.q.dtype


def quantize_np(w: np.ndarray, n_contract: int = 1, stack_dims: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel symmetric int8 of a (possibly layer-stacked) weight.

    `stack_dims` leading axes (e.g. the layer axis) are kept apart; the next `n_contract` axes are
    the contracted input axes over which one scale is shared.
    """
    w = np.asarray(w, np.float32)
    axes = tuple(range(stack_dims, stack_dims + n_contract))
    amax = np.max(np.abs(w), axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis=axes)


def dequantize(w) -> jax.Array:
    if isinstance(w, QuantArray):
        if w.blockwise:
            return scale_blocks(w.q.astype(jnp.float32), w.scale)
        s = w.scale.reshape((1,) * w.n_contract + w.scale.shape)
        return w.q.astype(jnp.float32) * s
    return w


def operand(w, dtype):
    """(a matmul weight as the dot takes it, in `dtype`; the scale of the product's output
    channels, or None). Per-channel scales stay apart, for after the dot (XLA fuses them into its
    epilogue); blockwise ones vary along the contracted dims, so they scale the values first."""
    if not isinstance(w, QuantArray):
        return w.astype(dtype), None
    if w.blockwise:
        return dequantize(w).astype(dtype), None
    return w.q.astype(dtype), w.scale


def scale_blocks(values, scale):
    """`values` times `scale` broadcast over its boxes (values.shape[i] // scale.shape[i] entries
    along each dim), on numpy or JAX arrays."""
    boxes = [(n, v // n) for v, n in zip(values.shape, scale.shape)]
    split = values.reshape([d for box in boxes for d in box])
    return (split * scale.reshape([d for n, _ in boxes for d in (n, 1)])).reshape(values.shape)


def block_ratios(dims: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, ...]:
    """Entries per scale along each of `dims`, for scales over `block` consecutive entries of them
    flattened (row-major, the last block of a length not a multiple of it partial): where those
    blocks are boxes (the last dims whole, one dim in part), the boxes; else boxes of
    gcd(block, last dim) along the last dim, which each lie inside one block. At most `block`
    entries are one box."""
    if math.prod(dims) <= block:
        return tuple(dims)
    ratios, left = [1] * len(dims), block
    for i in reversed(range(len(dims))):
        if left % dims[i] == 0:
            ratios[i], left = dims[i], left // dims[i]
        elif dims[i] % left == 0:
            ratios[i], left = left, 1
        else:
            break
        if left == 1:
            return tuple(ratios)
    return (1,) * (len(dims) - 1) + (math.gcd(block, dims[-1]),)


def fp8_ratios(shape: tuple[int, ...], lead: int, n_contract: int) -> tuple[int, ...]:
    """Entries per FP8 scale along each dim of a weight [*lead, *contracted, *out] (`lead`: its
    layer and expert axes, a scale each): 128 x 128 blocks over the contracted and output dims
    flattened, as FP8 checkpoints scale [out, in]."""
    cut = lead + n_contract
    return (1,) * lead + block_ratios(shape[lead:cut]) + block_ratios(shape[cut:])


def quantize_blocks_np(w: np.ndarray, ratios: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """float8_e4m3fn values and float32 scales (each box's amax / 448) of a float weight."""
    w = np.asarray(w, np.float32)
    boxes = [(v // r, r) for v, r in zip(w.shape, ratios)]
    split = w.reshape([d for box in boxes for d in box])
    amax = np.abs(split).max(axis=tuple(range(1, 2 * len(boxes), 2)))
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    q = np.clip(split / scale.reshape([d for n, _ in boxes for d in (n, 1)]), -FP8_MAX, FP8_MAX)
    return q.reshape(w.shape).astype(ml_dtypes.float8_e4m3fn), scale


def quantize_rows_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 of an embedding table [V, D]: scales [V, 1], so one QuantArray serves both the
    token lookup (a row times its scale) and the tied output projection (a scale per logit)."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale
