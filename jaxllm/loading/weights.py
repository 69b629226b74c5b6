"""Checkpoint tensors -> the weights pytree: names from the family, layout and checks shared.

Tensors are read one at a time, converted to our layout ([in..., out...] for matmuls), quantized
or cast right away, and only then stacked per attention kind, so the float32 copy of a tensor
never outlives its own conversion.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import ml_dtypes

from ..config import ModelConfig
from ..errors import ModelError
from ..params import ParamSpec, is_spec
from ..quant import QuantArray, quantize_np

PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")


def detect_prefix(source, probe: str = "embed_tokens.weight") -> str:
    for p in PREFIXES:
        if p + probe in source.names():
            return p
    raise ModelError(f"checkpoint has no '{probe}' under any known prefix; is this a causal LM checkpoint?")


def hf_shape(spec: ParamSpec, stacked: bool) -> tuple[int, ...]:
    """The shape the checkpoint stores: matmul weights as [out, in] (torch Linear; after any batch
    dims such as experts), others as is."""
    shape = spec.shape[1:] if stacked else spec.shape
    if spec.n_contract:
        nb, n = spec.n_batch, spec.n_contract
        mat = shape[nb:]
        return (*shape[:nb], int(np.prod(mat[n:])), int(np.prod(mat[:n])))
    return shape


def to_layout(a: np.ndarray, spec: ParamSpec, stacked: bool) -> np.ndarray:
    shape = spec.shape[1:] if stacked else spec.shape
    if spec.n_contract:
        return np.ascontiguousarray(np.swapaxes(a, -1, -2)).reshape(shape)
    return a.reshape(shape)


def _np_dtype(dtype):
    return ml_dtypes.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else np.dtype(jnp.dtype(dtype).name)


def fetch(source, name: str, spec: ParamSpec, stacked: bool, convert: Callable | None) -> np.ndarray:
    if name not in source.names():
        raise ModelError(f"checkpoint is missing tensor '{name}'")
    want = hf_shape(spec, stacked)
    got = source.shape(name)
    if tuple(got) != tuple(want):
        raise ModelError(f"tensor '{name}' has shape {tuple(got)}, but config.json implies {tuple(want)}")
    a = np.asarray(source.get(name), np.float32)
    if convert is not None:
        a = convert(a)
    return to_layout(a, spec, stacked)


def finish(arrays: list[np.ndarray], spec: ParamSpec, stacked: bool, dtype, quant: str):
    """Quantize (matmul weights under int8) or cast each piece, then stack the layers."""
    if quant == "int8" and spec.n_contract:
        pieces = [quantize_np(a, spec.n_contract, spec.n_batch) for a in arrays]
        q, s = [p[0] for p in pieces], [p[1] for p in pieces]
        if stacked:
            return QuantArray(jnp.asarray(np.stack(q)), jnp.asarray(np.stack(s)), spec.n_contract)
        return QuantArray(jnp.asarray(q[0]), jnp.asarray(s[0]), spec.n_contract)
    npd = _np_dtype(dtype)
    cast = [a.astype(npd) for a in arrays]
    return jnp.asarray(np.stack(cast) if stacked else cast[0])


def build_weights(cfg: ModelConfig, family, source, dtype, quant: str = "none",
                  progress: Callable[[int, int], None] | None = None) -> dict:
    """Fill the family's abstract weights from `source` (safetensors or dequantized GGUF)."""
    prefix = detect_prefix(source)
    tree = family.abstract(cfg)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    convert = getattr(family, "convert_tensor", None)
    out = []
    for n, (path, spec) in enumerate(leaves):
        keys = [p.key for p in path]
        if keys[0] == "layers":
            ids = [i for i in range(cfg.num_layers) if cfg.group_of(i) == keys[1]]
            names = [prefix + family.hf_name(keys[2], i) for i in ids]
        else:
            names = [prefix_for(prefix, family.hf_name(keys[0], None))]
        stacked = keys[0] == "layers"
        conv = (lambda a, key=keys[-1]: convert(cfg, key, a)) if convert else None
        arrays = [fetch(source, nm, spec, stacked, conv) for nm in names]
        out.append(finish(arrays, spec, stacked, dtype, quant))
        if progress:
            progress(n + 1, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, out)


def prefix_for(prefix: str, name: str) -> str:
    """Top-level names like 'lm_head.weight' sit outside the model prefix."""
    return name if name.startswith("lm_head") else prefix + name
