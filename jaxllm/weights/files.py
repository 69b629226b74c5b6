"""Where a model's files are (a directory, a .gguf file, a hub id or the embedded default) and what
its directory says of it, with no JAX."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jaxllm.errors import ModelError
from jaxllm.tokenizer import Tokenizer, read_json
from jaxllm.weights.default import DEFAULT_MODEL_NAME, default_model_file
from jaxllm.weights.gguf_file import SplitFile
from jaxllm.weights.stored_quant import Fp8Blocks, stored_format

SAVED_META = "jaxllm.json"  # marks a directory written by jaxllm.convert (see `saved`)


@dataclass
class ModelFiles:
    name: str
    path: Path | SplitFile
    kind: str  # "hf" | "gguf" | "saved" (written by jaxllm.convert)
    stored: Fp8Blocks | None = None  # an HF directory's weights stored quantized (`stored_quant`)


def locate(model_dir: str | os.PathLike | None) -> ModelFiles:
    if model_dir is None:
        return ModelFiles(DEFAULT_MODEL_NAME, default_model_file(), "gguf")
    p = Path(model_dir).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelFiles(p.name, p, "gguf")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p}: no config.json (not a Hugging Face model directory)")
        if (p / SAVED_META).exists():
            return ModelFiles(p.name, p, "saved")
        return hf_files(p.name, p)
    if p.exists():
        raise ModelError(f"{p}: neither a model directory nor a .gguf file")
    s = str(model_dir)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        from jaxllm.weights.hub import resolve_hub_id

        return hf_files(s, resolve_hub_id(s))
    raise ModelError(f"model path {s} does not exist")


def hf_files(name: str, path: Path) -> ModelFiles:
    """An HF directory, a quantization its config.json names that cannot load refused by name here,
    before anything loads."""
    return ModelFiles(name, path, "hf", stored_format(read_json(path / "config.json"), str(path / "config.json")))


def read_hf_config(d: Path) -> tuple[dict, dict]:

    return read_json(d / "config.json"), read_json(d / "generation_config.json")


def read_dir(path: Path):
    """(config, family, tokenizer) of a directory with a config.json (Hugging Face or saved)."""
    from jaxllm.model.families import family_for

    hf, gen = read_hf_config(path)
    fam = family_for(hf)  # refuses unknown architectures before any weight is read
    cfg = fam.config_from_hf(hf, gen)
    tok = Tokenizer.from_hf_dir(path, fam.CHAT_TEMPLATE)
    if tok is not None and tok.eos_ids:
        cfg = cfg.replace(eos_ids=tuple(dict.fromkeys(cfg.eos_ids + tok.eos_ids)))
    return cfg, fam, tok
