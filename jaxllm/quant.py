"""int8 weights with one scale per output channel, as a pytree the matmul helpers understand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm import pytree


@pytree.dataclass
class QuantArray:
    """Symmetric int8 values and a float scale over the weight's output (non-contracted) dims."""

    q: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, shape = q.shape[n_contract:]
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
