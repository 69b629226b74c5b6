"""Load a model's weights: (config, family, weights pytree, tokenizer, name) from any source
`locate` finds, through the weight cache for GGUF sources."""

from __future__ import annotations

from pathlib import Path

from jaxllm.config.runtime import Caches
from jaxllm.model.families import family_for
from jaxllm.tokenizer import Tokenizer
from jaxllm.weights import weight_cache as wcache
from jaxllm.weights.files import ModelFiles, locate, read_dir
from jaxllm.weights.fp8 import Fp8Source
from jaxllm.weights.gguf_file import SplitFile
from jaxllm.weights.safetensors_source import SafetensorsSource
from jaxllm.weights.saved import load_saved
from jaxllm.weights.weights import build_weights


def load_model(model_dir, dtype, quant: str, progress=None, layout=None, caches: Caches | None = None):
    """-> (ModelConfig, family module, weights pytree, Tokenizer | None, display name).

    caches: with `caches.weights`, the model built from a GGUF source is kept under
    `caches.folder` and loaded from there next time (see weight_cache); None keeps nothing."""
    entry = wcache.entry_for(model_dir, quant, dtype, caches or Caches())
    if entry is not None:
        hit = wcache.read(entry, dtype, layout)
        if hit is not None:
            return (*hit, entry.name)
    files = locate(model_dir)
    if files.kind == "saved":
        return (*load_saved(files.path, dtype, quant, layout), files.name)
    cfg, fam, source, tok = read_gguf(files.path) if files.kind == "gguf" else read_hf(files)
    weights = build_weights(cfg, fam, source, dtype, quant, progress, layout)
    if entry is not None:
        wcache.write(entry, files, cfg, weights, tok)
    return cfg, fam, weights, tok, files.name


def read_gguf(path: Path | SplitFile):
    """(config, family, tensor source (dequantized as read), tokenizer) of a GGUF file."""
    # the gguf package (half a second to import) only where a GGUF file is read
    from jaxllm.weights.gguf import GGUFSource, load_gguf_tokenizer, read_gguf_config

    hf = read_gguf_config(path)
    fam = family_for(hf)
    info = load_gguf_tokenizer(path)
    cfg = fam.config_from_hf(hf, {"eos_token_id": list(info.eos_ids)})
    source = GGUFSource(path)
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


def read_hf(files: ModelFiles):
    """(config, family, tensor source, tokenizer) of a Hugging Face directory; an FP8 checkpoint's
    source dequantizes its weights as read."""
    cfg, fam, tok = read_dir(files.path)
    source = SafetensorsSource(files.path)
    return cfg, fam, source if files.stored is None else Fp8Source(source, files.stored), tok
