"""The layer matmul weights laid out for the GPU kernels: each stack output-major.

The model holds a layer weight input-major, `[L, *in, *out]`. The kernels read it faster with each
output channel's inputs contiguous, `[L, *out, *in]`: inside the decode step on an H100 the batch-1
Q/K/V, O and down kernels ran 1.2-1.3x faster, and batch-8 decode 12% faster (`kernels.matmul`;
docs/benchmarks.md has the measurements). `out_major` transposes
those stacks once, after loading (`PallasOps.prepare_weights`); wherever XLA multiplies them instead (a
prefill) the backend contracts them the other way round, so nothing else changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllm.compiling import compile_all
from jaxllm.ops.gpu import log
from jaxllm.ops.gpu.types import OutMajor
from jaxllm.quant import QuantArray


def kernel_axes(spec) -> tuple | None:
    """The logical axes of one layer of the stack `spec` describes (a `model.params.ParamSpec`,
    the layer axis first), in the model's order, where the kernels lay the stack out output-major
    and, on a mesh, read its shards by those names: a matmul weight each of whose dims has a name
    (the projections and the MLP). None for any other, among them the matmul weights with an
    unnamed dim (Gemma 4's per-layer-input projections), which the kernels read as the model
    holds them, on one device."""
    if spec.role != "matmul" or None in spec.axes:
        return None
    return tuple(spec.axes[1:])


def _transpose(a, n_contract: int, donate: bool):
    """[L, *in, *out] -> [L, *out, *in] on a's devices, its sharding permuted with its dims: the
    lowered function, to compile."""
    perm = (0,) + tuple(range(1 + n_contract, a.ndim)) + tuple(range(1, 1 + n_contract))
    sharding = getattr(a, "sharding", None)
    out = None
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (a.ndim - len(sharding.spec))
        out = NamedSharding(sharding.mesh, P(*(spec[i] for i in perm)))
    return jax.jit(lambda x: jnp.transpose(x, perm), out_shardings=out, donate_argnums=(0,) if donate else ()).lower(a)


def _stack(w, spec):
    """The array of a layer weight to lay out output-major, and its contracted dims, or None."""
    if isinstance(w, OutMajor) or kernel_axes(spec) is None:
        return None
    n = spec.n_contract
    if isinstance(w, QuantArray):  # not FP8 blocks: the kernels take int8 per channel (XLA the rest)
        return (w.q, n) if w.n_contract == n and not w.blockwise else None
    return w, n


def out_major(weights: dict, specs: dict, donate: bool = False) -> dict:
    """`weights` with each layer stack the kernels take output-major (`kernel_axes`; Q, K, V, O,
    gate, up, down), as `specs` (the model's `ParamSpec` tree) describes them. The transposes are
    compiled together (`compiling.compile_all`), then run one stack at a time; with `donate` each
    input stack is freed as its copy is made, so loading needs one stack of headroom rather than a
    second model."""
    stacks, layer_specs = weights["layers"], specs["layers"]
    todo = [(g, k) for g, group in stacks.items() for k, v in group.items() if _stack(v, layer_specs[g][k]) is not None]
    fns = compile_all(todo, lambda gk: _transpose(*_stack(stacks[gk[0]][gk[1]], layer_specs[gk[0]][gk[1]]), donate))
    layers = {g: dict(group) for g, group in stacks.items()}
    for (g, k), fn in zip(todo, fns):
        w = layers[g][k]
        n = layer_specs[g][k].n_contract
        if isinstance(w, QuantArray):
            layers[g][k] = OutMajor(QuantArray(fn(w.q), w.scale, n), n)
        else:
            layers[g][k] = OutMajor(fn(w), n)
    log.info("layer matmul weights laid out output-major for the kernels")
    return {**weights, "layers": layers}
