"""64-bit offsets for the large one-byte arrays the kernels index.

Pallas's Triton lowering turns a ref index into element offsets that are added to the array's base
pointer, and it makes them 32-bit unless the array is over 2**32 *bytes*. Triton adds an offset as
a signed integer, so 32 bits reach 2**31 - 1 elements. For arrays of two or more bytes an element
count under 2**31 follows from the byte bound, but a one-byte array of 2 to 4 GiB has offsets past
2**31 that wrap negative: loads from outside the array (other buffers' bytes, or an illegal-address
fault) and stores into them. Such arrays are ordinary here: the int8 weight stack of a layer group
(Qwen3-14B's gate and up, Gemma 4 31B's Q on one GPU and most of its projections at TP=2) and the
int8 KV cache of a few dozen rows.

`install()` makes the lowering take 64-bit offsets for every array of 2**31 elements or more, as
it already does for every array over 4 GiB. Where this JAX's lowering is not laid out as expected
it installs nothing and returns False; `check()` then refuses, by name, any operand the 32-bit
offsets cannot address.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxllm.errors import ModelError

LIMIT = 2**31  # elements a signed 32-bit offset addresses
_installed: bool | None = None


def _needs_wide(shape, dtype) -> bool:
    n = math.prod(shape)
    return n >= LIMIT and n * np.dtype(dtype).itemsize <= 2**32


def install() -> bool:
    """Widen the Triton lowering's offsets for one-byte arrays of 2**31 elements or more; True when
    in place (also when already installed)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        from jax._src.pallas.triton import lowering as tl

        orig = tl._compute_offsets_from_indices
        fields = {f.name for f in dataclasses.fields(tl.BlockInfo)}
    except (ImportError, AttributeError, TypeError):
        _installed = False
        return False
    if "full_shape_dtype" not in fields or getattr(orig, "_jaxllm_wide", False):
        _installed = getattr(orig, "_jaxllm_wide", False)
        return _installed

    def offsets(block_info, nd_indexer):
        sd = block_info.full_shape_dtype
        if _needs_wide(sd.shape, sd.dtype):
            # Its byte size decides the offset width: present it as 8-byte elements, over 2**32.
            block_info = dataclasses.replace(block_info, full_shape_dtype=jax.ShapeDtypeStruct(sd.shape, np.int64))
        return orig(block_info, nd_indexer)

    offsets._jaxllm_wide = True
    tl._compute_offsets_from_indices = offsets
    _installed = True
    return True


def check(*arrays) -> None:
    """Raise where the kernels would index an operand past what their offsets address (only when
    `install()` could not widen them)."""
    if install():
        return
    for a in arrays:
        if a is not None and hasattr(a, "shape") and _needs_wide(a.shape, a.dtype):
            raise ModelError(
                f"a {a.dtype} array of shape {tuple(a.shape)} is too large for the Pallas kernels' "
                f"32-bit offsets in this JAX version; run with JAXLLM_KERNELS=xla"
            )
