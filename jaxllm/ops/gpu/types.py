"""The GPU backend's own forms of weights and activations, which the model never sees by name:
layer stacks read in place by the kernels (`Stacked`), output-major weights (`OutMajor`), a
matmul's unsummed K-split partial products (`Partials`) and a norm left for the next matmul to
apply as it loads its rows (`Normed`). `PallasOps` hands them from one kernel to the next and
turns them into arrays (`total`, `value`, `layer_of`) wherever XLA takes over."""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxllm import pytree
from jaxllm.ops.xla import rms_norm


@pytree.dataclass
class OutMajor:
    """A layer-stacked matmul weight stored with its output dims before its contracted ones,
    `[L, *out, *in]` (a QuantArray's values so; its scales `[L, *out]` as always), which the GPU
    matmul kernels read fastest (see `ops.gpu.weights`); `PallasOps.layer_weights` hands it on as a `Stacked` view."""

    w: object
    n_contract: int = pytree.static(1)


@dataclass(frozen=True)
class Stacked:
    """Layer `idx` of a layer-stacked weight (an array or QuantArray with the layer axis first),
    left unsliced so that a kernel can read the layer in place; `layer()` slices it for XLA."""

    stack: object
    idx: jax.Array
    axes: tuple | None = None  # one layer's logical axes as the model holds it, [*in, *out], where
    # the sharded kernels take the weight (`weights.kernel_axes`)
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
        return rms_norm(self.x, layer_of(self.w), self.eps, self.offset)


def value(x):
    """An activation as an array: `Normed` normalized."""
    return x.value() if isinstance(x, Normed) else x


def layer_of(w):
    """A layer's weight as an array: a `Stacked` view sliced, anything else as it is."""
    return w.layer() if isinstance(w, Stacked) else w
