"""Find a model (directory, .gguf file, hub id or the embedded default), read its config, check it,
and produce (config, family, weights, tokenizer).

Finding a model and reading its config import no JAX (the families do, when a config is mapped),
so front ends check a model path before JAX loads."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from jaxllm.errors import ModelError
from jaxllm.weights.gguf_file import SplitFile

SAVED_META = "jaxllm.json"      # marks a directory written by jaxllm.convert (see `saved`)


@dataclass
class ModelFiles:
    name: str
    path: Path | SplitFile
    kind: str          # "hf" | "gguf" | "saved" (written by jaxllm.convert)


def locate(model_dir: str | os.PathLike | None) -> ModelFiles:
    if model_dir is None:
        from jaxllm.weights.default import DEFAULT_MODEL_NAME, default_model_file
        return ModelFiles(DEFAULT_MODEL_NAME, default_model_file(), "gguf")
    p = Path(model_dir).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelFiles(p.name, p, "gguf")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p}: no config.json (not a Hugging Face model directory)")
        return ModelFiles(p.name, p, "saved" if (p / SAVED_META).exists() else "hf")
    if p.exists():
        raise ModelError(f"{p}: neither a model directory nor a .gguf file")
    s = str(model_dir)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        from jaxllm.weights.hub import resolve_hub_id
        return ModelFiles(s, resolve_hub_id(s), "hf")
    raise ModelError(f"model path {s} does not exist")


def read_hf_config(d: Path) -> tuple[dict, dict]:
    from jaxllm.tokenizer import read_json
    return read_json(d / "config.json"), read_json(d / "generation_config.json")


def read_config(model_dir):
    """The model's `ModelConfig` from its config.json or GGUF metadata alone, no weight or
    tokenizer read: what a front end checks its limits against before loading."""
    files = locate(model_dir)                   # a missing model is refused before JAX loads
    from jaxllm.model.families import family_for
    if files.kind == "gguf":
        from jaxllm.weights.gguf import read_gguf_config
        hf = read_gguf_config(files.path)
    else:
        hf = read_hf_config(files.path)[0]
    return family_for(hf).config_from_hf(hf)


def load_model(model_dir, dtype, quant: str, progress=None, layout=None, weight_cache=None):
    """-> (ModelConfig, family module, weights pytree, Tokenizer | None, display name).

    weight_cache: keep the model built from a GGUF source in the user's cache and load it from
    there next time (see weight_cache); None follows $JAXLLM_WEIGHT_CACHE (on unless "off")."""
    from jaxllm.weights import weight_cache as wcache
    from jaxllm.weights.saved import load_saved
    from jaxllm.weights.weights import build_weights
    entry = wcache.entry_for(model_dir, quant, dtype, weight_cache)
    if entry is not None:
        hit = wcache.read(entry, dtype, layout)
        if hit is not None:
            return (*hit, entry.name)
    files = locate(model_dir)
    if files.kind == "saved":
        return (*load_saved(files.path, dtype, quant, layout), files.name)
    cfg, fam, source, tok = (read_gguf if files.kind == "gguf" else read_hf)(files.path)
    weights = build_weights(cfg, fam, source, dtype, quant, progress, layout)
    if entry is not None:
        wcache.write(entry, files, cfg, weights, tok)
    return cfg, fam, weights, tok, files.name


def read_gguf(path: Path | SplitFile):
    """(config, family, dequantized tensors, tokenizer) of a GGUF file."""
    from jaxllm.model.families import family_for
    from jaxllm.tokenizer import Tokenizer
    from jaxllm.weights.gguf import iter_gguf_tensors, load_gguf_tokenizer, read_gguf_config
    from jaxllm.weights.safetensors_source import DictSource
    hf = read_gguf_config(path)
    fam = family_for(hf)
    info = load_gguf_tokenizer(path)
    cfg = fam.config_from_hf(hf, {"eos_token_id": list(info.eos_ids)})
    source = DictSource(dict(iter_gguf_tensors(path)))
    tok = Tokenizer(info.tokenizer, bos_id=info.bos_id, eos_ids=info.eos_ids, add_bos=info.add_bos,
                    chat_template=info.chat_template or fam.CHAT_TEMPLATE,
                    bos_token=info.tokenizer.id_to_token(info.bos_id) if info.bos_id is not None else None,
                    chat_tuned=info.chat_tuned)
    return cfg, fam, source, tok


def read_hf(path: Path):
    """(config, family, tensor source, tokenizer) of a Hugging Face directory."""
    from jaxllm.weights.safetensors_source import SafetensorsSource
    cfg, fam, tok = read_dir(path)
    return cfg, fam, SafetensorsSource(path), tok


def read_dir(path: Path):
    """(config, family, tokenizer) of a directory with a config.json (Hugging Face or saved)."""
    from jaxllm.model.families import family_for
    from jaxllm.tokenizer import Tokenizer
    hf, gen = read_hf_config(path)
    fam = family_for(hf)            # refuses unknown architectures before any weight is read
    cfg = fam.config_from_hf(hf, gen)
    tok = Tokenizer.from_hf_dir(path, fam.CHAT_TEMPLATE)
    if tok is not None and tok.eos_ids:
        cfg = cfg.replace(eos_ids=tuple(dict.fromkeys(cfg.eos_ids + tok.eos_ids)))
    return cfg, fam, tok
