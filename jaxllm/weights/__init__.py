"""Find a model (directory, .gguf file, hub id or the embedded default), read its config, check it,
and produce (config, family, weights, tokenizer).

Finding a model and reading its config import no JAX (the families do, when a config is mapped),
so front ends check a model path before JAX loads."""

from __future__ import annotations

from pathlib import Path

from jaxllm.config.runtime import Caches
from jaxllm.weights.files import SAVED_META, ModelFiles, locate, read_dir, read_hf_config
from jaxllm.weights.gguf_file import SplitFile

__all__ = ["SAVED_META", "ModelFiles", "locate", "read_config", "read_dir", "read_hf_config", "load_model"]


def read_config(model_dir):
    """The model's `ModelConfig` from its config.json or GGUF metadata alone, no weight or
    tokenizer read: what a front end checks its limits against before loading."""
    files = locate(model_dir)  # a missing model is refused before JAX loads
    from jaxllm.model.families import family_for

    if files.kind == "gguf":
        from jaxllm.weights.gguf import read_gguf_config

        hf = read_gguf_config(files.path)
    else:
        hf = read_hf_config(files.path)[0]
    return family_for(hf).config_from_hf(hf)


def load_model(model_dir, dtype, quant: str, progress=None, layout=None, caches: Caches | None = None):
    """-> (ModelConfig, family module, weights pytree, Tokenizer | None, display name).

    caches: with `caches.weights`, the model built from a GGUF source is kept under
    `caches.folder` and loaded from there next time (see weight_cache); None keeps nothing."""
    from jaxllm.weights import weight_cache as wcache
    from jaxllm.weights.saved import load_saved
    from jaxllm.weights.weights import build_weights

    entry = wcache.entry_for(model_dir, quant, dtype, caches or Caches())
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
    tok = Tokenizer(
        info.tokenizer,
        bos_id=info.bos_id,
        eos_ids=info.eos_ids,
        add_bos=info.add_bos,
        chat_template=info.chat_template or fam.CHAT_TEMPLATE,
        bos_token=info.tokenizer.id_to_token(info.bos_id) if info.bos_id is not None else None,
        chat_tuned=info.chat_tuned,
    )
    return cfg, fam, source, tok


def read_hf(path: Path):
    """(config, family, tensor source, tokenizer) of a Hugging Face directory."""
    from jaxllm.weights.safetensors_source import SafetensorsSource

    cfg, fam, tok = read_dir(path)
    return cfg, fam, SafetensorsSource(path), tok
