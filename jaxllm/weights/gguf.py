"""GGUF loading: config, weights and tokenizer of the architectures llama.cpp's converter writes for
the families jaxllm runs -- `gemma3`, `qwen3`, `qwen3moe` and `gemma4` (`gguf_archs` says what each
file's metadata and tensor names mean, `gguf_tokenizer` rebuilds its tokenizer).

A file reads as the HF checkpoint it was converted from: the config.json dict, and tensors under HF
names, dequantized to float32 by the gguf package. For Gemma 3 that is what transformers' GGUF path
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)`) builds, the test-time reference;
deliberate differences are marked "Unlike transformers". transformers 5.24 reads the other three
only in part (not Qwen3-MoE's expert width, nor Gemma 4's per-layer keys), so their reference is the
checkpoint itself. transformers is not imported here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import quants

from jaxllm.errors import ModelError
from jaxllm.model.families import family_for
from jaxllm.weights.gguf_archs import ARCHS, Meta, config_only_names, tensor_names
from jaxllm.weights.gguf_file import GGUFFile, SplitFile
from jaxllm.weights.gguf_tokenizer import GGUFTokenizerInfo, build_tokenizer

SUPPORTED_ARCHITECTURES = tuple(ARCHS)

Q = gguf.GGMLQuantizationType
# what the gguf package dequantizes: the float types and every block type it has a class for
# (Q4_0, Q8_0, the K-quants, the i-quants, ...)
DEQUANTIZABLE = frozenset({Q.F32, Q.F16, *quants._type_traits})


# ----------------------------------------------------------------------------------------------
# Reading the file
# ----------------------------------------------------------------------------------------------

# A load asks for config, tensors and tokenizer separately: keep the last few parsed files (each is
# a memmap plus parsed metadata, not the tensor data).
_reader_cache: dict = {}
_READER_CACHE_SIZE = 4


def _name(path) -> str:
    """A GGUF file's name (a `SplitFile` is named as its parts joined)."""
    return path.name if isinstance(path, SplitFile) else Path(path).name


def _reader(path):
    """A parsed `GGUFFile` for `path` (a file, or a `SplitFile`), or ModelError with a one-line reason."""
    parts = path.parts if isinstance(path, SplitFile) else (Path(path),)
    shown = path.name if isinstance(path, SplitFile) else parts[0]
    try:
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in parts)
        if key in _reader_cache:
            return _reader_cache[key]
        with open(parts[0], "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelError(f"cannot read GGUF file {shown}: {err.strerror or err}") from None
    if magic != b"GGUF":
        raise ModelError(f"{shown}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFFile(path)
    except Exception as err:  # damaged files surface as ValueError/IndexError/struct errors
        reason = " ".join(str(err).split())[:120] or type(err).__name__  # one line, bounded
        raise ModelError(f"{shown}: truncated or corrupt GGUF file ({reason})") from None
    while len(_reader_cache) >= _READER_CACHE_SIZE:
        del _reader_cache[next(iter(_reader_cache))]  # oldest first (dicts keep insertion order)
    _reader_cache[key] = reader
    return reader


def _checked_metadata(path) -> tuple[object, dict]:
    reader = _reader(path)
    meta = reader.meta  # every key/value field as Python values (strings decoded, arrays as lists)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported GGUF architecture {arch!r} in {_name(path)} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return reader, meta


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def _meta(path) -> Meta:
    reader, meta = _checked_metadata(path)
    return Meta(meta, {t.name: t for t in reader.tensors}, _name(path))


def read_gguf_config(path) -> dict:
    """An HF `config.json`-style dict of the model the GGUF file was converted from."""
    m = _meta(path)
    return ARCHS[m.arch].config(m)


# ----------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------


_DEQUANT_CHUNK = 1 << 22  # elements a step: big enough that numpy's per-call cost vanishes


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """`gguf.quants.dequantize`, in chunks of rows a few MB each. gguf's own splits every tensor
    into groups of 16 rows, and that per-group overhead was most of a load's dequantization time;
    the values are the same (each block is dequantized on its own either way)."""
    kind = quants._type_traits.get(qtype)
    if kind is None or data.ndim < 1 or data.dtype != np.uint8:
        return quants.dequantize(data, qtype)
    kind.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    step = max(1, _DEQUANT_CHUNK // max(1, rows.shape[1]))
    out = np.empty((rows.shape[0], rows.shape[1] // kind.type_size * kind.block_size), np.float32)
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = kind.dequantize_rows(rows[i : i + step])
    return out.reshape(*data.shape[:-1], out.shape[-1])


def _checked_names(path) -> tuple[object, str, dict]:
    """(reader, architecture, gguf name -> (HF name, piece, pieces)), every tensor's name and type
    checked before any is read."""
    reader, meta = _checked_metadata(path)
    arch = meta["general.architecture"]
    config = read_gguf_config(path)
    names = tensor_names(arch, family_for(config), config["num_hidden_layers"])
    skip = config_only_names(arch)
    for t in reader.tensors:
        if t.name not in names and t.name not in skip:
            raise ModelError(f"{_name(path)}: unexpected tensor {t.name!r} for {arch}")
        if t.tensor_type not in DEQUANTIZABLE:
            raise ModelError(
                f"{_name(path)}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            )
    return reader, arch, names


class GGUFSource:
    """A GGUF file's weights under HF names, each dequantized when asked for: a load holds one
    float32 tensor at a time, not the model (Qwen3-30B-A3B's would be 122 GB). Shapes are HF's:
    numpy's shape of a ggml tensor is its `ne` reversed, which for linears is already [out, in], so
    nothing is transposed; a tensor the converter wrote in pieces is joined along its rows."""

    def __init__(self, path):
        reader, arch, names = _checked_names(path)
        self.shown, self.shift = _name(path), ARCHS[arch].norm_shift
        tensors = {t.name: t for t in reader.tensors}
        self.pieces: dict[str, list] = {}
        for name, (hf, k, n) in names.items():
            if name in tensors:
                self.pieces.setdefault(hf, [None] * n)[k] = tensors[name]
        for name, (hf, k, _) in names.items():
            if hf in self.pieces and self.pieces[hf][k] is None:
                raise ModelError(f"{self.shown}: tensor {name!r} is missing")

    def names(self):
        return self.pieces.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        shapes = [tuple(int(d) for d in reversed(t.shape)) for t in self.pieces[name]]
        return (*shapes[0][:-2], sum(s[-2] for s in shapes), shapes[0][-1]) if len(shapes) > 1 else shapes[0]

    def get(self, name: str) -> np.ndarray:
        arrays = [self._read(t) for t in self.pieces[name]]
        return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=-2)

    def _read(self, tensor) -> np.ndarray:
        weights = _dequantize(tensor.data, tensor.tensor_type)
        # copy: F32 comes back as a view of the read-only memmap
        weights = np.array(weights, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if self.shift and tensor.name.endswith("norm.weight"):
            # transformers' Gemma2TensorProcessor takes the 1 off too; it subtracts in the stored
            # dtype, we in float32 -- equal for the F32 norms llama.cpp writes
            weights -= self.shift
        return weights


def iter_gguf_tensors(path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for every weight, one at a time."""
    source = GGUFSource(path)
    for name in source.names():
        yield name, source.get(name)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def load_gguf_tokenizer(path) -> GGUFTokenizerInfo:
    """The file's tokenizer, as transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
    builds it, with its ids and chat template (see gguf_tokenizer)."""
    _, meta = _checked_metadata(path)
    return build_tokenizer(meta, _name(path))
