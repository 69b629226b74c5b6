"""Tensor sources: a name -> numpy lookup over a checkpoint, read one tensor at a time."""

from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxllm.errors import ModelError


class SafetensorsSource:
    """All tensors of an HF directory (one file, or many with model.safetensors.index.json),
    memory-mapped through the safetensors library."""

    def __init__(self, model_dir: Path):

        self._open = safe_open
        self._handles: dict[Path, object] = {}
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise ModelError(f"{index}: malformed index ({e})") from None
            files = {name: model_dir / f for name, f in weight_map.items()}
        else:
            paths = sorted(model_dir.glob("*.safetensors"))
            if not paths:
                raise ModelError(f"{model_dir}: no *.safetensors weights found")
            files = {}
            for p in paths:
                for name in self._handle(p).keys():
                    files[name] = p
        self.files = files

    def _handle(self, path: Path):
        h = self._handles.get(path)
        if h is None:
            if not path.exists():
                raise ModelError(f"weight file {path.name} named in the index is missing")
            _header(path)  # size check before mapping
            try:
                h = self._open(str(path), framework="numpy")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ModelError(f"{path.name}: not a readable safetensors file ({_one_line(e)})") from None
            self._handles[path] = h
        return h

    def names(self):
        return self.files.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name ("BF16", "F8_E4M3", ...), read from the header."""
        return self._handle(self.files[name]).get_slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        h = self._handle(self.files[name])
        viewed = VIEWED.get(h.get_slice(name).get_dtype())
        if viewed is not None:
            return _read_viewed(self.files[name], name, viewed)
        return h.get_tensor(name)


_HEADERS: dict[Path, tuple[int, dict]] = {}


def _header(path: Path) -> tuple[int, dict]:
    """The file's JSON header, checked against its size: safe_open maps lazily, so a truncated
    file would otherwise fail only at first read, deep inside loading."""
    if path not in _HEADERS:
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError("bad header length")
                header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ModelError(f"{path.name}: not a readable safetensors file (bad header)") from None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ModelError(f"{path.name} is truncated: {size} bytes, its header needs {8 + n + end}")
        _HEADERS[path] = (n, header)
    return _HEADERS[path]


# numpy has neither bfloat16 nor float8 (FP8 checkpoints' weights), so the mapped bytes of these are
# viewed through ml_dtypes (a jax dependency).
VIEWED = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _read_viewed(path: Path, name: str, dtype) -> np.ndarray:
    n, header = _header(path)
    info = header[name]
    begin, end = info["data_offsets"]
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n + begin, shape=(end - begin,))
    return mm.view(dtype).reshape(info["shape"])


PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


class ExpertsStacked:
    """A source that also offers a layer's experts stacked, as transformers holds them in memory
    (`experts.gate_up_proj` [E, 2F, D], each expert's gate rows then its up rows; `experts.down_proj`
    [E, D, F]) where the checkpoint stores one expert at a time (`experts.<e>.gate_proj.weight`, ...:
    Qwen3-MoE's published checkpoints, and what `save_pretrained` writes for them)."""

    def __init__(self, source):
        self.source = source
        count: dict[str, int] = {}
        for name in source.names():
            m = PER_EXPERT.fullmatch(name)
            if m:
                count[m[1]] = max(count.get(m[1], 0), int(m[2]) + 1)
        self.stacked = {}  # stacked name -> per expert, the tensors concatenated into its row
        for base, E in count.items():
            one = lambda e, *projs: tuple(f"{base}.{e}.{p}_proj.weight" for p in projs)
            self.stacked[f"{base}.gate_up_proj"] = [one(e, "gate", "up") for e in range(E)]
            self.stacked[f"{base}.down_proj"] = [one(e, "down") for e in range(E)]
        self._names = {**dict.fromkeys(source.names()), **dict.fromkeys(self.stacked)}.keys()

    def names(self):
        return self._names

    def shape(self, name):
        parts = self.stacked.get(name)
        if parts is None:
            return self.source.shape(name)
        rows = {tuple(self._shape(n) for n in p) for p in parts}
        if len(rows) != 1:
            raise ModelError(f"the experts stacked into '{name}' differ in shape")
        (row,) = rows
        return (len(parts), sum(s[0] for s in row), *row[0][1:])

    def _shape(self, name):
        if name not in self.source.names():
            raise ModelError(f"checkpoint is missing tensor '{name}'")
        return self.source.shape(name)

    def get(self, name):
        parts = self.stacked.get(name)
        if parts is None:
            return self.source.get(name)
        return np.stack([np.concatenate([self.source.get(n) for n in p]) for p in parts])

    def stored(self, name):
        """A tensor's FP8 values and block scales as stored (`fp8.Fp8Source.stored`); None for the
        stacked experts and where the source has none."""
        stored = getattr(self.source, "stored", None)
        return None if stored is None or name in self.stacked else stored(name)


def _one_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
