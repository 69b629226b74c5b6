"""FP8 checkpoints (`stored_quant.Fp8Blocks`): their tensors read one at a time, each quantized
weight dequantized on the host as the loader asks for it, so that no float copy of more than one
tensor exists; or, for FP8 weights on the device (--quant fp8), its values kept as stored and its
block scales laid out as the model's weight is."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxllm.errors import ModelError
from jaxllm.quant import block_ratios
from jaxllm.weights.stored_quant import Fp8Blocks

SCALE = "_scale_inv"  # `<weight name>_scale_inv`: a quantized weight's block scales
SCALE_DTYPES = ("F32", "BF16", "F16")


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float32 values of an FP8 weight [..., out, in]: each value times the scale of its block,
    `scale_inv[..., o // block[0], i // block[1]]` (the last blocks of a dim not a multiple of the
    block are partial), as transformers dequantizes them; one block row at a time, in place."""
    bo, bi = block
    O, I = q.shape[-2:]
    w = q.astype(np.float32)
    s = np.asarray(scale_inv, np.float32)
    for g in range(s.shape[-2]):
        w[..., g * bo : (g + 1) * bo, :] *= np.repeat(s[..., g : g + 1, :], bi, axis=-1)[..., :I]
    return w


class Stored(NamedTuple):
    """A weight as an FP8 checkpoint stores it."""

    values: np.ndarray  # float8_e4m3fn [..., out, in]
    scale_inv: np.ndarray  # float [..., ceil(out / block[0]), ceil(in / block[1])]
    block: tuple[int, int]


def layout_scales(stored: Stored, contract: tuple, out: tuple) -> np.ndarray:
    """The block scales of a stored weight [out, in] (`out` and `contract` its dims, each group
    flattened) for its values in the model's layout [*contract, *out], in boxes of
    `quant.block_ratios` along each group: each box's scale that of the stored block holding it."""
    block = stored.block
    rows = _box_starts(out, block_ratios(out, block[0])) // block[0]
    cols = _box_starts(contract, block_ratios(contract, block[1])) // block[1]
    s = np.asarray(stored.scale_inv, np.float32)[rows[None, :], cols[:, None]]
    shape = [d // r for dims, b in ((contract, block[1]), (out, block[0])) for d, r in zip(dims, block_ratios(dims, b))]
    return s.reshape(shape)


def _box_starts(dims: tuple, ratios: tuple) -> np.ndarray:
    """The flat (row-major) index of each box's first entry, the boxes in row-major order."""
    grid = np.indices([d // r for d, r in zip(dims, ratios)]).reshape(len(dims), -1)
    return np.ravel_multi_index(tuple(grid * np.array(ratios)[:, None]), dims)


class Fp8Source:
    """A tensor source (`SafetensorsSource`) of an FP8 checkpoint: the names without the scales;
    `get` dequantizes a quantized weight to float32, `stored` gives its values and block scales as
    the checkpoint holds them."""

    def __init__(self, source, fmt: Fp8Blocks):
        self.source, self.block = source, fmt.block
        names = source.names()
        self.scaled = {n[: -len(SCALE)] for n in names if n.endswith(SCALE)}
        for n in sorted(self.scaled):
            if n not in names:
                raise ModelError(f"checkpoint has '{n}{SCALE}' but no '{n}'")
        self._names = dict.fromkeys(n for n in names if not n.endswith(SCALE)).keys()

    def names(self):
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(name)

    def get(self, name: str) -> np.ndarray:
        stored = self.stored(name)
        if stored is None:
            return self.source.get(name)
        return dequantize_blocks(*stored)

    def stored(self, name: str) -> Stored | None:
        """A quantized weight's values and block scales; None for a tensor stored unquantized."""
        dtype = self.source.dtype(name)
        if name not in self.scaled:
            if dtype.startswith("F8"):
                raise ModelError(f"tensor '{name}' is FP8 but the checkpoint has no '{name}{SCALE}'")
            return None
        shape = self.source.shape(name)
        if dtype != "F8_E4M3" or len(shape) < 2:
            raise ModelError(f"tensor '{name}' has block scales but is {dtype} {list(shape)}, not an F8_E4M3 matrix")
        want = (*shape[:-2], *(math.ceil(d / b) for d, b in zip(shape[-2:], self.block)))
        got = (self.source.dtype(name + SCALE), tuple(self.source.shape(name + SCALE)))
        if got[0] not in SCALE_DTYPES or got[1] != want:
            raise ModelError(
                f"tensor '{name}{SCALE}' is {got[0]} {list(got[1])}; {list(shape)} weights in "
                f"{self.block[0]}x{self.block[1]} blocks have float scales {list(want)}"
            )
        q, s = self.source.get(name), self.source.get(name + SCALE)
        return Stored(q, s, self.block)
