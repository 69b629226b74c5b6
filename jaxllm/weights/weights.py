"""Checkpoint tensors -> the weights pytree: names from the family, layout and checks shared.

Tensors are read one at a time, converted to our layout ([in..., out...] for matmuls), quantized
or cast right away, and only then stacked per attention kind, so the float32 copy of a tensor
never outlives its own conversion.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jaxllm.config.model import ModelConfig
from jaxllm.errors import ModelError
from jaxllm.model.params import ParamSpec, is_spec
from jaxllm.model.sharding import check_divisible, scale_shape_axes, single_device_layout
from jaxllm.quant import VALUE_DTYPES, QuantArray, fp8_ratios, quantize_blocks_np, quantize_np, quantize_rows_np
from jaxllm.weights.fp8 import layout_scales
from jaxllm.weights.place import convert_layer, from_host, place_stacked, rows_to_host
from jaxllm.weights.safetensors_source import ExpertsStacked

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


def fetch_check(source, name: str, spec: ParamSpec, stacked: bool) -> None:
    if name not in source.names():
        raise ModelError(f"checkpoint is missing tensor '{name}'")
    want = hf_shape(spec, stacked)
    got = source.shape(name)
    if tuple(got) != tuple(want):
        raise ModelError(f"tensor '{name}' has shape {tuple(got)}, but config.json implies {tuple(want)}")


def fetch(source, name: str, spec: ParamSpec, stacked: bool, convert: Callable | None) -> np.ndarray:
    fetch_check(source, name, spec, stacked)
    a = np.asarray(source.get(name), np.float32)
    if convert is not None:
        a = convert(a)
    return to_layout(a, spec, stacked)


# Embedding tables go int8 with the weights (one scale per row, which also serves as the tied
# output head's per-logit scale). Measured on Gemma 3 270M (GPL-3, first 3000 tokens, window 1024,
# stride 512): bf16 weights PPL 15.041; int8 projections with a bf16 table 15.008 (-0.22%); int8
# projections and table 15.057 (+0.11%), logits RMS difference 0.35 vs 0.37 and top-1 agreement
# 95.7% vs 95.3%. The table's quantization error is lost in the projections', and int8 halves the
# table, the largest tensor a decode step reads (262144 x 5376 in Gemma 4 31B, most of a 270M).
QUANTIZE_EMBEDDINGS = True


def is_quantized(spec: ParamSpec, quant: str) -> bool:
    if quant != "int8":
        return False
    return bool(spec.n_contract) or (QUANTIZE_EMBEDDINGS and tuple(spec.axes) == ("vocab", "embed"))


def weight_format(spec: ParamSpec, quant: str) -> str | None:
    """A weight's format on the device under `quant`: "int8" (`is_quantized`); "fp8", float8_e4m3fn
    values with a scale per 128 x 128 block (`quant.fp8_ratios`), for the layers' matmul weights
    (the embedding and output head keep the compute dtype, as FP8 checkpoints keep them in bf16);
    None, the compute dtype."""
    if quant == "fp8":
        return "fp8" if spec.n_contract and spec.axes[0] == "layers" else None
    return "int8" if is_quantized(spec, quant) else None


def fp8_layer(source, name: str, spec: ParamSpec, convert) -> tuple[np.ndarray, np.ndarray]:
    """One layer of an FP8 weight (values, block scales): as the checkpoint stores it where it does
    (`fp8.Fp8Source.stored`), else quantized from its float values."""
    fetch_check(source, name, spec, True)
    layer = spec.shape[1:]
    stored = source.stored(name) if convert is None and not spec.n_batch else None
    if stored is None:
        a = fetch(source, name, spec, True, convert)
        return quantize_blocks_np(a, fp8_ratios(layer, spec.n_batch, spec.n_contract))
    n = spec.n_contract
    return to_layout(stored.values, spec, True), layout_scales(stored, layer[:n], layer[n:])


def finish(arrays: list[np.ndarray], spec: ParamSpec, stacked: bool, dtype, quant: str):
    """Quantize (matmul weights under int8) or cast each piece, then stack the layers (host arrays,
    for callers that already hold every layer in memory)."""
    if is_quantized(spec, quant):
        pieces = [
            quantize_np(a, spec.n_contract, spec.n_batch) if spec.n_contract else quantize_rows_np(a) for a in arrays
        ]
        q, s = [p[0] for p in pieces], [p[1] for p in pieces]
        if stacked:
            return QuantArray(jnp.asarray(np.stack(q)), jnp.asarray(np.stack(s)), spec.n_contract)
        return QuantArray(jnp.asarray(q[0]), jnp.asarray(s[0]), spec.n_contract)
    npd = _np_dtype(dtype)
    cast = [a.astype(npd) for a in arrays]
    return jnp.asarray(np.stack(cast) if stacked else cast[0])


def place_weight(source, names, spec: ParamSpec, stacked: bool, dtype, quant: str, convert, sharding):
    """One weight of the tree, straight into its device shards (see loading.place)."""
    fmt = weight_format(spec, quant)
    int8 = fmt == "int8"
    shardings = (sharding.q, sharding.scale) if fmt else (sharding,)
    if stacked:
        shapes = [spec.shape] + ([scale_shape_axes(spec, fmt == "fp8")[0]] if fmt else [])
        dtypes = [VALUE_DTYPES[fmt], jnp.float32] if fmt else [dtype]
        nb = getattr(spec, "n_batch", 0)
        if fmt == "fp8":
            layer = lambda nm: fp8_layer(source, nm, spec, convert)
        else:
            layer = lambda nm: convert_layer(fetch(source, nm, spec, True, convert), spec.n_contract, dtype, int8, nb)
        arrays = place_stacked([partial(layer, nm) for nm in names], shapes, dtypes, shardings)
    elif len(spec.shape) == 2 and "vocab" in spec.axes and convert is None:
        fetch_check(source, names[0], spec, False)
        transpose = bool(spec.n_contract)
        mode = ("cols" if transpose else "rows") if int8 else None
        host = rows_to_host(source.get(names[0]), transpose, dtype, mode)
        arrays = [from_host(a, sh) for a, sh in zip(host, shardings)]
    else:
        a = fetch(source, names[0], spec, False, convert)
        host = convert_layer(a, spec.n_contract, dtype, int8) if spec.n_contract or not int8 else quantize_rows_np(a)
        arrays = [from_host(h, sh) for h, sh in zip(host, shardings)]
    return QuantArray(arrays[0], arrays[1], spec.n_contract, fmt == "fp8") if fmt else arrays[0]


def build_weights(
    cfg: ModelConfig,
    family,
    source,
    dtype,
    quant: str = "none",
    progress: Callable[[int, int], None] | None = None,
    layout=None,
) -> dict:
    """Fill the family's abstract weights from `source` (safetensors or dequantized GGUF), placed
    on the devices of `layout` (default: the first device)."""

    layout = layout or single_device_layout()
    tree = family.abstract(cfg)
    check_divisible(layout, tree)
    source = ExpertsStacked(source)
    prefix = detect_prefix(source)
    shardings = layout.weight_shardings(tree, lambda s: weight_format(s, quant))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)
    sh_leaves = treedef.flatten_up_to(shardings)
    convert = getattr(family, "convert_tensor", None)
    out = []
    for n, ((path, spec), sharding) in enumerate(zip(leaves, sh_leaves)):
        keys = [p.key for p in path]
        if keys[0] == "layers":
            ids = [i for i in range(cfg.num_layers) if cfg.group_of(i) == keys[1]]
            names = [prefix + family.hf_name(keys[2], i) for i in ids]
        else:
            names = [prefix_for(prefix, family.hf_name(keys[0], None))]
        stacked = keys[0] == "layers"
        conv = (lambda a, key=keys[-1]: convert(cfg, key, a)) if convert else None
        out.append(place_weight(source, names, spec, stacked, dtype, quant, conv, sharding))
        if progress:
            progress(n + 1, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, out)


def prefix_for(prefix: str, name: str) -> str:
    """Top-level names like 'lm_head.weight' sit outside the model prefix."""
    return name if name.startswith("lm_head") else prefix + name
