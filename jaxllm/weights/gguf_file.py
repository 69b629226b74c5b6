"""A GGUF header parser: metadata and tensor table, with tensor data as views of memmaps.

gguf's own GGUFReader builds a numpy view per field part, which costs ~10 s on a 262k-entry
vocabulary; reading the header with plain bytes takes a fraction of a second. Dequantization is
still the gguf package's.

A file may come in consecutive parts (`SplitFile`: the embedded model, as its wheels install it);
they are mapped where they lie, so the model is never copied whole onto the disk.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
STRING, ARRAY = 8, 9


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class SplitFile:
    """A file stored as consecutive parts, read as one where the parts lie."""

    name: str  # the whole file's name
    parts: tuple[Path, ...]


class Parts:
    """Byte arrays read as one: a range inside one array is a view of it, a range across arrays a
    copy (the one tensor that crosses, when it is read)."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = arrays
        self.starts = [0]
        for a in arrays:
            self.starts.append(self.starts[-1] + len(a))

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, begin: int, end: int) -> np.ndarray:
        if begin >= end:
            return self.arrays[0][:0]
        i = bisect.bisect_right(self.starts, begin) - 1
        if end <= self.starts[i + 1]:
            return self.arrays[i][begin - self.starts[i] : end - self.starts[i]]
        pieces = []
        while begin < end:
            stop = min(end, self.starts[i + 1])
            pieces.append(self.arrays[i][begin - self.starts[i] : stop - self.starts[i]])
            begin, i = stop, i + 1
        return np.concatenate(pieces)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order (innermost first), as gguf reports it
    tensor_type: object  # gguf.GGMLQuantizationType
    data_offset: int
    n_bytes: int
    file: GGUFFile = field(repr=False)

    @property
    def data(self) -> np.ndarray:
        """Raw: float/int dtype for plain types, uint8 rows for quantized ones."""
        return self.file.tensor_data(self)


class GGUFFile:
    def __init__(self, path: Path | SplitFile):
        import gguf  # half a second: loaded only where a GGUF file is read

        self.path = path if isinstance(path, SplitFile) else Path(path)
        parts = self.path.parts if isinstance(path, SplitFile) else (self.path,)
        self.buf = Parts([np.memmap(p, dtype=np.uint8, mode="r") for p in parts])
        self.mv = memoryview(self.buf.arrays[0])  # the header, as long as it lies in the first part
        self.pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError("not a GGUF file")
        version, n_tensors, n_kv = self._u32(), self._u64(), self._u64()
        if version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {version}")
        self.meta: dict = {}
        for _ in range(n_kv):
            key = self._str()
            self.meta[key] = self._value(self._u32())
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            nd = self._u32()
            dims = tuple(self._u64() for _ in range(nd))
            infos.append((name, dims, self._u32(), self._u64()))
        align = int(self.meta.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, dims, ttype, off in infos:
            if ttype not in {int(t) for t in gguf.GGMLQuantizationType}:
                raise GGUFFormatError(f"tensor {name!r} has ggml type {ttype}, which the gguf package does not know")
            qt = gguf.GGMLQuantizationType(ttype)
            block, size = gguf.GGML_QUANT_SIZES[qt]
            n_elem = int(np.prod(dims)) if dims else 1
            n_bytes = n_elem // block * size
            begin = start + off
            if begin + n_bytes > len(self.buf):
                raise GGUFFormatError(f"truncated GGUF file (tensor {name!r} runs past its end)")
            self.tensors.append(TensorInfo(name, dims, qt, begin, n_bytes, self))

    def tensor_data(self, t: TensorInfo) -> np.ndarray:
        import gguf

        raw = self.buf.read(t.data_offset, t.data_offset + t.n_bytes)
        shape = tuple(reversed(t.shape))
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return raw.view(np.float32 if t.tensor_type == gguf.GGMLQuantizationType.F32 else np.float16).reshape(shape)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        return raw.reshape(rows, -1) if len(shape) > 1 else raw

    # -- primitive reads -------------------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFFormatError("truncated GGUF header")
        out = self.mv[self.pos : end] if end <= len(self.mv) else memoryview(self.buf.read(self.pos, end))
        self.pos = end
        return out

    def _u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def _u64(self) -> int:
        return struct.unpack("<Q", self._take(8))[0]

    def _str(self) -> str:
        return bytes(self._take(self._u64())).decode("utf-8", errors="replace")

    def _value(self, vtype: int):
        if vtype == STRING:
            return self._str()
        if vtype == ARRAY:
            etype, n = self._u32(), self._u64()
            if etype == STRING:
                return [self._str() for _ in range(n)]
            if etype in _NP:
                itemsize = np.dtype(_NP[etype]).itemsize
                return np.frombuffer(bytes(self._take(n * itemsize)), dtype=_NP[etype]).tolist()
            return [self._value(etype) for _ in range(n)]
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]
        raise GGUFFormatError(f"unknown GGUF value type {vtype}")
