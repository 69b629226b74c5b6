"""int8 weights with one scale per output channel, as a pytree the matmul helpers understand."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import pytree


@pytree.dataclass
class QuantArray:
    """Symmetric int8 values and a float scale over the weight's output (non-contracted) dims."""
    q: jax.Array                 # int8, the weight's shape
    scale: jax.Array             # float32, shape = q.shape[n_contract:]
    n_contract: int = pytree.static(1)

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


@pytree.dataclass
class OutMajor:
    """A layer-stacked matmul weight stored with its output dims before its contracted ones,
    `[L, *out, *in]` (a QuantArray's values so; its scales `[L, *out]` as always), which the GPU
    matmul kernels read fastest (see `kernels.weights`). The model meets it only through `Stacked`."""
    w: object
    n_contract: int = pytree.static(1)


@dataclass(frozen=True)
class Stacked:
    """Layer `idx` of a layer-stacked weight (an array or QuantArray with the layer axis first),
    left unsliced so that a kernel can read the layer in place; `layer()` slices it for XLA."""
    stack: object
    idx: jax.Array
    name: str = ""          # the weight's name in its layer ("q", "down", ...): its logical axes
    out_major: bool = False  # the stack is laid out as an `OutMajor` weight's

    def layer(self):
        return jax.tree_util.tree_map(lambda a: a[self.idx], self.stack)


@dataclass(frozen=True)
class Partials:
    """A matmul's output as the kernel left it when it split K: float32 partial products
    `[split, ..., N]` not yet summed, nor scaled by the per-channel `scale` ([N], a `Stacked` view
    of a stack [L, N], or None), nor cast to
    `dtype`; a kernel downstream can take them as they are, anything else calls `total()`."""
    parts: jax.Array
    scale: jax.Array | None
    dtype: object

    def total(self) -> jax.Array:
        y = self.parts.sum(axis=0)
        return (y if self.scale is None else y * layer_of(self.scale)).astype(self.dtype)


def total(y):
    """A matmul's output as an array, `Partials` summed."""
    return y.total() if isinstance(y, Partials) else y


@dataclass(frozen=True)
class Normed:
    """`rms_norm(x, w, eps, offset)` not yet computed: a matmul kernel that takes it normalizes x's
    rows as it loads them, so the norm needs no kernels of its own; anything else calls `value()`.
    `w` is [D], a `Stacked` view of a stack [L, D], or None (no weight)."""
    x: jax.Array
    w: object
    eps: float
    offset: float = 0.0

    def value(self) -> jax.Array:
        from jaxllm.model.layers import rms_norm
        return rms_norm(self.x, self.w, self.eps, self.offset)


def value(x):
    """An activation as an array: `Normed` normalized."""
    return x.value() if isinstance(x, Normed) else x


def layer_of(w):
    """A layer's weight as an array: a `Stacked` view sliced, anything else as it is."""
    return w.layer() if isinstance(w, Stacked) else w


def linear(x: jax.Array, w, n_contract: int = 1, partials: bool = False) -> jax.Array:
    """Contract the last `n_contract` dims of x with the first `n_contract` dims of w (or, for an
    output-major `Stacked` weight, its last ones).

    The output is x's leading dims followed by w's output dims, so a per-output-channel scale
    broadcasts on the trailing dims and XLA fuses the dequantization into the dot's epilogue.
    A `Stacked` weight goes to the stacked-matmul kernel when it takes the shape; with `partials`
    its output may come back as `Partials` (K split, not yet summed). x may be `Normed`.
    """
    out_major = False
    if isinstance(w, Stacked):
        from jaxllm.ops.gpu.dispatch import stacked_linear
        y = stacked_linear(x, w, n_contract, partials)
        if y is not None:
            return y
        out_major, w = w.out_major, w.layer()
    x = value(x)
    xa = tuple(range(x.ndim - n_contract, x.ndim))
    nd = len(w.shape)
    wa = tuple(range(nd - n_contract, nd)) if out_major else tuple(range(n_contract))
    if isinstance(w, QuantArray):
        y = jax.lax.dot_general(x, w.q.astype(x.dtype), ((xa, wa), ((), ())),
                                preferred_element_type=jnp.float32)
        return (y * w.scale).astype(x.dtype)
    return jax.lax.dot_general(x, w.astype(x.dtype), ((xa, wa), ((), ())),
                               preferred_element_type=jnp.float32).astype(x.dtype)


def linears(x: jax.Array, ws: list, n_contract: int = 1, partials: bool = False) -> list:
    """[linear(x, w) for w in ws]; Stacked weights of one layer go to a single kernel launch, whose
    outputs may come back as `Partials` with `partials`. x may be `Normed` (normalized once, here or
    in the kernel)."""
    if all(isinstance(w, Stacked) for w in ws):
        from jaxllm.ops.gpu.dispatch import stacked_linears
        ys = stacked_linears(x, ws, n_contract, partials)
        if ys is not None:
            return ys
    x = value(x)
    return [linear(x, w, n_contract) for w in ws]


def dequantize(w) -> jax.Array:
    if isinstance(w, QuantArray):
        s = w.scale.reshape((1,) * w.n_contract + w.scale.shape)
        return w.q.astype(jnp.float32) * s
    return w


def quantize_rows_np(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int8 of an embedding table [V, D]: scales [V, 1], so one QuantArray serves both the
    token lookup (a row times its scale) and the tied output projection (a scale per logit)."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=-1, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def take_rows(table, ids: jax.Array, dtype) -> jax.Array:
    """Embedding lookup from a plain or row-quantized table."""
    if isinstance(table, QuantArray):
        rows = jnp.take(table.q, ids, axis=0).astype(jnp.float32)
        return (rows * jnp.take(table.scale, ids, axis=0)).astype(dtype)
    return jnp.take(table, ids, axis=0).astype(dtype)


def matmul_rows(h: jax.Array, table) -> jax.Array:
    """h [..., D] against every row of a table [V, D] -> float32 [..., V] (tied output head)."""
    if isinstance(table, QuantArray):
        out = jnp.einsum("...d,vd->...v", h, table.q.astype(h.dtype), preferred_element_type=jnp.float32)
        return out * table.scale[:, 0]
    return jnp.einsum("...d,vd->...v", h, table.astype(h.dtype), preferred_element_type=jnp.float32)
