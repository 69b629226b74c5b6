"""`PallasOps`: the backend interface (`ops.xla.XlaOps`) with the GPU kernels where they take the
shapes, and XLA (the parent class) where they do not.

The kernels read layer weights in place in their stacks (`Stacked`), fuse the input norm into the
Q/K/V matmul (`Normed`), leave K-split matmul outputs unsummed for the kernel downstream
(`Partials`) and write the decode step's keys and values in the prologue kernel. Those forms stay
inside this backend: whatever leaves it for XLA goes through `value` or `weight` first.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jaxllm.ops import xla
from jaxllm.ops.gpu import dispatch as k
from jaxllm.ops.gpu import install, note, scope
from jaxllm.ops.gpu.types import Normed, OutMajor, Stacked, layer_of, total, value
from jaxllm.ops.gpu.weights import kernel_axes, out_major
from jaxllm.ops.xla import XlaOps, activation, matmul
from jaxllm.quant import QuantArray

# The roles (`model.params.ParamSpec.role`) of the layer weights the model reads only through this
# backend: the matmul weights and the norms (the input norm in the Q/K/V matmul, the per-head ones
# in the prologue, those around the residual add), which it hands over as `Stacked` views, for the
# kernels to read in place.
IN_PLACE = ("matmul", "norm")


def _is_quant(w) -> bool:
    return isinstance(w, QuantArray)


def _bytes_limit(layout) -> int | None:
    """The memory a device of the computation may allocate (None where the runtime does not say)."""
    return xla.memory_limit(jax.local_devices()[0] if layout is None else layout.mesh.devices.flat[0])


def _rows(x) -> int:
    x = x.x if isinstance(x, Normed) else x
    return math.prod(x.shape[:-1])


@dataclasses.dataclass(frozen=True)
class PallasOps(XlaOps):
    name = "pallas"

    def __post_init__(self):
        install()

    def _scope(self):
        return scope(self.layout, self.runtime.int8_widen)

    def scan_unroll(self, num_layers: int, rows: int, tokens_per_row: int) -> int:
        """A decode step runs the layer scan unrolled whole: every loop iteration costs a kernel of
        its own (the counter) and a launch's gap (Qwen3-4B, batch 1, one H100: 2.39 ms a step against
        2.45 rolled); a prefill keeps one layer an iteration (91 ms against 80 for 2048 tokens)."""
        if self.runtime.scan_unroll is not None:
            return super().scan_unroll(num_layers, rows, tokens_per_row)
        return num_layers if tokens_per_row == 1 and rows <= k.MAX_ROWS else 1

    # --- weights
    def kv_dtype(self, dtype):
        """The kernels read and write pools of the compute dtype itself."""
        return dtype

    def prepare_weights(self, weights: dict, specs: dict, donate: bool = False) -> dict:
        with self._scope():
            return out_major(weights, specs, donate)

    def loop_weights(self, weights, rows: int, state=None, dtype=jnp.bfloat16):
        """Above `MAX_ROWS` rows a step XLA runs the matmuls as cuBLAS GEMMs, and inside the decode
        loop it widens each layer's int8 weights to `dtype` for them at every step: every weight
        byte read, written twice as wide and read again. Widened once before the loop instead (the
        same values, so the same tokens), the steps only read them: Gemma 4 31B's per-GPU layers
        at TP=4 on one H200, 1024 rows, 31.8 ms a step against 23.3 (768 rows: 25.1 against 16.9).
        `RuntimeConfig.widen_once`: `auto` where the widened copy fits beside the weights, the
        call's state and a tenth of the device's memory for the step's own buffers."""
        mode = self.runtime.widen_once
        quant = [w for w in jax.tree_util.tree_leaves(weights, is_leaf=_is_quant) if _is_quant(w)]
        if mode == "off" or rows <= k.MAX_ROWS or not quant:
            return weights
        shards = 1 if self.layout is None else self.layout.mesh.size
        need = sum(w.q.size for w in quant) * jnp.dtype(dtype).itemsize / shards
        have = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves((weights, state))) / shards
        limit = _bytes_limit(self.layout)
        fits = limit is not None and have + need <= 0.9 * limit
        if mode == "on" or fits:
            why = "on"
        elif limit is None:
            why = "off (no memory limit known)"
        else:
            why = f"off ({(have + need) / 2**30:.1f} GiB with the copy, over {0.9 * limit / 2**30:.1f})"
        note("widen once", (rows, f"{need / 2**30:.1f} GiB"), why)
        if why != "on":
            return weights
        return jax.tree_util.tree_map(
            lambda w: dataclasses.replace(w, q=w.q.astype(dtype)) if _is_quant(w) else w, weights, is_leaf=_is_quant
        )

    def layer_weights(self, group: dict, idx, specs: dict) -> dict:
        def one(w, spec):
            if isinstance(w, OutMajor):
                return Stacked(w.w, idx, kernel_axes(spec), out_major=True)
            if spec.role in IN_PLACE and not (_is_quant(w) and w.blockwise):  # FP8 blocks: XLA's matmuls
                return Stacked(w, idx, kernel_axes(spec))
            return jax.tree_util.tree_map(lambda a: a[idx], w)

        return {name: one(w, specs[name]) for name, w in group.items()}

    def weight(self, w):
        return layer_of(w)

    def value(self, y):
        return total(value(y))

    # --- the layer's operations
    def rms_norm(self, x, w, eps: float, offset: float = 0.0):
        return xla.rms_norm(self.value(x), layer_of(w), eps, offset)

    def next_input(self, x, next_norm, eps: float, offset: float = 0.0):
        if _rows(x) <= k.NORM_ROWS:
            return x, None  # the next layer's Q/K/V kernel normalizes its rows
        return x, self.rms_norm(x, next_norm, eps, offset)

    def layer_input(self, x, h, norm, eps: float, offset: float = 0.0):
        return Normed(x, norm, eps, offset) if h is None else h

    def linear(self, x, w, n_contract: int = 1, partials: bool = False):
        if isinstance(w, Stacked):
            with self._scope():
                y = k.stacked_linear(x, w, n_contract, partials)
            if y is not None:
                return y
            return gemm(self.value(x), w.layer(), n_contract, w.out_major)
        return matmul(self.value(x), w, n_contract)

    def linears(self, x, ws: list, n_contract: int = 1, partials: bool = False) -> list:
        if all(isinstance(w, Stacked) for w in ws):
            with self._scope():
                ys = k.stacked_linears(x, ws, n_contract, partials)
            if ys is not None:
                return ys
        x = self.value(x)
        return [self.linear(x, w, n_contract) for w in ws]

    def gated_mlp(self, x, gate, up, down, act: str, partials: bool = False):
        """Gate and up in one kernel. The down projection's K-split partials are left for the
        residual add's kernel above `NORM_ROWS` rows; at fewer, the layer closes in XLA (see
        `close_layer`), so the kernel sums them itself."""
        x = self.value(x)
        with self._scope():
            h = k.gated(x, gate, up, functools.partial(activation, act))
        if h is None:
            h = activation(act, self.linear(x, gate)) * self.linear(x, up)
        return self.linear(h, down, partials=partials and _rows(x) > k.NORM_ROWS)

    def add_norm(self, x, y, post, pre, eps: float, offset: float = 0.0):
        return self._add_norm(x, y, post, pre, eps, offset, None)

    def close_layer(self, x, y, post, next_norm, eps: float, offset: float = 0.0, h_into=None):
        """Up to `NORM_ROWS` rows the add is XLA's and the next layer's norm is left to its Q/K/V
        kernel (one H100: batch 1 5% faster than the add-and-norm kernel), so the stream carries no
        h; above, one kernel does both, writing the norm over `h_into`."""
        if _rows(x) <= k.NORM_ROWS:
            y = self.value(y)
            if post is not None:
                y = self.rms_norm(y, post, eps, offset)
            return x + y, None
        return self._add_norm(x, y, post, next_norm, eps, offset, h_into)

    def _add_norm(self, x, y, post, pre, eps, offset, h_into):
        with self._scope():
            out = k.add_norm(x, y, post, pre, eps, offset, h_into)
        if out is not None:
            return out
        return super().add_norm(x, self.value(y), layer_of(post), layer_of(pre), eps, offset)

    def head_prologue(self, q, k_, v, prep, positions, layer_cache):
        with self._scope():
            fused = k.prologue(q, k_, v, prep, positions, layer_cache)
        if fused is not None:
            return fused[0], None, None, fused[1]
        prep = dataclasses.replace(prep, q_norm=layer_of(prep.q_norm), k_norm=layer_of(prep.k_norm))
        return super().head_prologue(q, k_, v, prep, positions, layer_cache)

    def paged_attention(self, q, layer_kv, positions, *, scale, softcap, window, keys=None):
        with self._scope():
            return k.paged_attention(q, layer_kv, positions, scale=scale, softcap=softcap, window=window, keys=keys)

    def output_head(self, h, table, tied: bool):
        with self._scope():
            out = k.output_head(h, table, tied)
        return super().output_head(h, table, tied) if out is None else out


def gemm(x, w, n_contract: int, out_major: bool):
    """XLA's product of x and a layer's weight where the kernels do not take it (a prefill's
    rows). An int8 weight is widened to x's dtype with its per-channel scale folded in, and the
    dot writes x's dtype (accumulating in float32): as `xla.matmul` does it, cuBLAS writes float32
    products that a pass of their own then scales, and every operation after reads them at twice
    the bytes (Qwen3-4B, 64 prompts of 128 tokens on one H200: 1 GB of float32 products a layer).
    The rounding differs from the kernels' (scale after the sum) by one bf16 step of the weight.
    A weight widened already (`loop_weights`) keeps its scale apart, so the copy is used as is."""
    if not (isinstance(w, QuantArray) and w.q.dtype == jnp.int8 and x.dtype != jnp.float32):
        return matmul(x, w, n_contract, out_major=out_major)
    s = w.scale.reshape(w.scale.shape + (1,) * n_contract) if out_major else w.scale
    return matmul(x, (w.q.astype(jnp.float32) * s).astype(x.dtype), n_contract, out_major, out_dtype=x.dtype)
