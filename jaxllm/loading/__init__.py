"""Find a model (directory, .gguf file, hub id or the embedded default), read its config, check it,
and produce (config, family, weights, tokenizer)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from ..models import family_for
from ..tokenizer import Tokenizer


@dataclass
class ModelFiles:
    name: str
    path: Path
    kind: str          # "hf" | "gguf" | "saved" (written by jaxllm.convert)


def locate(model_dir: str | os.PathLike | None) -> ModelFiles:
    if model_dir is None:
        from .default import DEFAULT_MODEL_NAME, default_model_path
        return ModelFiles(DEFAULT_MODEL_NAME, default_model_path(), "gguf")
    p = Path(model_dir).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelFiles(p.name, p, "gguf")
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p}: no config.json (not a Hugging Face model directory)")
        from .saved import is_saved
        return ModelFiles(p.name, p, "saved" if is_saved(p) else "hf")
    if p.exists():
        raise ModelError(f"{p}: neither a model directory nor a .gguf file")
    s = str(model_dir)
    if s.count("/") == 1 and not s.startswith((".", "/", "~")):
        from .hub import resolve_hub_id
        return ModelFiles(s, resolve_hub_id(s), "hf")
    raise ModelError(f"model path {s} does not exist")


def read_hf_config(d: Path) -> tuple[dict, dict]:
    from ..tokenizer import read_json
    return read_json(d / "config.json"), read_json(d / "generation_config.json")


def load_model(model_dir, dtype, quant: str, progress=None, layout=None):
    """-> (ModelConfig, family module, weights pytree, Tokenizer | None, display name)."""
    from .weights import build_weights
    files = locate(model_dir)
    if files.kind == "gguf":
        from .gguf import iter_gguf_tensors, load_gguf_tokenizer, read_gguf_config
        from .safetensors_source import DictSource
        hf, gen = read_gguf_config(files.path), {}
        fam = family_for(hf)
        info = load_gguf_tokenizer(files.path)
        gen = {"eos_token_id": list(info.eos_ids)}
        cfg = fam.config_from_hf(hf, gen)
        source = DictSource(dict(iter_gguf_tensors(files.path)))
        tok = Tokenizer(info.tokenizer, bos_id=info.bos_id, eos_ids=info.eos_ids, add_bos=info.add_bos,
                        chat_template=info.chat_template or fam.CHAT_TEMPLATE,
                        bos_token=info.tokenizer.id_to_token(info.bos_id) if info.bos_id is not None else None)
    else:
        from .safetensors_source import SafetensorsSource
        hf, gen = read_hf_config(files.path)
        fam = family_for(hf)            # refuses unknown architectures before any weight is read
        cfg = fam.config_from_hf(hf, gen)
        source = SafetensorsSource(files.path) if files.kind == "hf" else None
        tok = Tokenizer.from_hf_dir(files.path, fam.CHAT_TEMPLATE)
        if tok is not None and tok.eos_ids:
            cfg = cfg.replace(eos_ids=tuple(dict.fromkeys(cfg.eos_ids + tok.eos_ids)))
    if files.kind == "saved":
        from ..sharding import single_device_layout
        from .saved import restore_weights
        weights = restore_weights(files.path, cfg, fam, quant, dtype, layout or single_device_layout())
    else:
        weights = build_weights(cfg, fam, source, dtype, quant, progress, layout)
    return cfg, fam, weights, tok, files.name
